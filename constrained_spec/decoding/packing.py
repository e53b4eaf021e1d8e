"""Packed batched steps: every row's new tokens in one sequence, padded only inside attention.

A batched step's rows verify different numbers of tokens: one row a 12-token forced span,
another its last token alone. Right-padded to one width ``w``, every linear layer, norm and the
output projection would pay for ``b x w`` rows; on this CPU a forward grows about 2 ms per row
(the int4 kernel computes each row on its own), so padding would cost what the drafts save.
Packed, the model sees one sequence ``[1, N]`` of all rows' tokens, each at its own row's
position (``position_ids``), and pays for the ``N`` tokens that are there. Only attention needs
rows apart: ``packed_attention`` gathers the queries into ``[b, w]`` (each row's tokens, then
padding), lets the model's own attention (sdpa, eager or the batch-invariant one) attend each
row to its own keys through the per-row mask, and scatters the outputs back into ``[1, N]``.
The row cache writes each token's keys at its row's slot and position (``RowCache.step``).
The output projection then runs on the rows whose logits are needed, by packed index.

Attention's padded query rows cost ``b x w x keys`` there, the one place padding remains; it is
a small part of a forward of this model.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..models.invariant import IMPLEMENTATION as INVARIANT

#: Name prefix of the packed wrappers registered with transformers (one per base implementation).
PACKED_PREFIX = "constrained_spec_packed:"


@dataclass(frozen=True)
class PromptSegment:
    """A joining request's prompt tokens in a packed step: packed indices ``start .. start +
    length - 1``, its row (cache slot), the keys that row already holds (``past``) and the
    tokens the row feeds in all this step (``fed``: the prompt, its last token, its drafts)."""

    row: int
    start: int
    length: int
    past: int
    fed: int


@dataclass(frozen=True)
class PackedRows:
    """Where each of a step's ``N`` packed tokens sits: its row (cache slot) and absolute
    position; the step's new tokens (each row's last token and drafts) also sit in a padded
    ``[b, w]`` grid for attention: ``gather`` maps the grid to packed indices (padding points at
    some new token, its results are dropped), ``scatter`` maps the new tokens, in packed order
    (``new``), to the grid (``row * w + col``). ``prompts``: the prompt segments of rows that
    join in this step, attended on their own (see ``packed_attention``)."""

    rows: torch.Tensor
    positions: torch.Tensor
    new: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    batch: int
    width: int
    #: Keys every row's attention spans: the longest row's length (with its prompt) plus the
    #: width, so a grid query ``t`` of any row lies at or before key ``key_length - width + t``.
    key_length: int
    #: Each row's length before its new tokens (its cache and its prompt segment).
    bases: torch.Tensor
    prompts: tuple[PromptSegment, ...] = ()

    @property
    def tokens(self) -> int:
        """``N``, the packed tokens."""
        return int(self.rows.numel())

    def to(self, device: torch.device) -> "PackedRows":
        """The same on ``device``."""
        if self.rows.device == device:
            return self
        return PackedRows(*(t.to(device) for t in (self.rows, self.positions, self.new, self.gather, self.scatter)),
                          self.batch, self.width, self.key_length, self.bases.to(device), self.prompts)


def pack_rows(lengths: torch.Tensor, counts: list[int], prompt_counts: list[int] | None = None) -> PackedRows:
    """The layout of a step in which row ``i`` (cache length ``lengths[i]``) feeds
    ``prompt_counts[i]`` prompt tokens (a request joining now) and then ``counts[i]`` new tokens
    (0 for a row that sits the step out)."""
    b = len(counts)
    prompt_counts = prompt_counts or [0] * b
    width = max(max(counts), 1)
    fed = [p + n for p, n in zip(prompt_counts, counts)]
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(fed, dtype=torch.long))
    starts = list(itertools.accumulate(fed, initial=0))
    cols = torch.arange(len(rows)) - torch.tensor(starts[:-1], dtype=torch.long)[rows]
    lengths = lengths[:b]
    positions = lengths[rows] + cols
    new = torch.tensor([starts[i] + prompt_counts[i] + t for i in range(b) for t in range(counts[i])], dtype=torch.long)
    new_rows = rows[new]
    scatter = new_rows * width + (cols[new] - torch.tensor(prompt_counts, dtype=torch.long)[new_rows])
    gather = torch.full((b * width,), int(new[0]) if len(new) else 0, dtype=torch.long)
    gather[scatter] = new
    bases = lengths + torch.tensor(prompt_counts, dtype=torch.long)
    prompts = tuple(PromptSegment(i, starts[i], prompt_counts[i], int(lengths[i]), fed[i]) for i in range(b) if prompt_counts[i])
    return PackedRows(rows, positions, new, gather, scatter, b, width, int(bases.max()) + width, bases, prompts)


def padded_mask(packing: PackedRows) -> torch.Tensor:
    """``[b, 1, w, keys]`` boolean: row ``i``'s grid query ``t`` sees its own keys up to its own
    position (absolute), nothing of other rows."""
    positions = packing.bases[:, None].cpu() + torch.arange(packing.width)
    keys = torch.arange(packing.key_length)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def prompt_mask(segment: PromptSegment, additive: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask a request's own first pass gives its prompt rows: built for the whole pass
    (``fed`` tokens after ``past`` cached ones) and cut to the prompt rows and their keys, as
    the model's mask function and the batch-invariant attention do; None where the model's
    sdpa mask is skipped (no cached keys: plain causal)."""
    past, length, fed = segment.past, segment.length, segment.fed
    if past == 0 and not additive:
        return None
    keys = torch.arange(past + fed)
    mask = (keys[None, :] <= past + torch.arange(fed)[:, None])[None, None]
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return mask[..., :length, : past + length]


def _base_attention(name: str, module: Any) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # modeling files define eager attention themselves
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _packed_attention(base: str):
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, packing: PackedRows | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        fn = _base_attention(base, module)
        if packing is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        kwargs.pop("prompt_rows", None)  # the segments are in ``packing``
        # New tokens: query [1, h, N, d] -> the [b, h, w, d] grid, each row against its own keys.
        heads, dim = query.shape[1], query.shape[3]
        q = query[0].index_select(1, packing.gather).view(heads, packing.batch, packing.width, dim).transpose(0, 1)
        out, _ = fn(module, q, key, value, attention_mask, **kwargs)  # [b, w, h, d]
        out = out.reshape(packing.batch * packing.width, heads, dim).index_select(0, packing.scatter)
        if not packing.prompts:
            return out[None], None
        # Prompt segments: each exactly as the request's own first pass computes its prompt rows.
        full = out.new_empty(query.shape[2], heads, dim)
        full[packing.new] = out
        additive = base == "eager"
        for seg in packing.prompts:
            keys = seg.past + seg.length
            k, v = (t[seg.row : seg.row + 1, :, :keys].to(query.dtype) for t in (key, value))
            mask = prompt_mask(seg, additive, query.dtype)
            extra = {"prompt_rows": seg.length} if base == INVARIANT else {}
            seg_out, _ = fn(module, query[:, :, seg.start : seg.start + seg.length], k, v,
                            None if mask is None else mask.to(query.device), **kwargs, **extra)
            full[seg.start : seg.start + seg.length] = seg_out[0]
        return full[None], None

    return attention


def install_packed_attention(model: Any) -> None:
    """Let ``model``'s attention take ``packing=`` (in place, once): its implementation is wrapped
    so that a forward without ``packing`` runs exactly as before."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    base = model.config._attn_implementation
    if base.startswith(PACKED_PREFIX):
        return
    name = PACKED_PREFIX + base
    AttentionInterface.register(name, _packed_attention(base))
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name
