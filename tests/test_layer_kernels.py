"""The layer kernels (``models.layer_kernels``): the norm, residual add, rotary embedding and cache
write of a decoder layer in single calls, bit for bit the torch ops they replace, and a norm that
is exactly batch-invariant."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from constrained_spec import ModelLoadError, config, load_model
from constrained_spec.models import attention_kernel, cpu_kernels, invariant, layer_kernels

pytestmark = pytest.mark.skipif(not layer_kernels.enabled(), reason="the layer kernels do not build here")
ops = torch.ops.constrained_spec


def _rows(n: int, d: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("n,d", [(1, 576), (21, 576), (5, 100), (3, 17)])
def test_row_variance_is_the_float64_mean_of_squares(n, d):
    """Against torch's float64 sum rounded to float32: equal on these rows (another float64 sum
    order differs only within ~1e-16 of a float32 rounding boundary)."""
    x = _rows(n, d)
    want = (x.double().square().sum(-1, keepdim=True) / d).float()
    assert torch.equal(layer_kernels.row_variance(x), want)
    assert torch.equal(invariant.float64_variance(x), want)  # every CPU path takes the kernel


def test_a_rows_variance_does_not_depend_on_the_rows_beside_it():
    """A row gets the same bits alone, among 64 rows, at any offset and in a 3-d batch."""
    x = _rows(64, 576, seed=1, scale=1.0)
    alone = torch.cat([layer_kernels.row_variance(x[i : i + 1]) for i in range(64)])
    assert torch.equal(layer_kernels.row_variance(x), alone)
    assert torch.equal(layer_kernels.row_variance(x[7:28]), alone[7:28])
    assert torch.equal(layer_kernels.row_variance(x.view(4, 16, 576)), alone.view(4, 16, 1))
    assert torch.equal(layer_kernels.row_variance(x.t().contiguous().t()), alone)  # a strided input is copied


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_gives_the_bits_of_torchs_ops(with_delta):
    """The residual add and ``weight * (s * rsqrt(var + eps))`` as torch computes them, and its
    first output never the input itself (an op's outputs must not alias its inputs)."""
    x, delta, weight = _rows(21, 576), _rows(21, 576, seed=2), _rows(1, 576, seed=3)[0]
    s, h = ops.add_rms_norm(x, delta if with_delta else None, weight, 1e-5)
    want_s = x + delta if with_delta else x
    want_h = weight * (want_s * torch.rsqrt(layer_kernels.row_variance(want_s) + 1e-5))
    assert torch.equal(s, want_s) and torch.equal(h, want_h)
    assert s.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("dim", [64, 128])
def test_rope_store_rotates_like_transformers_and_writes_the_cache(dim):
    """q and k rotated as transformers' ``apply_rotary_pos_emb`` rotates them (the same bits), k and
    v written at ``past`` .. ``past + n``, every other position of the buffers untouched."""
    q_heads, kv_heads, n, past, capacity = 9, 3, 21, 300, 340
    qkv = _rows(n, (q_heads + 2 * kv_heads) * dim, seed=4)
    angles = torch.arange(past, past + n)[:, None] * (10000.0 ** (-torch.arange(0, dim, 2) / dim))[None]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    signed = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)
    keys, values = _rows(kv_heads * capacity, dim, seed=5), _rows(kv_heads * capacity, dim, seed=6)
    keys, values = keys.view(1, kv_heads, capacity, dim), values.view(1, kv_heads, capacity, dim)
    before_k, before_v = keys.clone(), values.clone()
    q = ops.rope_store(qkv, cos, signed, keys, values, past, q_heads, dim)

    heads = qkv.view(1, n, -1, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(heads[:, :q_heads], heads[:, q_heads : q_heads + kv_heads], cos[None], sin[None])
    assert torch.equal(q.transpose(1, 2), want_q)
    assert torch.equal(keys[:, :, past : past + n], want_k)
    assert torch.equal(values[:, :, past : past + n], heads[:, q_heads + kv_heads :])
    outside = torch.ones(capacity, dtype=torch.bool)
    outside[past : past + n] = False
    assert torch.equal(keys[:, :, outside], before_k[:, :, outside])
    assert torch.equal(values[:, :, outside], before_v[:, :, outside])


@pytest.mark.parametrize("dim", [64, 256])
def test_rope_store_into_a_bfloat16_cache_rounds_as_torch_does(dim):
    """A bfloat16 cache (``RuntimeConfig.kv_cache``) gets the float32 cache's keys and values
    rounded by torch's conversion, bit for bit, and the same rotated q."""
    q_heads, kv_heads, n, past, capacity = 4, 1, 13, 40, 64
    qkv = _rows(n, (q_heads + 2 * kv_heads) * dim, seed=7) * 30  # wide exponents, many rounding cases
    emb = torch.cat([torch.arange(past, past + n)[:, None] * torch.rand(1, dim // 2)] * 2, dim=-1)
    cos, signed = emb.cos(), torch.cat((-emb.sin()[:, : dim // 2], emb.sin()[:, dim // 2 :]), dim=-1)
    wide_k, wide_v = torch.zeros(1, kv_heads, capacity, dim), torch.zeros(1, kv_heads, capacity, dim)
    want_q = ops.rope_store(qkv, cos, signed, wide_k, wide_v, past, q_heads, dim)
    keys, values = (torch.zeros(1, kv_heads, capacity, dim, dtype=torch.bfloat16) for _ in range(2))
    q = ops.rope_store(qkv, cos, signed, keys, values, past, q_heads, dim)
    assert torch.equal(q, want_q)
    assert torch.equal(keys.view(torch.int16), wide_k.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(values.view(torch.int16), wide_v.to(torch.bfloat16).view(torch.int16))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.rope_store(qkv, cos, signed, keys, wide_v, past, q_heads, dim)


def test_bad_inputs_are_refused_by_name():
    x = _rows(2, 64)
    with pytest.raises(RuntimeError, match="contiguous float32 rows"):
        ops.row_variance(x.double())
    with pytest.raises(RuntimeError, match="weight of the rows' width"):
        ops.add_rms_norm(x, None, torch.ones(32), 1e-5)
    keys = torch.zeros(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match="capacity >= past"):
        ops.rope_store(_rows(2, 3 * 64), _rows(2, 64), _rows(2, 64), keys, keys.clone(), 3, 1, 64)


@pytest.mark.parametrize("env", [config.variable("layer_kernels"), config.variable("attention_kernel")])
def test_a_bad_switch_is_refused_by_name_when_the_model_loads(env, monkeypatch):
    """Not at the first forward, deep inside it: ``load_model`` names the variable and its values."""
    monkeypatch.setenv(env, "fast")
    with pytest.raises(ModelLoadError, match=f"expected one of 'on', 'off' \\(default 'on'\\), got {env}='fast'"):
        load_model(precision="float32")


def test_the_switch_takes_on_and_off_only(monkeypatch):
    variable = config.variable("layer_kernels")
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(ValueError, match="got CONSTRAINED_SPEC_LAYER_KERNELS='fast'"):
        config.read("layer_kernels")
    monkeypatch.setenv(variable, "off")
    assert not config.read("layer_kernels")
    monkeypatch.setenv(variable, "")
    assert config.read("layer_kernels")
