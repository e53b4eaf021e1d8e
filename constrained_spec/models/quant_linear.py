"""Linear layers over a GGUF file's weights at their own precision, batch-invariant: the one entry
the rest of the codebase uses for a quantized (or dense) matrix.

Every llama.cpp quant type is repacked losslessly (``models.gguf_*``) into one of two canonical
forms, each run by a VNNI kernel:

- four-bit (Q4_0, Q4_1, Q4_K): ``q`` uint8 ``[N, K]`` in 0..15, ``scale`` and ``min`` float32
  ``[N, K/32]``, w = scale q + min; ``models.q4_vnni``'s kernel with activations split into two
  int8 parts (about 15 bits);
- eight-bit (Q8_0, Q5_*, Q6_K): ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N, K/32]`` or
  ``[N, K/16]`` (Q6_K's per-half-block scales), ``min`` ``[N, K/32]`` or None,
  w = scale[k // 32 or k // 16] q + min[k // 32]; ``models.q8_output``'s kernel (``q8_mm``), the
  activations split the same way.

What is exact and what rounds: the weights are the file's, exactly (scales and mins in float32,
``gather_rows`` gives ``scale * q + min`` rounded as float32 rounds a product, then a sum). The
activations are rounded per block of 32 to dx (a + b / 254), dx = max|x| / 127 (an error below
dx / 508 a value, so a relative error of about 1e-4 of sum |w x| at worst), the integer dot
products are exact, and each block adds its terms in float32.

``dense`` (F32, F16, BF16 files; and the fallback where the VNNI kernels do not build, with a
warning once: the quantized forms then dequantize to float32 exactly) multiplies in float32 as
``W @ X.T`` over the rows zero-padded to blocks of exactly ``DENSE_ROWS``, one matmul shape
whatever the row count (``models.bucketed_linear.BucketedLinear``'s idea), so a row's bits do not
depend on the rows beside it.

Every path is batch-invariant: a row's output has the same bits alone or among any rows, at any
position (the kernels' threads split columns, never a row's sum).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from . import q4_vnni, q8_output
from .q4_vnni import GROUP

#: Rows of one matmul call on the dense path (the CPU output projection's block, ``models.invariant``).
DENSE_ROWS = 8
#: Output rows a packed block holds: the padding unit of each form.
ROW_UNIT = {"four_bit": 2 * q4_vnni.COLS, "eight_bit": q8_output.COLS, "dense": 1}
KINDS = tuple(ROW_UNIT)

def _fallback_warning(kind: str) -> None:
    """Say that the quantized layers run dense (slower, more memory): once per kind and place of
    the load, by the warnings module's own default filter, not a flag of ours."""
    warnings.warn(f"The VNNI kernels do not run on this machine: {kind} layers are dequantized to float32 "
                  "and run as dense matmuls (exact weights, more memory and time).", stacklevel=3)


def _four_bit_kernel() -> bool:
    return q4_vnni.cpu_supports() and q4_vnni.load_kernel(warn=False)


def _eight_bit_kernel() -> bool:
    return q4_vnni.cpu_supports() and q8_output.kernel() == "vnni"


def _numpy(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _pad(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``a`` zero-padded to ``rows`` x ``cols`` (no copy when it already is)."""
    if a.shape == (rows, cols):
        return a
    return np.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _bias(bias: np.ndarray | torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    b = torch.as_tensor(_numpy(bias)).to(torch.float32).reshape(-1).contiguous()
    if b.numel() != n:
        raise ValueError(f"A bias of {b.numel()} values for {n} output rows.")
    return b


class QuantLinear(nn.Module):
    """``y = x W.T (+ bias)`` over a four-bit, eight-bit or dense matrix (module docstring); build it
    with ``four_bit``, ``eight_bit``, ``dense`` or ``fuse``.

    Output rows not a multiple of the packed block (32 four-bit, 16 eight-bit) are padded with zero
    rows at pack time and sliced off the output; input columns not a multiple of 32 are padded
    with zero weights, and the activations with zeros, the same way. Neither changes a value."""

    def __init__(self, kind: str, buffers: dict[str, torch.Tensor | None], in_features: int,
                 parts: list[tuple[int, int]], bias: torch.Tensor | None = None) -> None:
        """``buffers``: the kind's operands (four-bit ``packed``, ``scales``; eight-bit those and
        ``mins``; dense ``weight0``, ``weight1``, ... one a part); ``parts``: each fused part's
        ``(rows, padded rows)``, in output order."""
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"Unknown QuantLinear kind {kind!r}: use one of {', '.join(KINDS)}.")
        self.kind = kind
        self.in_features = in_features
        self.parts = list(parts)
        self.out_features = sum(n for n, _ in self.parts)
        self.padded_in = in_features if kind == "dense" else -(-in_features // GROUP) * GROUP
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=True)
        self.register_buffer("bias", bias, persistent=True)
        # Output columns to keep from the padded result (None: all of them, nothing was padded).
        keep = [torch.arange(start, start + n) for (n, _), start in zip(self.parts, self._starts())]
        self._keep = None if all(n == p for n, p in self.parts) else torch.cat(keep)

    def _starts(self) -> list[int]:
        starts, at = [], 0
        for _, padded in self.parts:
            starts.append(at)
            at += padded
        return starts

    # ---- construction ----

    @staticmethod
    def four_bit(q: np.ndarray | torch.Tensor, scale: np.ndarray | torch.Tensor, min: np.ndarray | torch.Tensor,
                 bias: np.ndarray | torch.Tensor | None = None) -> "QuantLinear":
        """Weights w = scale q + min: ``q`` ``[N, K]`` in 0..15, ``scale`` and ``min``
        ``[N, ceil(K/32)]`` float32 (float16 widened exactly), ``bias`` ``[N]`` or None. On the
        four-bit VNNI kernel (split activations); dense float32 where it does not build."""
        q, scale, min = _numpy(q), _numpy(scale), _numpy(min)
        n, k = q.shape
        g = -(-k // GROUP)
        if scale.shape != (n, g) or min.shape != (n, g):
            raise ValueError(f"Scales {scale.shape} and mins {min.shape} do not fit a {n} x {k} matrix: expected {(n, g)}.")
        if q.size and (q.min() < 0 or q.max() > 15):
            raise ValueError("Four-bit weights must lie in 0..15.")
        if not _four_bit_kernel():
            _fallback_warning("four-bit")
            return QuantLinear.dense(dequantize(q, scale, min), bias)
        rows = -(-n // ROW_UNIT["four_bit"]) * ROW_UNIT["four_bit"]
        packed, scales = q4_vnni.pack(_pad(q.astype(np.uint8), rows, g * GROUP), _pad(scale, rows, g), _pad(min, rows, g))
        return QuantLinear("four_bit", {"packed": packed, "scales": scales}, k, [(n, rows)], _bias(bias, n))

    @staticmethod
    def eight_bit(q: np.ndarray | torch.Tensor, scale: np.ndarray | torch.Tensor,
                  min: np.ndarray | torch.Tensor | None = None,
                  bias: np.ndarray | torch.Tensor | None = None) -> "QuantLinear":
        """Weights w = scale q (+ min): ``q`` ``[N, K]`` in -128..127, ``scale`` ``[N, ceil(K/32)]``
        (a scale per block of 32) or ``[N, ceil(K/16)]`` (per half-block of 16), ``min``
        ``[N, ceil(K/32)]`` or None, float32 (float16 widened exactly); ``bias`` ``[N]`` or None.
        On the eight-bit VNNI kernel; dense float32 where it does not build."""
        q, scale = _numpy(q), _numpy(scale)
        min = None if min is None else _numpy(min)
        n, k = q.shape
        g = -(-k // GROUP)
        if scale.shape not in ((n, g), (n, -(-k // 16))):
            raise ValueError(f"Scales {scale.shape} do not fit a {n} x {k} matrix: expected {(n, g)} or "
                             f"{(n, -(-k // 16))}.")
        if min is not None and min.shape != (n, g):
            raise ValueError(f"Mins {min.shape} do not fit a {n} x {k} matrix: expected {(n, g)}.")
        if q.size and (q.min() < -128 or q.max() > 127):
            raise ValueError("Eight-bit weights must lie in -128..127.")
        if not _eight_bit_kernel():
            _fallback_warning("eight-bit")
            return QuantLinear.dense(dequantize(q, scale, min), bias)
        halves = 2 if scale.shape[1] != g else 1
        rows = -(-n // ROW_UNIT["eight_bit"]) * ROW_UNIT["eight_bit"]
        packed, scales, mins = q8_output.pack_vnni(_pad(q.astype(np.int8), rows, g * GROUP), _pad(scale, rows, halves * g),
                                                   None if min is None else _pad(min, rows, g))
        return QuantLinear("eight_bit", {"packed": packed, "scales": scales, "mins": mins}, k, [(n, rows)],
                           _bias(bias, n))

    @staticmethod
    def dense(weight: np.ndarray | torch.Tensor, bias: np.ndarray | torch.Tensor | None = None) -> "QuantLinear":
        """A float32 matrix ``weight`` ``[N, K]`` (F32, F16, BF16 files widened exactly),
        ``bias`` ``[N]`` or None: batch-invariant blocked matmuls (module docstring)."""
        w = torch.as_tensor(_numpy(weight)).to(torch.float32).contiguous()
        n, k = w.shape
        return QuantLinear("dense", {"weight0": w}, k, [(n, n)], _bias(bias, n))

    @staticmethod
    def fuse(layers: list["QuantLinear"]) -> "QuantLinear":
        """One layer whose output is the concatenation of ``layers``' outputs (q/k/v, gate/up in
        one call), bit for bit the separate layers' (each output column is computed from its own
        weights alone). They must share the kind, the input width and the group layout (scales a
        block or a half-block, mins or none): ValueError otherwise. A missing bias is zeros."""
        if not layers:
            raise ValueError("Nothing to fuse.")
        first = layers[0]
        for layer in layers[1:]:
            if layer.kind != first.kind or layer.in_features != first.in_features:
                raise ValueError(f"Cannot fuse a {layer.kind} layer of {layer.in_features} inputs with a "
                                 f"{first.kind} layer of {first.in_features}.")
            if first.kind == "eight_bit" and (layer.scales.dim() != first.scales.dim()
                                              or bool(layer.mins.numel()) != bool(first.mins.numel())):
                raise ValueError("Cannot fuse eight-bit layers of different group layouts (scales a block or a "
                                 "half-block, with or without mins).")
        if first.kind == "dense":
            weights = [getattr(layer, f"weight{i}") for layer in layers for i in range(len(layer.parts))]
            buffers = {f"weight{i}": w for i, w in enumerate(weights)}
        else:
            names = ("packed", "scales", "mins") if first.kind == "eight_bit" else ("packed", "scales")
            buffers = {name: torch.cat([getattr(layer, name) for layer in layers]) for name in names}
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
                              for layer in layers])
        return QuantLinear(first.kind, buffers, first.in_features, [p for layer in layers for p in layer.parts], bias)

    # ---- use ----

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype (computed in float32)."""
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        if self.padded_in != self.in_features:
            rows = torch.nn.functional.pad(rows, (0, self.padded_in - self.in_features))
        rows = rows.contiguous()
        if self.kind == "four_bit":
            y = torch.ops.constrained_spec.q4_1_mm(rows, self.packed, self.scales, True)
        elif self.kind == "eight_bit":
            y = torch.ops.constrained_spec.q8_mm(rows, self.packed, self.scales, self.mins)
        else:
            y = self._dense(rows)
        if self._keep is not None:
            y = y.index_select(1, self._keep)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """``W @ X.T`` over fresh zero-padded blocks of ``DENSE_ROWS`` rows: the same matmul shape
        (and aligned buffers) for every call, so a row's bits do not depend on its neighbours."""
        weights = [getattr(self, f"weight{i}") for i in range(len(self.parts))]
        out = []
        for start in range(0, rows.shape[0], DENSE_ROWS):
            chunk = rows[start : start + DENSE_ROWS]
            block = torch.zeros(DENSE_ROWS, rows.shape[1])
            block[: len(chunk)] = chunk
            out.append(torch.cat([torch.mm(w, block.t()) for w in weights]).t()[: len(chunk)])
        return torch.cat(out) if out else rows.new_zeros(0, self.out_features)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, of the output dimension) of the weights, dequantized exactly: float32
        ``[len(ids), K]`` (``scale * q + min`` as float32 rounds it; a tied embedding's lookup)."""
        ids = torch.as_tensor(ids).reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"Row ids must lie in 0..{self.out_features - 1}.")
        if self._keep is not None:
            ids = self._keep[ids]  # the rows' places in the padded matrix
        if self.kind == "four_bit":
            rows = q4_vnni.gather_rows(self.packed, self.scales, ids)
        elif self.kind == "eight_bit":
            rows = q8_output.gather_rows(self.packed, self.scales, self.mins, ids)
        else:
            rows = torch.empty(len(ids), self.in_features)
            start = 0
            for i, (n, _) in enumerate(self.parts):
                inside = (ids >= start) & (ids < start + n)
                rows[inside] = getattr(self, f"weight{i}")[ids[inside] - start]
                start += n
        return rows[:, : self.in_features]

    def take_rows(self, ids: torch.Tensor) -> "QuantLinear":
        """A layer of output rows ``ids`` (int64, in that order) of this one, in the same form and
        with the same weights, unpacked from the packed bytes (no dense copy of the matrix): a
        draft vocabulary's rows of an output projection. On the packed kernels each output
        column reads its own weights alone, so its outputs are these columns of this layer's."""
        ids = torch.as_tensor(ids).reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"Row ids must lie in 0..{self.out_features - 1}.")
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        at = self._keep[ids] if self._keep is not None else ids  # the rows' places in the padded matrix
        if self.kind == "four_bit":
            q, d, m = q4_vnni.unpack_rows(self.packed, self.scales, at)
            return QuantLinear.four_bit(q[:, : self.in_features], d, m, bias)
        if self.kind == "eight_bit":
            q, scale, min = q8_output.unpack_rows(self.packed, self.scales, self.mins, at)
            return QuantLinear.eight_bit(q[:, : self.in_features], scale, min, bias)
        return QuantLinear.dense(self.gather_rows(ids), bias)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the layer's buffers (weights, scales, mins, bias)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}, parts={len(self.parts)}"


def dequantize(q: np.ndarray, scale: np.ndarray, min: np.ndarray | None = None) -> np.ndarray:
    """The float32 matrix of a four- or eight-bit form (``QuantLinear.four_bit`` / ``eight_bit``'s
    arguments): ``scale * q`` rounded to float32, then ``+ min`` rounded, as ``gather_rows`` does."""
    q, scale = _numpy(q), _numpy(scale).astype(np.float32)
    n, k = q.shape
    g = -(-k // GROUP)
    per = GROUP if scale.shape[1] == g else 16  # weights a scale covers
    qf = _pad(q.astype(np.float32), n, scale.shape[1] * per).reshape(n, scale.shape[1], per)
    w = (qf * scale[..., None]).reshape(n, -1)
    if min is not None:
        w = (_pad(w, n, g * GROUP).reshape(n, g, GROUP) + _numpy(min).astype(np.float32)[..., None]).reshape(n, -1)
    return np.ascontiguousarray(w[:, :k])
