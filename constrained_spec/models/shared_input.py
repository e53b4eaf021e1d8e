"""Layers that read the same input (q/k/v, gate/up) run as one kernel call over their weights
concatenated along the output rows, each layer replaced by a part that takes its share."""

from __future__ import annotations

import threading
from typing import Any

import torch


class SharedInputCall:
    """One layer ``fused`` whose output is several layers' outputs side by side (``sizes``
    columns each): the first part called with an input computes every part's output, the
    others take theirs. The kernels compute each output element from its own weights alone, so
    a part's bits are the separate layer's."""

    def __init__(self, fused: Any, sizes: list[int]) -> None:
        self.layer = fused
        self.sizes = sizes
        self._local = threading.local()  # forwards in two threads must not read each other's outputs

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Output ``index`` for input ``x`` (computed once per input; an in-place change of ``x``
        counts as a new input)."""
        held = getattr(self._local, "held", None)
        if held is None or held[0] is not x or held[1] != x._version:
            held = self._local.held = (x, x._version, self.layer(x).split(self.sizes, dim=-1))
        if index == len(self.sizes) - 1:
            self._local.held = None  # the last part read: hold nothing between forwards
        return held[2][index]
