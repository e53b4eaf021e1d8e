"""Applying a constraint's mask to logits, and the masked law those logits define."""

from __future__ import annotations

import torch


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to -inf in place. ``logits``: ``[..., V_model]``, ``mask``: ``[..., V_vocab]``.

    ``V_model`` may exceed ``V_vocab`` (embedding padding); those rows are always disallowed.
    """
    n = mask.shape[-1]
    logits[..., :n].masked_fill_(~mask, float("-inf"))
    if logits.shape[-1] > n:
        logits[..., n:] = float("-inf")
    return logits


def masked_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the allowed set; masked entries are -inf in ``logits`` and get 0.

    ``logits``: ``[..., V]``, already masked. Computed in float64 so tiny p and q keep their ratio.
    """
    return torch.softmax(logits.double() / temperature, dim=-1)
