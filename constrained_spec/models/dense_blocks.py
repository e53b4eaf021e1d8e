"""Dense matmuls of prompt rows whose bits do not depend on the thread count.

Why hand-written: prompt rows of the native model run a dense bfloat16 matmul where the CPU
multiplies bfloat16 in hardware (``models.int4``), and oneDNN cuts a matmul, its reduction
included, by the number of threads it reads. So a prompt's keys, and with them the output,
changed with the thread count, and prompt passes had to run at one fixed count whatever the
load: beside a busy neighbour every region then waited for a thread that had no core, and a
long prompt took several times as long as on one thread (docs/performance.md, "Sharing the
machine").

``kernels/dense_blocks.cpp`` runs the weights as ``parts`` blocks of output columns, each packed
once by oneDNN for its matmul (``mkldnn._reorder_linear_weight``) and multiplied on one thread
with oneDNN told so; torch's threads take whole blocks. A block's bits then depend on its shape
alone (tested: the same bits at one thread and two, equal to each block's own ``linear`` on one
thread), and the thread governor (``models.threads``) may shed threads in prompt passes too.
``parts`` is the most threads the process uses, fixed for its life, so every block has a thread
when the machine is free.
"""

from __future__ import annotations

import functools

import torch

from . import cpu_kernels

#: Output columns of a block are a multiple of this (oneDNN's bfloat16 tiles are 16 wide).
COLUMN_STEP = 16
#: Rows oneDNN packs a block's weights for (the prompt chunk of ``decoding.prefix``).
PACKED_FOR_ROWS = 256


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this process multiplies prompt rows in blocks: the kernel builds and oneDNN
    packs and multiplies a bfloat16 block (checked once on a small one)."""
    if not torch.backends.mkldnn.is_available() or not cpu_kernels.build("dense_blocks.cpp", (), warn=False):
        return False
    try:
        weight = torch.ones(COLUMN_STEP, 32, dtype=torch.bfloat16)
        out = PackedLinear(weight, 1)(torch.ones(2, 32, dtype=torch.bfloat16))
    except RuntimeError:  # a torch built without oneDNN's linear ops
        return False
    return bool((out == 32).all())


def block_widths(columns: int, parts: int) -> list[int]:
    """``columns`` split into at most ``parts`` blocks, each a multiple of ``COLUMN_STEP`` but the last."""
    width = -(-columns // max(1, parts))
    width = -(-width // COLUMN_STEP) * COLUMN_STEP
    widths = [width] * (columns // width)
    if columns % width:
        widths.append(columns % width)
    return widths


class PackedLinear:
    """``weight`` ``[N, K]`` (bfloat16) as ``parts`` blocks packed by oneDNN; called on rows
    ``[M, K]`` of the weight's dtype, returns ``[M, N]`` in ``dtype`` (None: the rows'), the same
    bits at any thread count."""

    def __init__(self, weight: torch.Tensor, parts: int) -> None:
        self.out_features, self.in_features = weight.shape
        self.widths = block_widths(self.out_features, parts)
        self.blocks = [torch.ops.mkldnn._reorder_linear_weight(block.contiguous(), PACKED_FOR_ROWS)
                       for block in weight.split(self.widths)]

    def __call__(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.ops.constrained_spec.linear_blocks(rows, self.blocks, self.widths, dtype)
