"""The small ops of a batch-invariant decoder layer on the CPU, each one kernel call where torch
takes several.

Why hand-written: outside its matmuls and attention, a layer of the scripted decode loop
(``models.native_decode``) is some thirty small torch ops on a few kilobytes each, each paying
its dispatch: the two RMSNorms (a float64 copy, the square, the sum, the division, the rounding
back, the epsilon, the reciprocal square root and two products) and the residual adds before
them, the rotary embedding of q and k (two products, a roll, an add) and the cache writes of k
and v with their views (the gain is in docs/performance.md). ``kernels/layer_ops.cpp`` does
each group in one pass with AVX-512:
- ``row_variance``: a row's mean of squares, summed in float64 in one fixed order (two 8-lane
  accumulators, then a fixed tree of the lanes), divided by the width and rounded to float32:
  each row alone, so exactly invariant with no odds (torch's float64 sum is invariant up to
  ~1e-8 odds a value);
- ``add_rms_norm``: the residual add, that variance, then ``weight * (s * (1 / sqrt(var + eps)))``;
- ``rope_store``: ``x cos + roll(x) signed_sin`` for q's and k's heads, k and v written into the
  cache buffers at their positions, q returned.
Each elementwise step is rounded as torch rounds it (built with ``-ffp-contract=off``; tested
equal, bit for bit, to torch's ops), so the scripted loop keeps the bits of transformers'
forward. Every CPU path of a batch-invariant model takes ``row_variance`` for its new rows
(``invariant.float64_variance``), so every path of a process computes the same bits.

On by default wherever it builds (AVX-512 and a compiler, ``models.cpu_kernels``);
``RuntimeConfig.layer_kernels`` (``CONSTRAINED_SPEC_LAYER_KERNELS=off``) keeps torch's ops. One
choice per process.
"""

from __future__ import annotations

import torch

from . import cpu_kernels

#: Whether this process runs the layer kernels: asked for (``RuntimeConfig.layer_kernels``, on by
#: default) and built. Fixed at the first call, so a model's forwards never mix the two paths.
enabled = cpu_kernels.ProcessChoice("layer_kernels", lambda: cpu_kernels.build(
    "layer_ops.cpp", cpu_kernels.AVX512, ("-ffp-contract=off",), warn=False))


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: float32 rows on the CPU, with the kernels enabled."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and enabled()


def row_variance(x: torch.Tensor) -> torch.Tensor:
    """The mean of squares of each float32 row of ``x`` ``[..., d]``, summed in float64 in one
    fixed order and rounded to float32: ``[..., 1]``."""
    return torch.ops.constrained_spec.row_variance(x.contiguous())
