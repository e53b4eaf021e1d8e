"""The outlines-core backend: a regex becomes an ``Index`` with integer states.

States are the index's own integers, the same for every request, so per-state caches (masks,
drafters' forced text) live with the compiled constraint and serve all requests; a matcher is
just a history of states, and rollback is assignment. A schema reaches this module as a regex
(``outlines_core_schema.schema_to_regex``: refused where outlines-core's regex would be wrong,
rewritten where a correct form exists); compiled indexes are also cached on disk.

outlines-core 0.2.14 builds indexes that lose part of the language (docs/upstream-outlines-core.md):
its DFA keeps the leftmost-first match only (``a|ab`` never writes ``ab``), and its index drops
every token whose last byte leaves a state where the text could already end, unless the text
after the token is complete again (``(ab)?`` allows ``ab`` but not ``a`` then ``b``; ``1`` then
``.1`` is refused in a number). Both happen only where a complete match is followed by more
text. So every index here is built over ``(?:pattern)<m>``, one ASCII end marker ``<m>`` that no
complete match of the pattern is ever followed by (proven per pattern, ``_end_marker``): then
nothing is followed after a complete match, nothing is lost, and a state is final exactly
where the marker's token would complete the text (``MarkedIndex``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from typing import NamedTuple

import torch
from outlines_core import Index, Vocabulary

from ..errors import InvalidRegexError, UnsupportedSchemaFeatureError
from ..storage import cache_dir
from .base import CompiledConstraint, Matcher, State
from .vocabulary import TokenVocabulary

BACKEND = "outlines-core"
#: Masks kept per compiled constraint, shared by its requests (oldest dropped first): one is
#: vocab-size bytes (48 KiB on SmolLM2), so 1,024 of them is 48 MiB; a long-running server
#: would otherwise grow them without bound on a large schema.
MAX_SHARED_MASKS = 1024
#: Bytes per index transition in the estimate of an index's size (a token id and a state in a
#: Rust hash map, with its overhead).
TRANSITION_BYTES = 24

#: Every byte as a token (id = byte + 1; EOS 0), to index a pattern for what it can match.
BYTE_VOCAB = TokenVocabulary.build({b + 1: bytes([b]) for b in range(256)}, 0)


def _to_outlines(vocab: TokenVocabulary, extra: dict[bytes, int] | None = None) -> Vocabulary:
    """The outlines-core ``Vocabulary`` (bytes -> ids; EOS given separately), plus ``extra`` tokens."""
    grouped: dict[bytes, list[int]] = {}
    for tid, b in vocab.token_bytes.items():
        if tid != vocab.eos_token_id:
            grouped.setdefault(b, []).append(tid)
    for b, tid in (extra or {}).items():
        grouped.setdefault(b, []).append(tid)
    return Vocabulary(vocab.eos_token_id, grouped)


# -- the end marker ------------------------------------------------------------------------------
#: ``BYTE_VOCAB`` for outlines-core: the probes below reach every state of the DFA.
_PROBE_VOCAB = _to_outlines(BYTE_VOCAB)
_WORD_BYTES = frozenset(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
#: End-marker candidates, most rarely written first. Non-word characters come first: with one
#: of them an ASCII word-boundary assertion at the end of the pattern sees the marker as it
#: would see the end of the text; word characters are tried only for patterns without one.
_MARKER_CANDIDATES = (
    *range(0x00, 0x09), *range(0x0E, 0x20), 0x7F, 0x0B, 0x0C, 0x09, 0x0D, 0x0A,
    *(b for b in range(0x20, 0x7F) if b not in _WORD_BYTES), *sorted(_WORD_BYTES),
)
#: Part of the disk cache key: bump when what ``build_index`` stores changes.
_INDEX_FORMAT = "marked-1"


class RegexScan(NamedTuple):
    """What ``scan_regex`` finds in a pattern (Rust ``regex`` syntax), outside character classes."""

    ok: bool  #: parentheses balance and the pattern does not end inside an escape or a class
    end_anchors: tuple[tuple[int, int], ...]  #: spans of ``$`` and ``\z``
    word_boundary: bool  #: ``\b``, ``\B``, ``\<``, ``\>``
    verbose: bool  #: an ``x`` flag (``#`` comments would swallow what follows the pattern)


def skip_escape(pattern: str, i: int) -> int:
    """Index just past the escape starting at ``pattern[i] == '\\'`` (braced forms included)."""
    if i + 1 >= len(pattern):
        return len(pattern) + 1  # a trailing backslash: not a pattern
    j = i + 2
    if pattern[i + 1] in "xuUpPb" and pattern.startswith("{", j):
        close = pattern.find("}", j)
        return len(pattern) + 1 if close < 0 else close + 1
    return j


def skip_class(pattern: str, i: int) -> int:
    """Index just past the character class opening at ``pattern[i] == '['`` (nested classes such
    as ``[[:alpha:]]`` and a leading literal ``]`` included); past the end if it never closes."""
    n, depth = len(pattern), 0
    while i < n:
        if pattern[i] == "[":
            depth += 1
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):
                i += 1  # a leading ']' is a literal
            continue
        if pattern[i] == "\\":
            i = skip_escape(pattern, i)
            continue
        if pattern[i] == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n + 1


def scan_regex(pattern: str) -> RegexScan:
    """Find the assertions and flags that matter to an end marker, reading Rust ``regex`` syntax.

    Conservative where it matters: a pattern it cannot read is not ``ok``.
    """
    n, i, depth = len(pattern), 0, 0
    ends: list[tuple[int, int]] = []
    word = verbose = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            j = skip_escape(pattern, i)
            if j > n:
                return RegexScan(False, (), word, verbose)
            kind = pattern[i + 1]
            if kind == "z":
                ends.append((i, j))
            word |= kind in "bB<>"
            i = j
        elif c == "[":
            i = skip_class(pattern, i)
            if i > n:
                return RegexScan(False, (), word, verbose)
        elif c == "(":
            depth += 1
            if pattern.startswith("?", i + 1):
                j = i + 2
                while j < n and (pattern[j].isalpha() or pattern[j] == "-") and pattern[j] != "P":
                    j += 1
                flags = pattern[i + 2:j]
                verbose |= "x" in flags.split("-")[0]
            i += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return RegexScan(False, (), word, verbose)
            i += 1
        else:
            if c == "$":
                ends.append((i, i + 1))
            i += 1
    return RegexScan(depth == 0, tuple(ends), word, verbose)


def _without_redundant_end_anchors(pattern: str, ends: tuple[tuple[int, int], ...]) -> str | None:
    """The pattern without its end-of-text assertions when each is followed only by closing
    parentheses and other such assertions (the index matches whole texts, so they assert
    nothing there); None if one stands anywhere else (the marker would follow it, so it could
    never hold)."""
    out, last = [], 0
    for k, (a, b) in enumerate(ends):
        rest, pos = [], b
        for x, y in ends[k + 1:]:
            rest.append(pattern[pos:x])
            pos = y
        rest.append(pattern[pos:])
        if "".join(rest).strip(")"):
            return None
        out.append(pattern[last:a])
        last = b
    return "".join(out) + pattern[last:]


def _ends_followed(pattern: str, marker: int, follower: int) -> tuple[bool, set[int]]:
    """One probe of ``_end_marker``: (whether some complete match is followed by ``marker`` in a
    longer match, bytes proven to follow some complete match).

    The probe indexes ``(?:pattern)<marker><follower>`` over every byte. A match ends only after
    those two bytes, so along the shortest text that is a complete match followed by ``marker``
    in a longer match nothing was matched yet and the DFA is exact: that text's state ``s``
    reaches, by ``marker``, a state ``s1`` that leads by ``follower`` to a final state (the
    probe's own ending) and by some other byte on into the longer match, unless every such
    continuation starts with ``follower`` itself (``_end_marker`` runs a second probe with
    another follower). Conversely, ``s1 --follower--> final`` proves ``s``'s text complete, and
    any other byte out of ``s1`` proves a longer match.
    """
    index = Index(f"(?:{pattern})\\x{marker:02X}\\x{follower:02X}", _PROBE_VOCAB)
    transitions = index.get_transitions()
    finals = index.get_final_states()
    m_id, f_id = marker + 1, follower + 1
    followed, followers = False, set()
    for edges in transitions.values():
        s1 = edges.get(m_id)
        if s1 is None:
            continue
        after = transitions.get(s1, {})
        if after.get(f_id) not in finals:
            continue
        followers.update(t - 1 for t in edges if t not in (0, m_id))
        followed |= any(t not in (0, f_id) for t in after)
    return followed, followers


def _end_marker(pattern: str, word_boundary: bool) -> int | None:
    """An ASCII byte that never follows a complete match of ``pattern`` within a longer match,
    or None. Raises what outlines-core raises for a pattern that does not compile."""
    ruled_out: set[int] = set()
    for marker in _MARKER_CANDIDATES:
        if marker in ruled_out or (word_boundary and marker in _WORD_BYTES):
            continue
        followers = [f for f in (0x01, 0x02, 0x03) if f != marker][:2]
        for follower in followers:
            followed, seen = _ends_followed(pattern, marker, follower)
            ruled_out |= seen
            if followed:
                break
        else:
            return marker
    return None


class MarkedIndex:
    """An outlines-core ``Index`` of ``(?:pattern)<marker>`` read as the index of ``pattern``.

    The same methods as ``outlines_core.Index``, with its meaning for ``pattern``: final states
    are those where the marker's token leads to the raw index's final states; the marker's token
    (an id past the vocabulary) and every token that ends past the pattern (its text then ends
    with the marker) are not allowed; EOS is allowed in final states and leads to the same state.
    """

    def __init__(self, index: Index, marker_id: int, marker_enders: frozenset[int], eos_token_id: int) -> None:
        self.index = index
        self.marker_id = marker_id
        self.eos_token_id = eos_token_id
        #: Real tokens whose bytes end with the marker's byte: the only ones that can end past the pattern.
        self.marker_enders = marker_enders
        transitions = index.get_transitions()
        self.past_end = frozenset(index.get_final_states())
        self.final_states = frozenset(s for s, edges in transitions.items() if edges.get(marker_id) in self.past_end)
        self.transition_count = sum(len(edges) for edges in transitions.values())

    def get_initial_state(self) -> int:
        """The state before any token."""
        return self.index.get_initial_state()

    def get_final_states(self) -> frozenset[int]:
        """States where the text so far is a complete match of the pattern."""
        return self.final_states

    def is_final_state(self, state: int) -> bool:
        """Whether ``state`` is final."""
        return state in self.final_states

    def get_next_state(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None where it is not allowed."""
        if token == self.eos_token_id:
            return state if state in self.final_states else None
        if token == self.marker_id:
            return None
        nxt = self.index.get_next_state(state, token)
        return None if nxt in self.past_end else nxt

    def get_allowed_tokens(self, state: int) -> list[int]:
        """Token ids allowed in ``state`` (EOS included where it is final)."""
        allowed = self.index.get_allowed_tokens(state) or []
        final = state in self.final_states
        drop = {t for t in self.marker_enders if self.index.get_next_state(state, t) in self.past_end}
        if not final and not drop:
            return allowed  # the marker and EOS leave only final states
        drop |= {self.marker_id, self.eos_token_id}
        out = [t for t in allowed if t not in drop]
        if final:
            out.append(self.eos_token_id)
        return out


def _invalid_regex(pattern: str, error: Exception) -> InvalidRegexError:
    """outlines-core's error for ``pattern`` as an ``InvalidRegexError`` that says what to fix."""
    msg = str(error).split("\n")[0]
    if "incompatible with the regex" in msg or "no transitions" in msg.lower():
        return InvalidRegexError(
            f"Invalid regex {pattern[:200]!r}: no sequence of tokens of this vocabulary can match it "
            f"(the pattern matches nothing, or needs characters no token has). outlines-core: {msg}"
        )
    return InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it does not compile ({msg}).")


def _refuse(pattern: str, kind: str, why: str) -> Exception:
    """The refusal of a pattern the end-marker workaround cannot make exact."""
    detail = (f"outlines-core drops part of the language of patterns whose complete matches can "
              f"be followed by more text (docs/upstream-outlines-core.md), and the workaround "
              f"cannot be applied here: {why}. Use backend='llguidance'.")
    if kind == "json":
        return UnsupportedSchemaFeatureError("(structure)", "", detail)
    return InvalidRegexError(f"Invalid regex {pattern[:200]!r} for backend 'outlines-core': {detail}")


def _marked(pattern: str, kind: str) -> tuple[str, int]:
    """(the pattern to index, its end marker byte); raises where no marker is proven safe."""
    scan = scan_regex(pattern)
    if not scan.ok:
        try:
            Index(pattern, _PROBE_VOCAB)
        except Exception as e:
            raise _invalid_regex(pattern, e) from None
        raise _refuse(pattern, kind, "its parentheses, classes or escapes could not be read")
    if scan.verbose:
        raise _refuse(pattern, kind, "it uses the verbose flag (?x)")
    body = _without_redundant_end_anchors(pattern, scan.end_anchors)
    if body is None:
        raise _refuse(pattern, kind, "it asserts the end of the text ('$' or '\\z') before its end")
    try:
        marker = _end_marker(body, scan.word_boundary)
    except Exception as e:
        raise _invalid_regex(pattern, e) from None
    if marker is None:
        raise _refuse(pattern, kind, "every ASCII character can follow a complete match within a longer one, "
                                     "so no end marker is free")
    return body, marker


def build_index(pattern: str, vocab: TokenVocabulary, *, disk_cache: bool = True, kind: str = "regex") -> MarkedIndex:
    """The index of ``pattern`` over ``vocab`` (a ``MarkedIndex``), from the disk cache when there.

    Raises ``InvalidRegexError`` when the pattern does not compile, no sequence of tokens matches
    it, or (``UnsupportedSchemaFeatureError`` for ``kind="json"``) the end-marker workaround
    cannot make outlines-core's index exact for it.
    """
    digest = hashlib.sha256(f"{_INDEX_FORMAT}\0{vocab.fingerprint}\0{pattern}".encode()).hexdigest()[:40]
    path = cache_dir() / "index" / f"{digest}.pkl"
    if disk_cache and path.is_file():
        try:
            cached = pickle.loads(path.read_bytes())
            if isinstance(cached, MarkedIndex):
                return cached
        except Exception:
            pass  # a stale or truncated file is rebuilt below
    marker = getattr(pattern, "end_marker", None)
    body, marker = (str(pattern), marker) if marker is not None else _marked(pattern, kind)
    marker_id = vocab.size  # past every real id, so no caller can pass it
    enders = frozenset(t for t, b in vocab.token_bytes.items() if b.endswith(bytes([marker])) and t != vocab.eos_token_id)
    try:
        raw = Index(f"(?:{body})\\x{marker:02X}", _to_outlines(vocab, {bytes([marker]): marker_id}))
    except Exception as e:
        raise _invalid_regex(pattern, e) from None
    index = MarkedIndex(raw, marker_id, enders, vocab.eos_token_id)
    if not index.get_final_states():
        raise InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it matches nothing.")
    if disk_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(pickle.dumps(index))
            os.replace(tmp, path)
        except OSError:
            pass  # the disk cache is an optimization only
    return index


class OutlinesCompiled(CompiledConstraint):
    """An outlines-core index. Its per-state caches (masks, done flags) are pure functions of
    the state, so every matcher shares them."""

    backend = BACKEND

    def __init__(self, index: MarkedIndex, vocab: TokenVocabulary, kind: str, pattern: str) -> None:
        super().__init__(vocab, kind, pattern)
        self.index = index
        self.initial_state: int = index.get_initial_state()
        self.final_states = index.get_final_states()
        self.masks: dict[int, torch.Tensor] = {}
        self.done: dict[int, bool] = {}
        self._index_bytes = TRANSITION_BYTES * index.transition_count

    @property
    def nbytes(self) -> int:
        """The index's transitions and the masks cached so far."""
        return self._index_bytes + len(self.masks) * self.vocab.size + super().nbytes

    def matcher(self) -> "OutlinesMatcher":
        """A fresh matcher (a history of states) over this index."""
        return OutlinesMatcher(self)


class OutlinesMatcher(Matcher):
    """A request's history of outlines-core states; lookups go to the shared, cached index."""

    compiled: OutlinesCompiled

    def __init__(self, compiled: OutlinesCompiled) -> None:
        self.initial_state = compiled.initial_state
        super().__init__(compiled)
        self._index = compiled.index
        self._memo: dict[str, dict] = {}

    @property
    def memo(self) -> dict[str, dict]:
        """This request's (drafters learn from its verdicts; a seeded request must not depend on
        what earlier requests learned)."""
        return self._memo

    def next_state(self, state: State, token: int) -> State | None:
        """The state after ``token``, or None when it is not allowed (EOS: None too)."""
        if token == self.eos_token_id:
            return None
        return self._index.get_next_state(state, token)

    def allowed_mask(self, state: State) -> torch.Tensor:
        """Boolean mask of shape ``[vocab.size]`` (cached per state, shared by all matchers)."""
        mask = self.compiled.masks.get(state)
        if mask is None:
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)
            allowed = self._index.get_allowed_tokens(state)
            if allowed:
                mask[torch.tensor(allowed, dtype=torch.long)] = True
            masks = self.compiled.masks
            if len(masks) >= MAX_SHARED_MASKS:
                masks.pop(next(iter(masks)), None)  # another request's thread may have dropped it
            masks[state] = mask
        return mask

    def is_final(self, state: State) -> bool:
        """Whether the text so far is a complete member of the language."""
        return state in self.compiled.final_states

    def is_done(self, state: State) -> bool:
        """Final with nothing but EOS allowed."""
        done = self.compiled.done.get(state)
        if done is None:
            done = self.is_final(state) and self._index.get_allowed_tokens(state) == [self.eos_token_id]
            self.compiled.done[state] = done
        return done


def compile_outlines(pattern: str, vocab: TokenVocabulary, kind: str, *, disk_cache: bool = True) -> OutlinesCompiled:
    """Compile a regex (a JSON schema's, or the user's) into an ``OutlinesCompiled``."""
    return OutlinesCompiled(build_index(pattern, vocab, disk_cache=disk_cache, kind=kind), vocab, kind, pattern)
