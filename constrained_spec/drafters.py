"""Drafters: propose up to K tokens from the current FSM state; the verifier decides.

Contract (two methods, as in transformers' candidate generators):
- ``reset(prompt_ids)`` before a request;
- ``propose(context, state, k) -> Draft``: at most ``k`` tokens, every one allowed by the
  shared constraint when walked from ``state``. A drafter never proposes EOS, so the draft
  distribution q is the drafter's own distribution over the allowed set minus EOS; the target
  still emits EOS as a recovered or bonus token.

Deterministic drafters (prompt lookup) return ``q = None``: q is one-hot at the proposal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch
from transformers import DynamicCache

from .constraint import Constraint, apply_mask
from .verifier import masked_probs


@dataclass
class Draft:
    """A proposal.

    Attributes:
        tokens: x_1..x_k (k may be 0).
        states: FSM states s_0..s_k along the path (``len(tokens) + 1`` entries).
        q: ``[k, V]`` draft probabilities, or None for a deterministic drafter.
    """

    tokens: list[int]
    states: list[int]
    q: torch.Tensor | None = None
    kind: str = "none"
    #: Which drafter supplied each token (hybrid drafts mix kinds); defaults to ``kind``.
    kinds: list[str] | None = None

    def token_kinds(self) -> list[str]:
        """The drafter kind behind each token."""
        return self.kinds if self.kinds is not None else [self.kind] * len(self.tokens)


class Drafter(Protocol):
    """What the decoder needs from a drafter."""

    name: str

    def reset(self, prompt_ids: list[int]) -> None:
        """Forget everything from a previous request."""

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """Up to ``k`` tokens continuing ``context`` (prompt + output so far) from FSM ``state``."""

    # Optional: ``update(draft, accepted, next_token)`` sees each verdict (drafters that learn).


def _cut_to_constraint(constraint: Constraint, state: int, tokens: list[int]) -> list[int]:
    """FSM states along the longest prefix of ``tokens`` the constraint allows (never past a done state)."""
    states = [state]
    for t in tokens:
        if constraint.is_done(states[-1]):
            break
        nxt = constraint.next_state(states[-1], t)
        if nxt is None:
            break
        states.append(nxt)
    return states


class LookupDrafter:
    """Prompt lookup: continue the longest n-gram match of the recent tokens found earlier in the context.

    Matches are tried from the longest n-gram (``max_ngram``) down to ``min_ngram``; among the
    most recent ``max_candidates`` matches of that length, the one whose continuation the
    constraint accepts furthest wins. q is one-hot (deterministic).
    """

    name = "lookup"

    def __init__(self, constraint: Constraint, *, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 8,
                 ignore: frozenset[int] = frozenset()) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"Invalid n-gram range: expected 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}.")
        self.constraint = constraint
        #: Tokens that cannot make a match on their own: after ``": "`` alone, the last value
        #: written is no guess at the next one (JSON punctuation, see ``structural_tokens``).
        self.ignore = ignore
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_candidates = max_candidates

    def reset(self, prompt_ids: list[int]) -> None:
        """Lookup keeps no state between steps."""

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """Continuation of the best n-gram match, cut where the FSM rejects it."""
        if k <= 0 or len(context) < 2:
            return Draft([], [state], None, self.name)
        ctx = np.asarray(context, dtype=np.int64)
        best_tokens: list[int] = []
        best_states: list[int] = [state]
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            if self.ignore and all(int(t) in self.ignore for t in tail):
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # matches end before the tail
            hits = np.flatnonzero((windows == tail).all(axis=1))
            for start in hits[::-1][: self.max_candidates]:  # most recent first
                cont = ctx[start + n : start + n + k].tolist()
                states = _cut_to_constraint(self.constraint, state, cont)
                if len(states) > len(best_states):
                    best_tokens, best_states = cont[: len(states) - 1], states
                    if len(best_tokens) == k:
                        break
            if best_tokens:
                break
        return Draft(best_tokens, best_states, None, self.name)


class ModelDrafter:
    """A smaller causal LM sharing the target's tokenizer, with its own KV cache.

    Each proposal samples (or, greedy, takes the argmax of) the draft model's distribution
    masked by the shared constraint, walking its own copy of the FSM state. The cache keeps the
    tokens it has seen; before a proposal it is cropped to the longest prefix it shares with the
    context, so rejected draft tokens are dropped without recomputation.
    """

    name = "model"

    def __init__(
        self,
        model: Any,
        constraint: Constraint,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = model
        self.constraint = constraint
        self.temperature = temperature
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.cached_ids: list[int] = []

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a fresh cache for a new request."""
        self.cache = DynamicCache(config=self.model.config)
        self.cached_ids = []

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Crop the cache to its common prefix with ``context``, feed the rest; logits of the last position."""
        assert self.cache is not None, "reset() must be called before propose()"
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)  # always feed at least one token
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        if common < len(self.cached_ids):
            self.cache.crop(common - len(self.cached_ids))  # negative: drop that many positions
            del self.cached_ids[common:]
        return self._feed(context[common:])

    @torch.no_grad()
    def _feed(self, ids: list[int]) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device), cache=self.cache, use_cache=True, logits_to_keep=1
        )
        self.cached_ids.extend(ids)
        return out.logits[0, -1].float().cpu()

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """Sample up to ``k`` tokens from the masked draft distribution q."""
        states = [state]
        if k <= 0:
            return Draft([], states, None, self.name)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        logits = self._sync(context)
        eos = self.constraint.eos_token_id
        for i in range(k):
            s = states[-1]
            if self.constraint.is_done(s):
                break
            mask = self.constraint.allowed_mask(s).clone()
            if eos < mask.shape[0]:
                mask[eos] = False  # drafts never end the sequence; see the module docstring
            if not bool(mask.any()):
                break
            masked = apply_mask(logits.double(), mask)
            if self.temperature > 0:
                q = masked_probs(masked, self.temperature)
                x = int(torch.multinomial(q, 1, generator=self.generator))
                qs.append(q)
            else:
                x = int(masked.argmax())
            tokens.append(x)
            states.append(self.constraint.next_state(s, x))  # type: ignore[arg-type]
            if i + 1 < k:
                logits = self._feed([x])
        q_all = torch.stack(qs) if qs else None
        return Draft(tokens, states, q_all, self.name)


_STRUCTURAL_TOKENS: dict[str, frozenset[int]] = {}


def structural_tokens(vocab: Any) -> frozenset[int]:
    """Ids of tokens made only of JSON punctuation and whitespace (``": "``, ``",``, ``{"``), per vocabulary."""
    found = _STRUCTURAL_TOKENS.get(vocab.fingerprint)
    if found is None:
        found = frozenset(t for t, b in vocab.token_bytes.items() if b and not b.strip(b' \t\n\r"{}[],:'))
        _STRUCTURAL_TOKENS[vocab.fingerprint] = found
    return found


class GrammarDrafter:
    """Text the constraint forces next (keys, quotes, colons, commas, brackets, enum prefixes).

    From a state, the forced bytes are found by walking single-byte tokens while exactly one
    byte is allowed and the state is not final. The text is tokenized as the tokenizer would
    tokenize it, cut where the FSM rejects, and proposed with a one-hot q. Costs no model call.

    Cached per FSM state on the constraint (``constraint.memo``), so later requests with the
    same schema reuse it. When the target rejects a forced token and emits another one in that
    state (it tokenizes the same text differently, e.g. ``{`` then ``"name`` rather than
    ``{"`` then ``name``), that token is remembered and proposed first from then on.
    """

    name = "grammar"

    def __init__(self, constraint: Constraint, tokenize: Callable[[str], list[int]]) -> None:
        self.constraint = constraint
        self.tokenize = tokenize
        self._forced = constraint.memo.setdefault("grammar.forced", {})
        self._learned = constraint.memo.setdefault("grammar.learned", {})

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing per request: the caches depend on the constraint only."""

    def allowed_bytes(self, state: int) -> dict[int, int]:
        """Single bytes allowed next from ``state`` and the state after each."""
        return self.constraint.allowed_bytes(state)

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every continuation from ``state`` starts with (the backend knows how)."""
        return self.constraint.forced_bytes(state)

    def forced(self, state: int) -> tuple[list[int], list[int]]:
        """Tokens of the forced text from ``state`` and the FSM states along them (cached)."""
        hit = self._forced.get(state)
        if hit is None:
            learned = self._learned.get(state)
            if learned is not None:
                nxt = self.constraint.next_state(state, learned)
                rest_tokens, rest_states = self.forced(nxt) if nxt is not None else ([], [state])
                tokens, states = [learned, *rest_tokens], [state, *rest_states]
            else:
                text = self.forced_bytes(state).decode("utf-8", errors="ignore")
                tokens = self.tokenize(text) if text else []
                states = _cut_to_constraint(self.constraint, state, tokens)
            hit = self._forced[state] = (tokens[: len(states) - 1], states)
        return hit

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """Up to ``k`` forced tokens; empty where the constraint leaves a choice."""
        tokens, states = self.forced(state)
        return Draft(tokens[:k], states[: min(k, len(tokens)) + 1], None, self.name)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """Learn the target's own tokenization where it rejected a forced token."""
        kinds = draft.token_kinds()
        if accepted < len(kinds) and kinds[accepted] == self.name and next_token != self.constraint.eos_token_id:
            state = draft.states[accepted]
            if self._learned.get(state) != next_token and self.constraint.next_state(state, next_token) is not None:
                self._learned[state] = next_token
                self._forced.clear()  # forced spans through this state change


_PHRASE_END = re.compile(r'[\n"<]|[.,;:!?)(](?=[\s<]|$)|\s+\(')  # "<": a chat marker follows
_STRUCTURAL = re.compile(r'[\[\]{}",:]')
_NEXT_WORD = re.compile(r"\s+([A-Za-z]+)")
#: Words that start the sentence around an extracted value rather than continue it
#: ("Maria Gonzalez| is a", "INV-2291| from", "harbour pilot| in Rotterdam").
_VALUE_STOP_WORDS = frozenset(
    "is are was were be been being at in on from for to and or with by who whom which that as has have had "
    "will would can could may might should does did its his her their our your since until after before".split())


def _value_end(rest: str, value: str) -> int | None:
    """Where the copied prompt text most likely stops being the value, or None if it may go on.

    At a phrase end (punctuation, a quote, a newline, an opening parenthesis), before a
    sentence word, and, for a value that starts capitalized or with a digit (names, titles,
    codes), before the first lower-case word. A guess: a wrong one costs one verify pass at
    most, a right one lets the closing quote and the next key land in the same pass.
    """
    phrase = _PHRASE_END.search(rest)
    limit = phrase.start() if phrase else len(rest)
    first = value.lstrip()[:1]
    proper = first.isupper() or first.isdigit()
    for m in _NEXT_WORD.finditer(rest, 0, limit):
        word = m.group(1)
        if word.lower() in _VALUE_STOP_WORDS or (proper and word[0].islower()):
            return m.start()
    return phrase.start() if phrase else None


class CopyDrafter:
    """Copies text from the prompt: the value being written continues as it does in the prompt.

    Matching works on text, not tokens, because a value inside JSON is tokenized differently
    from the same words in running text (``"B``, ``arc``, ``elona`` against `` Barcelona``).
    The tail of the current value is looked up in the prompt; its continuation, up to the end
    of the phrase, is tokenized and proposed. Where the copy ends the value, the closing
    character and the text the constraint forces after it are appended (``", "age": ``), so a
    whole field can land in one verify pass. Deterministic: q is one-hot.
    """

    name = "copy"

    def __init__(self, constraint: Constraint, tokenize: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], grammar: GrammarDrafter | None = None,
                 *, max_chars: int = 48, source: str | None = None) -> None:
        self.constraint = constraint
        self.tokenize = tokenize
        self.decode = decode
        self.grammar = grammar
        self.max_chars = max_chars
        #: The text to copy from: the user's prompt when the caller knows it (a chat template's
        #: system text would otherwise offer "Hugging Face" after an "H"); else the decoded prompt.
        self.source = source
        self.prompt_len = 0
        self.prompt_text = ""

    def reset(self, prompt_ids: list[int]) -> None:
        """Remember the prompt's length and the text to copy from."""
        self.prompt_len = len(prompt_ids)
        self.prompt_text = self.source if self.source is not None else self.decode(prompt_ids)

    def _continuation(self, output_text: str) -> tuple[str, bool]:
        """Prompt text continuing the current value, and whether it stops at a phrase end."""
        last = None
        for last in _STRUCTURAL.finditer(output_text):
            pass
        value = output_text[last.end():] if last else output_text
        start = self._find(value.lstrip())
        if start < 0:
            return "", False
        rest = self.prompt_text[start : start + self.max_chars]
        end = _value_end(rest, value)
        return (rest[:end], True) if end is not None else (rest, False)

    def _find(self, value: str) -> int:
        """Where the prompt continues ``value``: the end of the last occurrence of its longest
        tail (24, 12 or 6 characters; a whole value must start a word there), matched exactly,
        else ignoring case (a model writes "Architect" for "architect"); -1 if none."""
        if not value:
            return -1
        tails = [t for t in dict.fromkeys(value[-n:] for n in (24, 12, 6)) if len(t) >= 3 or t == value]
        for flags in (0, re.IGNORECASE):
            for tail in tails:
                start = -1
                for m in re.finditer(re.escape(tail), self.prompt_text, flags):
                    at_word_start = m.start() == 0 or not self.prompt_text[m.start() - 1].isalnum()
                    if tail != value or at_word_start:
                        start = m.end()  # the last occurrence: the document comes after the instructions
                if start >= 0:
                    return start
        return -1

    def _closing(self, state: int) -> str:
        """The character that ends the current value here, when only one can, plus forced text."""
        if self.grammar is None:
            return ""
        allowed = self.grammar.allowed_bytes(state)
        for close in (b'"', b",", b"}", b"]"):
            if close[0] in allowed and (close == b'"' or sum(b in allowed for b in b",}]") == 1):
                after = self.grammar.forced_bytes(allowed[close[0]])
                return (close + after).decode("utf-8", errors="ignore")
        return ""

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """The copied continuation (and the value's end), cut where the FSM rejects it."""
        if k <= 0 or len(context) <= self.prompt_len:
            return Draft([], [state], None, self.name)
        text, phrase_end = self._continuation(self.decode(context[self.prompt_len :]))
        tokens = self.tokenize(text) if text else []
        states = _cut_to_constraint(self.constraint, state, tokens)
        if phrase_end or len(states) <= len(tokens):  # the value ends here, by the prompt or the FSM
            copied = self.decode(tokens[: len(states) - 1]) if len(states) > 1 else ""
            closing = self._closing(states[-1])
            if closing:
                tokens = self.tokenize(copied + closing)
                states = _cut_to_constraint(self.constraint, state, tokens)
        n = min(k, len(states) - 1)
        return Draft(tokens[:n], states[: n + 1], None, self.name)


class HybridDrafter:
    """Forced text first, then prompt lookup, then the draft model when one is given.

    Each part continues from the state the previous part reached, so the whole draft is one
    FSM path; model positions carry q rows, deterministic ones one-hot rows.
    """

    name = "hybrid"

    def __init__(self, parts: list[Any], *, max_model_tokens: int = 4) -> None:
        self.parts = parts
        #: A draft model pays per token, so its share of one proposal is capped.
        self.max_model_tokens = max_model_tokens

    def reset(self, prompt_ids: list[int]) -> None:
        """Reset every part."""
        for part in self.parts:
            part.reset(prompt_ids)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """Let the parts that learn see the verdict."""
        for part in self.parts:
            if hasattr(part, "update"):
                part.update(draft, accepted, next_token)

    def propose(self, context: list[int], state: int, k: int) -> Draft:
        """Concatenate the parts' proposals until ``k`` tokens are drafted."""
        tokens: list[int] = []
        states = [state]
        kinds: list[str] = []
        q_rows: list[torch.Tensor | None] = []
        while len(tokens) < k:
            grew = False
            for part in self.parts:
                room = k - len(tokens)
                if part.name == "model":
                    room = min(room, self.max_model_tokens)
                d = part.propose(context + tokens, states[-1], room)
                if not d.tokens:
                    continue
                tokens += d.tokens
                states += d.states[1:]
                kinds += d.token_kinds()
                q_rows += list(d.q) if d.q is not None else [None] * len(d.tokens)
                grew = True
                break  # start again from the first part: forced text may follow a copied span
            if not grew:
                break
        q = None
        if any(r is not None for r in q_rows):
            v = next(r for r in q_rows if r is not None).shape[0]
            q = torch.stack([r if r is not None else _one_hot(t, v) for r, t in zip(q_rows, tokens)])
        return Draft(tokens, states, q, self.name, kinds)


def _one_hot(token: int, size: int) -> torch.Tensor:
    row = torch.zeros(size, dtype=torch.float64)
    row[token] = 1.0
    return row
