"""Q4_1 linear layers on an int8 dot-product kernel (AVX-512 VNNI): the default where it builds.

Why hand-written: torch's CPU int4 kernel (``models.int4``) computes a row alone, as batch
invariance needs, but in float32 FMAs on weights it de-quantizes, at the CPU's FMA limit per
row, so a verify pass spends most of its linear layers' time there whatever the code around it
does. oneDNN's int8 and bfloat16 matmuls are faster per row but pick their blocking (and so the
bits of a row) by the number of rows. No library has an int4 kernel that is both.

This one multiplies the stored nibbles (0..15) with int8 activations exactly in int32
(``vpdpbusd``) and adds each block's ``d * dx * sum(q * qx) + m * sum(x)`` in float32 with the
stored ``d`` and ``m`` as float32 (a Q4_1 file's fp16 widened exactly, Q4_0's m = -8 d, Q4_K's d * sc
and -dmin * m as computed; torch's kernel takes bfloat16 scales). The
activations of each block of 32 are, by ``RuntimeConfig.int4_kernel``
(``CONSTRAINED_SPEC_INT4_KERNEL``):
- ``vnni`` (the default): split into two int8 parts, x = dx (a + b / 254) with dx = max|x| / 127,
  about 15 bits where torch's kernel rounds them to bfloat16's 8; ``254 dot(q, a) + dot(q, b)``
  stays below 2^24, exact in float32 too. Far closer to the exact product than one int8 part,
  for less than twice its time;
- ``vnni-int8``: llama.cpp's Q4_1 x Q8_1 arithmetic, one int8 part (max |x| / 127): the fastest,
  with llama.cpp's own rounding;
- ``torch``: torch's kernel.
docs/performance.md holds the timings and how often each keeps the float32 model's outputs.
Every row runs the same instructions in the same order whatever rows are beside it, and threads
split the columns, never a sum: a row's bits do not depend on the batch (tested).

Built once per machine from ``kernels/q4_1_vnni.cpp`` (``models.cpu_kernels``); a machine without
AVX-512 VNNI, a compiler, or ninja keeps torch's kernel, with a warning when the kernel was asked
for by name.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import config
from . import cpu_kernels

#: Output columns of one packed block (one AVX-512 register of float32); blocks go in pairs.
COLS = 16
GROUP = 32
#: Version of ``pack``'s layout, in the name of the cached weights (a change must not load old ones).
LAYOUT = 3  # 3: float32 scales (2: float16)
_CPU_FLAGS = cpu_kernels.AVX512 + ("avx512_vnni",)


#: ``RuntimeConfig.int4_kernel``'s values: torch's kernel, this one with activations split into
#: two int8 parts, this one with llama.cpp's one int8 rounding.
KERNELS = config.INT4_KERNELS
DEFAULT = config.DEFAULT_INT4_KERNEL


def cpu_supports() -> bool:
    """Whether this CPU has the AVX-512 subsets the kernel is compiled for."""
    return all(f in cpu_kernels.cpu_flags() for f in _CPU_FLAGS)


def load_kernel(warn: bool = True) -> bool:
    """Build (once per machine and source) and load the kernel; False (with a warning when
    ``warn``) where it cannot be (no AVX-512 VNNI, no compiler or ninja)."""
    return cpu_kernels.build("q4_1_vnni.cpp", _CPU_FLAGS, ("-mavx512vnni",), warn)


def kernel(asked: str | None = None) -> str:
    """The kernel a new native model takes for ``RuntimeConfig.int4_kernel`` ``asked`` (None:
    ``DEFAULT``): that one, or ``torch`` where it does not load (with a warning when it was
    asked for by name rather than by default)."""
    value = asked or DEFAULT
    if value not in KERNELS:
        raise ValueError(f"Unknown int4 kernel {value!r}: use one of {', '.join(map(repr, KERNELS))}.")
    return value if value == "torch" or load_kernel(warn=asked is not None) else "torch"


def pack(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of four-bit weights w = d q + m: ``q`` ``[N, K]`` (0..15), ``d`` and
    ``m`` ``[N, K/32]`` (float32, or float16 widened exactly: ``unpack_q4_1``'s): ``packed`` uint8
    ``[N/32, K/32, 512]``, for each 32 columns and group, two blocks of 16 columns whose four
    64-byte loads hold weights k = 4t..4t+3 (low nibbles) and 16+4t..16+4t+3 (high), column-major
    in fours (``vpdpbusd``'s operand layout); ``scales`` float32 ``[N/32, K/32, 2, 2, 16]``: each
    block's d, then m (float32 because Q4_K's sub-block scales d * sc are not float16 values)."""
    q, d, m = np.asarray(q), np.asarray(d), np.asarray(m)
    n, k = q.shape
    if n % (2 * COLS) or k % GROUP:
        raise ValueError(f"Cannot pack a {n} x {k} four-bit matrix for the VNNI kernel: rows must be a multiple of "
                         f"{2 * COLS} and columns of {GROUP}.")
    if d.shape != (n, k // GROUP) or m.shape != (n, k // GROUP):
        raise ValueError(f"Scales {d.shape} and mins {m.shape} do not fit a {n} x {k} matrix: expected {(n, k // GROUP)}.")
    g = k // GROUP
    blocks = q.astype(np.uint8).reshape(n // (2 * COLS), 2, COLS, g, 2, 4, 4)  # pair, c, column, group, half, t, e
    nibbles = blocks[:, :, :, :, 0] | (blocks[:, :, :, :, 1] << 4)  # pair, c, column, group, t, e
    packed = nibbles.transpose(0, 3, 1, 4, 2, 5).reshape(n // (2 * COLS), g, 2 * 4 * COLS * 4)
    per_block = [_float32(a, "scales").reshape(n // (2 * COLS), 2, COLS, g).transpose(0, 3, 1, 2) for a in (d, m)]
    scales = np.stack(per_block, axis=3)  # pair, group, c, d/m, column
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(scales))


def _float32(a: np.ndarray, what: str) -> np.ndarray:
    """``a`` as float32, refusing a wider type whose values float32 would round (the kernels
    promise the stored scales exactly)."""
    wide = a.astype(np.float32)
    if a.dtype not in (np.float16, np.float32) and not np.array_equal(wide.astype(a.dtype), a):
        raise ValueError(f"The {what} are not float32 values ({a.dtype}): the kernels would round them.")
    return wide


def unpack_rows(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``ids`` (int64 ``[n]``) of ``pack``'s operands, as ``pack`` took them: ``q`` uint8
    ``[n, K]`` (0..15), ``d`` and ``m`` float32 ``[n, K/32]``; torch ops on the packed bytes."""
    pairs, g = packed.shape[0], packed.shape[1]
    ids = ids.reshape(-1).to(torch.int64)
    pair, c, col = ids // (2 * COLS), (ids // COLS) % 2, ids % COLS
    # [pair, group, c, t, column, e] -> [n, group, t, e] for each id's column.
    nibbles = packed.view(pairs, g, 2, 4, COLS, 4)[pair, :, c, :, col, :]
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=2).reshape(len(ids), g * GROUP)
    dm = scales.view(pairs, g, 2, 2, COLS)[pair, :, c, :, col]  # [n, group, d/m]
    return q, dm[..., 0], dm[..., 1]


def gather_rows(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[n]``) of ``pack``'s weights, dequantized: float32 ``[n, K]``, each
    weight exactly ``d * q + m`` rounded as float32 does (the product rounded, then the sum):
    torch ops on the packed bytes, no dense copy of the matrix."""
    q, d, m = unpack_rows(packed, scales, ids)
    n, g = d.shape
    return (q.reshape(n, g, GROUP).to(torch.float32) * d[..., None] + m[..., None]).reshape(n, g * GROUP)


def q4_1_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, split: bool = True) -> torch.Tensor:
    """``x`` ``[M, K]`` (any float dtype) times the packed weights: float32 ``[M, N]``; ``split``:
    activations as two int8 parts (about 15 bits), else one (llama.cpp's Q8_1 rounding)."""
    return torch.ops.constrained_spec.q4_1_mm(x.to(torch.float32).contiguous(), packed, scales, split)
