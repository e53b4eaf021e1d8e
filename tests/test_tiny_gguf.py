"""tests/tiny_gguf.py writes GGUF files that transformers loads as the model they describe."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from constrained_spec.models.gguf_quants import UnsupportedQuantTypeError, unpack
from tests.tiny_gguf import ARCHITECTURES, llama_unpermute_order, write_tiny_gguf

transformers = pytest.importorskip("transformers")

# A mix like the presets people download (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0, F32), plus the other types.
MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q5_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q5_1", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K", "blk.1.ffn_gate": "F16"}

TEXT = "Hello world, this is a test of the tiny model: 12 + 30 = 42!"

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_name(gguf_name: str, arch: str) -> str:
    """The transformers parameter a GGUF tensor loads into."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    names = dict(_LAYER_NAMES, **(_GEMMA_NORMS if arch == "gemma3" else {"ffn_norm.weight": "post_attention_layernorm.weight"}))
    return f"model.layers.{layer}.{names[rest]}"


def load(path: Path):
    """Config, tokenizer and float32 model from a GGUF file, as a user loads one with transformers."""
    folder, name = str(path.parent), path.name
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return config, tokenizer, model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_the_model_written(tmp_path: Path, arch: str, tied: bool) -> None:
    hf_weights: dict[str, np.ndarray] = {}
    # A cut vocabulary keeps this fast; test_full_smollm2_tokenizer covers the full copy.
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, types=MIXED, tied=tied, gpt2_vocab=1024,
                           seed=ARCHITECTURES.index(arch), hf_weights=hf_weights)
    config, tokenizer, model = load(path)
    vocab = 1024 if arch != "gemma3" else len(tokenizer)
    assert config.vocab_size == vocab and len(tokenizer) == vocab
    assert config.num_hidden_layers == 2 and config.hidden_size == 256
    assert config.tie_word_embeddings == tied

    # Every parameter is the file's weight, dequantized, in HF order (llama q/k un-permuted, Gemma norms - 1).
    state = model.state_dict()
    seen = set()
    for name, expected in hf_weights.items():
        key = hf_name(name, arch)
        np.testing.assert_array_equal(state[key].numpy(), expected, err_msg=f"{name} -> {key}")
        seen.add(key)
    missing = {k for k in state if k not in seen and not (tied and k == "lm_head.weight")}
    assert not missing, f"parameters the file does not set: {sorted(missing)}"

    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= 4
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], vocab)
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == TEXT


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_unpack_reads_every_tensor(tmp_path: Path, arch: str) -> None:
    """gguf_quants.unpack on the written file agrees with gguf-py and with the HF-order weights."""
    hf_weights: dict[str, np.ndarray] = {}
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, types=MIXED, tied=False, gpt2_vocab=512, hf_weights=hf_weights)
    heads = {"llama": (4, 2)}.get(arch)
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        u = unpack(t.data, t.tensor_type, shape, t.name)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        got = u if isinstance(u, np.ndarray) else u.dequantize()
        assert np.array_equal(got, ref), t.name
        if heads and (".attn_q." in t.name or ".attn_k." in t.name):
            order = llama_unpermute_order(shape[0], heads[0] if ".attn_q." in t.name else heads[1])
            np.testing.assert_array_equal(u.take_rows(order).dequantize(), hf_weights[t.name])


# SmolLM2-135M-Instruct's own tokenizer (transformers, from the embedded GGUF) gives these ids for
# FULL_TEXT; checked against it when this test was written, kept literal so the test loads one tokenizer.
FULL_TEXT = TEXT + " {\"name\": \"\u00dcn\u00efc\u00f8d\u00e9 \u2603\"}\n\t<|im_start|>"
SMOLLM2_IDS = [19556, 905, 28, 451, 314, 253, 1028, 282, 260, 5383, 1743, 42, 216, 33, 34, 1232, 216, 35, 32, 446,
               216, 36, 34, 17, 9583, 1245, 1799, 476, 142, 246, 94, 25972, 83, 21817, 84, 2756, 4636, 242, 221,
               23597, 3354, 1]


def test_full_smollm2_tokenizer(tmp_path: Path) -> None:
    """By default the file carries all of SmolLM2's tokenizer, so it tokenizes as the embedded model does."""
    path = write_tiny_gguf(tmp_path / "full.gguf", "llama", hidden=256, layers=1, ff=256)
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="full.gguf")
    assert len(ours) == 49152
    assert ours(FULL_TEXT).input_ids == SMOLLM2_IDS
    assert ours.decode(SMOLLM2_IDS, skip_special_tokens=True) == FULL_TEXT.removesuffix("<|im_start|>")
    reader = gguf.GGUFReader(path)
    assert reader.fields["llama.vocab_size"].contents() == 49152
    assert [int(x) for x in reversed(reader.get_tensor(0).shape.tolist())] == [49152, 256]


def test_gemma3_sentencepiece_tokenizer(tmp_path: Path) -> None:
    """The small Gemma-style vocabulary: BOS added, merges rebuilt, unknown characters fall back to bytes."""
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=1, ff=256)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id == 2 and tok.eos_token_id == 1
    # Gemma adds no prefix space (tokenizer.ggml.add_space_prefix is false), as in the real files.
    assert tok.convert_ids_to_tokens(ids[1:]) == ["hello", "\u2581world"]
    text = "café ☃ and the schema"
    ids = tok(text).input_ids
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_gemma3_with_gpt2_tokenizer(tmp_path: Path) -> None:
    """transformers picks the tokenizer by tokenizer.ggml.model, so a byte-level BPE works for gemma3 too."""
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=1, ff=256, tokenizer="gpt2", gpt2_vocab=512)
    _, tok, model = load(path)
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert tok.decode(ids[0]) == TEXT


def test_gemma3_norms_stored_plus_one(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=1, ff=256)
    norms = [t for t in gguf.GGUFReader(path).tensors if t.name.endswith("norm.weight")]
    assert norms and all(0.5 < float(np.mean(t.data)) < 1.5 for t in norms)


def test_types_written_as_asked(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen3", types=dict(MIXED, ffn_down="Q3_K", attn_v="Q2_K"),
                           default="Q8_0", gpt2_vocab=512)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert kinds["blk.1.ffn_gate.weight"] == gguf.GGMLQuantizationType.F16
    assert kinds["blk.0.ffn_gate.weight"] == gguf.GGMLQuantizationType.Q4_1
    assert kinds["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q3_K
    assert kinds["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32
    # A file with a type the native path does not run is refused by name.
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    with pytest.raises(UnsupportedQuantTypeError, match="Q3_K.*blk.0.ffn_down.weight"):
        unpack(t.data, t.tensor_type, (256, 512), t.name)


def test_refuses_what_cannot_be_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        write_tiny_gguf(tmp_path / "a.gguf", "llama", hidden=128, types={"attn_q": "Q4_K"}, gpt2_vocab=512)
    with pytest.raises(ValueError, match="multiple of 256"):
        write_tiny_gguf(tmp_path / "b.gguf", "llama", ff=384, types={"ffn_down": "Q6_K"}, gpt2_vocab=512)
    with pytest.raises(ValueError, match="arch"):
        write_tiny_gguf(tmp_path / "c.gguf", "mamba")
    with pytest.raises(ValueError, match="head_dim"):
        write_tiny_gguf(tmp_path / "d.gguf", "qwen3", head_dim=64)
    with pytest.raises(ValueError, match="unknown key"):
        write_tiny_gguf(tmp_path / "e.gguf", "llama", types={"attn_qq": "Q8_0"})
    with pytest.raises(ValueError, match="unknown GGML type"):
        write_tiny_gguf(tmp_path / "f.gguf", "llama", types={"attn_q": "Q4_K_M"})
    with pytest.raises(ValueError, match="cannot"):
        write_tiny_gguf(tmp_path / "g.gguf", "llama", types={"attn_q": "IQ2_XXS"}, gpt2_vocab=512)


# llama.cpp itself, where llama-cpp-python is installed, run in a child process: a crash there (some
# builds segfault on batched quantized matmuls, hence one token per eval) fails this test, not the run.
_LLAMA_CPP_LOGITS = """
import sys, numpy as np, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False, logits_all=True)
ids = [int(x) for x in sys.argv[3].split(",")]
for t in ids:
    llm.eval([t])
np.save(sys.argv[2], np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


@pytest.mark.parametrize("default,mixed", [("F32", False), ("Q8_0", True)], ids=["f32", "mixed"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_llama_cpp_runs_the_same_model(tmp_path: Path, arch: str, default: str, mixed: bool) -> None:
    """llama.cpp reads the file as the model transformers reads: q/k order, Gemma norms, head sizes, biases."""
    import subprocess
    import sys
    from importlib.util import find_spec

    if find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, types=MIXED if mixed else {}, default=default, tied=False,
                           gpt2_vocab=1024, seed=1)
    _, tokenizer, model = load(path)
    ids = tokenizer("Hello world, this is a test", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model(ids).logits[0].numpy()
    out = tmp_path / "logits.npy"
    subprocess.run([sys.executable, "-c", _LLAMA_CPP_LOGITS, str(path), str(out), ",".join(map(str, ids[0].tolist()))],
                   check=True, capture_output=True, timeout=120)
    theirs = np.load(out)
    assert theirs.shape == ours.shape
    if mixed:
        # llama.cpp rounds activations to 8 bits for quantized matmuls: close, not equal.
        assert np.corrcoef(theirs.ravel(), ours.ravel())[0, 1] > 0.999
        assert np.abs(theirs - ours).max() < 0.1
    else:
        assert np.abs(theirs - ours).max() < 5e-3
