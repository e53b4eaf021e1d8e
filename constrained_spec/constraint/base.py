"""The constraint interface: an immutable compiled constraint and a per-request matcher.

A ``CompiledConstraint`` is built once per (backend, vocabulary, schema or pattern, options),
cached, and shared by every request and thread; it never changes what it accepts. Each request
asks it for a fresh ``Matcher`` (``compiled.matcher()``), which is the only thing that decodes.

A matcher has two faces:

- a cursor, the tokens this request has committed: ``state``, ``advance(tokens)``,
  ``rollback(n)``, ``reset()``, ``fill_mask(out)``;
- lookahead by state, which never moves the cursor: ``next_state``, ``walk``, ``allowed_mask``,
  ``is_final``, ``is_done``, ``forced_bytes``, ``allowed_bytes``. Drafts and the verifier's
  masks along a draft path walk states this way, then the walk is dropped.

States are ints and mean something only to the matcher that made them (for outlines-core they
are the index's own states; for llguidance, nodes of the request's token trie).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from ..errors import ConstraintViolationError
from .vocabulary import TokenVocabulary

State = int


class CompiledConstraint(ABC):
    """A token automaton compiled for one vocabulary. Immutable and thread-safe; get a
    ``matcher()`` per request.

    Attributes:
        backend: "outlines-core" or "llguidance".
        kind: "json" or "regex".
        pattern: the regex (outlines-core), or the grammar's cache key (llguidance).
        vocab: the vocabulary it was compiled over.
        warnings: schema keywords the backend relaxed (lenient mode); empty when all are enforced.
    """

    backend: str = ""

    def __init__(self, vocab: TokenVocabulary, kind: str, pattern: str, warnings: Sequence[str] = ()) -> None:
        self.vocab = vocab
        self.kind = kind
        self.pattern = pattern
        self.warnings: tuple[str, ...] = tuple(warnings)

    @property
    def eos_token_id(self) -> int:
        """The tokenizer's EOS id: allowed only where the text is a complete member of the language."""
        return self.vocab.eos_token_id

    @property
    def nbytes(self) -> int:
        """About how many bytes this compiled constraint holds (what caches bound by): its
        pattern here; a backend adds its own tables."""
        return len(self.pattern) + 1024

    @abstractmethod
    def matcher(self) -> "Matcher":
        """A fresh matcher at the start of the language; it shares no mutable state with others."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} {self.kind} {self.pattern[:60]!r}>"


class Matcher(ABC):
    """One request's walk through a compiled constraint (see the module docstring).

    Not thread-safe: one request, one thread. Masks are boolean tensors of shape
    ``[vocab.size]``, True where a token is allowed; EOS is allowed only in final states.
    """

    #: The state before any token.
    initial_state: State = 0

    def __init__(self, compiled: CompiledConstraint) -> None:
        self.compiled = compiled
        self.vocab = compiled.vocab
        self.eos_token_id = compiled.vocab.eos_token_id
        self._history: list[State] = [self.initial_state]

    # -- lookahead: never moves the cursor ---------------------------------------------------
    @abstractmethod
    def next_state(self, state: State, token: int) -> State | None:
        """The state after ``token``, or None when it is not allowed there (EOS: None too)."""

    @abstractmethod
    def allowed_mask(self, state: State) -> torch.Tensor:
        """Boolean ``[vocab.size]`` mask of the tokens allowed in ``state`` (cached; do not modify)."""

    @abstractmethod
    def is_final(self, state: State) -> bool:
        """Whether the text up to ``state`` is a complete member of the language."""

    @abstractmethod
    def is_done(self, state: State) -> bool:
        """Final with nothing but EOS allowed: generation ends here without another forward."""

    @property
    @abstractmethod
    def memo(self) -> dict[str, dict]:
        """Per-state caches that drafters keep for this request (forced text, learned
        tokenizations), keyed by the drafter's own names."""

    def allows(self, state: State, token: int) -> bool:
        """Whether ``token`` is allowed in ``state`` (EOS only in final states)."""
        if token == self.eos_token_id:
            return self.is_final(state)
        return self.next_state(state, token) is not None

    def walk(self, state: State, tokens: Sequence[int]) -> list[State]:
        """States along ``tokens`` from ``state``: ``[s_0, s_1, ...]``, cut before the first rejected token."""
        states = [state]
        for t in tokens:
            nxt = self.next_state(states[-1], t)
            if nxt is None:
                break
            states.append(nxt)
        return states

    def allowed_bytes(self, state: State) -> dict[int, State]:
        """Single bytes allowed next from ``state`` -> the state after each, read off the mask at
        the single-byte tokens (byte-level vocabularies have one per byte). Cached in ``memo``."""
        cache = self.memo.setdefault("allowed_bytes", {})
        hit = cache.get(state)
        if hit is None:
            byte_ids, token_ids = _byte_token_table(self)
            allowed = self.allowed_mask(state)[token_ids]
            hit = {}
            for b, t in zip(byte_ids[allowed].tolist(), token_ids[allowed].tolist()):
                nxt = self.next_state(state, t)
                if nxt is not None:
                    hit[b] = nxt
            cache[state] = hit
        return hit

    def forced_bytes(self, state: State, limit: int = 256) -> bytes:
        """The bytes every continuation from ``state`` starts with: single-byte steps while exactly
        one byte is allowed and the state is not final (backends with a faster way override it)."""
        out = bytearray()
        while len(out) < limit and not self.is_final(state):
            options = self.allowed_bytes(state)
            if len(options) != 1:
                break
            byte, state = next(iter(options.items()))
            out.append(byte)
        return bytes(out)

    # -- the cursor: what this request has committed ------------------------------------------
    @property
    def state(self) -> State:
        """The state after the committed tokens."""
        return self._history[-1]

    @property
    def num_tokens(self) -> int:
        """How many tokens are committed."""
        return len(self._history) - 1

    def advance(self, tokens: Sequence[int]) -> State:
        """Commit ``tokens``; returns the new state. Raises ``ConstraintViolationError`` (naming the
        token and its position) and commits none of them if any is not allowed. EOS is not a
        token of the language: it ends a request and is never committed."""
        states = self.walk(self.state, tokens)
        if len(states) <= len(tokens):
            bad = tokens[len(states) - 1]
            raise ConstraintViolationError(
                f"Token {bad} ({self.vocab.token_bytes.get(bad, b'<special>')!r}) is not allowed after "
                f"{self.num_tokens + len(states) - 1} committed tokens; nothing was committed."
            )
        self._history.extend(states[1:])
        return self.state

    def rollback(self, n: int) -> State:
        """Uncommit the last ``n`` tokens; returns the new state."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"Invalid rollback: expected 0..{self.num_tokens} tokens, got {n}.")
        if n:
            del self._history[-n:]
        return self.state

    def reset(self) -> None:
        """Back to the start of the language (caches are kept)."""
        del self._history[1:]

    def fill_mask(self, out: torch.Tensor, state: State | None = None) -> torch.Tensor:
        """Write the allowed mask of ``state`` (default: the cursor's) into the preallocated boolean
        buffer ``out`` of shape ``[>= vocab.size]``; positions past the vocabulary are False."""
        mask = self.allowed_mask(self.state if state is None else state)
        out[: mask.shape[0]].copy_(mask)
        out[mask.shape[0]:] = False
        return out


_BYTE_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_BYTE_TABLES_LOCK = threading.Lock()


def _byte_token_table(matcher: Matcher) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, token ids) of the single-byte tokens of a vocabulary, built once per vocabulary."""
    key = matcher.vocab.fingerprint
    hit = _BYTE_TABLES.get(key)
    if hit is None:
        table = matcher.vocab.single_byte_tokens()
        hit = (torch.tensor(list(table.keys()), dtype=torch.long), torch.tensor(list(table.values()), dtype=torch.long))
        with _BYTE_TABLES_LOCK:
            _BYTE_TABLES.setdefault(key, hit)
    return hit

