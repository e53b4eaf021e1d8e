"""The VNNI int4 kernel (``models.q4_vnni``): llama.cpp's Q4_1 x Q8_1 arithmetic, or activations
split into two int8 parts, row for row the same bits whatever the batch, and its layout's
concatenation for fused layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from constrained_spec import ModelLoadError, config, load_model
from constrained_spec.models import q4_vnni
from constrained_spec.models.int4 import FusedInt4, Int4Linear, dequantize_q4_1, unpack_q4_1

from .test_native import random_q4_1

pytestmark = pytest.mark.skipif(not (q4_vnni.cpu_supports() and q4_vnni.load_kernel()),
                                reason="no AVX-512 VNNI kernel on this machine")


def q8_1_reference(x: np.ndarray, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """llama.cpp's Q4_1 x Q8_1 dot in float64 over the kernel's own int8 rounding: each block of
    32 activations as round(x * (1 / (max|x| / 127))) (in float32, ties to even), times the
    nibbles, scaled by d * dx, plus m * sum(x)."""
    q, d, m = unpack_q4_1(raw, shape)
    n, k = shape
    xb = x.astype(np.float32).reshape(len(x), k // 32, 32)
    dx = np.abs(xb).max(-1) / np.float32(127)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    qx = np.clip(np.rint(xb * inv[..., None]), -128, 127).astype(np.float64)
    dots = np.einsum("rgk,ngk->rng", qx, q.reshape(n, k // 32, 32).astype(np.float64))
    sums = xb.astype(np.float64).sum(-1)
    return (dots * d.astype(np.float64)[None] * dx.astype(np.float64)[:, None] + m.astype(np.float64)[None] * sums[:, None]).sum(-1)


@pytest.mark.parametrize("shape", [(64, 96), (192, 576)])
def test_kernel_computes_q4_1_times_q8_1(shape):
    """Against the float64 reference of the same arithmetic: float32 accumulation error only
    (a wrong nibble, column or scale would be off by whole blocks); against the stored weights
    times the float activations: within the int8 rounding (and not equal: it does round)."""
    n, k = shape
    raw = random_q4_1(n, k, seed=7)
    layer = Int4Linear.from_q4_1(raw, shape, vnni=True, vnni_split=False)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(8))
    got = layer(x).double().numpy()
    scale = np.abs(got).max()
    assert np.abs(got - q8_1_reference(x.numpy(), raw, shape)).max() < 1e-5 * scale
    exact = x.double().numpy() @ dequantize_q4_1(raw, shape).astype(np.float64).T
    assert 0 < np.abs(got - exact).max() < 2e-2 * scale


@pytest.mark.parametrize("shape", [(64, 96), (192, 576)])
def test_split_activations_give_the_stored_weights_times_the_activations(shape):
    """Two int8 parts a block (about 15 bits): within float32 accumulation of the exact product,
    over 100x closer than one int8 part, and closer than torch's kernel (bfloat16 activations)."""
    n, k = shape
    raw = random_q4_1(n, k, seed=7)
    split = Int4Linear.from_q4_1(raw, shape, vnni=True)
    assert split.vnni_split
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(8))
    exact = x.double().numpy() @ dequantize_q4_1(raw, shape).astype(np.float64).T
    error = np.abs(split(x).double().numpy() - exact).max()
    assert error < 1e-4 * np.abs(exact).max()
    one_part = Int4Linear.from_q4_1(raw, shape, vnni=True, vnni_split=False)
    assert error * 100 < np.abs(one_part(x).double().numpy() - exact).max()
    torch_kernel = Int4Linear.from_q4_1(raw, shape)
    assert error * 10 < np.abs(torch_kernel(x).double().numpy() - exact).max()


@pytest.mark.parametrize("split", [True, False])
def test_a_row_has_the_same_bits_alone_or_among_any_rows(split):
    """Row blocks of 4 and the 1-3 left over run the same instructions per row: every row of 37,
    and of slices cut across those blocks, equals its one-row result bit for bit."""
    n, k = 128, 160
    layer = Int4Linear.from_q4_1(random_q4_1(n, k, seed=9), (n, k), vnni=True, vnni_split=split)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(10))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)
    for a, b in [(0, 5), (3, 4), (2, 9), (6, 19), (1, 37)]:
        assert torch.equal(layer(x[a:b]), alone[a:b])
    assert torch.equal(layer(x[None, 4:12])[0], alone[4:12])  # [1, rows, K] as the model calls it
    assert layer(x[:0]).shape == (0, n)


@pytest.mark.parametrize("split", [True, False])
def test_fused_vnni_layers_equal_the_separate_ones_bit_for_bit(split):
    k = 96
    layers = [Int4Linear.from_q4_1(random_q4_1(n, k, seed=s), (n, k), vnni=True, vnni_split=split)
              for n, s in ((128, 1), (64, 2), (64, 3))]
    fused = FusedInt4(layers)
    assert fused.layer.vnni_packed is not None and fused.layer.vnni_split == split
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(11))
    for i, layer in enumerate(layers):
        assert torch.equal(fused.part(x, i), layer(x))


def test_bad_inputs_are_refused_by_name(monkeypatch):
    layer = Int4Linear.from_q4_1(random_q4_1(64, 96), (64, 96), vnni=True)
    with pytest.raises(RuntimeError, match="does not fit"):
        q4_vnni.q4_1_mm(torch.randn(2, 64), layer.vnni_packed, layer.vnni_scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        q4_vnni.pack(*unpack_q4_1(random_q4_1(48, 96), (48, 96)))
    with pytest.raises(ValueError, match="'torch', 'vnni', 'vnni-int8'"):
        q4_vnni.kernel("fast")
    monkeypatch.setenv(config.variable("int4_kernel"), "fast")
    with pytest.raises(ModelLoadError, match="expected one of 'torch', 'vnni', 'vnni-int8' .*, "
                                             "got CONSTRAINED_SPEC_INT4_KERNEL='fast'"):
        load_model(precision="native")


def test_a_vnni_layer_holds_no_torch_layout_and_loads_none_from_an_older_cache(tmp_path):
    """The VNNI layout alone is kept (the embedded model: 66 MB fewer); a cache file written with
    both layouts loads the VNNI one only, with the same outputs; a layer with neither is refused."""
    from constrained_spec.models.native import load_int4, save_int4

    n, k = 64, 96
    raw = random_q4_1(n, k, seed=12)
    layer = Int4Linear.from_q4_1(raw, (n, k), vnni=True)
    assert layer.packed is None and layer.scales_and_zeros is None
    stock = Int4Linear.from_q4_1(raw, (n, k))
    both = Int4Linear(stock.packed.clone(), stock.scales_and_zeros.clone(), k, n,
                      vnni=(layer.vnni_packed, layer.vnni_scales))
    save_int4({"a": both, "b": stock}, tmp_path / "old.safetensors")
    loaded = load_int4(tmp_path / "old.safetensors")
    assert loaded["a"].packed is None and loaded["a"].vnni_packed is not None
    assert loaded["b"].packed is not None and loaded["b"].vnni_packed is None
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(13))
    assert torch.equal(loaded["a"](x), layer(x)) and torch.equal(loaded["b"](x), stock(x))
    with pytest.raises(ValueError, match="needs its weights"):
        Int4Linear(None, None, k, n)
