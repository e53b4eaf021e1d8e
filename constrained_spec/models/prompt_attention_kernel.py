"""Causal attention of prompt rows in bfloat16 on AVX512_BF16: a kernel that computes each row alone.

Why hand-written: over a long document the prompt pass is mostly attention, and torch's CPU
flash attention runs bfloat16 no faster than float32 on a CPU without AMX, although the CPU
multiplies bfloat16 pairs (``vdpbf16ps``) at twice float32's rate (docs/extraction.md).

``kernels/prompt_attention.cpp`` rounds queries, keys and values to bfloat16 (to nearest even,
as torch does), then for each (row, head): tiles of 64 keys cut at fixed positions from key 0,
up to the row's own position; each tile's scores by pairs of dimensions in float32, an online
softmax in float32 (in base 2, by Cephes' exp2f polynomial, about 1 ulp; each tile's maximum
reduced only where a score passes the running one, the weights' sum kept lane by lane), the
weights rounded to bfloat16, the values accumulated by pairs of keys in float32; then divided
by the weights' sum. Twelve query vectors of a key head share each load of a tile. Every row
runs the same arithmetic whatever rows, heads or threads are beside it and however its prompt
was cut into chunks: a chunk's keys and values are the same bits alone, in a batch or from the
prefix cache, at any thread count (tested). Its precision is that of torch's bfloat16 attention.

Used by ``models.invariant`` for prompt chunks that attend in bfloat16
(``RuntimeConfig.prompt_attention``) with causal masks and one batch row, where it builds.
"""

from __future__ import annotations

import functools

import torch

from . import cpu_kernels

_HEAD_DIMS = (64, 128, 256)
_CPU_FLAGS = cpu_kernels.AVX512 + ("avx512_bf16",)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernel runs here: AVX512_BF16 without AMX (where AMX multiplies bfloat16,
    torch's flash attention runs on it), a compiler; built once per machine."""
    flags = cpu_kernels.cpu_flags()
    if "amx_bf16" in flags or not all(f in flags for f in _CPU_FLAGS):
        return False
    return cpu_kernels.build("prompt_attention.cpp", _CPU_FLAGS, ("-mavx512bf16",), warn=False)


def usable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attend`` takes these: one batch row on the CPU, a head dimension of 64, 128 or
    256, whole groups of query heads a key head, the kernel built."""
    return (query.device.type == "cpu" and query.shape[0] == 1 and key.shape[0] == 1
            and query.shape[-1] in _HEAD_DIMS and query.shape[1] % key.shape[1] == 0 and available())


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int, scale: float,
           window: int = 0) -> torch.Tensor:
    """Causal attention of ``query`` ``[1, h, r, d]`` over ``key`` / ``value`` ``[1, h_kv, kv, d]``
    (any float dtype; rounded to bfloat16 in the kernel, a bfloat16 cache's read as they are), row
    ``i`` seeing keys ``0 .. first + i``, or with a sliding ``window`` > 0 the last ``window`` of
    them: float32 ``[1, r, h, d]``."""
    stored = torch.bfloat16 if key.dtype == value.dtype == torch.bfloat16 else torch.float32
    q, k, v = query[0].to(torch.float32), key[0].to(stored), value[0].to(stored)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return torch.ops.constrained_spec.prompt_attend(q, k, v, first, scale, window)[None]
