"""Batch-invariant float32 attention of new rows on the CPU: a kernel that computes each row alone.

Why hand-written: a verify pass's rows must get the bits a one-row pass gives them, and torch's
CPU attention in float32 picks its blocking by the number of rows and keys. ``models.invariant``
therefore ran it in float64 (invariant up to ~1e-8 odds a value) or, past ``LONG_CONTEXT``, in
float32 on padded fixed shapes, both several times slower than this kernel (see
docs/performance.md).

``kernels/row_attention.cpp`` does, for each (batch row, key head, query row), with AVX-512:
- the keys transposed 64 at a time ([D, 64], a tile that stays in the core's cache), so 16 keys'
  scores come from one FMA per dimension: each score is ``q[0] k[0]``, then one FMA a dimension
  in order, times the scale;
- the allowed keys in order (the mask's row), their maximum score, weights ``exp(s - max)``
  (a Cephes polynomial, about 1 ulp) summed lane-wise by place in that sequence, then the
  weighted values key by key in that order, divided by the weights' sum.
Every row runs the same arithmetic on the same sequence whatever rows, heads, batch rows or
padding keys are beside it: exactly invariant, with no odds (tested: each of 21 rows equals its
one-row pass; padded keys and other batch rows change no bit). Its error against float64 is
that of torch's float32 attention. Threads split whole units of each phase (a key head's tile of
keys, a row's head, a key head's 16 dimensions), never a sum, so the bits do not depend on the
thread count either; a decode step over a long context reads each key and value once, which is
what bounds it (see docs/performance.md).

On by default wherever it builds (AVX-512 and a compiler, ``models.cpu_kernels``);
``RuntimeConfig.attention_kernel`` (``CONSTRAINED_SPEC_ATTENTION_KERNEL=off``) keeps the float64
path, which a machine without the kernel takes silently. One choice per process, so every
forward of a model agrees.
"""

from __future__ import annotations

import torch

from . import cpu_kernels

_HEAD_DIMS = (64, 128, 256)
_MAX_GROUP = 16

#: Whether this process attends new rows with the kernel: asked for (``RuntimeConfig.attention_kernel``,
#: on by default) and built. Fixed at the first call, so a model's forwards never mix the two paths.
enabled = cpu_kernels.ProcessChoice("attention_kernel",
                                    lambda: cpu_kernels.build("row_attention.cpp", cpu_kernels.AVX512, warn=False))


def fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel computes attention of this shape (and is enabled): a head dimension of
    64, 128 or 256 (Gemma's), and at most 16 query heads a key head."""
    return (head_dim in _HEAD_DIMS and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= _MAX_GROUP
            and enabled())


def usable(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attend`` takes these tensors: float32 queries on the CPU of a shape that ``fits``."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and fits(query.shape[1], key.shape[1], query.shape[-1]))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Attention of ``query`` ``[b, h, r, d]`` over ``key`` / ``value`` ``[b, h_kv, kv, d]``
    (float32, a bfloat16 cache's, read as they are, or float64 copies of float32 values, read
    back exactly), ``allowed`` the keys each row sees (``[r, kv]`` or ``[b | 1, 1, r, kv]``; None:
    every key): float32 ``[b, h, r, d]``, a view whose memory is ``[b, r, h, d]`` (what the output
    projection reads)."""
    if key.dtype not in (torch.float32, torch.bfloat16) or value.dtype != key.dtype:
        key, value = key.float(), value.float()
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if allowed is not None:
        allowed = allowed.reshape(-1, *allowed.shape[-2:])
    return torch.ops.constrained_spec.attend_rows(query, key, value, allowed, scale).transpose(1, 2)
