"""Prompt lookup: continue the longest n-gram match of the recent tokens found earlier in the context."""

from __future__ import annotations

import numpy as np

from ..constraint import Matcher, State, TokenVocabulary
from .base import Draft, Drafter, DraftKind, cut_to_constraint

_STRUCTURAL_TOKENS: dict[str, frozenset[int]] = {}


def structural_tokens(vocab: TokenVocabulary) -> frozenset[int]:
    """Ids of tokens made only of JSON punctuation and whitespace (``": "``, ``",``, ``{"``), per vocabulary."""
    found = _STRUCTURAL_TOKENS.get(vocab.fingerprint)
    if found is None:
        found = frozenset(t for t, b in vocab.token_bytes.items() if b and not b.strip(b' \t\n\r"{}[],:'))
        _STRUCTURAL_TOKENS[vocab.fingerprint] = found
    return found


class LookupDrafter(Drafter):
    """Prompt lookup, cut where the matcher rejects.

    Matches are tried from the longest n-gram (``max_ngram``) down to ``min_ngram``; among the
    most recent ``max_candidates`` matches of that length, the one whose continuation the
    constraint accepts furthest wins. q is one-hot (deterministic).
    """

    name = DraftKind.LOOKUP

    def __init__(self, matcher: Matcher, *, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 8,
                 ignore: frozenset[int] = frozenset()) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"Invalid n-gram range: expected 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}.")
        super().__init__(matcher)
        #: Tokens that cannot make a match on their own: after ``": "`` alone, the last value
        #: written is no guess at the next one (JSON punctuation, see ``structural_tokens``).
        self.ignore = ignore
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_candidates = max_candidates

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Continuation of the best n-gram match, cut where the matcher rejects it."""
        if k <= 0 or len(context) < 2:
            return self.empty(state)
        ctx = np.asarray(context, dtype=np.int64)
        best_tokens: list[int] = []
        best_states: list[State] = [state]
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            if self.ignore and all(int(t) in self.ignore for t in tail):
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)  # matches end before the tail
            hits = np.flatnonzero((windows == tail).all(axis=1))
            for start in hits[::-1][: self.max_candidates]:  # most recent first
                cont = ctx[start + n : start + n + k].tolist()
                states = cut_to_constraint(self.matcher, state, cont)
                if len(states) > len(best_states):
                    best_tokens, best_states = cont[: len(states) - 1], states
                    if len(best_tokens) == k:
                        break
            if best_tokens:
                break
        return Draft(best_tokens, best_states, None, self.name)
