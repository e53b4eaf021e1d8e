"""The logits a step reads, computed only over the tokens the constraint lets a position use.

The vocabulary projection reads the whole output matrix for every row it computes, the largest
single cost of a decode step on the embedded model (see docs/performance.md). Yet many of the
positions whose logits a structured output reads allow only a few tokens: digits, an enum's
values, ``true``/``false``, a comma or a closing bracket. A row in such a state gets its
logits from those rows of the matrix alone (``allowed_subset``), the others from the model's
own output layer; a step whose rows are all small or forced skips the full projection.

Exactness. Which path a row takes depends only on its constraint state (the number of tokens
the state allows), never on K, the other rows or the batch, and a row on the subset path is
computed alone, so a position's logits have the same bits in target-only decoding, in any
verify pass and in any batch: greedy identity and the batch invariance hold on either path. The
tokens outside the subset are the ones the mask sets to -inf anyway, so the masked law is the
model's on the allowed tokens (up to the rounding of a different summation order).

Models whose logits are more than a plain output layer of the final hidden state (a final
softcap, a logit scale, another kind of layer, a hook on it) keep the full projection
(``supports_subsets``), and so do models on a GPU: there the whole matrix is read in
microseconds, while each subset row is a transfer of
its ids, a gather, a product and a copy back, each waiting on the last.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .invariant import BucketedLinear
from .q8_output import Q8OutputProjection
from .quant_linear import QuantLinear

#: States allowing more tokens than this take the full projection: gathering a row of the
#: matrix costs about what reading it costs, so past a few thousand rows the subset stops paying
#: (1,024 rows: 2.4 MB, a fiftieth of the matrix).
SUBSET_MAX = 1024


def supports_subsets(target: Any) -> bool:
    """Whether ``target``'s logits are its output layer applied to the final hidden state, so a
    subset of rows can be computed on its own."""
    config = getattr(target, "config", None)
    out = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    layers = [out, getattr(out, "linear", None)] if isinstance(out, BucketedLinear) else [out]
    plain = all(isinstance(m, nn.Linear) or type(m) in (BucketedLinear, Q8OutputProjection, QuantLinear) for m in layers)
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layers if isinstance(m, nn.Module))
    on_gpu = out is not None and any(p.device.type == "cuda" for p in out.parameters())
    return (out is not None and plain and not hooked and not on_gpu and hasattr(target, "base_model")
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logits_scaling", 1.0) in (1, 1.0, None)
            and getattr(config, "logit_scale", 1.0) in (1, 1.0, None))


def allowed_subset(mask: torch.Tensor) -> torch.Tensor | None:
    """The token ids ``mask`` allows when they are few enough for the subset path (2 to
    ``SUBSET_MAX``), else None. A state allowing one token needs no logits at all."""
    count = int(mask.sum())
    if count < 2 or count > SUBSET_MAX:
        return None
    return mask.nonzero().flatten()


def forward_logits(target: Any, rows: Sequence[int], subsets: Sequence[torch.Tensor | None] | None,
                   use_subsets: bool, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """One forward of ``target`` on ``inputs`` (``input_ids``, ``cache``, ...) and the logits of
    positions ``rows`` ``[len(rows), V]`` on the CPU (float32, or float64 where the model
    computes in it): over ``subsets`` (``project_rows``) when ``use_subsets``, else through the
    model's forward with ``logits_to_keep``. Returns (the forward's output, the logits)."""
    if use_subsets:
        out = target.base_model(**inputs)
        subsets = subsets if subsets is not None else [None] * len(rows)
        return out, project_rows(target, out.last_hidden_state[0, list(rows)], subsets)
    device = inputs["input_ids"].device
    out = target(**inputs, logits_to_keep=torch.tensor(list(rows), dtype=torch.long, device=device))
    logits = out.logits[0].cpu()
    return out, logits if logits.dtype == torch.float64 else logits.float()


def project_rows(target: Any, hidden: torch.Tensor, subsets: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Logits ``[n, V]`` (float32, or float64 where the model computes in it, on the CPU) of the
    final hidden states ``hidden`` ``[n, d]``: row ``i`` over the ids ``subsets[i]`` (zeros
    elsewhere, which the mask removes), or over the whole vocabulary when it is None (through
    the model's own output layer, all such rows in one call, as the model's forward does)."""
    out = target.get_output_embeddings()
    linear = out.linear if isinstance(out, BucketedLinear) else out  # the wrapper has no bias of its own
    if isinstance(linear, QuantLinear):  # packed: its rows are gathered, exactly as the file stores them
        rows_of, dtype, device, vocab = linear.gather_rows, torch.float32, hidden.device, linear.out_features
    else:
        weight = linear.weight
        rows_of, device, vocab = (lambda ids: weight.index_select(0, ids)), weight.device, weight.shape[0]
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    logits = torch.zeros(len(subsets), vocab, dtype=dtype)
    full = [i for i, s in enumerate(subsets) if s is None]
    if full:
        logits[full] = out(hidden[full][None])[0].to(dtype).cpu()
    bias = getattr(linear, "bias", None)
    for i, ids in enumerate(subsets):
        if ids is None:
            continue
        ids_dev = ids.to(device)
        rows = rows_of(ids_dev)
        row = torch.mv(rows, hidden[i].to(rows.dtype))
        if bias is not None:
            row = row + bias.index_select(0, ids_dev)
        logits[i, ids] = row.to(dtype).cpu()
    return logits
