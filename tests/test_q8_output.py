"""The Q8_0 output projection's VNNI kernel (``models.q8_output``): the stored weights times
activations kept to about 15 bits, exactly row-invariant, far closer to the exact logits than the
int4 pair it replaces, and chosen (or refused) at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from constrained_spec import ModelLoadError, config, load_model
from constrained_spec.models import cpu_kernels, q8_output
from constrained_spec.models.q8_output import Q8OutputProjection

from .test_native import random_q8_0

pytestmark = pytest.mark.skipif(not cpu_kernels.build("q8_0_vnni.cpp", q8_output._CPU_FLAGS, ("-mavx512vnni",), False),
                                reason="no AVX-512 VNNI output kernel on this machine")


def _layers(n: int, k: int, seed: int) -> tuple[torch.Tensor, Q8OutputProjection, Q8OutputProjection]:
    raw = random_q8_0(n, k, seed=seed)
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k).astype(np.float32))
    return exact, Q8OutputProjection.from_q8_0(raw, exact, "vnni"), Q8OutputProjection.from_q8_0(raw, exact, "torch")


@pytest.mark.parametrize("shape", [(64, 96), (512, 576)])
def test_kernel_gives_the_stored_weights_times_the_activations(shape):
    """Fed the identity, the stored weights to float32 rounding (a wrong byte, column or scale
    would be off by whole weights); fed real-looking rows, logits within the 15-bit split's error
    of float64, and 100x closer than the int4 pair's bfloat16."""
    n, k = shape
    exact, vnni, pair = _layers(n, k, seed=1)
    got = vnni(torch.eye(k)).T
    assert got.dtype == torch.float32
    assert (got - exact).abs().max() <= 1e-6 * exact.abs().max()
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(2)) * 3
    want = x.double() @ exact.double().T
    error = (vnni(x).double() - want).abs().max()
    assert error <= 1e-4 * want.abs().max()
    assert error * 30 < (pair(x).double() - want).abs().max()


def test_each_row_has_its_one_row_bits():
    """37 rows (9 blocks of 4 and 1 over) and slices across the blocks against each row alone;
    the output is float32 of every shape a forward hands it ([..., K] -> [..., N])."""
    _, vnni, _ = _layers(96, 64, seed=3)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([vnni(x[i : i + 1]) for i in range(37)])
    assert torch.equal(vnni(x), alone)
    for start, stop in ((1, 4), (3, 10), (30, 37)):
        assert torch.equal(vnni(x[start:stop]), alone[start:stop])
    assert torch.equal(vnni(x[None, 5:9])[0], alone[5:9]) and vnni(x[:0]).shape == (0, 96)


def test_bad_shapes_and_a_bad_variable_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="multiple of 16"):
        q8_output.pack_vnni(np.zeros((40, 64), np.int8), np.zeros((40, 2), np.float16))
    _, vnni, _ = _layers(32, 64, seed=5)
    with pytest.raises(RuntimeError, match="does not fit x's 96 columns"):
        torch.ops.constrained_spec.q8_0_mm(torch.randn(2, 96), vnni.vnni_packed, vnni.vnni_scales)
    with pytest.raises(ValueError, match="Unknown output kernel"):
        Q8OutputProjection({}, torch.zeros(32, 64), "fast")
    with pytest.raises(ValueError, match="Unknown output kernel 'fast'"):
        q8_output.kernel("fast")
    monkeypatch.setenv(config.variable("output_kernel"), "fast")
    with pytest.raises(ModelLoadError, match="got CONSTRAINED_SPEC_OUTPUT_KERNEL='fast'"):
        load_model(precision="native")
    assert q8_output.kernel("torch") == "torch"


def test_native_model_takes_the_kernel_by_default(smol):
    """The default native model's output projection is the VNNI kernel, named in the model's name."""
    out = smol.model.get_output_embeddings()
    assert isinstance(out, Q8OutputProjection) and out.kernel == "vnni"
    assert "VNNI output" in smol.name


def test_gather_rows_give_the_exact_embedding_rows():
    """A tied embedding read from the packed VNNI matrix: the dequantized float32 rows bit for bit."""
    exact, vnni, _ = _layers(64, 96, seed=6)
    assert vnni.vnni_scales.dtype == torch.float32
    ids = torch.tensor([0, 63, 17, 17, 40])
    got = q8_output.gather_rows(vnni.vnni_packed, vnni.vnni_scales, torch.empty(0), ids)
    assert torch.equal(got.view(torch.int32), exact[ids].view(torch.int32))
