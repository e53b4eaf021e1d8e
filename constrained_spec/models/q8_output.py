"""The embedded model's Q8_0 output projection as two calls of torch's int4 kernel.

The tied embedding / output matrix (49,152 x 576) is Q8_0 in the GGUF: w = q d, q in -127..127,
one fp16 scale d per 32 weights. torch has no CPU kernel for per-group int8 weights, so it
used to run as the dequantized float32 matrix (113 MB read per row block; 8-10 ms of a
one-token step here, the largest single op). With u = q + 128 = 16 h + l (nibbles h, l in
0..15), w = 16 d (h - 8) + [d (l - 8) + 8 d]: two int4 matrices with group scales and zeros in
the form the int4 kernel takes (w = (q4 - 8) s + z), 28 MB in all, no float32 copy read.
Measured here (``benchmarks/q8_split_probe.py``): 4.3 against 8.1 ms for one row with the
caches cold.

What it costs in exactness: the kernel takes bfloat16 activations and scales and returns
bfloat16 (as for every Q4_1 layer of the model already, ``models.int4``), so a logit is rounded
to 8 significant bits: up to 0.06 for logits of 16-32, and a near-tie of two tokens closer than
that can flip (measured on the bench prompts: ``constrained-spec bench --precision
native-exact,native``, in the README). Sending the activations as two bfloat16 halves was
tried and left out: it halves the activations' share of the error but not the output's, at
twice the time for 2+ rows. Like every layer on the int4 kernel it computes each output row
alone, so a row's logits do not depend on the rows beside it: batch-invariant as it is, with
no padded row blocks. ``precision="native-exact"`` keeps the exact float32 matrix.

``weight`` stays the exact float32 matrix (the input embedding shares it, and the logits path
over a few allowed ids, ``decoding.logits``, gathers its rows), so only full-vocabulary rows
take the int4 path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .int4 import GROUP

#: Bytes of one Q8_0 block: fp16 d, 32 int8 weights.
Q8_0_BLOCK_BYTES = 34


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
    """A bias-free output layer over Q8_0 weights on two int4 kernel calls (module docstring).

    ``weight``: the exact dequantized float32 matrix (shared with the input embedding; not read
    by ``forward``)."""

    #: The packed matrices, in the order ``__init__`` takes them (and a cache stores them).
    BUFFERS = ("packed_hi", "sz_hi", "packed_lo", "sz_lo")

    def __init__(self, packed_hi: torch.Tensor, sz_hi: torch.Tensor, packed_lo: torch.Tensor, sz_lo: torch.Tensor,
                 weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        for name, t in zip(self.BUFFERS, (packed_hi, sz_hi, packed_lo, sz_lo)):
            self.register_buffer(name, t, persistent=False)
        self.weight = weight  # a plain attribute: the embedding owns the parameter
        self.bias = None

    @staticmethod
    def from_q8_0(raw: np.ndarray, weight: torch.Tensor) -> "Q8OutputProjection":
        """Pack a Q8_0 tensor's raw bytes (``weight``: its dequantized float32 matrix, checked against them)."""
        n, k = weight.shape
        q, d = unpack_q8_0(raw, (n, k))
        q_t, d_t = torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d.astype(np.float32))
        exact = (q_t.reshape(n, k // GROUP, GROUP).float() * d_t[..., None]).reshape(n, k)
        if not torch.equal(exact, weight.float()):
            raise ValueError("The Q8_0 tensor does not dequantize to the model's output matrix.")
        u = q_t + 128  # 1..255
        hi, lo = u >> 4, u & 15
        packed_hi, sz_hi = _pack(hi, 16 * d_t, torch.zeros_like(d_t))
        packed_lo, sz_lo = _pack(lo, d_t, 8 * d_t)
        return Q8OutputProjection(packed_hi, sz_hi, packed_lo, sz_lo, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> float32 logits ``[..., N]``."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(rows, self.packed_hi, GROUP, self.sz_hi).float()
        y += mm(rows, self.packed_lo, GROUP, self.sz_lo).float()
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0 as two int4 matrices"
