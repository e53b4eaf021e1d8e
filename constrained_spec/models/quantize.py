"""A Hugging Face checkpoint quantized at load for the CPU kernels: ``precision="int8"`` or
``"int4"``, so a float checkpoint runs on the same batch-invariant kernels as a GGUF file, in a
quarter (int8) or a sixth (int4) of its float32 size.

The rounding is llama.cpp's for the nearest types, per block of 32 weights along a row:
- int8 (Q8_0's rule): d = max|w| / 127, q = round(w / d) in -127..127, w' = d q;
- int4 (Q4_1's rule): m = min w, d = (max w - m) / 15, q = round((w - m) / d) in 0..15, w' = d q + m.
Scales and mins stay float32 (the kernels' forms, ``models.quant_linear``). Every decoder linear
layer is quantized; the output projection takes int8 in both modes (it decides the token), and
a tied input embedding then reads its rows from it (``models.gguf_model.GatheredEmbedding``).
What it does to the extracted fields is measured on [Your model](../docs/models.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from .gguf_quants import EightBit, FourBit

#: ``precision=`` values that quantize a float checkpoint at load.
QUANTIZED_PRECISIONS = ("int8", "int4")
BLOCK = 32


def _blocks(weight: torch.Tensor) -> np.ndarray:
    """``weight`` ``[N, K]`` as float32 ``[N, K / 32, 32]`` (K zero-padded to whole blocks)."""
    w = weight.detach().to(torch.float32).cpu().numpy()
    pad = -w.shape[1] % BLOCK
    if pad:
        w = np.pad(w, ((0, 0), (0, pad)))
    return w.reshape(w.shape[0], -1, BLOCK)


def quantize_eight_bit(weight: torch.Tensor) -> EightBit:
    """Q8_0's rounding of a float matrix, with float32 scales."""
    blocks = _blocks(weight)
    d = np.abs(blocks).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return EightBit(q=q.reshape(q.shape[0], -1), scale=d.astype(np.float32), min=None)


def quantize_four_bit(weight: torch.Tensor) -> FourBit:
    """Q4_1's rounding of a float matrix, with float32 scales and mins."""
    blocks = _blocks(weight)
    lo, hi = blocks.min(axis=-1), blocks.max(axis=-1)
    d = (hi - lo) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint((blocks - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return FourBit(q=q.reshape(q.shape[0], -1), scale=d.astype(np.float32), min=lo.astype(np.float32))


def _layer(linear: nn.Linear, precision: str) -> nn.Module:
    """The ``QuantLinear`` of a float ``nn.Linear`` at ``precision``."""
    from .quant_linear import QuantLinear

    k = linear.in_features
    bias = None if linear.bias is None else linear.bias.detach().to(torch.float32)
    if precision == "int4":
        form = quantize_four_bit(linear.weight)
        return QuantLinear.four_bit(form.q[:, :k], form.scale, form.min, bias=bias)
    form8 = quantize_eight_bit(linear.weight)
    return QuantLinear.eight_bit(form8.q[:, :k], form8.scale, None, bias=bias)


def quantize_model(model: Any, precision: str) -> Any:
    """Replace every ``nn.Linear`` of ``model``'s decoder by a ``QuantLinear`` at ``precision``
    ("int8" or "int4") and its output projection by an int8 one (a tied embedding then reads its
    rows from it), q/k/v and gate/up run as one call each; in place."""
    from .gguf_model import GatheredEmbedding, embedding_scale, set_module, fuse_shared_inputs

    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(f"Unknown quantized precision {precision!r}: use one of {QUANTIZED_PRECISIONS}.")
    output = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = output is not None and output.weight is embedding.weight
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            set_module(model, name, _layer(module, "int8" if module is output else precision))
    if tied:
        model.set_input_embeddings(GatheredEmbedding(model.get_output_embeddings(), embedding_scale(embedding),
                                                     embedding.padding_idx))
    fuse_shared_inputs(model)
    return model
