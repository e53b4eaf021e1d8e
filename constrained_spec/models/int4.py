"""Q4_1 linear layers as stored: 4-bit values on torch's CPU weight-only int4 kernel.

A GGUF Q4_1 block holds 32 weights as nibbles q in 0..15 with an fp16 scale d and minimum m:
w = q d + m. torch's kernel (``_weight_int4pack_mm_for_cpu``, group size 32) computes
w = (q - 8) s + z, so s = d and z = m + 8 d. Its fast path takes bfloat16 inputs and bfloat16
scales; bfloat16 holds d and z only to 8 significant bits (most of the model's blocks are not
exact in bfloat16), so weights differ from the stored ones by at most 2^-9 of a block's scale,
below the bfloat16 rounding of the activations that the kernel applies anyway. (Float32 scales
and inputs reproduce the stored weights bit for bit, but that path of the kernel is unvectorized
here: far slower than a float32 matmul.)

The kernel computes every output row on its own, so a row's result is bit-identical whether
it is computed alone or among any number of rows (tested): what batch-invariant decoding needs.

It pays for that per row: more than twice what a float32 matmul pays per row of a long input,
so a prompt spent most of its time in this kernel. Prompt rows need no invariance
(``models.invariant``: the same rows with the same keys in every run of a request), so a
layer given ``prompt_weight`` (the stored weights in bfloat16: the precision the kernel's own
scales and inputs have) and a row split (``rows``, set by ``make_batch_invariant``) sends prompt
segments of at least ``MIN_DENSE_ROWS`` rows through a dense matmul instead: a bfloat16 one
where the CPU multiplies bfloat16 in hardware (AVX512_BF16 or AMX: several times faster than a
float32 matmul of a prompt's shapes, accumulated in float32), else a float32 one over the
weights widened once per forward (docs/performance.md has the figures). The bfloat16 one runs in
blocks packed by oneDNN at the first prompt (``models.dense_blocks``: the same bits at any thread
count), which then replace the bfloat16 copy.

A layer with the VNNI layout may instead take its prompt rows on that kernel with each
activation rounded to one int8 part, llama.cpp's arithmetic (``prompt_int8``, set at load where
``RuntimeConfig.prompt_linears`` asks for ``int8``): faster than oneDNN's bfloat16 matmul on a
CPU without AMX, every row computed alone, and no second copy of the weights; but it moves the
model further from its float32 outputs than bfloat16 does, so it is not the default (where AMX
multiplies bfloat16 the dense blocks are also about twice as fast; docs/extraction.md).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

from . import cpu_kernels, dense_blocks, q4_vnni
from .dense_blocks import PackedLinear
from .shared_input import SharedInputCall
from .threads import at_dense_threads, dense_threads

GROUP = 32
#: Bytes of one Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles.
Q4_1_BLOCK_BYTES = 20


#: Per dense dtype, prompt segments shorter than this stay on the kernel: the dense path reads
#: every layer's weights (the float32 one converts them first), which a few rows do not repay.
#: Each threshold is the measured crossover for a prompt pass between decode steps, whose kernel
#: weights are warm and whose dense weights are not: lower where AMX multiplies bfloat16 (see
#: docs/performance.md, prompt rows).
MIN_DENSE_ROWS = {torch.bfloat16: 32 if "amx_bf16" in cpu_kernels.cpu_flags() else 64, torch.float32: 48}


@functools.lru_cache(maxsize=1)
def bfloat16_matmul_in_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (the ``avx512_bf16`` or ``amx_bf16``
    flag), where oneDNN's bfloat16 matmul beats float32. Read from the flags, not timed, so the
    choice (and with it a prompt's bits) is the same in every run on one machine."""
    flags = cpu_kernels.cpu_flags()
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    # oneDNN must be built with bfloat16 too (a private query; a torch without it: assume so).
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else True


def amx_bfloat16() -> bool:
    """Whether AMX multiplies bfloat16 here (and oneDNN with it): where the bfloat16 prompt paths
    beat the integer kernel and float32 attention (docs/extraction.md)."""
    return "amx_bf16" in cpu_kernels.cpu_flags() and bfloat16_matmul_in_hardware()


def prompt_matmul_dtype() -> torch.dtype:
    """The dtype prompt rows are multiplied in on this machine (see the module docstring)."""
    return torch.bfloat16 if bfloat16_matmul_in_hardware() else torch.float32


def unpack_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q [N, K] in 0..15, d [N, K/32], m [N, K/32])`` of a Q4_1 tensor's raw bytes (``N`` rows
    of ``K`` weights). Element j of a block is the low nibble of byte j, element j + 16 its high nibble."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k)
    return q, d, m


def dequantize_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The stored weights, float32 ``[N, K]`` (what llama.cpp and transformers compute)."""
    q, d, m = unpack_q4_1(raw, shape)
    n, k = shape
    w = q.reshape(n, k // GROUP, GROUP).astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    return w.reshape(n, k)


class Int4Linear(nn.Module):
    """A bias-free linear layer over packed Q4_1 weights (see the module docstring).

    Inputs of any float dtype are rounded to bfloat16 for the kernel; the output comes back in
    the input's dtype. ``packed``: uint8 ``[N, K/2]`` in the kernel's layout; ``scales_and_zeros``:
    bfloat16 ``[K/32, N, 2]``. ``prompt_weight`` (bfloat16 ``[N, K]``), ``rows`` (a
    ``models.bucketed_linear.RowSplit``) and ``prompt_dtype`` (``prompt_matmul_dtype()`` unless set):
    the dense path of prompt rows (see the module docstring). ``vnni``: the same weights in
    ``models.q4_vnni``'s layout (``pack``), which then computes every kernel row instead, with
    activations split into two int8 parts (``vnni_split``, about 15 bits) or rounded to one; such
    a layer needs no torch layout (``packed`` and ``scales_and_zeros`` None, which saves their memory).
    """

    def __init__(self, packed: torch.Tensor | None, scales_and_zeros: torch.Tensor | None, in_features: int,
                 out_features: int, prompt_weight: torch.Tensor | None = None,
                 vnni: tuple[torch.Tensor, torch.Tensor] | None = None, vnni_split: bool = True) -> None:
        super().__init__()
        if vnni is None and (packed is None or scales_and_zeros is None):
            raise ValueError("An Int4Linear needs its weights in torch's layout, in the VNNI one, or both.")
        self.vnni_split = vnni_split
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("packed", packed, persistent=True)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=True)
        self.register_buffer("vnni_packed", vnni[0] if vnni else None, persistent=True)
        self.register_buffer("vnni_scales", vnni[1] if vnni else None, persistent=True)
        # A plain attribute, not a buffer: decode and verify rows never read it, so it is not
        # among the bytes a forward's profile counts (``forward_profile``).
        self.prompt_weight = prompt_weight
        self.prompt_blocks: PackedLinear | None = None
        self.prompt_dtype = prompt_matmul_dtype()
        self.prompt_int8 = False
        self.rows: Any = None

    @staticmethod
    def from_q4_1(raw: np.ndarray, shape: tuple[int, int], row_order: np.ndarray | None = None,
                   vnni: bool = False, vnni_split: bool = True) -> "Int4Linear":
        """Pack a Q4_1 tensor's raw bytes; ``row_order`` permutes output rows (q/k projections);
        ``vnni``: for ``models.q4_vnni``'s kernel instead (``vnni_split``: its activations' two parts)."""
        q, d, m = unpack_q4_1(raw, shape)
        if row_order is not None:
            q, d, m = q[row_order], d[row_order], m[row_order]
        if vnni:
            return Int4Linear(None, None, in_features=shape[1], out_features=shape[0], vnni=q4_vnni.pack(q, d, m),
                              vnni_split=vnni_split)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        sz = torch.from_numpy(np.stack([d32.T, (m32 + 8 * d32).T], axis=-1).copy()).to(torch.bfloat16)
        return Int4Linear(packed, sz, in_features=shape[1], out_features=shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype."""
        if self.rows is not None and self.prompt_int8 and self.vnni_packed is not None:
            return self.rows.apply(x, self._int8_rows, self._kernel)
        if self.rows is not None and (self.prompt_weight is not None or self.prompt_blocks is not None):
            dense: list[torch.Tensor] = []  # the weights in prompt_dtype, converted once for all of a forward's chunks

            def prompt(rows: torch.Tensor) -> torch.Tensor:
                if rows.shape[-2] < MIN_DENSE_ROWS[self.prompt_dtype]:
                    return self._kernel(rows)
                blocks = self._prompt_blocks()
                if blocks is not None:  # the same bits at any thread count (models.dense_blocks)
                    flat = rows.reshape(-1, self.in_features).to(self.prompt_dtype)
                    return blocks(flat, rows.dtype).reshape(*rows.shape[:-1], self.out_features)
                # At one thread count whatever the load: the library's split of the reduction,
                # and so the bits, depend on it (models.threads).
                with at_dense_threads():
                    if not dense:
                        dense.append(self.prompt_weight.to(self.prompt_dtype))
                    # As a matrix: a slice of a forward's rows keeps the whole tensor's batch
                    # stride, and matmul then takes bmm over a copy of the weights made on each
                    # call, a large share of a prompt pass.
                    flat = rows.reshape(-1, self.in_features).to(self.prompt_dtype)
                    out = nn.functional.linear(flat, dense[0]).to(rows.dtype)
                    return out.reshape(*rows.shape[:-1], self.out_features)

            return self.rows.apply(x, prompt, self._kernel)
        return self._kernel(x)

    def _prompt_blocks(self) -> PackedLinear | None:
        """The prompt weights packed in blocks (``models.dense_blocks``), packed at the first
        prompt and the bfloat16 copy then dropped; None where the blocks do not run."""
        if self.prompt_blocks is None and self.prompt_weight is not None and self.prompt_dtype == torch.bfloat16 \
                and dense_blocks.available():
            self.prompt_blocks = PackedLinear(self.prompt_weight, dense_threads())
            self.prompt_weight = None
        return self.prompt_blocks

    def kernel_bfloat16(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on ``x`` ``[..., K]`` as rows ``[n, N]``, in the kernel's bfloat16 (for
        callers whose next op promotes it exactly, ``models.native_decode``); float32 from the
        VNNI kernel where the layer has its weights."""
        if self.vnni_packed is not None:
            return q4_vnni.q4_1_mm(x.reshape(-1, self.in_features), self.vnni_packed, self.vnni_scales, self.vnni_split)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)

    def _int8_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows on the VNNI kernel, each activation rounded to one int8 part."""
        y = q4_vnni.q4_1_mm(x.reshape(-1, self.in_features), self.vnni_packed, self.vnni_scales, False)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_bfloat16(x).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4_1 (int4 kernel)"


#: torch's CPU int4 packing interleaves output rows in blocks of 64 (measured: packed tensors of
#: 64-row multiples concatenate into the packing of the concatenation; 32-row ones do not).
PACK_BLOCK_N = 64


class FusedInt4(SharedInputCall):
    """Several ``Int4Linear`` layers that read the same input, run as one kernel call (weights
    concatenated along the output rows): q/k/v and gate/up of a llama layer. Each layer is
    replaced by an ``Int4Part``; the first part called with an input computes every part's
    output, the others take theirs. Outputs equal the separate layers' bit for bit (the kernel
    computes each output element alone); one call instead of three saves each call's fixed cost."""

    def __init__(self, layers: list[Int4Linear]) -> None:
        if not self.can_fuse(layers):
            raise ValueError(f"Cannot fuse int4 layers of {[m.out_features for m in layers]} rows: the packed "
                             f"layout holds whole blocks of {PACK_BLOCK_N} rows, so each must have a multiple of it.")
        dense = [m.prompt_weight for m in layers]
        vnni = None
        if all(m.vnni_packed is not None for m in layers):  # whole 32-column blocks: they concatenate too
            vnni = (torch.cat([m.vnni_packed for m in layers]), torch.cat([m.vnni_scales for m in layers]))
        torch_layout = all(m.packed is not None for m in layers)
        layer = Int4Linear(torch.cat([m.packed for m in layers]) if torch_layout else None,
                           torch.cat([m.scales_and_zeros for m in layers], dim=1) if torch_layout else None,
                           in_features=layers[0].in_features, out_features=sum(m.out_features for m in layers),
                           prompt_weight=torch.cat(dense) if all(w is not None for w in dense) else None, vnni=vnni,
                           vnni_split=layers[0].vnni_split)
        super().__init__(layer, [m.out_features for m in layers])

    @staticmethod
    def can_fuse(layers: list[Int4Linear]) -> bool:
        """Whether the layers' packed weights concatenate into a valid packing (same input width,
        each a multiple of ``PACK_BLOCK_N`` output rows)."""
        return len({m.in_features for m in layers}) == 1 and all(m.out_features % PACK_BLOCK_N == 0 for m in layers)


class Int4Part(nn.Module):
    """One layer's share of a ``FusedInt4`` (see there)."""

    def __init__(self, fused: FusedInt4, index: int) -> None:
        super().__init__()
        self.fused = fused
        self.index = index
        self.in_features = fused.layer.in_features
        self.out_features = fused.sizes[index]
        if index == 0:
            self.kernel = fused.layer  # registered once, so the weights show up in the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> this part's ``[..., N]``."""
        return self.fused.part(x, self.index)

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused q4_1 layer, out_features={self.out_features}"
