"""Shared fixtures: tiny random models (no downloads), a hand-built vocabulary, the real tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int, seed: int, *, dtype: torch.dtype = torch.float64, context: int = 256,
               init: float = 0.5) -> LlamaForCausalLM:
    """A 2-layer random Llama. A large init spread makes its distributions far from uniform,
    so draft and target differ and wrong verifiers are visible."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        initializer_range=init, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct at its default precision (native on the CPU; weights
    cached after the first load)."""
    from constrained_spec import load_model

    return load_model()


@pytest.fixture(scope="session")
def smol_float32():
    """The embedded model with float32 weights (the dequantized GGUF)."""
    from constrained_spec import load_model

    return load_model(precision="float32")


@pytest.fixture(scope="session")
def smol_tokenizer(smol):
    return smol.tokenizer


@pytest.fixture(params=["kernel", "float64"])
def attention_path(request, monkeypatch):
    """Each batch-invariant attention path for new rows (``models.invariant.attend_new_rows``):
    the row kernel (``models.attention_kernel``; skipped where it does not build) and the float64
    / float32-blocks path a machine without it takes."""
    from constrained_spec.models import attention_kernel

    if request.param == "kernel" and not attention_kernel.enabled():
        pytest.skip("the attention kernel does not build on this machine")
    if request.param == "float64":
        monkeypatch.setattr(attention_kernel, "enabled", lambda: False)
    return request.param


@pytest.fixture
def float64_attention(monkeypatch):
    """The attention path of a machine without the row kernel (the float64 and float32-blocks
    path of ``models.invariant``), for tests of that path's own arithmetic."""
    from constrained_spec.models import attention_kernel

    monkeypatch.setattr(attention_kernel, "enabled", lambda: False)
