"""Exact speculative verification: a pure tensor function (no model, no FSM, no cache).

Words, used the same way everywhere (as in vLLM):
- *accepted* tokens: the draft tokens x_1..x_n that pass the test;
- *recovered* token: sampled from the residual normalize(max(0, p_i - q_i)) at the first rejection;
- *bonus* token: sampled from p_{k+1} when all k draft tokens are accepted.

Every step therefore emits n accepted tokens plus exactly one recovered or bonus token, and the
emitted sequence has exactly the distribution of sampling from p token by token (Leviathan et
al. 2023; Chen et al. 2023). Here p is the *grammar-masked* target distribution, so the output
follows target-only masked sampling, not the unconstrained model conditioned on the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constraint.masking import masked_probs

__all__ = ["Verdict", "masked_probs", "verify_greedy", "verify_sampled"]


@dataclass(frozen=True)
class Verdict:
    """Result of one verification.

    Attributes:
        accepted: n, how many leading draft tokens were accepted (0..k).
        next_token: the recovered token (n < k) or the bonus token (n == k).
        bonus: True when ``next_token`` is a bonus token.
    """

    accepted: int
    next_token: int
    bonus: bool


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Greedy (T = 0) verification: accept x_i iff it is the argmax of p_i; else emit that argmax.

    Args:
        target_logits: ``[k+1, V]`` grammar-masked target logits for positions 1..k+1.
        draft_tokens: ``[k]`` proposed tokens x_1..x_k.
    """
    k = draft_tokens.shape[0]
    best = target_logits.argmax(dim=-1)  # [k+1]
    mismatch = (best[:k] != draft_tokens).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return Verdict(accepted=n, next_token=int(best[n]), bonus=n == k)


def verify_sampled(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Exact rejection sampling of a draft against the target.

    Args:
        p: ``[k+1, V]`` target probabilities p_1..p_{k+1} (masked, normalized).
        draft_tokens: ``[k]`` proposed tokens x_1..x_k.
        q: ``[k, V]`` draft probabilities q_1..q_k, or None for a deterministic drafter
            (q_i is then one-hot at x_i).
        generator: the random source; the same generator and inputs give the same verdict.

    Accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection the
    recovered token is drawn from normalize(max(0, p_i - q_i)); if all k pass, the bonus token
    is drawn from p_{k+1}.
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k)
    p_x = p[idx, draft_tokens]  # [k]
    q_x = q[idx, draft_tokens] if q is not None else torch.ones(k, dtype=p.dtype)
    u = torch.rand(k, dtype=p.dtype, generator=generator)
    # q_x > 0 always (the drafter sampled x from q); the ratio form avoids a 0/0 when p_x = 0.
    rejected = (u * q_x > p_x).nonzero()
    if not rejected.numel():
        return Verdict(accepted=k, next_token=_sample(p[k], generator), bonus=True)
    n = int(rejected[0, 0])
    if q is None:
        residual = p[n].clone()
        residual[draft_tokens[n]] = 0.0
    else:
        residual = (p[n] - q[n]).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q: rejection had probability 0; keep p to stay defined
        residual = p[n]
    return Verdict(accepted=n, next_token=_sample(residual, generator), bonus=False)


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalized non-negative ``weights`` of shape ``[V]``."""
    return int(torch.multinomial(weights, 1, generator=generator))
