"""Packed batched steps: every row's tokens in one sequence, rows kept apart only in attention.

A batched step's rows verify different numbers of tokens: one row a 12-token forced span,
another its last token alone, a joining request its whole prompt. Right-padded to one width
``w``, every linear layer, norm and the output projection would pay for ``b x w`` rows; on a
CPU a forward grows with every row (the int4 kernel computes each row on its own), so padding
would cost what the drafts save. Packed, the model sees one sequence ``[1, N]`` of all
rows' tokens, each at its own row's position (``position_ids``), and pays for the ``N`` tokens
that are there; the output projection runs on the packed positions whose logits are read. The
row cache writes each token's keys at its row's slot and position (``RowCache.packing``).

Only attention needs rows apart (``_packed_attention``, a wrapper around the model's own
implementation: sdpa, eager or the batch-invariant one). A step's new tokens are gathered into
padded grids ``[rows, h, w, d]``, each row attending to its own keys through a per-row mask,
and scattered back. Rows are grouped by the cache's parts first (``RowCache.parts()``: a
shelf's rows, all within about twice each other's length, their keys one buffer), so short rows
do not attend over a long document's padded positions, nor pay for a shelf whose rows all feed
nothing this step (a document waiting for its next prompt chunk); within a group, a row
feeding many more tokens than the rest gets a second grid. A grid over some of a part's rows
gathers their keys; one over all of them reads the part's views. Without parts (one dense
buffer), rows are grouped by key length (``_length_groups``: a row whose keys are more than
twice another's, plus ``LENGTH_SLACK``, goes to another grid). A joining request's prompt
segment is attended on its own,
with the very call its own first pass makes (its keys only, the mask that pass builds), so its
prompt rows come out as they would alone. Padded grid cells are the one place padding remains.
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
    #: The row's shelf (its index in the cache's parts) and slot on it.
    part: int = 0
    slot: int = 0


@dataclass(frozen=True)
class Grid:
    """A padded ``[rows, width]`` block of a step's new tokens, attended at once over the keys of
    cache part ``part`` (a shelf of ``batching.cache``): ``slots`` the part's slots it covers
    (None: all of them, in order), ``offset`` the first column of those rows'
    new tokens it holds; ``tokens`` the packed indices of its tokens, ``scatter`` their places
    in the block (``row * width + col``), ``gather`` the block's packed indices (padding points
    at one of its tokens, the result is dropped), ``mask`` ``[rows, 1, width, keys]``: each query
    sees its own row's keys up to its own position; ``keys`` the key positions its rows with
    tokens span up to the grid's last column."""

    slots: torch.Tensor | None
    width: int
    offset: int
    tokens: torch.Tensor
    scatter: torch.Tensor
    gather: torch.Tensor
    mask: torch.Tensor
    keys: int = 0
    part: int = 0

    def to(self, device: torch.device) -> "Grid":
        """The same on ``device``."""
        return Grid(_move(self.slots, device), self.width, self.offset, _move(self.tokens, device),
                    _move(self.scatter, device), _move(self.gather, device), _move(self.mask, device), self.keys,
                    self.part)


#: Where a part's tokens are written: the packed indices of its tokens (None: every token),
#: their slots and positions; None for a part with no token this step.
Write = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None


def _move(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


@dataclass(frozen=True)
class PackedRows:
    """Where each of a step's ``N`` packed tokens sits: its row (cache slot) and absolute
    position. The new tokens (each row's last token and drafts) are attended in padded grids:
    all rows up to a width, and, when a few rows feed many more tokens than the rest, those
    rows' further tokens in a second grid (so one long forced span does not pad every row).
    ``prompts``: the prompt segments of rows that join in this step, attended on their own
    (see ``_packed_attention``)."""

    rows: torch.Tensor
    positions: torch.Tensor
    #: Each row's first packed index.
    starts: list[int]
    batch: int
    #: Keys every row's attention spans: the longest row's length (with its prompt) plus the
    #: widest row's new tokens, so any grid query lies at or before key ``key_length - width + t``.
    key_length: int
    grids: tuple[Grid, ...]
    prompts: tuple[PromptSegment, ...] = ()
    #: Per cache part, where its tokens are written (``RowCache.update``).
    writes: tuple[Write, ...] = ()

    @property
    def tokens(self) -> int:
        """``N``, the packed tokens."""
        return int(self.rows.numel())

    def to(self, device: torch.device) -> "PackedRows":
        """The same on ``device``."""
        if self.rows.device == device:
            return self
        writes = tuple(None if w is None else tuple(_move(t, device) for t in w) for w in self.writes)
        return PackedRows(self.rows.to(device), self.positions.to(device), self.starts, self.batch, self.key_length,
                          tuple(g.to(device) for g in self.grids), self.prompts, writes)  # type: ignore[arg-type]


#: What gathering one long row's keys and values for a second grid costs, in padded query rows
#: (a row's float64 keys and values are ~1 MB at 350 positions here; a padded query row attends
#: over them with ~0.8 MFLOP).
KEY_COPY_ROWS = 4
#: Rows whose keys are at most twice the shortest's plus this many share a grid
#: (``_length_groups``): below it a second grid's call and key gathers cost more than the padding.
LENGTH_SLACK = 256


def _length_groups(bases: list[int]) -> list[list[int]]:
    """Rows grouped by their key lengths ``bases``: in increasing order, a row joins the current
    group while its keys are at most twice the group's first row's plus ``LENGTH_SLACK``."""
    groups: list[list[int]] = []
    for i in sorted(range(len(bases)), key=lambda i: bases[i]):
        if groups and bases[i] <= 2 * bases[groups[-1][0]] + LENGTH_SLACK:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def _split_width(counts: list[int]) -> int:
    """The first grid's width: the one minimizing padded query rows over both grids."""
    widest, b = max(counts), len(counts)
    best, best_w = b * widest, widest
    for w in sorted(set(counts)):
        longer = sum(c > w for c in counts)
        cost = b * w + longer * (widest - w + KEY_COPY_ROWS)
        if 0 < w < widest and cost < best:
            best, best_w = cost, w
    return best_w


def pack_rows(lengths: torch.Tensor, counts: list[int], prompt_counts: list[int] | None = None,
              additive: bool = False, parts: list[list[int]] | None = None) -> PackedRows:
    """The layout of a step in which row ``i`` (cache length ``lengths[i]``) feeds
    ``prompt_counts[i]`` prompt tokens (a request joining now) and then ``counts[i]`` new tokens
    (0 for a row that sits the step out). ``additive``: masks as additive floats (eager attention).
    ``parts``: the rows of each part of the cache (``RowCache.parts()``: a shelf's rows in slot
    order), attended a grid per part over its keys; None: one part, rows ``0 .. b - 1`` in their
    slots, grouped by key length (``_length_groups``)."""
    b = len(counts)
    prompt_counts = prompt_counts or [0] * b
    widest = max(max(counts), 1)
    fed = [p + n for p, n in zip(prompt_counts, counts)]
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(fed, dtype=torch.long))
    starts = list(itertools.accumulate(fed, initial=0))
    lengths = lengths[:b]
    cols = torch.arange(len(rows)) - torch.tensor(starts[:-1], dtype=torch.long)[rows]
    positions = lengths[rows] + cols
    bases = lengths + torch.tensor(prompt_counts, dtype=torch.long)  # each row's first new position
    key_length = int(bases.max()) + widest
    if parts is None:
        parts = [list(range(b))]
        groups = [(0, g) for g in _length_groups(bases.tolist())]
        if len(groups) > 1:  # rows feeding nothing need no grid once the grids gather their rows anyway
            groups = [(0, g) for g in ([i for i in group if counts[i]] for _, group in groups) if g]
        groups = groups or [(0, list(range(b)))]
    else:  # a grid over each part that feeds new tokens: its rows' keys are views of one buffer
        groups = [(p, rows_) for p, rows_ in enumerate(parts) if any(counts[i] for i in rows_)]
    part_of, slot_of = [0] * b, [0] * b
    for p, rows_ in enumerate(parts):
        for s, i in enumerate(rows_):
            part_of[i], slot_of[i] = p, s
    grids = [_grid(group, len(parts[p]), p, slot_of, counts, starts, prompt_counts, bases, lo, hi, additive)
             for p, group in groups for lo, hi in _spans([counts[i] for i in group])]
    prompts = tuple(PromptSegment(i, starts[i], prompt_counts[i], int(lengths[i]), fed[i], part_of[i], slot_of[i])
                    for i in range(b) if prompt_counts[i])
    return PackedRows(rows, positions, starts[:-1], b, key_length, tuple(grids), prompts,
                      _writes(rows, positions, part_of, slot_of, len(parts)))


def _writes(rows: torch.Tensor, positions: torch.Tensor, part_of: list[int], slot_of: list[int],
            n_parts: int) -> tuple[Write, ...]:
    """Each part's packed tokens, slots and positions (see ``Write``)."""
    token_parts = torch.tensor(part_of, dtype=torch.long)[rows] if len(rows) else rows
    slots = torch.tensor(slot_of, dtype=torch.long)[rows] if len(rows) else rows
    out: list[Write] = []
    for p in range(n_parts):
        if n_parts == 1:
            out.append((None, slots, positions) if len(rows) else None)
            continue
        tokens = (token_parts == p).nonzero().flatten()
        if not len(tokens):
            out.append(None)
        elif len(tokens) == len(rows):
            out.append((None, slots, positions))
        else:
            out.append((tokens, slots[tokens], positions[tokens]))
    return tuple(out)


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """The column spans of a group's grids: one up to the split width, and one past it if any."""
    widest = max(max(counts, default=0), 1)
    split = _split_width(counts) if counts else widest
    return [(0, split)] + ([(split, widest)] if split < widest else [])


def _grid(group: list[int], part_rows: int, part: int, slot_of: list[int], counts: list[int], starts: list[int],
          prompt_counts: list[int], bases: torch.Tensor, lo: int, hi: int, additive: bool) -> Grid:
    """The grid of columns ``lo .. hi - 1`` of the new tokens of rows ``group`` (of cache part
    ``part``, which holds ``part_rows`` rows; ``slot_of``: each row's slot in its part)."""
    members = [i for i in group if counts[i] > lo] if lo else group
    width = hi - lo
    tokens, places = [], []
    for g, i in enumerate(members):
        for t in range(lo, min(counts[i], hi)):
            tokens.append(starts[i] + prompt_counts[i] + t)
            places.append(g * width + t - lo)
    tokens_t, scatter = torch.tensor(tokens, dtype=torch.long), torch.tensor(places, dtype=torch.long)
    gather = torch.full((len(members) * width,), tokens[0] if tokens else 0, dtype=torch.long)
    gather[scatter] = tokens_t
    # The attention kernels take the grid's queries to be its last ``width`` key positions
    # (``models.invariant._allowed``: query ``t`` sees keys up to ``keys - width + t``, anded
    # with the mask), so ``keys`` is the furthest ``base + hi`` over the rows with a token in
    # the grid; a row with none (a full shelf's row sitting the step out) does not count, or
    # ``keys`` could lie past its shelf. The engine reserves ``base + widest`` for every row
    # that feeds new tokens.
    keys = max((int(bases[i]) + hi for i in members if counts[i] > lo), default=0)
    query_pos = bases[members][:, None] + lo + torch.arange(width)
    mask = (torch.arange(keys)[None, None, :] <= query_pos[:, :, None])[:, None]
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    slots = [slot_of[i] for i in members]
    every = slots == list(range(part_rows))
    return Grid(None if every else torch.tensor(slots, dtype=torch.long), width, lo, tokens_t, scatter, gather, mask,
                keys, part)


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
    """The attention function transformers registers as ``name`` (eager: the module's own)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":  # modeling files define eager attention themselves
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _packed_attention(base: str) -> Any:
    """The attention function registered for a model whose own implementation is ``base``."""

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, packing: PackedRows | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        fn = _base_attention(base, module)
        if packing is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        kwargs.pop("prompt_rows", None)  # the segments are in ``packing``
        heads, dim = query.shape[1], query.shape[3]
        out = query.new_empty(query.shape[2], heads, dim)  # [N, h, d]
        # New tokens: grids of [rows, h, w, d] queries, each row against its own keys.
        # The cache's parts (``RowCache.update`` returns a list: one buffer per shelf).
        keys_of = key if isinstance(key, list) else [key]
        values_of = value if isinstance(value, list) else [value]
        for grid in packing.grids:
            if not grid.tokens.numel():  # no row feeds new tokens (a prompt chunk alone)
                continue
            k, v = keys_of[grid.part][:, :, : grid.keys], values_of[grid.part][:, :, : grid.keys]
            if grid.slots is not None:
                k, v = k.index_select(0, grid.slots), v.index_select(0, grid.slots)
            rows = k.shape[0]
            q = query[0].index_select(1, grid.gather).view(heads, rows, grid.width, dim).transpose(0, 1)
            got, _ = fn(module, q, k, v, grid.mask, **kwargs)  # [rows, w, h, d]
            out[grid.tokens] = got.reshape(rows * grid.width, heads, dim).index_select(0, grid.scatter)
        # Prompt segments: each exactly as the request's own first pass computes its prompt rows.
        additive = base == "eager"
        for seg in packing.prompts:
            keys = seg.past + seg.length
            # A float64 cache's exact copies back to the query's dtype; a bfloat16 cache's as they
            # are (the attention kernels read them so, ``models.invariant``).
            k, v = (_prompt_operand(t[seg.part][seg.slot : seg.slot + 1, :, :keys], query.dtype)
                    for t in (keys_of, values_of))
            mask = prompt_mask(seg, additive, query.dtype)
            extra = {"prompt_rows": seg.length} if base == INVARIANT else {}
            got, _ = fn(module, query[:, :, seg.start : seg.start + seg.length], k, v,
                        None if mask is None else mask.to(query.device), **kwargs, **extra)
            out[seg.start : seg.start + seg.length] = got[0]
        return out[None], None

    return attention


def _prompt_operand(held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A prompt segment's cached keys or values for its attention: a bfloat16 cache's as they
    are, any other in ``dtype`` (the query's)."""
    return held if held.dtype == torch.bfloat16 else held.to(dtype)


def install_packed_attention(model: Any) -> None:
    """Let ``model``'s attention take ``packing=`` (in place, once): its implementation is wrapped
    so that a forward without ``packing`` runs exactly as the unwrapped one."""
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
