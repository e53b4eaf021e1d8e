"""A float checkpoint quantized at load (``models.quantize``): llama.cpp's Q8_0 and Q4_1 rounding,
on the batch-invariant CPU kernels, so speculative output stays target-only's."""

from __future__ import annotations

import pytest
import torch

from constrained_spec import generate_json, load_model
from constrained_spec.errors import ModelLoadError
from constrained_spec.models import q4_vnni
from constrained_spec.models.quantize import quantize_eight_bit, quantize_four_bit

needs_kernels = pytest.mark.skipif(not q4_vnni.cpu_supports(), reason="the CPU kernels need AVX-512 VNNI")


def test_the_roundings_are_llama_cpps_and_within_half_a_step():
    """Each weight lands within half its block's step of the float one, the codes in range, and
    a block's extreme weight exactly on a code (Q8_0: +-127 d; Q4_1: its min)."""
    torch.manual_seed(0)
    w = torch.randn(48, 100) * torch.rand(48, 1) * 3  # K not a multiple of 32: the last block padded
    e8, e4 = quantize_eight_bit(w), quantize_four_bit(w)
    padded = torch.nn.functional.pad(w, (0, 28)).reshape(48, 4, 32)
    w8 = torch.from_numpy(e8.dequantize()).reshape(48, 4, 32)
    w4 = torch.from_numpy(e4.dequantize()).reshape(48, 4, 32)
    d8, d4 = torch.from_numpy(e8.scale)[..., None], torch.from_numpy(e4.scale)[..., None]
    assert ((w8 - padded).abs() <= d8 / 2 * (1 + 1e-6)).all()
    assert ((w4 - padded).abs() <= d4 / 2 * (1 + 1e-5) + 1e-7).all()
    assert int(e8.q.min()) >= -127 and int(e8.q.max()) <= 127 and int(e4.q.max()) <= 15
    assert torch.equal(torch.from_numpy(e4.min), padded.min(-1).values)


@needs_kernels
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_quantized_checkpoint_is_smaller_and_speculation_keeps_its_output(precision, smol_float32):
    """The embedded model's float32 checkpoint at int8 / int4: its tensors take under a third
    (int8) or a quarter (int4) of the float32 bytes, and greedy speculative output equals its
    own target-only output on the bench prompts."""
    from constrained_spec.bench.single import DEFAULT_PROMPTS, load_prompts

    handle = load_model(precision=precision)
    assert handle.precision == precision

    def size(model):
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}.values())

    assert size(handle.model) < (0.33 if precision == "int8" else 0.25) * size(smol_float32.model)
    for item in load_prompts(DEFAULT_PROMPTS)[:3]:
        base = generate_json(handle, item["schema"], item["prompt"], drafter="none", max_new_tokens=128)
        assert generate_json(handle, item["schema"], item["prompt"], drafter="auto", max_new_tokens=128) == base


def test_a_gguf_file_is_not_quantized_again(tmp_path):
    with pytest.raises(ModelLoadError, match="not for a GGUF file"):
        load_model(str(tmp_path / "model.gguf"), precision="int8")
