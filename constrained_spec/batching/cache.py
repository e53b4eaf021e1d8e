"""The batch engine's KV cache: rows of their own lengths, on shelves of one capacity each.

Design. A row lives on the shelf of the smallest capacity that holds it (``capacity_for``:
256, 512, 1024, 2048, then multiples of 1024, up to the model's context). A shelf keeps, per
layer, dense buffers ``[slots, kv_heads, capacity, head_dim]`` and its rows in slots ``0 ..
n - 1``; a row's cache is positions ``0 .. lengths[row] - 1`` of its slot. A step's tokens come
packed (``batching.packing``: one sequence of every row's new tokens, each with its row and
position); ``update`` writes each token's keys at its shelf, slot and position, and returns
each shelf's buffers, which attention reads as views, one grid per shelf (a shelf's rows are
within about twice each other's length, so a grid pads little). Rolling a row back is lowering
its length: the rejected draft positions are overwritten by a later step, so rows roll back
independently at no cost. A row that outgrows its shelf moves to the next (a copy of its
positions, once per doubling, then once per 1,024 positions); a finished row's slot is refilled
by the shelf's last row, and a shelf's buffers shrink once they would be a quarter of what it
holds and are freed when it empties. So memory is the rows' capacities summed (at most about
twice the positions held, plus slot doubling), not every slot at the longest row's capacity:
a long document does not size the slots of the short rows beside it.
``bytes_per_token`` is ``2 x layers x kv_heads x head_dim x dtype size`` (SmolLM2-135M in
bfloat16: 23 KiB, in float32 46 KiB, in float64 92 KiB).

Why not fixed-size blocks from one pool with a block table per row (vLLM's paged attention,
transformers' continuous-batching ``PagedAttentionCache``): torch has no attention over a
block table on the CPU, so every layer of every step would gather each row's blocks into a
dense copy first, which costs several times the attention itself (see docs/performance.md).
Shelves give most of
a pool's memory behaviour (a row holds about what it uses and gives it back when it leaves)
while attention keeps reading views.

Why float64: a batch-invariant model attends in float64 (``models.invariant``). Kept in float64
(exact copies of the float32 keys), each step converts only its new tokens; kept in float32,
every step would convert every row's whole cache in every layer, which costs about what the
gather above costs. So the cache pays 92 KiB a position for the speed of every step, up to
``LONG_CONTEXT`` positions: past it a row's queries attend in float32 blocks
(``models.invariant.attend_new_rows``), so the shelves of capacity above it keep float32 (46
KiB a position; a row moving up converts exactly, once). Where the attention kernels read the
cache (``models.invariant.cache_dtype``) it keeps the model's own choice throughout: float32, or
bfloat16 for a native model loaded with ``CONSTRAINED_SPEC_KV_CACHE=bfloat16``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..models import growing_cache as kv_cache
from ..models.heap import trim_heap
from .packing import PackedRows

#: Above this capacity shelves grow by ``LARGE_STEP`` positions rather than doubling, so a long
#: document's row holds at most that many unused positions.
DOUBLING_LIMIT = 2048
LARGE_STEP = 1024


@dataclass
class Shelf:
    """The rows of one capacity: per layer ``[allocated, kv_heads, capacity, head_dim]`` buffers
    (None until written), ``rows[s]`` the row in slot ``s``."""

    capacity: int
    #: The buffers' dtype (None: the keys' own).
    dtype: torch.dtype | None = None
    rows: list[int] = field(default_factory=list)
    allocated: int = 0
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def resize(self, slots: int) -> None:
        """Buffers of ``slots`` slots holding the rows' positions."""
        keep = min(len(self.rows), slots)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is not None:
                    resized = buf.new_zeros(slots, *buf.shape[1:])  # zeros: stale slots stay finite
                    resized[:keep] = buf[:keep]
                    store[i] = resized
        self.allocated = slots

    def buffer(self, store: list[torch.Tensor | None], layer: int, like: torch.Tensor) -> torch.Tensor:
        """``store[layer]``, allocated for ``like``'s heads and head size if not yet."""
        buf = store[layer]
        if buf is None:
            buf = store[layer] = like.new_zeros(self.allocated, like.shape[-3], self.capacity, like.shape[-1],
                                                dtype=self.dtype or like.dtype)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for store in (self.keys, self.values) for b in store if b is not None)


class RowCache(Cache):
    """Per-row-length KV cache for up to ``slots`` rows (see the module docstring). Rows are
    numbered ``0 .. active - 1`` (the engine's order); each sits on a shelf.

    Args:
        num_layers: the model's decoder layers.
        slots: the most rows at once.
        max_capacity: positions per row at most (the model's context).
        capacity: the smallest shelf's capacity.
        dtype: the buffers' dtype; None: the keys' own (float64 for a batch-invariant model:
            see the module docstring).
    """

    def __init__(self, num_layers: int, slots: int, max_capacity: int, capacity: int = 256,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.slots = slots
        self.max_capacity = max_capacity
        self.initial_capacity = min(capacity, max_capacity)
        self.dtype = dtype
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.active = 0
        #: The layout of the step under way (set by the engine around each forward).
        self.packing: PackedRows | None = None
        #: Shelves by capacity.
        self.shelves: dict[int, Shelf] = {}
        #: Each row's shelf capacity and slot on it.
        self._place: list[tuple[int, int]] = []

    # -- layout -----------------------------------------------------------------------------------
    def capacity_for(self, positions: int) -> int:
        """The capacity of the shelf a row of ``positions`` positions sits on."""
        if positions > self.max_capacity:
            raise ValueError(f"A row needs {positions} positions; the model's context holds {self.max_capacity}.")
        cap = doubled_to(self.initial_capacity, positions)
        if positions > DOUBLING_LIMIT:
            cap = -(-positions // LARGE_STEP) * LARGE_STEP
        return min(max(cap, self.initial_capacity), self.max_capacity)

    def parts(self) -> list[list[int]]:
        """The rows of each shelf in slot order, smallest capacity first (``pack_rows``'s parts,
        in the order ``update`` returns the shelves' buffers)."""
        return [self.shelves[c].rows for c in sorted(self.shelves)]

    def capacity_of(self, row: int) -> int:
        """The capacity of ``row``'s shelf."""
        return self._place[row][0]

    def shelf_dtype(self, cap: int) -> torch.dtype | None:
        """The dtype of the shelf of capacity ``cap``: float32 past ``LONG_CONTEXT`` positions
        (attention reads those rows in float32, ``models.invariant``), else ``dtype``."""
        return torch.float32 if self.dtype == torch.float64 and cap > kv_cache.LONG_CONTEXT else self.dtype

    def footprint_bytes(self, positions: list[int], values_per_position: int, default_size: int) -> int:
        """Bytes the shelves allocate at most for rows of these sizes, ``values_per_position``
        numbers a position (keys and values of every layer) of each shelf's dtype
        (``default_size`` bytes each where the shelf keeps the keys' own)."""
        counts: dict[int, int] = {}
        for n in positions:
            cap = self.capacity_for(min(n, self.max_capacity))
            counts[cap] = counts.get(cap, 0) + 1
        return sum(min(doubled_to(1, k), self.slots) * cap * values_per_position * _element_size(self.shelf_dtype(cap), default_size)
                   for cap, k in counts.items())

    def footprint(self, positions: list[int]) -> int:
        """Positions (slots x capacity) the shelves allocate at most for rows of these sizes."""
        counts: dict[int, int] = {}
        for n in positions:
            cap = self.capacity_for(min(n, self.max_capacity))
            counts[cap] = counts.get(cap, 0) + 1
        return sum(min(doubled_to(1, k), self.slots) * cap for cap, k in counts.items())

    # -- the interface transformers' attention calls -------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Write the step's packed keys / values (``[1, kv_heads, N, head_dim]``, placed by
        ``self.packing``) at each token's shelf, slot and position; return each shelf's keys /
        values (``[rows, kv_heads, capacity, head_dim]`` views, in ``parts()`` order)."""
        packing = self.packing
        if packing is None:
            raise RuntimeError("RowCache.update outside a packed step (set RowCache.packing first)")
        k_new, v_new = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [N, heads, dim]
        keys_out, values_out = [], []
        for cap, write in zip(sorted(self.shelves), packing.writes):
            shelf = self.shelves[cap]
            keys = shelf.buffer(shelf.keys, layer_idx, key_states)
            values = shelf.buffer(shelf.values, layer_idx, value_states)
            if write is not None:
                tokens, slots, positions = write
                k, v = (k_new, v_new) if tokens is None else (k_new.index_select(0, tokens), v_new.index_select(0, tokens))
                k, v = k.to(keys.dtype), v.to(values.dtype)  # the shelf's dtype (exact either way)
                # [slots, capacity, heads, dim] views: (slot, position) pairs index the first two dims
                keys.transpose(1, 2)[slots, positions] = k
                values.transpose(1, 2)[slots, positions] = v
            n = len(shelf.rows)
            keys_out.append(keys[:n])
            values_out.append(values[:n])
        return keys_out, values_out

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The longest active row's length."""
        return int(self.lengths[: self.active].max()) if self.active else 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_capacity

    # -- what the engine calls ------------------------------------------------------------------
    def reserve_row(self, row: int, positions: int) -> None:
        """Make room for ``positions`` in ``row`` (moving it to a larger shelf if need be)."""
        cap, slot = self._place[row]
        if positions <= cap:
            return
        new = self.capacity_for(positions)
        target = self._shelf(new)
        to = self._seat(target, row)
        old = self.shelves[cap]
        _copy_row(old, slot, target, to, int(self.lengths[row]))
        self._unseat(cap, slot)
        self._place[row] = (new, to)
        if not old.rows:  # its buffers go at once, not at the next release
            del self.shelves[cap]

    def add_row(self, cache: DynamicCache, positions: int = 1) -> int:
        """Take a request's single-row cache (its shared prefix, or nothing) as the next row, on
        the shelf for ``positions`` (what it will hold at least: its prompt), so that a prompt fed
        chunk by chunk does not move the row from shelf to shelf (each move holds both copies
        for a moment: a 3,900-token document's row moving from 3,072 to 4,096 positions, 644 MiB)."""
        if self.active >= self.slots:
            raise RuntimeError("RowCache is full")
        row = self.active
        cap = self.capacity_for(min(max(cache.get_seq_length(), positions, 1), self.max_capacity))
        self._place.append((cap, self._seat(self._shelf(cap), row)))
        self.lengths[row] = 0
        self.active += 1
        if cache.get_seq_length():
            self.append(row, [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers])
        return row

    def append(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a block's keys and values (per layer ``[kv_heads, n, head_dim]``) after the
        row's held positions, and count them."""
        start = int(self.lengths[row])
        n = keys[0].shape[1]
        self.reserve_row(row, start + n)
        cap, slot = self._place[row]
        shelf = self.shelves[cap]
        for i, (k, v) in enumerate(zip(keys, values)):
            shelf.buffer(shelf.keys, i, k)[slot, :, start : start + n] = k
            shelf.buffer(shelf.values, i, v)[slot, :, start : start + n] = v
        self.lengths[row] = start + n

    def block(self, row: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Positions ``start .. end - 1`` of ``row``: per layer ``[kv_heads, n, head_dim]`` views."""
        cap, slot = self._place[row]
        shelf = self.shelves[cap]
        return ([k[slot, :, start:end] for k in shelf.keys if k is not None],
                [v[slot, :, start:end] for v in shelf.values if v is not None])

    def remove_row(self, row: int) -> int | None:
        """Free ``row``; the last row takes its number. Returns the row that was renumbered (now
        ``row``), or None if ``row`` was the last."""
        cap, slot = self._place[row]
        self._unseat(cap, slot)
        last = self.active - 1
        moved = None
        if row != last:
            self._place[row] = self._place[last]
            c, s = self._place[row]
            self.shelves[c].rows[s] = row
            self.lengths[row] = self.lengths[last]
            moved = last
        self._place.pop()
        self.lengths[last] = 0
        self.active -= 1
        return moved

    def keep(self, row: int, positions: int) -> None:
        """Commit ``positions`` of the row's last step (its last token and accepted drafts); the
        rest of what the step wrote is rolled back by not counting it."""
        self.lengths[row] += positions

    def release(self) -> None:
        """Give back what the rows no longer need: an empty shelf's buffers, and a shelf's slots
        once they would be a quarter of what it holds."""
        freed = False
        for cap in list(self.shelves):
            shelf = self.shelves[cap]
            if not shelf.rows:
                freed = freed or shelf.nbytes > 0
                del self.shelves[cap]
            elif 4 * doubled_to(1, len(shelf.rows)) <= shelf.allocated:
                shelf.resize(doubled_to(1, len(shelf.rows)))
                freed = True
        if freed:
            trim_heap()

    # -- internals --------------------------------------------------------------------------------
    def _shelf(self, cap: int) -> Shelf:
        shelf = self.shelves.get(cap)
        if shelf is None:
            shelf = self.shelves[cap] = Shelf(cap, self.shelf_dtype(cap), keys=[None] * self.num_layers,
                                              values=[None] * self.num_layers)
        return shelf

    def _seat(self, shelf: Shelf, row: int) -> int:
        """Put ``row`` in ``shelf``'s next slot (doubling its slots as needed); its slot."""
        slot = len(shelf.rows)
        if slot >= shelf.allocated:
            shelf.resize(min(doubled_to(max(shelf.allocated, 1), slot + 1), self.slots))
        shelf.rows.append(row)
        return slot

    def _unseat(self, cap: int, slot: int) -> None:
        """Free ``slot`` of shelf ``cap``: its last row moves into it (a copy of that row's positions)."""
        shelf = self.shelves[cap]
        last = len(shelf.rows) - 1
        if slot != last:
            moved = shelf.rows[last]
            _copy_row(shelf, last, shelf, slot, int(self.lengths[moved]))
            shelf.rows[slot] = moved
            self._place[moved] = (cap, slot)
        shelf.rows.pop()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one cached position of one row takes (all layers, keys and values) on the
        smallest shelf (rows past ``LONG_CONTEXT`` take half that, in float32)."""
        buf = next((b for c in sorted(self.shelves) for b in self.shelves[c].keys if b is not None), None)
        if buf is None:
            return 0
        return 2 * self.num_layers * buf.shape[1] * buf.shape[3] * buf.element_size()

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the buffers now."""
        return sum(s.nbytes for s in self.shelves.values())


def _copy_row(src: Shelf, src_slot: int, dst: Shelf, dst_slot: int, n: int) -> None:
    """Copy positions ``0 .. n - 1`` of ``src``'s slot into ``dst``'s (the same shelf or a larger
    one), in every layer written so far."""
    for dst_store, src_store in ((dst.keys, src.keys), (dst.values, src.values)):
        for i, buf in enumerate(src_store):
            if buf is not None:
                dst.buffer(dst_store, i, buf)[dst_slot, :, :n] = buf[src_slot, :, :n]


def _element_size(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else torch.empty(0, dtype=dtype).element_size()


def doubled_to(start: int, at_least: int) -> int:
    """``start`` doubled until it is at least ``at_least``."""
    n = max(start, 1)
    while n < at_least:
        n *= 2
    return n
