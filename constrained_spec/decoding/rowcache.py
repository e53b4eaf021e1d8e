"""The batch engine's KV cache: one slot per active request, each with its own length.

Design. Per layer, keys and values live in dense buffers ``[slots, kv_heads, capacity, head_dim]``;
request ``i``'s cache is positions ``0 .. lengths[i] - 1`` of its slot. A step's tokens come
packed (``decoding.packing``: one sequence of every row's new tokens, each with its row and
position); ``update`` writes each token's keys at ``(row, position)`` and attention sees each
row's keys through a per-row causal mask over absolute positions. Rolling a row back is lowering
its length: the rejected draft positions are simply overwritten by a later step, so rows roll
back independently at no cost. Active rows always occupy slots ``0 .. active - 1``: a finished
row's slot is refilled by moving the last active row into it (a copy of one row's positions),
so a forward reads views of the buffers, never a gather. Capacity grows by doubling with the
longest row, up to the model's context, and slots are allocated as rows arrive (doubling too);
memory is ``allocated slots x capacity x bytes_per_token``, where ``bytes_per_token`` is
``2 x layers x kv_heads x head_dim x dtype size`` (SmolLM2-135M in float32: 46 KiB, in float64
92 KiB). When rows leave, ``release`` gives memory back: all of it once no row is active, and
buffers sized to the rows left once they would be a quarter of what is held, so a long
document's row does not keep its capacity for every later row.

transformers' continuous-batching ``PagedAttentionCache`` could hold this too (a caller-supplied
length per request makes rollback free there as well), but its packed layout gathers every
row's keys in every layer of every step (``index_select`` over all cached tokens), and its
manager samples one token per request; dense slots need neither.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .heap import trim_heap
from .packing import PackedRows


class RowCache(Cache):
    """Per-row-length KV cache for ``slots`` rows (see the module docstring).

    Args:
        num_layers: the model's decoder layers.
        slots: the most rows at once.
        max_capacity: positions per row at most (the model's context).
        capacity: positions per row allocated at first (doubled as rows grow).
        dtype: the buffers' dtype; None: the keys' own. A batch-invariant model attends in
            float64 (``models.invariant``), so its keys and values are kept in float64 (exact
            copies of the float32 ones): each step then converts only its new tokens, not every
            row's whole cache in every layer.
    """

    def __init__(self, num_layers: int, slots: int, max_capacity: int, capacity: int = 256,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.slots = slots
        self.max_capacity = max_capacity
        self.initial_capacity = self.capacity = min(capacity, max_capacity)
        self.dtype = dtype
        #: Slots the buffers have room for now (grown as rows arrive, up to ``slots``).
        self.allocated_slots = 1
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.active = 0
        #: The layout of the step under way (set by the engine around each forward).
        self.packing: PackedRows | None = None
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    # -- the interface transformers' attention calls -------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's packed keys / values (``[1, kv_heads, N, head_dim]``, placed by
        ``self.packing``) at each token's row and position; return every active row's keys /
        values up to ``packing.key_length``."""
        packing = self.packing
        if packing is None:
            raise RuntimeError("RowCache.update outside a packed step (set RowCache.packing first)")
        _, heads, _, dim = key_states.shape
        if packing.batch > self.allocated_slots:  # rows placed without add_row (tests)
            self._resize(min(doubled_to(self.allocated_slots, packing.batch), self.slots), self.capacity)
        if self.dtype is not None:
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        if self.keys[layer_idx] is None:
            shape = (self.allocated_slots, heads, self.capacity, dim)
            self.keys[layer_idx] = key_states.new_zeros(shape)  # zeros: stale slots stay finite
            self.values[layer_idx] = value_states.new_zeros(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        # [slots, capacity, heads, dim] views: (row, position) pairs index the first two dims
        keys.transpose(1, 2)[packing.rows, packing.positions] = key_states[0].transpose(0, 1)
        values.transpose(1, 2)[packing.rows, packing.positions] = value_states[0].transpose(0, 1)
        b, kv = packing.batch, packing.key_length
        return keys[:b, :, :kv], values[:b, :, :kv]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The longest active row's length."""
        return int(self.lengths[: self.active].max()) if self.active else 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_capacity

    # -- what the engine calls ------------------------------------------------------------------
    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` per row (doubling the capacity as needed)."""
        if positions > self.max_capacity:
            raise ValueError(f"A row needs {positions} positions; the model's context holds {self.max_capacity}.")
        if positions > self.capacity:
            self._resize(self.allocated_slots, min(doubled_to(self.capacity, positions), self.max_capacity))

    def _resize(self, slots: int, capacity: int) -> None:
        """Buffers of ``slots x capacity`` holding what the active rows hold."""
        rows, keep = min(self.active, slots), min(self.capacity, capacity)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is not None:
                    resized = buf.new_zeros(slots, buf.shape[1], capacity, buf.shape[3])
                    resized[:rows, :, :keep] = buf[:rows, :, :keep]
                    store[i] = resized
        self.allocated_slots, self.capacity = slots, capacity

    def release(self) -> None:
        """Give back what the rows no longer need (see the module docstring)."""
        if not self.active:
            if any(b is not None for b in self.keys):
                self.keys = [None] * self.num_layers
                self.values = [None] * self.num_layers
                trim_heap()
            self.allocated_slots, self.capacity = 1, self.initial_capacity
            return
        longest = int(self.lengths[: self.active].max())
        slots = min(doubled_to(1, self.active), self.slots)
        capacity = min(doubled_to(self.initial_capacity, longest), self.max_capacity)
        if 4 * slots * capacity <= self.allocated_slots * self.capacity:
            self._resize(slots, capacity)
            trim_heap()

    def add_row(self, cache: DynamicCache) -> int:
        """Take a request's single-row cache (its shared prefix, or nothing) into the next free slot."""
        if self.active >= self.slots:
            raise RuntimeError("RowCache is full")
        slot = self.active
        if slot >= self.allocated_slots:
            self._resize(min(doubled_to(self.allocated_slots, slot + 1), self.slots), self.capacity)
        self.lengths[slot] = 0
        self.active += 1
        if cache.get_seq_length():
            self.append(slot, [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers])
        return slot

    def append(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write a block's keys and values (per layer ``[kv_heads, n, head_dim]``) after the
        row's held positions, and count them."""
        start = int(self.lengths[slot])
        n = keys[0].shape[1]
        self.reserve(start + n)
        for i, (k, v) in enumerate(zip(keys, values)):
            if self.dtype is not None:
                k, v = k.to(self.dtype), v.to(self.dtype)
            if self.keys[i] is None:
                shape = (self.allocated_slots, k.shape[0], self.capacity, k.shape[2])
                self.keys[i], self.values[i] = k.new_zeros(shape), v.new_zeros(shape)
            self.keys[i][slot, :, start : start + n] = k
            self.values[i][slot, :, start : start + n] = v
        self.lengths[slot] = start + n

    def remove_row(self, slot: int) -> int | None:
        """Free ``slot``; the last active row moves into it. Returns the slot that moved (now
        ``slot``), or None if ``slot`` was the last."""
        last = self.active - 1
        moved = None
        if slot != last:
            n = int(self.lengths[last])
            for store in (self.keys, self.values):
                for buf in store:
                    if buf is not None:
                        buf[slot, :, :n] = buf[last, :, :n]
            self.lengths[slot] = n
            moved = last
        self.lengths[last] = 0
        self.active -= 1
        return moved

    def keep(self, slot: int, positions: int) -> None:
        """Commit ``positions`` of the row's last step (its last token and accepted drafts); the
        rest of what the step wrote is rolled back by not counting it."""
        self.lengths[slot] += positions

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one cached position of one row takes (all layers, keys and values)."""
        buf = next((b for b in self.keys if b is not None), None)
        if buf is None:
            return 0
        return 2 * self.num_layers * buf.shape[1] * buf.shape[3] * buf.element_size()

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the buffers now."""
        return sum(b.numel() * b.element_size() for store in (self.keys, self.values) for b in store if b is not None)


def doubled_to(start: int, at_least: int) -> int:
    """``start`` doubled until it is at least ``at_least``."""
    n = max(start, 1)
    while n < at_least:
        n *= 2
    return n

