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

The guard is checked after every token, never once per step, so a loop stops on the same token,
with the same partial text, whatever the drafter, K, batch or precision (``first_repetition``).
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


def repeated_cycle(tokens: Sequence[int], states: Sequence[State], repeats: int, matcher: Matcher,
                   end: int | None = None) -> int | None:
    """The length of a cycle that ``tokens[:end]`` (all of them by default) ends in ``repeats``
    (or more, see the module docstring) copies of, with the same matcher state after each copy;
    None if there is none. ``states[i]`` is the matcher state after ``tokens[i]``."""
    n = len(tokens) if end is None else end
    if repeats <= 0:
        return None
    for length in range(1, MAX_CYCLE + 1):
        copies = max(repeats, -(-MIN_SPAN // length))
        span = length * copies
        if span > n:
            break
        if tokens[n - 1] != tokens[n - 1 - length]:  # the cheap test first: most lengths fail here
            continue
        if any(tokens[i] != tokens[i + length] for i in range(n - span, n - length)):
            continue
        last = states[n - 1]
        if all(_same_state(matcher, states[n - 1 - j * length], last) for j in range(1, copies)):
            return length
    return None


def first_repetition(tokens: Sequence[int], states: Sequence[State], start: int, repeats: int,
                     matcher: Matcher) -> tuple[int, int] | None:
    """Where the guard fires among ``tokens[start:]``: ``(end, cycle length)`` for the first
    ``end > start`` at which ``tokens[:end]`` ends in a loop, checked token by token, or None.

    Token by token, not once per step: a step may emit several tokens, and the stop must fall on
    the same token whatever the drafter, K or batch (target-only decoding checks after each
    token). A state that allows only EOS ends the request instead, as it does in target-only
    decoding, so it is not checked.
    """
    for end in range(start + 1, len(tokens) + 1):
        if matcher.is_done(states[end - 1]):
            continue
        cycle = repeated_cycle(tokens, states, repeats, matcher, end)
        if cycle is not None:
            return end, cycle
    return None
