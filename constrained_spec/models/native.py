"""The embedded GGUF model at its native precision: its Q4_1 linear layers run as stored.

Every linear layer of SmolLM2's GGUF is Q4_1; they become ``Int4Linear`` modules (a fifth of
the float32 bytes). The tied embedding / output matrix is Q8_0, which torch's int8 kernel cannot
hold (one scale per row, Q8_0 has one per 32 weights), so the output projection runs on
``models.q8_output``'s kernels and the embedding reads the exact dequantized float32 matrix; the
norms are float32 in the file. The packed weights are cached beside the dequantized ones, so
later loads skip the packing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError
from .int4 import FusedInt4, Int4Linear, Int4Part

#: GGUF tensor name (within ``blk.N.``) -> the transformers module (within ``model.layers.N.``).
GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_row_order(rows: int, heads: int) -> np.ndarray:
    """GGUF stores q/k rows interleaved for llama.cpp's rotary layout; transformers un-permutes
    them on load (``reshape(heads, rows/heads/2, 2).swapaxes``). The same order here."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def q4_1_linears(gguf_path: Path | str, config: Any, vnni: bool = False, vnni_split: bool = True) -> dict[str, Int4Linear]:
    """``Int4Linear`` modules for every Q4_1 linear layer of a llama-family GGUF, by module name
    (``vnni``: in ``models.q4_vnni``'s layout instead of torch's, ``vnni_split`` its activations' two parts)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    out: dict[str, Int4Linear] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LINEARS:
            continue
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            raise ModelLoadError(f"Native precision needs Q4_1 linear layers; {tensor.name} is {tensor.tensor_type.name}.")
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists [in, out]
        order = None
        if parts[2] == "attn_q":
            order = _hf_row_order(shape[0], config.num_attention_heads)
        elif parts[2] == "attn_k":
            order = _hf_row_order(shape[0], config.num_key_value_heads)
        out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = Int4Linear.from_q4_1(tensor.data, shape, order, vnni=vnni,
                                                                                  vnni_split=vnni_split)
    if not out:
        raise ModelLoadError(f"No Q4_1 linear layers in {gguf_path}: native precision needs a Q4_1 GGUF.")
    return out


def install_int4(model: Any, linears: dict[str, Int4Linear], prompt_weights: bool = True) -> Any:
    """Replace ``model``'s linear layers by the given ``Int4Linear`` modules (in place), checking
    shapes. With ``prompt_weights``, each keeps the replaced layer's weights (the stored ones,
    dequantized) in bfloat16 as its ``prompt_weight`` (``models.int4``: prompt rows on a dense
    matmul); without, prompt rows take the kernel and no such copy is made."""
    for name, module in linears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if (old.out_features, old.in_features) != (module.out_features, module.in_features):
            raise ModelLoadError(f"Native precision: {name} is {tuple(old.weight.shape)} in the model, "
                                 f"({module.out_features}, {module.in_features}) in the GGUF.")
        if prompt_weights:
            module.prompt_weight = old.weight.detach().to(torch.bfloat16)
        setattr(parent, child, module)
    return model


#: Layers of one llama block that read the same input, run as one kernel call each group.
FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def fuse_projections(model: Any) -> Any:
    """Run each block's q/k/v and gate/up ``Int4Linear`` layers as one call (``FusedInt4``), in place."""
    for block in model.model.layers:
        for parent_name, names in FUSED_GROUPS:
            parent = getattr(block, parent_name)
            layers = [getattr(parent, n) for n in names]
            if not all(isinstance(m, Int4Linear) for m in layers) or not FusedInt4.can_fuse(layers):
                continue
            fused = FusedInt4(layers)
            for i, n in enumerate(names):
                setattr(parent, n, Int4Part(fused, i))
    return model


def save_int4(linears: dict[str, Int4Linear], path: Path) -> None:
    """Cache packed weights as safetensors (each layer's shape and its layouts: torch's, VNNI's)."""
    from safetensors.torch import save_file

    state = {}
    for name, m in linears.items():
        if m.packed is not None:
            state[f"{name}.packed"] = m.packed.contiguous()
            state[f"{name}.scales_and_zeros"] = m.scales_and_zeros.contiguous()
        state[f"{name}.shape"] = torch.tensor([m.out_features, m.in_features])
        if m.vnni_packed is not None:
            state[f"{name}.vnni_packed"] = m.vnni_packed.contiguous()
            state[f"{name}.vnni_scales"] = m.vnni_scales.contiguous()
    save_file(state, str(path), metadata={"format": "constrained_spec.int4"})


def load_int4(path: Path, vnni_split: bool = True) -> dict[str, Int4Linear]:
    """The modules cached by ``save_int4`` (``vnni_split``: how layers with the VNNI layout round
    their activations, ``models.q4_vnni``)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        # A layer with the VNNI layout never reads torch's (an older cache file holds both).
        state = {k: f.get_tensor(k) for k in keys
                 if not (k.endswith((".packed", ".scales_and_zeros")) and f"{k.rsplit('.', 1)[0]}.vnni_packed" in keys)}
    names = {k.rsplit(".", 1)[0] for k in state}
    return {name: Int4Linear(state.get(f"{name}.packed"), state.get(f"{name}.scales_and_zeros"),
                             in_features=int(state[f"{name}.shape"][1]), out_features=int(state[f"{name}.shape"][0]),
                             vnni=(state[f"{name}.vnni_packed"], state[f"{name}.vnni_scales"])
                             if f"{name}.vnni_packed" in state else None, vnni_split=vnni_split)
            for name in names}


def install_q8_output(model: Any, gguf_path: Path | str, cache: Path | None = None, kernel: str = "torch") -> Any:
    """Run ``model``'s output projection (the GGUF's Q8_0 ``token_embd``, tied) on ``kernel``
    (``models.q8_output``: ``vnni`` or ``torch``'s two int4 calls), in place; the packed matrices
    are cached at ``cache`` when given."""
    from .q8_output import Q8OutputProjection

    weight = model.get_output_embeddings().weight.detach()
    if cache is not None and cache.is_file():
        from safetensors.torch import load_file

        module = Q8OutputProjection(load_file(str(cache)), weight, kernel)
    else:
        from gguf import GGMLQuantizationType, GGUFReader

        tensor = next((t for t in GGUFReader(str(gguf_path)).tensors if t.name == "token_embd.weight"), None)
        if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
            raise ModelLoadError(f"Native precision needs a Q8_0 token_embd in {gguf_path}; use precision='native-exact'.")
        module = Q8OutputProjection.from_q8_0(tensor.data, weight, kernel)
        if cache is not None:
            from safetensors.torch import save_file

            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            save_file({n: getattr(module, n).contiguous() for n in module.BUFFERS[kernel]}, str(tmp),
                      metadata={"format": "constrained_spec.q8_output"})
            os.replace(tmp, cache)
    model.set_output_embeddings(module)
    return model
