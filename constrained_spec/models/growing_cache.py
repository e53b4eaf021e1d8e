"""A single request's KV cache: transformers' ``DynamicCache`` with each layer in a buffer that
grows by doubling, instead of a concatenation per step.

``DynamicLayer.update`` concatenates the new keys to the old ones, so every step copies every
layer's whole cache; and a batch-invariant model (``models.invariant``) then converted every
layer's whole cache to float64 for its attention: a cost that grows with the context (see
docs/performance.md). ``GrowingLayer`` writes the new positions into a preallocated buffer
(capacity doubling, so a request copies its cache O(log n) times, not once per step) and hands
attention views of it; a rollback only lowers the length. With ``dtype=torch.float64`` (what
the decoder asks for a batch-invariant model) the buffer holds exact float64 copies of the
float32 keys, so each step converts only its new tokens; the prompt's attention gets float32
back (``invariant_attention``), which is exact too. Bits are unchanged: the attention reads the
same numbers as ``DynamicCache`` gives it (tested). The batch engine's cache is
``batching.cache`` (one buffer for many rows).

Memory: the buffer is at most twice the positions held, and float64 doubles the bytes (92 KiB
per token for SmolLM2-135M, against 46 KiB in float32). With ``dtype=torch.bfloat16`` (a native
model loaded with ``CONSTRAINED_SPEC_KV_CACHE=bfloat16``, ``models.invariant.cache_dtype``) the
new positions are rounded once as they are written, and every row reads them so: 23 KiB a token. Once a request holds more than
``LONG_CONTEXT`` positions its buffers are float32 (exact: the float64 values are copies of
float32 keys): attention reads its rows from there on in float32 blocks (``models.invariant``),
and the long document's cache takes half the bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

#: Query rows at this position or later attend in float32 (``models.invariant.attend_new_rows``),
#: earlier ones in float64; the caches keep a row's keys in float32 once it holds more positions
#: than this.
LONG_CONTEXT = 2048
#: Positions a layer's buffer holds at first (a prompt longer than this sizes it).
INITIAL_CAPACITY = 256


class GrowingLayer(DynamicLayer):
    """One layer: ``keys`` / ``values`` are views ``[b, heads, length, dim]`` of buffers of
    ``capacity`` positions, in ``dtype`` (None: the keys' own)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.store_dtype = dtype
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they next grow."""
        return 0 if self._k is None else self._k.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True
        self.length = 0
        self._k = self._v = None

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, positions: int) -> None:
        if positions <= self.capacity:
            return
        new = max(INITIAL_CAPACITY, self.capacity)
        while new < positions:
            new *= 2
        b, heads, _, dim = like_k.shape
        dtype_k, dtype_v = self.store_dtype or like_k.dtype, self.store_dtype or like_v.dtype
        if new > LONG_CONTEXT and dtype_k == torch.float64:  # past it, attention reads float32 keys
            dtype_k = dtype_v = torch.float32
        # Zeros: attention's float32 blocks read whole key blocks past the held positions.
        k = torch.zeros(b, heads, new, dim, dtype=dtype_k, device=like_k.device)
        v = torch.zeros(b, heads, new, like_v.shape[-1], dtype=dtype_v, device=like_v.device)
        if self._k is not None and self.length:
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the held ones; return views of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, value_states, self.length + n)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def room_for(self, like_k: torch.Tensor, like_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a caller that writes new positions itself (``models.native_decode``'s scripted
        stack): the buffers, grown as ``update`` would grow them for ``like_k`` / ``like_v``
        (``[b, heads, n, dim]``), and the position the new ones start at. ``advance(n)``
        afterwards makes them held."""
        self._reserve(like_k, like_v, self.length + like_k.shape[-2])
        assert self._k is not None and self._v is not None
        return self._k, self._v, self.length

    def advance(self, n: int) -> None:
        """Hold the ``n`` positions written after the held ones (see ``room_for``)."""
        self.length += n
        self._views()

    def holds(self, buffer: torch.Tensor) -> bool:
        """Whether this layer's keys live in ``buffer`` (``move_into``)."""
        return self._k is buffer

    def move_into(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """Keep the positions in ``keys`` / ``values`` (``[b, heads, capacity, dim]``, of this
        layer's dtype) from now on, the held ones copied there; None: in fresh buffers of the
        layer's own. Why: ``models.cuda_graphs`` replays graphs that write to fixed buffers,
        so the request whose forward it runs moves into them, and out again when another one's
        forward comes (the same positions, the same values)."""
        old_k, old_v, n = self._k, self._v, self.length
        if old_k is None or old_v is None:
            return
        if keys is None or values is None:
            self._k = self._v = None
            self.length = 0
            self._reserve(old_k, old_v, max(n, 1))
        else:
            if keys.shape[-2] < n:
                raise ValueError(f"move_into: {n} positions held, the buffers take {keys.shape[-2]}")
            self._k, self._v = keys, values
        if n:
            self._k[:, :, :n] = old_k[:, :, :n]
            self._v[:, :, :n] = old_v[:, :, :n]
        self.length = n
        self._views()

    def get_seq_length(self) -> int:
        """Positions held."""
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (negative, as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value ({tokens_to_remove}) is not supported; "
                             "pass a negative number of positions to drop.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._views()

    def reset(self) -> None:
        """Drop everything held (the buffers too)."""
        self._k = self._v = None
        self.length = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:  # pragma: no cover - beam search only
        raise NotImplementedError("GrowingLayer holds one request; beam search is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # pragma: no cover - beam search only
        raise NotImplementedError("GrowingLayer holds one request; beam search is not supported")


def growing_cache(num_layers: int, dtype: torch.dtype | None = None) -> Cache:
    """A ``Cache`` of ``num_layers`` ``GrowingLayer``s (see the module docstring)."""
    return Cache(layers=[GrowingLayer(dtype) for _ in range(num_layers)])
