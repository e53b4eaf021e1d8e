"""Batch invariance in bfloat16 (row-bucketed linear layers), SmolLM2-135M's shapes: on the CPU
with 4 layers, and on a GPU with all 30 (those tests are skipped where there is none).

The weights are random (the embedded model's do not fit the device machine's transfer limit);
invariance is a property of the kernels and shapes, not of the weight values. Random weights
with a wide init make sharp distributions, and bfloat16 near-ties still occur, so a kernel that
rounds differently for another row count shows up as a changed greedy token.
"""

from __future__ import annotations

import pytest
import torch

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters import ModelDrafter
from constrained_spec.models.bucketed_linear import OUTPUT_BUCKET, ROW_BUCKET, BucketedLinear, RowSplit
from constrained_spec.models.invariant import make_batch_invariant

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]

EOS = 0
#: Byte b is token b + 1; a few multi-byte tokens so tokenizations differ.
TOKENS = {b + 1: bytes([b]) for b in range(256)} | {257: b'{"', 258: b'": ', 259: b'", "', 260: b"ab", 261: b"00"}
VOCAB = TokenVocabulary.build(TOKENS, EOS, size=264)
PATTERNS = [r'\{"name": "[a-z ]{3,24}", "age": [0-9]{1,3}, "tags": \["[a-z]{1,8}"(, "[a-z]{1,8}"){0,5}\]\}',
            r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [a-z]{2,10}){1,8}"]


def smol_shaped(vocab_size: int, seed: int, layers: int = 30, init: float = 0.02, device: str = "cuda"):
    """A random bfloat16 Llama with SmolLM2-135M's widths (576 hidden, 9 query / 3 key heads, 1536 MLP)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, rms_norm_eps=1e-5, initializer_range=init, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_bucketed_linear_rows_are_bit_identical_whatever_the_batch(device):
    linear = torch.nn.Linear(576, 1536, bias=False).to(device, torch.bfloat16)
    layer = BucketedLinear(linear, RowSplit())
    x = torch.randn(2 * ROW_BUCKET + 5, 576, device=device, dtype=torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for m in (2, 7, ROW_BUCKET, ROW_BUCKET + 1, x.shape[0]):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    assert (layer(x) - linear(x)).abs().max() <= 2 ** -6 * linear(x).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_output_projection_rows_are_bit_identical_whatever_the_batch(dtype):
    """The CPU output projection (``W @ X.T`` in blocks of ``OUTPUT_BUCKET`` rows): a row's
    logits are the same bits alone, among any number of rows, and in any slot of its block."""
    linear = torch.nn.Linear(576, 4096, bias=False).to(dtype)
    layer = BucketedLinear(linear, RowSplit(), bucket=OUTPUT_BUCKET, transposed=True)
    x = torch.randn(3 * OUTPUT_BUCKET + 3, 576, dtype=dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        for m in (2, 5, OUTPUT_BUCKET, OUTPUT_BUCKET + 1, 2 * OUTPUT_BUCKET + 3, x.shape[0]):
            assert torch.equal(layer(x[:m]), alone[:m]), m
        shifted = layer(x[3:])  # every row in another slot of its block
        assert torch.equal(shifted, alone[3:])
        assert layer(x[:0]).shape == (0, 4096)
        assert (layer(x) - linear(x)).abs().max() <= 1e-4 * linear(x).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_forward_is_batch_invariant(device):
    """Hidden states before the output projection, and the logits: a k-token pass equals k
    one-token passes bit for bit (k = 1..24), in the first pass (with the prompt) and later ones."""
    from transformers import DynamicCache

    layers = 30 if device == "cuda" else 4
    model = make_batch_invariant(smol_shaped(512, seed=0, layers=layers, device=device), bucket_linears=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 512, (60,), generator=g).tolist()
    out = torch.randint(1, 512, (24,), generator=g).tolist()
    n = len(prompt) - 1

    def run(cache, ids, prompt_rows=0):
        o = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True,
                  prompt_rows=prompt_rows, output_hidden_states=True, logits_to_keep=len(ids) - prompt_rows)
        return o.hidden_states[-1][0, prompt_rows:], o.logits[0]

    cache = DynamicCache(config=model.config)
    h, lg = run(cache, prompt, n)
    ref_h, ref_l = [h[-1]], [lg[-1]]
    for t in out:
        h, lg = run(cache, [t])
        ref_h.append(h[0])
        ref_l.append(lg[0])
    ref_h, ref_l = torch.stack(ref_h), torch.stack(ref_l)
    for k in range(1, 25):
        h, lg = run(DynamicCache(config=model.config), prompt + out[:k], n)
        assert torch.equal(h, ref_h[: k + 1]) and torch.equal(lg, ref_l[: k + 1]), f"first pass, k={k}"
    for k in (1, 2, 5, 8, 13, 21, 24):
        cache = DynamicCache(config=model.config)
        run(cache, prompt, n)
        h, lg = run(cache, out[:k])
        assert torch.equal(h, ref_h[1 : k + 1]) and torch.equal(lg, ref_l[1 : k + 1]), f"later pass, k={k}"


@GPU
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_greedy_speculative_equals_target_only(pattern):
    """Through the decoder, bfloat16 on the GPU: a random draft model's K-token proposals force
    multi-row verify passes at every step; greedy output equals target-only, token for token."""
    target = make_batch_invariant(smol_shaped(VOCAB.size, seed=2, init=0.2))
    draft = smol_shaped(VOCAB.size, seed=3, layers=2, init=0.2)
    compiled = compile_constraint(pattern, VOCAB, kind="regex")
    prompt = [t + 1 for t in b"Extract: name maria gonzalez, age 34, tags arch, bcn. Output JSON."]
    for seed_prompt in range(3):
        ids = prompt[seed_prompt:]
        base = decode(target, compiled.matcher(), ids, max_new_tokens=96)
        m = compiled.matcher()
        spec = decode(target, m, ids, drafter=ModelDrafter(draft, m), k_policy=FixedK(8), max_new_tokens=96)
        assert spec.tokens == base.tokens, seed_prompt
        assert spec.stats.target_forwards < len(spec.tokens) or spec.stats.drafted > 0
