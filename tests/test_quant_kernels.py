"""``models.quant_linear`` over the VNNI kernels' canonical forms (four-bit: scale q + min; eight-bit:
a scale per block of 32 or per half-block of 16, with or without mins) and the dense path: exact
row gathers, forwards within the split activations' derived error, rows with the same bits
whatever the batch, and fused layers bit for bit the separate ones."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from constrained_spec.models import q4_vnni, quant_linear
from constrained_spec.models.quant_linear import QuantLinear

VNNI = q4_vnni.cpu_supports()
needs_vnni = pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI on this machine")

#: (kind, weights a scale, with mins): every form the kernels run, and the dense path.
FORMS = [("four_bit", 32, True), ("eight_bit", 32, False), ("eight_bit", 32, True), ("eight_bit", 16, False),
         ("eight_bit", 16, True), ("dense", 0, False)]
FORM_IDS = ["q4", "q8", "q8-min", "q8-half", "q8-half-min", "dense"]
#: (rows, columns): odd rows (padded to a block), K a multiple of 32 and not.
SHAPES = [(37, 96), (64, 80), (16, 32)]


def form(kind: str, per: int, mins: bool, n: int, k: int, seed: int) -> dict[str, np.ndarray | None]:
    """Random weights of one form; scales and mins that float16 cannot hold (as Q4_K's d * sc)."""
    r = np.random.default_rng(seed)
    g = -(-k // 32)
    if kind == "dense":
        return {"weight": r.standard_normal((n, k)).astype(np.float32)}
    q = r.integers(0, 16, (n, k)).astype(np.uint8) if kind == "four_bit" else r.integers(-128, 128, (n, k)).astype(np.int8)
    scale = (r.uniform(0.5, 2.0, (n, -(-k // per))) * (0.1 if kind == "four_bit" else 0.01)).astype(np.float32)
    return {"q": q, "scale": scale, "min": (r.standard_normal((n, g)) * 0.1).astype(np.float32) if mins else None}


def build(kind: str, weights: dict, bias: np.ndarray | None) -> QuantLinear:
    if kind == "dense":
        return QuantLinear.dense(weights["weight"], bias)
    if kind == "four_bit":
        return QuantLinear.four_bit(weights["q"], weights["scale"], weights["min"], bias)
    return QuantLinear.eight_bit(weights["q"], weights["scale"], weights["min"], bias)


def reference(weights: dict) -> np.ndarray:
    """The weights as float32 in numpy: scale * q rounded, then + min rounded."""
    if "weight" in weights:
        return weights["weight"]
    q, scale, mins = weights["q"], weights["scale"], weights["min"]
    k = q.shape[1]
    per = 16 if scale.shape[1] == -(-k // 16) and scale.shape[1] != -(-k // 32) else 32
    w = np.repeat(scale, per, axis=1)[:, :k] * q.astype(np.float32)
    if mins is not None:
        w = w + np.repeat(mins, 32, axis=1)[:, :k]
    assert w.dtype == np.float32
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def layer_for(kind: str, per: int, mins: bool, shape: tuple[int, int], with_bias: bool, seed: int = 0):
    if kind != "dense" and not VNNI:
        pytest.skip("no AVX-512 VNNI on this machine")
    n, k = shape
    weights = form(kind, per, mins, n, k, seed)
    bias = np.random.default_rng(seed + 100).standard_normal(n).astype(np.float32) if with_bias else None
    layer = build(kind, weights, bias)
    assert layer.kind == kind
    return layer, weights, bias


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,per,mins", FORMS, ids=FORM_IDS)
def test_gather_rows_are_the_float32_weights_bit_for_bit(kind, per, mins, shape):
    layer, weights, _ = layer_for(kind, per, mins, shape, with_bias=True)
    want = torch.from_numpy(reference(weights))
    ids = torch.tensor([0, shape[0] - 1, 5 % shape[0], 3, 3, shape[0] // 2])
    got = layer.gather_rows(ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), shape[1])
    assert torch.equal(bits(got), bits(want[ids]))
    assert torch.equal(bits(layer.gather_rows(torch.arange(shape[0]))), bits(want))
    assert layer.gather_rows(torch.tensor([], dtype=torch.int64)).shape == (0, shape[1])
    with pytest.raises(IndexError):
        layer.gather_rows(torch.tensor([shape[0]]))


def error_bound(kind: str, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, scaled: np.ndarray) -> np.ndarray:
    """Per output, the derived bound on |forward - x @ w.T| (float64).

    Split activations (the VNNI kernels): each block of 32 is rebuilt as dx (a + b / 254) with
    dx = max|x_b| / 127, |t - a - b / 254| <= 1 / 508, so each x is off by at most
    max|x_b| / (127 * 508) = max|x_b| / 64516, times sum_b |scale q| (``scaled``: the mins multiply
    the float sum of x, not the split parts); float32's rounding of t, of the
    integer total and of the block's fmas adds a few 2^-24 of sum |w x| (2^-20 covers them). Dense:
    K float32 roundings of sum |w x|."""
    m, k = x.shape
    absw = np.abs(w.astype(np.float64))
    magnitude = np.abs(x.astype(np.float64)) @ absw.T
    if bias is not None:
        magnitude += np.abs(bias.astype(np.float64))
    if kind == "dense":
        return (k + 2) * 2.0**-24 * magnitude
    g = -(-k // 32)
    xp = np.pad(np.abs(x.astype(np.float64)), ((0, 0), (0, 32 * g - k))).reshape(m, g, 32).max(-1)  # [m, g]
    wp = np.pad(np.abs(scaled.astype(np.float64)), ((0, 0), (0, 32 * g - k))).reshape(len(w), g, 32).sum(-1)  # [n, g]
    return (xp / 64516.0) @ wp.T + 2.0**-20 * magnitude


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,per,mins", FORMS, ids=FORM_IDS)
def test_forward_is_the_product_within_the_derived_bound(kind, per, mins, shape):
    """Against float64 x @ W.T (+ bias) with W the exact weights: within ``error_bound``, which for
    these rows is about 1e-4 of sum |w x| or less; and the kernels do round (nonzero error)."""
    layer, weights, bias = layer_for(kind, per, mins, shape, with_bias=True)
    x = torch.randn(9, shape[1], generator=torch.Generator().manual_seed(1)) * 2
    w = reference(weights)
    want = x.double().numpy() @ w.astype(np.float64).T + bias.astype(np.float64)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (9, shape[0])
    error = np.abs(got.double().numpy() - want)
    scaled = reference({**weights, "min": None}) if kind != "dense" else w
    bound = error_bound(kind, x.numpy(), w, bias, scaled)
    assert (error <= bound).all(), float((error / bound).max())
    magnitude = np.abs(x.double().numpy()) @ np.abs(scaled.astype(np.float64)).T
    assert (bound <= 2e-4 * magnitude).all()  # what the bound amounts to: ~1e-4 of sum |scale q x|
    if kind != "dense":
        assert error.max() > 0
    # [..., K] in, [..., N] out, in x's dtype.
    assert torch.equal(layer(x[None, 2:5])[0], got[2:5])
    assert layer(x.double()).dtype == torch.float64 and layer(x[:0]).shape == (0, shape[0])


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("kind,per,mins", FORMS, ids=FORM_IDS)
def test_a_row_has_the_same_bits_alone_or_anywhere_in_any_batch(kind, per, mins, nthreads, threads):
    """Every row of 1..13-row calls, at several positions, equals its one-row result bit for bit."""
    torch.set_num_threads(nthreads)
    layer, _, _ = layer_for(kind, per, mins, (37, 96), with_bias=True, seed=3)
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(13)])
    for m in range(1, 14):
        for start in (0, m % 13, 7):
            order = [(start + j) % 13 for j in range(m)]
            assert torch.equal(bits(layer(x[order])), bits(alone[order])), (m, start)
    if kind != "dense":  # the kernels' threads split columns only: the same bits at any thread count
        torch.set_num_threads(3 - nthreads)
        assert torch.equal(bits(layer(x)), bits(alone))


@pytest.mark.parametrize("kind,per,mins", FORMS, ids=FORM_IDS)
def test_fused_layers_are_the_separate_ones_bit_for_bit(kind, per, mins):
    parts = [layer_for(kind, per, mins, (n, 80), with_bias=b, seed=n)[0] for n, b in ((37, True), (16, False), (50, True))]
    fused = QuantLinear.fuse(parts)
    assert fused.out_features == 37 + 16 + 50
    x = torch.randn(11, 80, generator=torch.Generator().manual_seed(5))
    assert torch.equal(bits(fused(x)), bits(torch.cat([p(x) for p in parts], -1)))
    ids = torch.tensor([0, 36, 37, 52, 53, 102])
    separate = torch.cat([p.gather_rows(torch.arange(p.out_features)) for p in parts])
    assert torch.equal(bits(fused.gather_rows(ids)), bits(separate[ids]))
    assert fused.nbytes <= sum(p.nbytes for p in parts) + 4 * fused.out_features  # a zero bias at most


@needs_vnni
def test_layers_of_different_layouts_do_not_fuse():
    q4 = layer_for("four_bit", 32, True, (32, 64), False)[0]
    q8 = layer_for("eight_bit", 32, False, (32, 64), False)[0]
    with pytest.raises(ValueError, match="Cannot fuse"):
        QuantLinear.fuse([q4, q8])
    with pytest.raises(ValueError, match="group layouts"):
        QuantLinear.fuse([q8, layer_for("eight_bit", 16, False, (32, 64), False)[0]])
    with pytest.raises(ValueError, match="group layouts"):
        QuantLinear.fuse([q8, layer_for("eight_bit", 32, True, (32, 64), False)[0]])
    with pytest.raises(ValueError, match="Cannot fuse"):
        QuantLinear.fuse([q8, layer_for("eight_bit", 32, False, (32, 96), False)[0]])


@needs_vnni
def test_float16_scales_widen_exactly_and_bad_forms_are_refused():
    w = form("eight_bit", 32, True, 16, 64, seed=6)
    half = {k: v.astype(np.float16) if v is not None and v.dtype == np.float32 else v for k, v in w.items()}
    layer = build("eight_bit", half, None)
    widened = {k: v.astype(np.float32) if v is not None and v.dtype == np.float16 else v for k, v in half.items()}
    assert torch.equal(layer.gather_rows(torch.arange(16)), torch.from_numpy(reference(widened)))
    assert layer.scales.dtype == torch.float32 and layer.mins.dtype == torch.float32
    with pytest.raises(ValueError, match="do not fit"):
        QuantLinear.eight_bit(w["q"], w["scale"][:, :1])
    with pytest.raises(ValueError, match="0..15"):
        QuantLinear.four_bit(np.full((32, 32), 16), np.ones((32, 1), np.float32), np.zeros((32, 1), np.float32))
    with pytest.raises(ValueError, match="not float32 values"):
        QuantLinear.eight_bit(w["q"], w["scale"].astype(np.float64) + 1e-12)


def test_without_the_kernels_quantized_layers_run_dense_with_one_warning(monkeypatch):
    """The fallback: exact float32 weights on the dense path, with a warning that names the form."""
    monkeypatch.setattr(quant_linear, "_four_bit_kernel", lambda: False)
    monkeypatch.setattr(quant_linear, "_eight_bit_kernel", lambda: False)
    w4, w8 = form("four_bit", 32, True, 37, 80, seed=7), form("eight_bit", 16, True, 37, 80, seed=8)
    with pytest.warns(UserWarning, match="do not run on this machine: four-bit"):
        q4 = build("four_bit", w4, None)
    with pytest.warns(UserWarning, match="do not run on this machine: eight-bit"):
        q8 = build("eight_bit", w8, None)
    for layer, w in ((q4, w4), (q8, w8)):
        assert layer.kind == "dense"
        assert torch.equal(bits(layer.gather_rows(torch.arange(37))), bits(torch.from_numpy(reference(w))))
        x = torch.randn(3, 80, generator=torch.Generator().manual_seed(9))
        assert torch.equal(bits(layer(x)), bits(QuantLinear.dense(reference(w))(x)))


@needs_vnni
def test_nbytes_counts_the_packed_buffers():
    layer = layer_for("eight_bit", 16, True, (37, 96), True)[0]
    # 48 padded rows: 96 bytes a row, 6 half-scales and 3 mins of 4 bytes; 37 biases.
    assert layer.nbytes == 48 * 96 + 48 * 6 * 4 + 48 * 3 * 4 + 37 * 4
    assert QuantLinear.dense(np.zeros((5, 7), np.float32)).nbytes == 5 * 7 * 4
