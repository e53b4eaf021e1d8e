"""The verifier alone: certain outcomes on hand-built logits, and its sampled law against p."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from constrained_spec.decoding.verifier import verify_greedy, verify_sampled

NEG = float("-inf")


def one_hot(v: int, i: int) -> torch.Tensor:
    p = torch.zeros(v, dtype=torch.float64)
    p[i] = 1.0
    return p


def test_greedy_accepts_matching_prefix_and_emits_target_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [2.0, 1.0, 0.0]])
    # argmax per position: 1, 0, 2, 0. Draft 1, 0, 1 -> reject at position 3, emit 2.
    v = verify_greedy(logits, torch.tensor([1, 0, 1]))
    assert (v.accepted, v.next_token, v.bonus) == (2, 2, False)
    v = verify_greedy(logits, torch.tensor([1, 0, 2]))
    assert (v.accepted, v.next_token, v.bonus) == (3, 0, True)
    v = verify_greedy(logits, torch.tensor([2, 0, 2]))
    assert (v.accepted, v.next_token, v.bonus) == (0, 1, False)
    v = verify_greedy(logits[:1], torch.tensor([], dtype=torch.long))
    assert (v.accepted, v.next_token, v.bonus) == (0, 1, True)


def test_greedy_never_picks_a_masked_token():
    logits = torch.tensor([[NEG, 1.0, NEG], [NEG, NEG, -100.0]])
    v = verify_greedy(logits, torch.tensor([1]))
    assert (v.accepted, v.next_token) == (1, 2)


def test_sampled_certain_accept_all_and_bonus():
    p = torch.stack([one_hot(4, 2), one_hot(4, 3), one_hot(4, 1)])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        v = verify_sampled(p, torch.tensor([2, 3]), None, g)
        assert (v.accepted, v.next_token, v.bonus) == (2, 1, True)


def test_sampled_certain_reject_where_target_gives_zero():
    # p_2(x_2) = 0: x_2 is always rejected and the recovered token comes from p_2 minus x_2.
    p = torch.stack([one_hot(4, 2), one_hot(4, 0), one_hot(4, 1)])
    q = torch.stack([one_hot(4, 2), torch.full((4,), 0.25, dtype=torch.float64)])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        v = verify_sampled(p, torch.tensor([2, 3]), q, g)
        assert (v.accepted, v.next_token, v.bonus) == (1, 0, False)
        v = verify_sampled(p, torch.tensor([2, 3]), None, g)  # one-hot q: residual is p with x zeroed
        assert (v.accepted, v.next_token, v.bonus) == (1, 0, False)


def test_sampled_residual_excludes_overproposed_tokens():
    # q puts all mass on token 0, p splits 0.5 / 0.5 between 0 and 1: on rejection the
    # residual max(0, p - q) is all on token 1.
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    seen = set()
    for seed in range(200):
        v = verify_sampled(p, torch.tensor([0]), q, torch.Generator().manual_seed(seed))
        seen.add((v.accepted, v.next_token))
    assert seen == {(1, 0), (0, 1)}


# -- the law of the first emitted token --------------------------------------------------------

def wrong_correction_from_p(p, x, q, g):
    """Known-wrong variant (negative control): the correction is sampled from p, not the residual."""
    k = x.shape[0]
    for i in range(k):
        qi = q[i, x[i]] if q is not None else 1.0
        if torch.rand((), dtype=torch.float64, generator=g) * qi > p[i, x[i]]:
            return i, int(torch.multinomial(p[i], 1, generator=g))
    return k, int(torch.multinomial(p[k], 1, generator=g))


def first_token_counts(fn, p, q, n, seed) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    v = p.shape[1]
    counts = np.zeros(v)
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        out = fn(p[:2], x, q[:1], g)
        first = int(x[0]) if out[0] >= 1 else out[1]
        counts[first] += 1
    return counts


def right(p, x, q, g):
    v = verify_sampled(p, x, q, g)
    return v.accepted, v.next_token


@pytest.fixture(scope="module")
def pq():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, 6, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(2, 6, generator=g, dtype=torch.float64) * 1.5, -1)
    return p, q


N = 20_000


def test_first_token_follows_p(pq):
    """Chi-square of the first emitted token against p_1. With N = 20,000 draws the test at
    alpha = 1e-3 has power ~1 against the 'correction from p' control below (whose law differs
    from p_1 by a total variation of 0.1-0.2 for these p, q; it is caught with p < 1e-30)."""
    p, q = pq
    counts = first_token_counts(right, p, q, N, seed=1)
    assert chisquare(counts, p[0].numpy() * N).pvalue > 1e-3


def test_negative_control_correction_from_p_is_caught(pq):
    p, q = pq
    counts = first_token_counts(wrong_correction_from_p, p, q, N, seed=1)
    assert chisquare(counts, p[0].numpy() * N).pvalue < 1e-6
