"""Lossless unpacking of GGUF (llama.cpp) quantized tensors into the two forms our CPU kernels run.

A GGUF tensor stores its weight as llama.cpp blocks: small integers ``q`` plus fp16 scales (and
sometimes fp16 mins, or 6/8-bit sub-scales under an fp16 super-scale). :func:`unpack` turns the
raw bytes of one tensor into

* :class:`FourBit`: ``weight[n, k] = scale[n, k // 32] * q[n, k] + min[n, k // 32]`` with ``q`` in
  0..15 (Q4_0, Q4_1, Q4_K), or
* :class:`EightBit`: ``weight[n, k] = scale[n, k // g] * q[n, k] (+ min[n, k // 32])`` with ``q``
  an int8 and ``g`` 32 or 16 (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), or
* a float32 array for F32, F16 and BF16 tensors,

all computed in float32, product first, then the add. gguf-py's ``gguf.quants.dequantize`` is
the reference; each form's ``dequantize()`` reproduces it as follows.

Why the products are exact: an fp16 number has an 11-bit significand (fewer when subnormal) and
converts to a *normal* float32 exactly. The K-quant sub-scale ``d * sc`` multiplies it by an
integer of at most 6 bits (Q4_K, Q5_K: sc <= 63) or 7 bits plus sign (Q6_K: |sc| <= 128, and 128
is a power of two), so it needs at most 18 significand bits and is exact in float32, as is
``dmin * m``. Multiplying by ``q`` adds at most 5 more bits (Q4_*: q <= 15; Q5_*: |q| <= 31,
Q6_K: |q| <= 32; Q8_0: fp16 d (11 bits) times |q| <= 128 (7 bits + power of two)), so every
``scale * q`` fits in 24 bits and is exact: the grouping ``(d * sc) * q`` versus ``d * (sc * q)``,
an FMA versus a separate multiply and add, or the order of the factors cannot change it.
Nothing overflows or underflows float32: the largest product, 65504 * 128 * 32 (Q6_K), is below
2**28, and fp16's smallest subnormal, 2**-24, is far above float32's smallest normal.

What rounds: only the add of the ``min`` term, ``scale * q + min`` for Q4_1, Q5_1 (``d*q + m``)
and Q4_K, Q5_K (``d*sc*q - dmin*m``). It is one float32 add of the same two float32 operands
gguf-py adds (``x - y`` is by IEEE 754 definition ``x + (-y)``, and ``-(dmin*m)`` is exact), so
it rounds identically, bit for bit. Kernels that keep it as one add (or an FMA, since the
product is exact) match too; kernels that fold the min into a dot product (``min * sum(x)``)
round differently, and that is their business, not this module's.

Per type, ``dequantize()`` versus ``gguf.quants.dequantize``:

* Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F32, F16, BF16: identical bits.
* Q4_0: identical values, but not always identical bits: gguf-py computes ``d * (q - 8)``, which
  is ``-0.0`` where ``q == 8`` and ``d < 0`` (llama.cpp's quantizer makes ``d`` negative in about
  half the blocks), or where ``d`` is a zero and ``q - 8`` has the other sign, while
  ``d * q + (-8 * d)`` gives ``+0.0`` there (an exact ``x + (-x)`` is ``+0`` in round-to-nearest). Every nonzero weight is bit-identical
  (``d * (q - 8)`` is exactly representable, so the add is exact). No form ``scale * q + min``
  can produce ``-0.0`` at ``q == 8`` with ``scale < 0`` unless ``scale*8`` is itself ``-0``, so
  this is a property of the FourBit form, not a bug here. A signed zero changes no dot product
  that has any nonzero term. (``EightBit(q - 8, d, None)`` would be bit-exact if a kernel wants
  it.)

Non-finite fp16 scales or mins (inf/NaN) never occur in files llama.cpp writes; :func:`unpack` refuses
them (:class:`QuantValueError`) rather than return a form that would not match gguf-py there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gguf
import numpy as np

from constrained_spec.errors import ModelLoadError

QT = gguf.GGMLQuantizationType

#: Quantized types unpacked to :class:`FourBit`.
FOUR_BIT_TYPES: tuple[QT, ...] = (QT.Q4_0, QT.Q4_1, QT.Q4_K)
#: Quantized types unpacked to :class:`EightBit`.
EIGHT_BIT_TYPES: tuple[QT, ...] = (QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0)
#: Float types returned as a float32 array.
FLOAT_TYPES: tuple[QT, ...] = (QT.F32, QT.F16, QT.BF16)
#: Every type :func:`unpack` accepts.
SUPPORTED_TYPES: tuple[QT, ...] = FLOAT_TYPES + FOUR_BIT_TYPES + EIGHT_BIT_TYPES

# Elements decoded per chunk of rows: bounds the temporaries of a large tensor (e.g. 262144 x 640).
_CHUNK_ELEMENTS = 1 << 22


class UnsupportedQuantTypeError(ModelLoadError):
    """A GGUF tensor uses a quantization type we cannot unpack losslessly (Q2_K, Q3_K, IQ*, ...).

    Attributes:
        qtype_name: the GGML type's name, e.g. ``"Q3_K"``.
        tensor_name: the tensor's GGUF name, e.g. ``"blk.0.attn_q.weight"``.
    """

    def __init__(self, qtype_name: str, tensor_name: str) -> None:
        self.qtype_name = qtype_name
        self.tensor_name = tensor_name
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        super().__init__(
            f"Unsupported GGUF quantization type {qtype_name} in tensor {tensor_name!r}: the native CPU path "
            f"runs only {supported}. Use a file quantized with those types (e.g. a Q4_K_M, Q5_K_M, Q6_K or "
            "Q8_0 preset), or load the model through the transformers backend, which dequantizes to float."
        )


class QuantShapeError(ModelLoadError):
    """A GGUF tensor's shape or byte count does not fit its quantization type's blocks."""


class QuantValueError(ModelLoadError):
    """A GGUF tensor's fp16 scale or min is inf or NaN: the file is corrupt (llama.cpp never writes one)."""


@dataclass(frozen=True)
class FourBit:
    """``weight[n, k] = scale[n, k // 32] * q[n, k] + min[n, k // 32]`` in float32 (product, then add).

    Attributes:
        q: uint8 ``[N, K]``, values 0..15, in the weight's column order.
        scale: float32 ``[N, K // 32]``.
        min: float32 ``[N, K // 32]``.
    """

    q: np.ndarray
    scale: np.ndarray
    min: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return int(self.q.nbytes + self.scale.nbytes + self.min.nbytes)

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight, computed as the class docstring says."""
        n, k = self.shape
        q = self.q.reshape(n, k // 32, 32).astype(np.float32)
        w = self.scale[:, :, None] * q
        w += self.min[:, :, None]
        return w.reshape(n, k)

    def take_rows(self, order: np.ndarray) -> FourBit:
        """The rows ``order`` (any integer index array: a permutation or a subset), as a new FourBit."""
        idx = _row_index(order, self.shape[0])
        return FourBit(q=self.q[idx], scale=self.scale[idx], min=self.min[idx])


@dataclass(frozen=True)
class EightBit:
    """``weight[n, k] = scale[n, k // g] * q[n, k] (+ min[n, k // 32])`` in float32, ``g = K // scale.shape[1]``.

    Attributes:
        q: int8 ``[N, K]`` in the weight's column order.
        scale: float32 ``[N, K // 32]`` (Q5_0, Q5_1, Q5_K, Q8_0) or ``[N, K // 16]`` (Q6_K).
        min: float32 ``[N, K // 32]`` (Q5_1, Q5_K) or ``None``.
    """

    q: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def group(self) -> int:
        """Columns per scale: 32 or 16."""
        return self.shape[1] // int(self.scale.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return int(self.q.nbytes + self.scale.nbytes + (0 if self.min is None else self.min.nbytes))

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight, computed as the class docstring says."""
        n, k = self.shape
        g = self.group
        w = self.scale[:, :, None] * self.q.reshape(n, k // g, g).astype(np.float32)
        if self.min is not None:
            w = w.reshape(n, k // 32, 32)
            w += self.min[:, :, None]
        return w.reshape(n, k)

    def take_rows(self, order: np.ndarray) -> EightBit:
        """The rows ``order`` (any integer index array: a permutation or a subset), as a new EightBit."""
        idx = _row_index(order, self.shape[0])
        return EightBit(q=self.q[idx], scale=self.scale[idx], min=None if self.min is None else self.min[idx])


def _row_index(order: np.ndarray, n: int) -> np.ndarray:
    """``order`` as a checked 1-D integer index into ``n`` rows."""
    idx = np.asarray(order)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"take_rows expects a 1-D integer array of row indices, got dtype {idx.dtype}, shape {idx.shape}")
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"take_rows: a row index is outside 0..{n - 1}")
    return idx


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block of ``b`` (``[..., type_size]`` uint8), as float32."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs[..., m]`` bytes as ``[..., 2, m]`` values: low nibbles first, then high (llama.cpp's order)."""
    out = np.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    np.right_shift(qs, 4, out=out[..., 1, :])
    return out


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes per super-block as eight 6-bit scales and eight 6-bit mins (gguf-py's layout)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# Each decoder takes blocks [n, nb, type_size] (uint8) and returns q [n, nb * block], scale, min.
_Decoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _q4_0(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[..., 2:18]).reshape(n, -1)
    # -8 * d is exact (a power of two), so the min term adds no rounding of its own.
    return q, d, d * np.float32(-8.0)


def _q4_1(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    return _nibbles(b[..., 4:20]).reshape(n, -1), _f16(b, 0), _f16(b, 2)


def _k_scales_and_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks ``b`` [n, nb, bytes]: each sub-block's scale ``d * sc`` and min
    ``-dmin * m``, float32 [n, nb * 8]."""
    n, nb = b.shape[:2]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, nb * 8)
    mins = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, nb * 8)
    return scale, mins


def _q4_k(b: np.ndarray) -> _Decoded:
    n, nb = b.shape[:2]
    scale, mins = _k_scales_and_mins(b)
    # 32 bytes hold sub-blocks 2j (low nibbles) and 2j+1 (high nibbles).
    q = _nibbles(b[..., 16:144].reshape(n, nb, 4, 32)).reshape(n, -1)
    return q, scale, mins


def _five_bit(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 16 nibble bytes and a little-endian 32-bit high-bit mask per block, as 0..31."""
    low = _nibbles(ql).reshape(*ql.shape[:-1], 32)
    high = np.unpackbits(qh, axis=-1, bitorder="little")
    return low | (high << 4)


def _q5_0(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    q = _five_bit(b[..., 6:22], b[..., 2:6]).view(np.int8) - np.int8(16)
    return q.reshape(n, -1), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    q = _five_bit(b[..., 8:24], b[..., 4:8]).view(np.int8)
    return q.reshape(n, -1), _f16(b, 0), _f16(b, 2)


def _q5_k(b: np.ndarray) -> _Decoded:
    n, nb = b.shape[:2]
    scale, mins = _k_scales_and_mins(b)
    low = _nibbles(b[..., 48:176].reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)
    # Bit i of qh[j] is the fifth bit of element j of sub-block i.
    qh = b[..., 16:48]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    q = (low | (high << 4)).view(np.int8)
    return q.reshape(n, -1), scale, mins


def _q6_k(b: np.ndarray) -> _Decoded:
    n, nb = b.shape[:2]
    ql = _nibbles(b[..., 0:128].reshape(n, nb, 2, 64)).reshape(n, nb, 8, 32)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = (qh & np.uint8(3)).reshape(n, nb, 8, 32)
    q = (ql | (qh << 4)).view(np.int8) - np.int8(32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    scale = (_f16(b, 208)[..., None] * sc).reshape(n, nb * 16)
    return q.reshape(n, -1), scale, None


def _q8_0(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    return b[..., 2:34].view(np.int8).reshape(n, -1), _f16(b, 0), None


_DECODERS: dict[QT, tuple[Callable[[np.ndarray], _Decoded], int, bool]] = {
    # qtype: (decoder, elements per scale, has min)
    QT.Q4_0: (_q4_0, 32, True),
    QT.Q4_1: (_q4_1, 32, True),
    QT.Q4_K: (_q4_k, 32, True),
    QT.Q5_0: (_q5_0, 32, False),
    QT.Q5_1: (_q5_1, 32, True),
    QT.Q5_K: (_q5_k, 32, True),
    QT.Q6_K: (_q6_k, 16, False),
    QT.Q8_0: (_q8_0, 32, False),
}


def _qtype_name(qtype: object) -> str:
    """A readable name for whatever was passed as the type (an enum, an int, anything)."""
    if isinstance(qtype, QT):
        return qtype.name
    try:
        value = int(qtype)  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return str(getattr(qtype, "name", qtype))
    try:
        return QT(value).name
    except ValueError:
        # e.g. 31..33, the removed Q4_0_4_4/Q4_0_4_8/Q4_0_8_8 repacked types.
        return f"type id {value} (unknown to gguf-py)"


def unpack(
    raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], name: str
) -> FourBit | EightBit | np.ndarray:
    """Unpack one GGUF tensor's bytes losslessly (see the module docstring for the exactness argument).

    Args:
        raw: the tensor's data as gguf's ``ReaderTensor.data`` gives it (any dtype/shape; its bytes are used).
        qtype: the tensor's GGML type.
        shape: ``(N, K)`` as torch sees the weight (GGUF's ``tensor.shape`` reversed). A 1-D shape
            ``(K,)`` is accepted too (one row; float types keep the 1-D shape).
        name: the tensor's name, for error messages.

    Returns:
        :class:`FourBit` for Q4_0/Q4_1/Q4_K, :class:`EightBit` for Q5_0/Q5_1/Q5_K/Q6_K/Q8_0, and a
        float32 array of ``shape`` for F32/F16/BF16 (for F32 a zero-copy, possibly read-only view of ``raw``).

    Raises:
        UnsupportedQuantTypeError: any other type; the message names it and the tensor.
        QuantShapeError: ``K`` is not a multiple of the type's block size, or ``raw`` has the wrong byte count.
        QuantValueError: a block's fp16 scale or min is inf or NaN (a corrupt file).
    """
    qt, dims, data = _checked_bytes(raw, qtype, shape, name)
    k = dims[-1]
    n = dims[0] if len(dims) == 2 else 1
    if qt == QT.F32:
        return data.view(np.float32).reshape(dims)
    if qt == QT.F16:
        return data.view(np.float16).astype(np.float32).reshape(dims)
    if qt == QT.BF16:
        # Same as gguf-py: the 16 bits become the high half of a float32.
        return (data.view(np.int16).astype(np.int32) << 16).view(np.float32).reshape(dims)
    return _unpack_blocks(data, qt, n, k, name, dims)


def _checked_bytes(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...],
                   name: str) -> tuple[QT, tuple[int, ...], np.ndarray]:
    """``unpack``'s checks: a supported type, a shape of whole blocks, the right byte count;
    returns the type, the shape and the bytes as a flat uint8 array."""
    try:
        qt = QT(int(qtype))
    except (ValueError, TypeError):
        raise UnsupportedQuantTypeError(_qtype_name(qtype), name) from None
    if qt not in SUPPORTED_TYPES:
        raise UnsupportedQuantTypeError(qt.name, name)
    dims = tuple(int(s) for s in shape)
    if len(dims) not in (1, 2) or any(s <= 0 for s in dims):
        raise QuantShapeError(f"Tensor {name!r}: expected a shape (N, K) or (K,) of positive sizes, got {shape}.")
    k = dims[-1]
    n = dims[0] if len(dims) == 2 else 1
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    if k % block:
        raise QuantShapeError(
            f"Tensor {name!r} ({qt.name}, shape {dims}): its row length K={k} is not a multiple of the "
            f"{qt.name} block size {block}, so it cannot be a valid {qt.name} tensor."
        )
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = n * (k // block) * type_size
    if data.size != expected:
        raise QuantShapeError(
            f"Tensor {name!r} ({qt.name}, shape {dims}): expected {expected} bytes "
            f"({n} rows x {k // block} blocks x {type_size} bytes), got {data.size}."
        )
    return qt, dims, data


def _unpack_blocks(data: np.ndarray, qt: QT, n: int, k: int, name: str,
                   dims: tuple[int, ...]) -> FourBit | EightBit:
    """A quantized tensor's checked bytes as its form, decoded in chunks of rows."""
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    decode, group, has_min = _DECODERS[qt]
    blocks = data.reshape(n, k // block, type_size)
    q = np.empty((n, k), dtype=np.uint8 if qt in FOUR_BIT_TYPES else np.int8)
    scale = np.empty((n, k // group), dtype=np.float32)
    mins = np.empty((n, k // 32), dtype=np.float32) if has_min else None
    step = max(1, _CHUNK_ELEMENTS // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        # inf * 0 in a corrupt file's scales is caught just below, with a clear error, not a warning.
        with np.errstate(invalid="ignore"):
            cq, cs, cm = decode(blocks[r0:r1])
        q[r0:r1] = cq
        scale[r0:r1] = cs
        if mins is not None:
            mins[r0:r1] = cm
    # A non-finite scale is a corrupt file, and the forms would not reproduce gguf-py's inf/NaN pattern.
    if not (np.isfinite(scale).all() and (mins is None or np.isfinite(mins).all())):
        raise QuantValueError(
            f"Tensor {name!r} ({qt.name}, shape {dims}) has an inf or NaN block scale or min: the file is corrupt. "
            "Re-download or re-quantize it."
        )
    if qt in FOUR_BIT_TYPES:
        assert mins is not None
        return FourBit(q=q, scale=scale, min=mins)
    return EightBit(q=q, scale=scale, min=mins)
