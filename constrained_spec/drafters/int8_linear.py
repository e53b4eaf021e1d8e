"""Int8 weight-only linear layers for a draft head, on torch's CPU kernel.

A head's cost per draft token is mostly its weight traffic: nine matrices, 26 MB in float32,
read once per draft token, and evicted from the caches by the target's forward between two
proposals. Saved as int8 (each row scaled to 127, ``DraftHead.save``), the same weights run
through ``torch._weight_int8pack_mm`` (int8 weights, one scale per output row, bfloat16
activations) read a quarter of the bytes, and take correspondingly less time per draft token
(see docs/drafters.md). The int8 bytes are the stored ones; the kernel takes the row scales and the activations in
bfloat16 (relative rounding at most 2^-9), which moves a draft's logits slightly (a head's draft
is checked by the target, so this changes speed, never the output law). Hand-written because
no library wraps this kernel as a module.
"""

from __future__ import annotations

import torch
from torch import nn


#: Byte alignment the int8 kernel's weights need: its AVX-512 path reads them with aligned
#: loads, and weights read by ``safetensors.torch.load_file`` sit at the file's offsets, where a
#: misaligned weight crashes the process.
KERNEL_ALIGNMENT = 64


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it in freshly allocated memory when its data is not on a
    ``KERNEL_ALIGNMENT`` boundary (torch's allocator aligns to 64 bytes)."""
    return t if t.data_ptr() % KERNEL_ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)


def int8_kernel_available() -> bool:
    """Whether this torch build runs the int8 weight-only kernel on the CPU."""
    try:
        w = torch.ones(8, 32, dtype=torch.int8)
        torch._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16), w, torch.ones(8, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


class Int8Linear(nn.Module):
    """A bias-free linear layer over int8 weights ``[N, K]`` with one scale per output row.

    Inputs of any float dtype are rounded to bfloat16 for the kernel; the output comes back in
    the input's dtype.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2 or scale.numel() != weight.shape[0]:
            raise ValueError("Invalid int8 weights: expected int8 [N, K] and N scales.")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", aligned(weight.contiguous()))
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        scale = self.scale if self.scale.dtype == torch.bfloat16 else self.scale.bfloat16()  # after a module.to()
        y = torch._weight_int8pack_mm(rows, self.weight, scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 (weight-only kernel)"


def use_int8_linears(module: nn.Module, stored: dict[str, torch.Tensor], scale_suffix: str) -> int:
    """Replace every bias-free ``nn.Linear`` of ``module`` whose weight ``stored`` holds as int8
    (``NAME.weight`` with ``NAME.weight + scale_suffix``) by an ``Int8Linear`` over those
    bytes; returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear) or child.bias is not None:
            continue
        key = f"{name}.weight"
        if key not in stored or stored[key].dtype != torch.int8 or key + scale_suffix not in stored:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Int8Linear(stored[key], stored[key + scale_suffix]))
        replaced += 1
    return replaced
