"""A GGUF file at its own precision: the config and tokenizer from the file, every linear layer
in the form the file stores it, on our CPU kernels, batch-invariant.

How a file becomes a model:
- **config and tokenizer**: transformers reads them from the file's metadata
  (``gguf_file=``). For a 262k-token vocabulary that parse takes the better part of a minute,
  so both are saved once per file (``metadata_folder``) and later loads read the saved folder.
- **the skeleton**: transformers' model class for the architecture, built on the meta device
  (no weights allocated), so the architecture's own forward runs: Gemma's embedding scale,
  sliding-window layers, q/k norms and GeGLU, Qwen's q/k/v biases and q/k norms.
- **the weights**: each tensor read with gguf-py (memory-mapped) and named as transformers'
  GGUF loader names it (``get_gguf_hf_weights_map``). A linear layer's quantized blocks are
  repacked without loss (``models.gguf_quants``) for the 4-bit or the 8-bit kernel
  (``models.quant_linear``); float tensors (norms, biases) are dequantized by gguf-py and
  corrected as transformers' loader corrects them (Gemma stores its norm weights plus one).
  llama.cpp stores a llama file's q/k rows in its own rotary order: the loader's permutation is
  found by running it on row numbers and applied to the quantized rows, so no weight is
  dequantized to be reordered.
- **the embedding** gathers its rows from the output projection's packed matrix where the two
  are tied (Gemma, SmolLM), so the vocabulary's matrix is held once, at the file's precision.

An architecture outside ``NATIVE_ARCHITECTURES`` loads through transformers in float32 with a
warning that names it: slower and larger, never a silently different forward.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from ..storage import cache_dir
from .shared_input import SharedInputCall

#: transformers' ``model_type`` of the architectures the native path runs.
NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
#: Version of what ``metadata_folder`` saves (a change must not read old folders).
METADATA_VERSION = 1


def is_gguf(name_or_path: str | os.PathLike[str] | None) -> bool:
    """Whether ``name_or_path`` names a GGUF file (by its suffix)."""
    return name_or_path is not None and str(name_or_path).lower().endswith(".gguf")


def _file_key(path: Path) -> str:
    """A key for this version of the file: its resolved path, size and modification time."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def metadata_location(path: Path) -> Path:
    """Where ``metadata_folder`` keeps what it saves for this version of the file (and the packed
    weights, ``native_model``)."""
    return cache_dir() / "gguf" / f"{path.stem}-{_file_key(path)}-v{METADATA_VERSION}"


def metadata_folder(path: Path) -> Path:
    """A folder with the file's ``config.json`` and tokenizer files, made on first use (see the
    module docstring). Written to a private folder and renamed into place, so a process killed
    while writing it leaves nothing that a later load reads."""
    from transformers import AutoConfig, AutoTokenizer

    folder = metadata_location(path)
    if (folder / "config.json").is_file():
        return folder
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"Could not read the GGUF file {str(path)!r}: {str(e).splitlines()[0]}") from None
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "gguf_source.json").write_text(json.dumps({"path": str(path.resolve())}))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process saved it first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def gguf_architecture(reader: Any) -> str:
    """The ``general.architecture`` of an open ``GGUFReader`` (gguf-py's name, e.g. "llama", "gemma3")."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError("The GGUF file has no general.architecture: not a model file.")
    return bytes(field.parts[field.data[0]]).decode()


class GatheredEmbedding(nn.Module):
    """An input embedding that reads its rows from a ``QuantLinear``'s packed matrix (the output
    projection's, where the two are tied), exactly as the file's blocks dequantize, times
    ``scale`` where the architecture scales its embeddings (Gemma: the square root of the width)."""

    def __init__(self, source: Any, scale: float | None = None, padding_idx: int | None = None, *,
                 tied: bool = True) -> None:
        super().__init__()
        self.source = [source]  # a list: a tied matrix is registered once, as the output layer
        if not tied:
            self.table = source  # the embedding's own matrix: registered here
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features
        self.padding_idx = padding_idx
        # transformers' scaled embedding multiplies by a float32 scalar tensor: the same here.
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype (read this, not ``weight.dtype``, which dequantizes the whole matrix)."""
        return torch.float32

    @property
    def weight(self) -> torch.Tensor:
        """The whole dequantized matrix (for code that reads an embedding's weight: slow, large)."""
        return self.source[0].gather_rows(torch.arange(self.num_embeddings))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[...]`` -> float32 ``[..., d]``."""
        rows = self.source[0].gather_rows(input_ids.reshape(-1)).reshape(*input_ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * self.scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the packed output matrix"


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None:
    """The row permutation transformers' loader applies to tensor ``name`` (None: none), found by
    running the loader's processor on a column of row numbers. A processor that does anything
    but permute rows would be applied to quantized blocks wrongly: refused."""
    probe = np.arange(rows, dtype=np.float64)[:, None]
    out = np.asarray(processor.process(weights=probe.copy(), name=name).weights)
    if out.shape != probe.shape or not np.array_equal(np.sort(out[:, 0]), probe[:, 0]):
        raise ModelLoadError(f"Native precision cannot repack {name}: transformers' loader changes its values, "
                             "not only the order of its rows.")
    order = out[:, 0].astype(np.int64)
    return None if np.array_equal(order, np.arange(rows)) else order


def _quant_linear(form: Any, bias: torch.Tensor | None, dense: bool = False) -> nn.Module:
    """The ``QuantLinear`` of an unpacked tensor (``models.gguf_quants``); ``dense``: its exact
    float32 weights instead of the packed form."""
    from .gguf_quants import EightBit, FourBit
    from .quant_linear import QuantLinear

    if dense and isinstance(form, (FourBit, EightBit)):
        form = form.dequantize()
    if isinstance(form, FourBit):
        return QuantLinear.four_bit(form.q, form.scale, form.min, bias=bias)
    if isinstance(form, EightBit):
        return QuantLinear.eight_bit(form.q, form.scale, form.min, bias=bias)
    return QuantLinear.dense(torch.from_numpy(np.ascontiguousarray(form, dtype=np.float32)), bias=bias)


def embedding_scale(module: nn.Module) -> float | None:
    """The factor an architecture's embedding multiplies its rows by (transformers' scaled embeddings)."""
    scale = getattr(module, "scalar_embed_scale", None)
    return None if scale is None or scale == 1.0 else float(scale)


def _set_tensor(model: nn.Module, hf_name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the (meta) parameter or buffer ``hf_name``, checking its shape."""
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, attr)
    if tuple(old.shape) != tuple(value.shape):
        value = value.reshape(old.shape) if value.numel() == old.numel() else value
        if tuple(old.shape) != tuple(value.shape):
            raise ModelLoadError(f"The GGUF tensor for {hf_name} is {tuple(value.shape)}, the model expects "
                                 f"{tuple(old.shape)}.")
    if isinstance(old, nn.Parameter):
        setattr(module, attr, nn.Parameter(value.to(torch.float32), requires_grad=False))
    else:
        setattr(module, attr, value)


def _rebuild_rotary(model: nn.Module) -> None:
    """Rotary embeddings' frequencies are buffers computed at construction, lost on the meta
    device: build those modules again on the CPU from their config."""
    for name, module in list(model.named_modules()):
        if "Rotary" in type(module).__name__ and any(b.is_meta for b in module.buffers()):
            with torch.device("cpu"):
                set_module(model, name, type(module)(config=module.config))


class FileWeights(NamedTuple):
    """A GGUF file's weights as ``read_weights`` sorts them for a model."""

    linears: dict[str, Any]  # linear module name -> its unpacked weight (``models.gguf_quants``)
    biases: dict[str, torch.Tensor]  # linear module name -> its float32 bias
    embedding: Any  # the token embedding, unpacked


def read_weights(reader: Any, model: nn.Module, processor: Any) -> FileWeights:
    """Every tensor of ``reader`` that ``model`` (on the meta device) has a place for: matrices
    unpacked in their stored form (q/k rows in transformers' order), float tensors (norms)
    dequantized, corrected by transformers' ``processor`` and put in place at once."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from .gguf_quants import unpack

    names = get_gguf_hf_weights_map(model, processor)
    weights = FileWeights({}, {}, None)
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue  # not a weight of this model (llama.cpp's precomputed rope_freqs, ...)
        module_name, _, attr = hf_name.rpartition(".")
        module = model.get_submodule(module_name)
        shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight" and len(shape) == 2:
            form = unpack(tensor.data, tensor.tensor_type, shape, tensor.name)
            order = _row_order(processor, tensor.name, shape[0])
            if order is not None:
                form = form.take_rows(order) if hasattr(form, "take_rows") else form[order]
            if isinstance(module, nn.Embedding):
                weights = weights._replace(embedding=form)
            else:
                weights.linears[module_name] = form
            continue
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        # A copy: the reader's arrays are read-only views of the mapped file.
        values = torch.from_numpy(np.array(processor.process(weights=values, name=tensor.name).weights,
                                           dtype=np.float32, order="C", copy=True))
        if isinstance(module, nn.Linear) and attr == "bias":
            weights.biases[module_name] = values
        else:
            _set_tensor(model, hf_name, values)
    return weights


def build_native_model(path: Path, hf_config: Any, dense: bool = False) -> nn.Module:
    """transformers' model for ``hf_config`` with every weight from the GGUF at ``path`` in its
    stored form (see the module docstring), or with ``dense`` dequantized exactly to float32 (a
    float32 model of the file's weights: the kernels' activation rounding gone, several times
    the memory); not yet batch-invariant."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(path))
    arch = gguf_architecture(reader)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    weights = read_weights(reader, model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict()))
    if weights.embedding is None:
        raise ModelLoadError(f"{str(path)!r} has no token_embd tensor.")
    output_name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    tied = output_name not in weights.linears
    linears = {**weights.linears, output_name: weights.embedding} if tied else weights.linears
    for module_name, form in linears.items():
        set_module(model, module_name, _quant_linear(form, weights.biases.get(module_name), dense))
    embedding = model.get_input_embeddings()
    source = model.get_output_embeddings() if tied else _quant_linear(weights.embedding, None, dense)
    model.set_input_embeddings(GatheredEmbedding(source, embedding_scale(embedding), embedding.padding_idx, tied=tied))
    fuse_shared_inputs(model)
    _rebuild_rotary(model)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelLoadError(f"{str(path)!r} has no tensor for {', '.join(missing[:5])}"
                             f"{' and others' if len(missing) > 5 else ''}: not a complete {arch} model.")
    return model.eval()


#: Layers of one block that read the same input: run as one kernel call where their forms agree.
SHARED_INPUTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class SharedInputPart(nn.Module):
    """One layer's share of a ``SharedInputCall``."""

    def __init__(self, call: SharedInputCall, index: int) -> None:
        super().__init__()
        self.call = call
        self.index = index
        self.in_features, self.out_features = call.layer.in_features, call.sizes[index]
        if index == 0:
            self.fused = call.layer  # registered once, so the weights show up in the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> this part's ``[..., N]``."""
        return self.call.part(x, self.index)


def fuse_shared_inputs(model: nn.Module) -> int:
    """Run each block's q/k/v and gate/up layers as one call where ``QuantLinear.fuse`` can join
    them (same form and group layout), in place; the number of groups fused."""
    from .quant_linear import QuantLinear

    fused = 0
    for block in getattr(model.base_model, "layers", []):
        for parent_name, names in SHARED_INPUTS:
            parent = getattr(block, parent_name, None)
            layers = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, QuantLinear) for m in layers):
                continue
            try:
                joined = QuantLinear.fuse(layers)
            except ValueError:  # different forms (a Q6_K v beside Q5_0 q and k): separate calls
                continue
            call = SharedInputCall(joined, [m.out_features for m in layers])
            for i, n in enumerate(names):
                setattr(parent, n, SharedInputPart(call, i))
            fused += 1
    return fused


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``name`` of ``model``, in place of what is there."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def packed_cache_name(dense: bool = False) -> str:
    """The packed weights' file name in a file's metadata folder: it names the kernels' layouts
    and whether they run (a change of either must not read an old cache), or the float32 model's."""
    from . import q4_vnni, q8_output
    from .quant_linear import _eight_bit_kernel, _four_bit_kernel

    if dense:
        return "float32.safetensors"
    kernels = "vnni" if _four_bit_kernel() and _eight_bit_kernel() else "dense"
    return f"native-{kernels}-q4v{q4_vnni.LAYOUT}-q8v{q8_output.LAYOUT}.safetensors"


def save_packed(model: nn.Module, path: Path) -> None:
    """Save a built native model's tensors and the structure they fill (which layers are which
    ``QuantLinear``, which share an input, how the embedding reads its rows), so a later load
    (``load_packed``) reads neither the GGUF's tensors nor packs them again. Written to a private
    file and renamed into place."""
    from safetensors.torch import save_file

    from .quant_linear import QuantLinear

    linears, shared, tensors = {}, [], {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            linears[name] = {"kind": module.kind, "in_features": module.in_features, "parts": module.parts,
                             "buffers": [b for b, t in module.named_buffers(recurse=False) if t is not None]}
        elif isinstance(module, SharedInputPart) and module.index == 0:
            parent, _, first = name.rpartition(".")
            names = [n for n, m in model.get_submodule(parent).named_children()
                     if isinstance(m, SharedInputPart) and m.call is module.call]
            shared.append({"parent": parent, "names": names, "fused": f"{name}.fused", "sizes": module.call.sizes})
    for name, tensor in model.state_dict().items():
        tensors[name] = tensor.contiguous()
    embedding = model.get_input_embeddings()
    source = next(n for n, m in model.named_modules() if m is embedding.source[0])
    structure = {"linears": linears, "shared": shared,
                 "embedding": {"source": source, "tied": not hasattr(embedding, "table"),
                               "scale": None if embedding.scale is None else float(embedding.scale),
                               "padding_idx": embedding.padding_idx}}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "constrained_spec.native", "structure": json.dumps(structure)})
    os.replace(tmp, path)


def load_packed(path: Path, hf_config: Any) -> nn.Module:
    """The model ``save_packed`` saved at ``path``, on transformers' skeleton for ``hf_config``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from .quant_linear import QuantLinear

    with safe_open(str(path), framework="pt") as f:
        structure = json.loads(f.metadata()["structure"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    fused_names = {s["fused"] for s in structure["shared"]}
    built: dict[str, QuantLinear] = {}
    for name, spec in structure["linears"].items():
        buffers = {b: tensors[f"{name}.{b}"] for b in spec["buffers"] if b != "bias"}
        built[name] = QuantLinear(spec["kind"], buffers, spec["in_features"], [tuple(p) for p in spec["parts"]],
                                  tensors.get(f"{name}.bias"))
        if name not in fused_names and not name.endswith(".table"):
            set_module(model, name, built[name])
    for group in structure["shared"]:
        call = SharedInputCall(built[group["fused"]], group["sizes"])
        for i, child in enumerate(group["names"]):
            set_module(model, f"{group['parent']}.{child}", SharedInputPart(call, i))
    emb = structure["embedding"]
    model.set_input_embeddings(GatheredEmbedding(built[emb["source"]], emb["scale"], emb["padding_idx"],
                                                 tied=emb["tied"]))
    taken = {f"{n}.{b}" for n, spec in structure["linears"].items() for b in spec["buffers"]}
    for name, tensor in tensors.items():
        if name not in taken:
            _set_tensor(model, name, tensor)
    _rebuild_rotary(model)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelLoadError(f"The packed weights at {path} do not fill {', '.join(missing[:5])}: delete the file.")
    return model.eval()


def native_model(path: Path, hf_config: Any, folder: Path, dense: bool = False) -> nn.Module:
    """The native model of the GGUF at ``path`` (``dense``: its float32 model): from the cache in
    ``folder`` where a load saved one, else built from the file (``build_native_model``) and
    saved there."""
    cached = folder / packed_cache_name(dense)
    if cached.is_file():
        return load_packed(cached, hf_config)
    model = build_native_model(path, hf_config, dense)
    save_packed(model, cached)
    return model
