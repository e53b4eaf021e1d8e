"""Stopping rows that loop: a greedy decoder that has emitted the same token cycle several times
over, with the constraint back where it was each time, almost always goes on to the token limit
(a small model in a free string: ``"https://www.youtube.com/embed_embed_embed...``), holding a
batch slot for hundreds of tokens. Not certainly: the context grows, so the guard is an option
(``max_repeats``; 0 turns it off) and a stopped request says so (``RepetitionError``).

A cycle of ``L`` tokens counts as looping when the output ends with ``max_repeats`` copies of it
(more for short cycles: the copies must span at least ``MIN_SPAN`` tokens, so "0000" inside a
number does not count) and the matcher allows the same tokens after every copy (states compared
by identity, else by their masks and finality: llguidance's states are trie nodes, a new one per
path, so equal ids would never repeat there). The mask comparison cannot see a counter whose
bound is still far (``(ab){0,50}``, an array's ``maxItems``): such a bounded loop may be
stopped before it would have ended valid, which ``max_repeats`` (higher, or 0) controls.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..constraint import Matcher, State

#: The fewest tokens the repeated copies must cover together.
MIN_SPAN = 16
#: The longest cycle looked for, in tokens.
MAX_CYCLE = 32


def _same_state(matcher: Matcher, a: State, b: State) -> bool:
    if a == b:
        return True
    return matcher.is_final(a) == matcher.is_final(b) and torch.equal(matcher.allowed_mask(a), matcher.allowed_mask(b))


def repeated_cycle(tokens: Sequence[int], states: Sequence[State], repeats: int, matcher: Matcher) -> int | None:
    """The length of a cycle the output ends in ``repeats`` (or more, see the module docstring)
    copies of, with the same matcher state after each copy; None if there is none.
    ``states[i]`` is the matcher state after ``tokens[i]``."""
    n = len(tokens)
    if repeats <= 0:
        return None
    for length in range(1, MAX_CYCLE + 1):
        copies = max(repeats, -(-MIN_SPAN // length))
        span = length * copies
        if span > n:
            break
        cycle = list(tokens[n - length :])
        if list(tokens[n - span :]) != cycle * copies:
            continue
        end = states[n - 1]
        if all(_same_state(matcher, states[n - 1 - j * length], end) for j in range(1, copies)):
            return length
    return None
