"""Native precision: Q4_1 weights packed for the int4 kernel, exact unpacking, row invariance."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from constrained_spec import ModelLoadError, config, load_model
from constrained_spec.models.int4 import Int4Linear, dequantize_q4_1, unpack_q4_1
from constrained_spec.models.q8_output import Q8OutputProjection, unpack_q8_0


def random_q4_1(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of a random Q4_1 tensor of ``n`` rows of ``k`` weights."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) + rng.normal(0, 0.01, size=d.shape)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    return blocks.reshape(n, -1)


def random_q8_0(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of a random Q8_0 tensor of ``n`` rows of ``k`` weights."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    d = rng.uniform(0.0005, 0.02, size=(n, k // 32)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 2:] = rng.integers(-127, 128, size=(n, k // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(n, -1)


def test_q8_output_projection_holds_the_q8_0_weights_on_two_int4_calls():
    """Q8_0 as two int4 matrices (``models.q8_output``): fed the identity, the pair returns the
    stored weights up to the bfloat16 rounding of scales and outputs (a wrong nibble split or zero point
    would be off by whole scales); each row's logits are the same alone or among others; a
    float32 matrix that is not the tensor's dequantization is refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 128, 96
    raw = random_q8_0(n, k, seed=4)
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k).astype(np.float32))
    q, d = unpack_q8_0(raw, (n, k))
    assert torch.equal(exact, torch.from_numpy((q.reshape(n, k // 32, 32) * d.astype(np.float32)[..., None]).reshape(n, k)))
    layer = Q8OutputProjection.from_q8_0(raw, exact)
    got = layer(torch.eye(k)).T  # [n, k]: the effective weights
    assert got.dtype == torch.float32
    assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max()
    assert (got - exact).abs().max() > 0  # bfloat16 does round: the exact path is another path
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(layer(x), alone) and torch.equal(layer(x[None])[0, 3:7], alone[3:7])
    assert layer(x[:0]).shape == (0, n)
    with pytest.raises(ValueError, match="does not dequantize"):
        Q8OutputProjection.from_q8_0(raw, exact + 1e-3)


def test_unpacking_matches_gguf():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_q4_1(48, 96)
    ours = dequantize_q4_1(raw, (48, 96))
    theirs = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(48, 96)
    assert np.array_equal(ours, theirs)


def test_int4_linear_holds_the_weights_up_to_bfloat16_scales():
    """Fed the identity, the kernel returns its effective weights: (q - 8) s + z with s, z in
    bfloat16 (as documented), rounded to bfloat16 on output. A wrong nibble order or row order
    would be off by whole scales."""
    n, k = 64, 128
    raw = random_q4_1(n, k, seed=1)
    layer = Int4Linear.from_q4_1(raw, (n, k))
    got = layer(torch.eye(k, dtype=torch.bfloat16)).T.float()  # [n, k]
    q, d, m = unpack_q4_1(raw, (n, k))
    s = torch.from_numpy(d.astype(np.float32)).to(torch.bfloat16).float()
    z = torch.from_numpy((m.astype(np.float32) + 8 * d.astype(np.float32))).to(torch.bfloat16).float()
    expected = ((torch.from_numpy(q.astype(np.float32)).reshape(n, k // 32, 32) - 8) * s[..., None] + z[..., None])
    assert torch.equal(got, expected.reshape(n, k).to(torch.bfloat16).float())
    exact = torch.from_numpy(dequantize_q4_1(raw, (n, k)))
    assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max()


def test_rows_are_bit_identical_whatever_the_batch():
    n, k = 96, 160
    layer = Int4Linear.from_q4_1(random_q4_1(n, k, seed=2), (n, k))
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(24)])
    for m in (2, 5, 9, 17, 24):
        assert torch.equal(layer(x[:m]), alone[:m])
    assert torch.equal(layer(x.reshape(4, 6, k)).reshape(24, n), alone)


def test_fused_layers_equal_the_separate_ones_bit_for_bit():
    from constrained_spec.models.int4 import FusedInt4, Int4Part

    layers = [Int4Linear.from_q4_1(random_q4_1(n, 128, seed=s), (n, 128)) for s, n in enumerate((128, 64, 64))]
    fused = FusedInt4(layers)
    parts = [Int4Part(fused, i) for i in range(3)]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(p(x), m(x)) for p, m in zip(parts, layers))
    y = x.clone()
    assert torch.equal(parts[0](y), layers[0](y))
    y.mul_(2)  # an in-place change is a new input
    assert torch.equal(parts[1](y), layers[1](y)) and torch.equal(parts[2](y), layers[2](y))
    # Packed rows interleave in blocks of 64: 32-row layers would mix weights, so they are refused.
    with pytest.raises(ValueError, match="multiple"):
        FusedInt4([Int4Linear.from_q4_1(random_q4_1(n, 128), (n, 128)) for n in (64, 32, 32)])


@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_take_the_dense_path_and_new_rows_keep_their_bits(dense_dtype):
    """With ``prompt_weight`` and a row split, long prompt segments go through a dense matmul
    over the stored weights (bfloat16; multiplied in bfloat16 or float32, as the machine
    chooses), short ones and every new row through the kernel, so a new row has the same bits
    whatever prompt rows share its forward."""
    from constrained_spec.models.int4 import MIN_DENSE_ROWS
    from constrained_spec.models.bucketed_linear import RowSplit

    n, k = 64, 128
    raw = random_q4_1(n, k, seed=5)
    exact = torch.from_numpy(dequantize_q4_1(raw, (n, k)))
    kernel = Int4Linear.from_q4_1(raw, (n, k))
    layer = Int4Linear.from_q4_1(raw, (n, k))
    layer.prompt_weight = exact.to(torch.bfloat16)
    layer.prompt_dtype = dense_dtype
    layer.rows = split = RowSplit()
    least = MIN_DENSE_ROWS[dense_dtype]
    long, short, new = least + 3, least - 1, 5
    x = torch.randn(1, long + new + short + new, k, generator=torch.Generator().manual_seed(6))
    split.segments = [(0, long), (long + new, short)]
    y = layer(x)[0]
    w = exact.to(torch.bfloat16).to(dense_dtype)
    dense = torch.nn.functional.linear(x[0, :long].to(dense_dtype), w).float()
    assert torch.equal(y[:long], dense)
    assert not torch.equal(dense, kernel(x[0, :long]))  # the kernel's own rounding: a different path
    assert (dense - x[0, :long] @ exact.T).abs().max() <= 1e-2 * dense.abs().max()
    assert torch.equal(y[long + new : long + new + short], kernel(x[0, long + new : long + new + short]))
    for start in (long, long + new + short):  # new rows: the kernel's bits
        assert torch.equal(y[start : start + new], kernel(x[0, start : start + new]))
    split.segments = []
    assert torch.equal(layer(x), kernel(x))


def test_prompt_rows_are_multiplied_in_bfloat16_only_where_the_cpu_has_it(monkeypatch, tmp_path):
    """The dense dtype follows the CPU's flags (the same choice in every run on a machine)."""
    from constrained_spec.models import cpu_kernels, int4

    for flags, expected in (("fpu avx512f avx512_bf16 sse", True), ("fpu amx_bf16 avx512f", True), ("fpu avx512f avx2", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor : 0\nflags : {flags}\n")
        real = cpu_kernels.Path
        monkeypatch.setattr(cpu_kernels, "Path", lambda p: real(info) if p == "/proc/cpuinfo" else real(p))
        cpu_kernels.cpu_flags.cache_clear()
        int4.bfloat16_matmul_in_hardware.cache_clear()
        try:
            assert int4.bfloat16_matmul_in_hardware() is (expected and torch.ops.mkldnn._is_mkldnn_bf16_supported())
            assert int4.prompt_matmul_dtype() is (torch.bfloat16 if int4.bfloat16_matmul_in_hardware() else torch.float32)
        finally:
            monkeypatch.setattr(cpu_kernels, "Path", real)
            cpu_kernels.cpu_flags.cache_clear()
            int4.bfloat16_matmul_in_hardware.cache_clear()


def test_prompt_rows_attend_in_bfloat16_where_the_cpu_multiplies_it_fast_unless_float32_is_asked_for():
    """``prompt_attention="auto"``: the native model's prompt rows attend in bfloat16 where AMX
    multiplies it or the bfloat16 prompt kernel runs (``float32``: as before, and ``auto``
    elsewhere); decode rows are untouched. Where they do, the two settings give another prompt
    pass (the switch does something) and the same one-token step after the same keys."""
    from constrained_spec.config import RuntimeConfig
    from constrained_spec.models.growing_cache import growing_cache
    from constrained_spec.models import prompt_attention_kernel
    from constrained_spec.models.int4 import amx_bfloat16

    handles = {name: load_model(precision="native", config=RuntimeConfig(prompt_attention=name))
               for name in ("auto", "float32")}
    bf16 = amx_bfloat16() or prompt_attention_kernel.available()
    for name, handle in handles.items():
        attention = [m for m in handle.model.modules() if type(m).__name__.endswith("Attention")]
        want = torch.bfloat16 if name == "auto" and bf16 else None
        assert attention and all(getattr(m, "prompt_attention_dtype", None) == want for m in attention)
    if not bf16:
        return
    prompt = torch.randint(100, 49152, (1, 300), generator=torch.Generator().manual_seed(3))

    def prompt_pass(model):
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=cache, use_cache=True, prompt_rows=299, logits_to_keep=1).logits
        return logits, cache

    (auto, auto_cache), (exact, _) = (prompt_pass(h.model) for h in handles.values())
    assert not torch.equal(auto, exact)
    steps = []
    with torch.no_grad():
        for handle in handles.values():  # the same step on the same keys, one model after the other
            steps.append(handle.model(input_ids=torch.tensor([[42]]), cache=auto_cache, use_cache=True).logits)
            auto_cache.crop(-1)
    assert torch.equal(steps[0], steps[1])


def test_bad_precision_is_refused():
    with pytest.raises(ModelLoadError, match="Invalid precision"):
        load_model(precision="int3")
    for precision in ("native", "native-exact"):
        with pytest.raises(ModelLoadError, match="runs GGUF files"):
            load_model("some/model", precision=precision)
    with pytest.raises(ModelLoadError, match="disagree"):
        load_model(precision="bfloat16", dtype="float32")


@pytest.mark.slow
def test_native_model_runs_the_stored_weights(smol_float32):
    """Every linear layer of the embedded model is packed, in transformers' row order (a wrong q/k
    permutation would move whole rows), and the next-token choice agrees with float32 here."""
    smol = smol_float32
    native = load_model(precision="native")
    assert native is load_model(precision="native") and native is load_model()  # native is the CPU default
    layers = dict(native.model.named_modules())
    # q/k/v and gate/up run fused: 4 kernels per block, 7 layers' weights
    n = native.model.config.num_hidden_layers
    kernels = [m for m in layers.values() if isinstance(m, Int4Linear)]
    assert len(kernels) == 4 * n and sum(m.out_features for m in kernels) == n * (576 * 3 + 192 * 2 + 1536 * 2)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj", "model.layers.29.mlp.down_proj"):
        w32 = smol.model.get_submodule(name).weight.detach()
        got = layers[name](torch.eye(w32.shape[1])).T
        assert (got - w32).abs().max() <= 2 ** -6 * w32.abs().max(), name
    ids = torch.tensor([smol.tokenizer("Maria Gonzalez is a 34-year-old architect who lives in")["input_ids"]])
    exact = load_model(precision="native-exact")
    assert isinstance(native.model.get_output_embeddings(), Q8OutputProjection)
    assert not isinstance(exact.model.get_output_embeddings(), Q8OutputProjection)
    with torch.no_grad():
        logits, exact_logits = native.model(ids).logits[0], exact.model(ids).logits[0]
        assert int(logits[-1].argmax()) == int(smol.model(ids).logits[0, -1].argmax())
    # The two output projections: the same hidden states, logits within the scales' bfloat16 rounding.
    assert 0 < (logits - exact_logits).abs().max() < 0.5
    assert torch.equal(logits.argmax(-1), exact_logits.argmax(-1))


@pytest.fixture(scope="module", params=["torch", "vnni", "vnni-int8"])
def native_and_tokens(smol, request):
    """The native model on each int4 kernel (``models.q4_vnni``, either rounding: where this CPU has AVX-512 VNNI),
    the first bench prompt and a 24-token answer. The kernel's variable stays set for the tests
    that use it, so their own ``load_model`` calls take the same kernel."""
    from constrained_spec.bench.single import DEFAULT_PROMPTS, load_prompts
    from constrained_spec.models import q4_vnni

    if request.param != "torch" and not (q4_vnni.cpu_supports() and q4_vnni.load_kernel()):
        pytest.skip("no AVX-512 VNNI kernel on this machine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(config.variable("int4_kernel"), request.param)
        native = load_model(precision="native")
        shape = native.model.model.native_decode.shape
        assert shape.vnni == (request.param != "torch") and shape.vnni_split == (request.param == "vnni")
        item = load_prompts(DEFAULT_PROMPTS)[0]
        text = native.tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                    add_generation_prompt=True, tokenize=False)
        prompt = native.tokenizer(text, add_special_tokens=False)["input_ids"]
        out = native.tokenizer('{"name": "Maria Gonzalez", "age": 34, "city": "Barcelona", "occupation": "architect"}',
                               add_special_tokens=False)["input_ids"]
        yield native, prompt, out


@torch.no_grad()
def hidden(model, cache, ids, prompt_rows=0):
    return model.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True,
                       prompt_rows=prompt_rows).last_hidden_state[0]


@pytest.mark.slow
def test_native_forward_is_batch_invariant(native_and_tokens):
    """Hidden states before the output projection: a k-token pass equals k one-token passes bit for
    bit, for k in 1..24, both in the first pass (which also carries the prompt) and later ones."""
    _check_batch_invariance(native_and_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before the new rows", "among them"])
def test_native_forward_is_batch_invariant_past_long_context(native_and_tokens, monkeypatch, where):
    """The same with ``LONG_CONTEXT`` moved into this short prompt, so the new rows attend in
    float32 blocks (all of them, or those past the threshold in a pass that straddles it)."""
    from constrained_spec.models import growing_cache as growing_cache_module

    _, prompt, _ = native_and_tokens
    monkeypatch.setattr(growing_cache_module, "LONG_CONTEXT", len(prompt) - 10 if where.startswith("before") else len(prompt) + 6)
    _check_batch_invariance(native_and_tokens)


def _check_batch_invariance(native_and_tokens) -> None:
    from transformers import DynamicCache

    native, prompt, out = native_and_tokens
    model = native.model
    assert model.batch_invariant and len(out) >= 24
    n = len(prompt) - 1
    # Reference: the prompt pass with the last prompt token alone, then one token per pass.
    cache = DynamicCache(config=model.config)
    ref = [hidden(model, cache, prompt, prompt_rows=n)[-1]]
    for t in out[:24]:
        ref.append(hidden(model, cache, [t])[0])
    ref = torch.stack(ref)  # positions n .. n + 24
    for k in range(1, 25):
        cache = DynamicCache(config=model.config)  # first pass: prompt + last + k drafts
        got = hidden(model, cache, prompt + out[:k], prompt_rows=n)[n:]
        assert torch.equal(got, ref[: k + 1]), f"first pass, k={k}"
    for k in (1, 2, 5, 8, 13, 21, 24):
        cache = DynamicCache(config=model.config)  # a later pass: the prompt, then k + 1 new rows
        hidden(model, cache, prompt, prompt_rows=n)
        got = hidden(model, cache, out[:k])
        assert torch.equal(got, ref[1 : k + 1]), f"later pass, k={k}"


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("layer_ops", ["kernels", "torch"])
@pytest.mark.parametrize("long_context", [None, "inside the prompt"])
@pytest.mark.parametrize("scripted", [True, False])
@pytest.mark.parametrize("kv_cache", [None, torch.bfloat16])
def test_native_decode_path_equals_transformers_forward_bit_for_bit(native_and_tokens, long_context, scripted,
                                                                      layer_ops, kv_cache, monkeypatch):
    """The flat decode and verify forward (``models.native_decode``) gives transformers' forward's
    bits: the final hidden states, every layer's hidden states and the cache it fills, for 1 to 21
    new rows after a prompt; forwards it does not cover (prompt rows) take transformers' path.
    Also with ``LONG_CONTEXT`` moved into the prompt (float32 blocks, a float32 cache). Both ways
    the flat forward runs its layers: the TorchScript stack (before ``LONG_CONTEXT``, or at any
    length with the attention kernel; checked that it ran) and the Python loop. With the layer
    kernels (``models.layer_kernels``) and with torch's ops in their place; and on a bfloat16 cache
    (``CONSTRAINED_SPEC_KV_CACHE=bfloat16``), which the kernels read and write as it is."""
    from constrained_spec.models import attention_kernel, invariant, layer_kernels, native_decode
    from constrained_spec.models import growing_cache as growing_cache_module
    from constrained_spec.models.growing_cache import growing_cache

    if layer_ops == "torch":
        monkeypatch.setattr(layer_kernels, "usable", lambda x: False)
    elif not layer_kernels.enabled():
        pytest.skip("the layer kernels do not build here")

    if kv_cache is not None and (long_context or layer_ops == "torch" or not attention_kernel.enabled()):
        pytest.skip("the bfloat16 cache is checked with the kernels, before LONG_CONTEXT")
    if long_context:
        monkeypatch.setattr(growing_cache_module, "LONG_CONTEXT", len(native_and_tokens[1]) // 2)
    stacks = []
    compiled = native_decode.scripted_stack
    # Without the scripted stack (as where torch cannot script it), the flat path runs its Python loop.
    monkeypatch.setattr(native_decode, "scripted_stack", lambda: stacks.append(1) or (compiled() if scripted else None))

    native, prompt, out = native_and_tokens
    model, out = native.model, out * 2  # 35 tokens are fed in all
    flat = model.model.native_decode
    assert flat.enabled and len(out) >= 35
    results = {}
    for enabled in (True, False):
        flat.enabled = enabled
        calls = []
        run = flat.run
        flat.run = lambda *a, **k: calls.append(a[0].shape[1]) or run(*a, **k)
        try:
            cache = growing_cache(model.config.num_hidden_layers, kv_cache or invariant.cache_dtype(model))
            model.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, prompt_rows=len(prompt))
            got, at = [], 0
            for k in (1, 4, 1, 12, 21):
                o = model.model(input_ids=torch.tensor([out[at : at + k]]), cache=cache, use_cache=True, prompt_rows=0,
                                output_hidden_states=True)
                got.append((o.last_hidden_state, o.hidden_states))
                cache.crop(-1)  # a rejected last token
                at += k - 1
            results[enabled] = (got, [layer.keys.clone() for layer in cache.layers], calls)
        finally:
            flat.run = run
            flat.enabled = True
    (flat_out, flat_keys, flat_calls), (stock_out, stock_keys, stock_calls) = results[True], results[False]
    assert flat_calls == [1, 4, 1, 12, 21] and stock_calls == []  # the prompt pass went to transformers
    assert len(stacks) == (5 if not long_context or attention_kernel.enabled() else 0)
    for (a, ha), (b, hb) in zip(flat_out, stock_out):
        assert torch.equal(a, b) and len(ha) == len(hb) == model.config.num_hidden_layers + 1
        assert all(torch.equal(x, y) for x, y in zip(ha, hb))
    assert all(torch.equal(x, y) for x, y in zip(flat_keys, stock_keys))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["native", "native-exact"])
@torch.no_grad()
def test_native_logits_are_batch_invariant(native_and_tokens, precision):
    """The logits too (the Q8_0 pair computes each row alone; the exact float32 path computes
    fixed blocks, see ``models.invariant``): a later pass over k new tokens gives each row the
    bits of its one-token pass."""
    from transformers import DynamicCache

    native, prompt, out = native_and_tokens
    model, n = load_model(precision=precision).model, len(prompt) - 1

    def logits(cache, ids, prompt_rows=0):
        return model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, prompt_rows=prompt_rows,
                     logits_to_keep=len(ids) - prompt_rows).logits[0]

    cache = DynamicCache(config=model.config)
    logits(cache, prompt, n)
    ref = torch.stack([logits(cache, [t])[0] for t in out[:13]])
    for k in (2, 5, 8, 9, 13):
        cache = DynamicCache(config=model.config)
        logits(cache, prompt, n)
        assert torch.equal(logits(cache, out[:k]), ref[:k]), f"k={k}"


@pytest.mark.slow
def test_native_greedy_speculative_equals_target_only_on_every_bench_prompt(native_and_tokens):
    """Through the decoder at native precision: the same text and token count, prompt by prompt
    (without the invariant attention and norm, one of these six differed)."""
    from constrained_spec import generate_json
    from constrained_spec.bench.single import DEFAULT_PROMPTS, load_prompts

    native = native_and_tokens[0]

    def text(item, drafter):
        stream = generate_json(native, item["schema"], item["prompt"], drafter=drafter, max_new_tokens=256, stream=True)
        return "".join(stream), stream.stats

    for item in load_prompts(DEFAULT_PROMPTS):
        base, s0 = text(item, "none")
        spec, s1 = text(item, "auto")
        assert spec == base, item["id"]
        assert s1.output_tokens == s0.output_tokens and s1.target_forwards < s0.target_forwards


@pytest.mark.slow
def test_bench_runs_precisions_side_by_side(monkeypatch):
    """Both precisions in one run, each row compared with its own precision's target-only output
    and scored against the prompt's expected fields; a reference row (a stand-in for llama.cpp,
    which CI does not build) is timed on the same prompt, parsed and scored the same way."""
    from constrained_spec.bench import single as bench
    from constrained_spec.bench.single import BenchConfig, run_bench

    item = bench.load_prompts(bench.DEFAULT_PROMPTS)[0]
    seen = []

    def fake_rows(gguf_file, max_new_tokens):
        assert gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file the model was loaded from

        def prepare(schema, text, ids, tokens):
            seen.append((schema.schema == item["schema"], text.endswith("assistant\n"), len(ids)))
            return lambda: json.dumps(item["expected"])
        return {"llama.cpp grammar (reference)": prepare}

    monkeypatch.setattr(bench, "llama_cpp_rows", fake_rows)
    configs = [BenchConfig("target-only", "none"), BenchConfig("hybrid, fixed K=8", "hybrid", 8, adaptive=False)]
    report = run_bench(limit=1, configs=configs, precisions=("float32", "native"), outlines_reference=False,
                       max_new_tokens=64)
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["float32: target-only", "float32: hybrid, fixed K=8", "native: target-only",
                          "native: hybrid, fixed K=8", "llama.cpp grammar (reference)"]
    assert all(rows[name]["identical_outputs"] == "1/1" for name in list(rows)[:4])
    # The same values at both precisions, so the same fields right (the small model misses some).
    assert len({rows[name]["field_accuracy"] for name in list(rows)[:4]}) == 1
    assert rows["llama.cpp grammar (reference)"]["field_accuracy"] == "4/4"
    assert seen == [(True, True, seen[0][2])] and seen[0][2] > 20
    assert report["precision"] == "float32, native"
    # Every row also says whether its output equals the first precision's target-only one.
    assert all(rows[name]["same_as_first_precision"] in ("0/1", "1/1") for name in list(rows)[:4])
    assert rows["float32: target-only"]["same_as_first_precision"] == "1/1"


@pytest.mark.slow
def test_bfloat16_load_is_batch_invariant(smol):
    """A half-precision model is made invariant on load (its stock CPU kernels flipped greedy
    tokens on 2 of 6 bench prompts): every linear layer row-bucketed, the lm_head included."""
    from constrained_spec.models.bucketed_linear import BucketedLinear

    bf16 = load_model(precision="bfloat16")
    assert bf16.model.batch_invariant and bf16.precision == "bfloat16"
    bucketed = [m for m in bf16.model.modules() if isinstance(m, BucketedLinear)]
    assert len(bucketed) == 7 * bf16.model.config.num_hidden_layers + 1
    assert bf16.model.get_output_embeddings().weight.dtype == torch.bfloat16


@torch.no_grad()
def test_int8_prompt_rows_run_the_kernel_with_one_int8_part_and_keep_no_dense_copy():
    """``prompt_linears="int8"``: every layer's prompt rows are the VNNI kernel's rows with each
    activation rounded to one int8 part (exactly ``q4_1_mm(..., split=False)``), the other rows
    of the same call are the decode kernel's; no bfloat16 copy of the weights is made or packed
    after a prompt pass ("dense" keeps one); the two paths give different prompt logits (the
    switch does something) and a prompt's chunks give the same keys in one forward as one
    forward each, bit for bit."""
    from constrained_spec.config import RuntimeConfig
    from constrained_spec.models import q4_vnni
    from constrained_spec.models.growing_cache import growing_cache
    from constrained_spec.models.int4 import Int4Linear

    if q4_vnni.kernel() == "torch":
        pytest.skip("no VNNI kernel here: int8 prompt rows need it")
    handles = {name: load_model(precision="native", config=RuntimeConfig(prompt_linears=name))
               for name in ("int8", "dense")}
    model = handles["int8"].model
    prompt = torch.randint(100, 49152, (1, 300), generator=torch.Generator().manual_seed(5))

    chunks = (128, 77, 95)

    def prompt_pass(m, alone=False):
        """The prompt as three chunks (``decoding.prefix``): in one forward, or one forward each."""
        cache = growing_cache(m.config.num_hidden_layers, torch.float64)
        if not alone:
            starts = [sum(chunks[:i]) for i in range(len(chunks))]
            logits = m(input_ids=prompt, cache=cache, use_cache=True, prompt_rows=list(zip(starts, chunks))).logits
            return logits[:, -1], cache
        at = 0
        for n in chunks:
            logits = m(input_ids=prompt[:, at:at + n], cache=cache, use_cache=True, prompt_rows=n).logits
            at += n
        return logits[:, -1], cache

    whole, cache = prompt_pass(model)
    layers = {name: [m for m in h.model.modules() if isinstance(m, Int4Linear)] for name, h in handles.items()}
    assert all(m.prompt_int8 and m.prompt_weight is None and m.prompt_blocks is None for m in layers["int8"])
    prompt_pass(handles["dense"].model)
    assert all(not m.prompt_int8 and (m.prompt_weight is not None or m.prompt_blocks is not None)
               for m in layers["dense"])
    assert not torch.equal(whole, prompt_pass(handles["dense"].model)[0])
    chunked, chunked_cache = prompt_pass(model, alone=True)
    assert torch.equal(whole, chunked)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.layers[layer].keys, chunked_cache.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, chunked_cache.layers[layer].values)

    # One layer alone: 7 prompt rows then 3 decode rows in one call.
    layer = layers["int8"][0]
    x = torch.randn(1, 10, layer.in_features, generator=torch.Generator().manual_seed(6))
    layer.rows.segments = [(0, 7)]
    try:
        out = layer(x)
    finally:
        layer.rows.segments = []
    rows = x[0]
    assert torch.equal(out[0, :7], q4_vnni.q4_1_mm(rows[:7], layer.vnni_packed, layer.vnni_scales, False))
    assert torch.equal(out[0, 7:], q4_vnni.q4_1_mm(rows[7:], layer.vnni_packed, layer.vnni_scales, layer.vnni_split))
    assert not torch.equal(out[0, :7], q4_vnni.q4_1_mm(rows[:7], layer.vnni_packed, layer.vnni_scales, True))
