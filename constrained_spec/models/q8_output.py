"""The embedded model's Q8_0 output projection on a VNNI int8 kernel, or as two calls of torch's
int4 kernel where that cannot build.

The tied embedding / output matrix (49,152 x 576) is Q8_0 in the GGUF: w = q d, q in -127..127,
one fp16 scale d per 32 weights. torch has no CPU kernel for per-group int8 weights, so as the
dequantized float32 matrix it was the largest single op of a one-token step.

**The VNNI kernel** (``kernels/q8_0_vnni.cpp``, the default where AVX-512 VNNI and a compiler are
there, ``models.cpu_kernels``): each row's block of 32 activations is split into two int8 parts,
x = dx (a + b / 254) with dx = max|x| / 127 (about 15 bits, where bfloat16 keeps 8), ``vpdpbusd``
multiplies both with the stored weights exactly in int32, and the block adds ``d dx / 254 (254
sum(q a) + sum(q b))`` in float32 with the file's fp16 d (stored widened to float32). The same kernel
(``q8_mm``, ``pack_vnni``) runs every eight-bit form: a scale per block of 32 or per half-block of
16, with or without a min per block (``models.quant_linear``). No rounding of the logits, so its
argmax is the exact one's where the int4 pair's can flip, and it is faster than the pair at
every row count (see docs/performance.md). Every row runs the same instructions in the same
order whatever rows are beside it: batch-invariant (tested). ``RuntimeConfig.output_kernel``
(``CONSTRAINED_SPEC_OUTPUT_KERNEL=torch``) keeps the int4 pair.

**The int4 pair** (any CPU): with u = q + 128 = 16 h + l (nibbles h, l in 0..15), w = 16 d (h - 8)
+ [d (l - 8) + 8 d]: two int4 matrices with group scales and zeros in the form the int4 kernel
takes (w = (q4 - 8) s + z), 28 MB in all, no float32 copy read. The kernel takes bfloat16
activations and scales and returns bfloat16 (as for every Q4_1 layer on torch's kernel,
``models.int4``), so a logit is rounded to 8 significant bits: up to 0.06 for logits of 16-32,
and a near-tie of two tokens closer than that can flip (``constrained-spec bench --precision
native-exact,native``). Like every layer on the int4 kernel it computes each output row alone:
batch-invariant as it is.

``precision="native-exact"`` keeps the exact float32 matrix. ``weight`` stays the exact float32
matrix either way (the input embedding shares it, and the logits path over a few allowed ids,
``models.output_rows``, gathers its rows), so only full-vocabulary rows take a kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import cpu_kernels
from .int4 import GROUP

#: Bytes of one Q8_0 block: fp16 d, 32 int8 weights.
Q8_0_BLOCK_BYTES = 34
#: Output columns of one block of the VNNI layout (one AVX-512 register of float32).
COLS = 16
#: Version of ``pack_vnni``'s layout, in the name of the cached weights (a change must not load old ones).
LAYOUT = 2  # 2: float32 scales (1: float16)
_CPU_FLAGS = cpu_kernels.AVX512 + ("avx512_vnni",)

# The general op's schema, defined at import whether or not the kernel builds (as
# ``models.cpu_kernels`` defines the others): the kernel library implements it when loaded.
_LIBRARY = torch.library.Library("constrained_spec", "FRAGMENT")
_LIBRARY.define("q8_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor")


def kernel(asked: str | None = None) -> str:
    """The output kernel a new native model takes for ``RuntimeConfig.output_kernel`` ``asked``:
    ``vnni`` (None or "vnni": where it builds) or ``torch`` (the int4 pair). Asked for by name
    and unable to build: a warning says why."""
    if asked not in (None, "vnni", "torch"):
        raise ValueError(f"Unknown output kernel {asked!r}: use 'vnni' or 'torch'.")
    if asked == "torch":
        return "torch"
    built = cpu_kernels.build("q8_0_vnni.cpp", _CPU_FLAGS, ("-mavx512vnni",), warn=asked == "vnni")
    return "vnni" if built else "torch"


def pack_vnni(q: np.ndarray, scale: np.ndarray, min: np.ndarray | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The VNNI kernel's layout of eight-bit weights w = scale q (+ min): ``q`` ``[N, K]`` int8
    (any of -128..127), ``scale`` ``[N, K/32]`` (one per block of 32: Q8_0, Q5_*) or
    ``[N, K/16]`` (one per half-block: Q6_K), ``min`` ``[N, K/32]`` or None; scales and mins
    float32 (float16 widened exactly). Returns ``q8_mm``'s operands: ``packed`` uint8
    ``[N/16, K/32, 512]``, q + 128 for each 16 columns and group as eight 64-byte loads of weights
    k = 4t..4t+3, column-major in fours (``vpdpbusd``'s operand layout); ``scales`` float32
    ``[N/16, K/32, 16]`` or ``[N/16, K/32, 2, 16]`` (per half); ``mins`` float32
    ``[N/16, K/32, 16]``, or empty without mins."""
    from .q4_vnni import _float32

    q, scale = np.asarray(q), np.asarray(scale)
    n, k = q.shape
    if n % COLS or k % GROUP:
        raise ValueError(f"Cannot pack a {n} x {k} eight-bit matrix for the VNNI kernel: rows must be a multiple of "
                         f"{COLS} and columns of {GROUP}.")
    if q.dtype != np.int8 and (q.min(initial=0) < -128 or q.max(initial=0) > 127):
        raise ValueError("Eight-bit weights must lie in -128..127.")
    g = k // GROUP
    if scale.shape not in ((n, g), (n, 2 * g)):
        raise ValueError(f"Scales {scale.shape} do not fit a {n} x {k} matrix: expected {(n, g)} or {(n, 2 * g)}.")
    u = (q.astype(np.int16) + 128).astype(np.uint8).reshape(n // COLS, COLS, g, 8, 4)
    packed = u.transpose(0, 2, 3, 1, 4).reshape(n // COLS, g, 8 * COLS * 4)
    halves = scale.shape[1] // g  # 1 or 2 scales a block
    scales = _float32(scale, "scales").reshape(n // COLS, COLS, g, halves).transpose(0, 2, 3, 1)
    scales = scales[:, :, 0] if halves == 1 else scales
    if min is None:
        mins = torch.empty(0, dtype=torch.float32)
    else:
        min = np.asarray(min)
        if min.shape != (n, g):
            raise ValueError(f"Mins {min.shape} do not fit a {n} x {k} matrix: expected {(n, g)}.")
        mins = torch.from_numpy(np.ascontiguousarray(_float32(min, "mins").reshape(n // COLS, COLS, g).transpose(0, 2, 1)))
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(scales)), mins


def q8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` (any float dtype) times ``pack_vnni``'s weights: float32 ``[M, N]``, the
    activations split into two int8 parts a block (module docstring)."""
    return torch.ops.constrained_spec.q8_mm(x.to(torch.float32).contiguous(), packed, scales, mins)


def unpack_rows(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows ``ids`` (int64 ``[n]``) of ``pack_vnni``'s operands, as it took them: ``q`` int16
    ``[n, K]`` (-128..127), ``scale`` float32 ``[n, K/32]`` or ``[n, K/16]`` (per half-block),
    ``min`` ``[n, K/32]`` or None; torch ops on the packed bytes."""
    blocks, g = packed.shape[0], packed.shape[1]
    ids = ids.reshape(-1).to(torch.int64)
    block, col = ids // COLS, ids % COLS
    # [block, group, t, column, e] -> [n, group, t, e] for each id's column: k = 4 t + e.
    q = packed.view(blocks, g, 8, COLS, 4)[block, :, :, col, :].to(torch.int16) - 128
    scale = (scales[block, :, :, col] if scales.dim() == 4 else scales[block, :, col]).reshape(len(ids), -1)
    return q.reshape(len(ids), g * GROUP), scale, mins[block, :, col] if mins.numel() else None


def gather_rows(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[n]``) of ``pack_vnni``'s weights, dequantized: float32 ``[n, K]``,
    each weight exactly ``scale * q (+ min)`` rounded as float32 does (the product rounded, then
    the sum): torch ops on the packed bytes, no dense copy of the matrix (a tied embedding)."""
    q, scale, min = unpack_rows(packed, scales, mins, ids)
    n, g = q.shape[0], q.shape[1] // GROUP
    per = q.shape[1] // scale.shape[1]  # weights a scale covers: 32, or 16 per half-block
    w = (q.to(torch.float32).reshape(n, scale.shape[1], per) * scale[..., None]).reshape(n, g, GROUP)
    if min is not None:
        w = w + min[..., None]
    return w.reshape(n, g * GROUP)


def unpack_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(q [N, K] int8, d [N, K/32] float16)`` of a Q8_0 tensor's raw bytes (``N`` rows of ``K``)."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return q, d


def _pack(q4: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
    return packed, sz


class Q8OutputProjection(nn.Module):
    """A bias-free output layer over Q8_0 weights on the VNNI kernel or two int4 kernel calls
    (module docstring).

    ``weight``: the exact dequantized float32 matrix (shared with the input embedding; not read
    by ``forward``)."""

    #: Per kernel, the packed matrices it reads (what ``__init__`` takes and a cache stores).
    BUFFERS = {"torch": ("packed_hi", "sz_hi", "packed_lo", "sz_lo"), "vnni": ("vnni_packed", "vnni_scales")}

    def __init__(self, buffers: dict[str, torch.Tensor], weight: torch.Tensor, kernel: str = "torch") -> None:
        super().__init__()
        if kernel not in self.BUFFERS:
            raise ValueError(f"Unknown output kernel {kernel!r}: use one of {sorted(self.BUFFERS)}.")
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        for name in self.BUFFERS[kernel]:
            self.register_buffer(name, buffers[name], persistent=False)
        self.weight = weight  # a plain attribute: the embedding owns the parameter
        self.bias = None

    @staticmethod
    def from_q8_0(raw: np.ndarray, weight: torch.Tensor, kernel: str = "torch") -> "Q8OutputProjection":
        """Pack a Q8_0 tensor's raw bytes for ``kernel`` (``weight``: its dequantized float32
        matrix, checked against them)."""
        n, k = weight.shape
        q, d = unpack_q8_0(raw, (n, k))
        q_t, d_t = torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d.astype(np.float32))
        exact = (q_t.reshape(n, k // GROUP, GROUP).float() * d_t[..., None]).reshape(n, k)
        if not torch.equal(exact, weight.float()):
            raise ValueError("The Q8_0 tensor does not dequantize to the model's output matrix.")
        if kernel == "vnni":
            packed, scales, _ = pack_vnni(q, d)
            return Q8OutputProjection({"vnni_packed": packed, "vnni_scales": scales}, weight, kernel)
        u = q_t + 128  # 1..255
        hi, lo = u >> 4, u & 15
        (packed_hi, sz_hi), (packed_lo, sz_lo) = _pack(hi, 16 * d_t, torch.zeros_like(d_t)), _pack(lo, d_t, 8 * d_t)
        return Q8OutputProjection({"packed_hi": packed_hi, "sz_hi": sz_hi, "packed_lo": packed_lo, "sz_lo": sz_lo},
                                  weight, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> float32 logits ``[..., N]``."""
        if self.kernel == "vnni":
            rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
            y = torch.ops.constrained_spec.q8_0_mm(rows, self.vnni_packed, self.vnni_scales)
            return y.reshape(*x.shape[:-1], self.out_features)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(rows, self.packed_hi, GROUP, self.sz_hi).float()
        y += mm(rows, self.packed_lo, GROUP, self.sz_lo).float()
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "on the VNNI int8 kernel" if self.kernel == "vnni" else "as two int4 matrices"
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0 {how}"
