"""A GGUF model's decode and verify forwards as one scripted layer loop: ``models.native_decode``'s
idea for every architecture ``models.gguf_model`` runs natively (llama, mistral, qwen2, qwen3, gemma3).

Why: a one-token step of Gemma 3 270M at its own precision spent over half of its decoder
stack's time outside any kernel, in transformers' module calls (some twenty a layer, each with
its hooks and keyword handling) and the small ops between them (docs/models.md has the profile
and the figures before and after). This module runs the same ops in one TorchScript function,
by the plain interpreter, for the forwards that dominate decoding: a request's own decode and
verify passes (``native_decode.plain_forward``). Prompt passes, packed batch steps and
everything else keep transformers' forward.

Bit for bit that forward of the batch-invariant model (``models.invariant``; tested for each
architecture, sliding windows included): the same kernels on the same float32 rows. Each norm is
``layer_kernels``' ``add_rms_norm`` (which the invariant norms call or equal: llama's form with
the norm's weight, Gemma's with ``1 + weight``, per head for q/k norms), the rotary embedding and
the cache write one ``rope_store``, attention the row kernel over the keys each row may see
(causal, and the layer's sliding window), each linear layer ``QuantLinear``'s own kernel call
with its padding, row selection and bias, the MLP's activation torch's (SiLU, or Gemma's tanh
GELU). A forward this loop cannot run exactly (no AVX-512 kernels, a cache in another dtype, an
architecture feature it does not know) is not given to it.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F

from . import attention_kernel, layer_kernels
from . import cpu_kernels  # noqa: F401  (defines the ops the scripted loop names)
from . import q8_output  # noqa: F401  (defines q8_mm)
from .native_decode import _signed_sin, plain_forward, scripted
from .quant_linear import DENSE_ROWS, QuantLinear

#: ``QuantLinear.kind`` as the scripted loop's integer.
KINDS = {"four_bit": 0, "eight_bit": 1, "dense": 2}

# The scripted loop's tuples, in NamedTuple's functional form: TorchScript reads their fields'
# types, which this module's postponed annotations would leave as strings.
LinearWeights = NamedTuple("LinearWeights", [
    ("kind", int), ("packed", torch.Tensor), ("scales", torch.Tensor), ("mins", torch.Tensor),
    ("weights", List[torch.Tensor]), ("bias", Optional[torch.Tensor]), ("keep", Optional[torch.Tensor]),
    ("in_features", int), ("padded_in", int), ("dense_rows", int),
])
LinearWeights.__doc__ = """One ``QuantLinear``'s operands: its kind (``KINDS``), packed weights, scales and
mins (four- and eight-bit; empty for dense), dense weights one a fused part, bias, the output
columns kept from the padded result, its input width before and after padding, and the dense
form's rows a matmul block (``quant_linear.DENSE_ROWS``)."""

LayerWeights = NamedTuple("LayerWeights", [
    ("input_norm", torch.Tensor),
    ("qkv", List[LinearWeights]),  # one fused call or three: their outputs side by side are q, k, v
    ("q_norm", Optional[torch.Tensor]), ("k_norm", Optional[torch.Tensor]),  # per head (qwen3, gemma3)
    ("o", LinearWeights),
    ("attn_out_norm", Optional[torch.Tensor]),  # Gemma: the attention output normed before the residual add
    ("mlp_norm", torch.Tensor),
    ("gate_up", List[LinearWeights]),
    ("mlp_out_norm", Optional[torch.Tensor]),  # Gemma: the MLP output normed before the residual add
    ("down", LinearWeights),
    ("rope", int),  # which of the forward's rotary tables
    ("mask", int),  # which of the forward's masks: 0 causal, 1 the sliding window
])
LayerWeights.__doc__ = """One decoder layer as ``_gguf_stack`` reads it: each norm's weight as
``add_rms_norm`` multiplies it (Gemma's ``1 + weight``), the linear layers, and which rotary
table and mask the layer takes."""

StackShape = NamedTuple("StackShape", [
    ("q_heads", int), ("kv_heads", int), ("head_dim", int), ("intermediate", int), ("scale", float),
    ("eps", float), ("gelu", bool),
])
StackShape.__doc__ = """What every layer shares: heads, head width, the MLP's width, attention's
scale, the norms' epsilon, and the MLP's activation (tanh GELU, else SiLU)."""


def _linear(x: torch.Tensor, layer: LinearWeights) -> torch.Tensor:
    """``QuantLinear.forward`` on float32 rows ``x`` ``[n, K]``: the same calls in the same order."""
    rows = x
    if layer.padded_in != layer.in_features:
        rows = F.pad(rows, [0, layer.padded_in - layer.in_features])
    rows = rows.contiguous()
    if layer.kind == 0:
        y = torch.ops.constrained_spec.q4_1_mm(rows, layer.packed, layer.scales, True)
    elif layer.kind == 1:
        y = torch.ops.constrained_spec.q8_mm(rows, layer.packed, layer.scales, layer.mins)
    else:  # QuantLinear._dense: zero-padded blocks of DENSE_ROWS rows, W @ X.T
        out: List[torch.Tensor] = []
        for start in range(0, rows.shape[0], layer.dense_rows):
            chunk = rows[start : start + layer.dense_rows]
            block = torch.zeros(layer.dense_rows, rows.shape[1])
            block[: chunk.shape[0]] = chunk
            out.append(torch.cat([torch.mm(w, block.t()) for w in layer.weights]).t()[: chunk.shape[0]])
        y = torch.cat(out)
    keep = layer.keep
    if keep is not None:
        y = y.index_select(1, keep)
    bias = layer.bias
    if bias is not None:
        y = y + bias
    return y


def _project(x: torch.Tensor, layers: List[LinearWeights]) -> torch.Tensor:
    """Layers that read the same input, their outputs side by side (one fused call, or several)."""
    if len(layers) == 1:
        return _linear(x, layers[0])
    return torch.cat([_linear(x, layer) for layer in layers], dim=1)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """A q/k norm over each head's slice of rows ``x`` ``[n, heads * head_dim]``."""
    n = x.shape[0]
    return torch.ops.constrained_spec.add_rms_norm(x.contiguous().view(n * heads, head_dim), None, weight, eps)[1].view(n, -1)


def _gguf_stack(x: torch.Tensor, cos: List[torch.Tensor], sin: List[torch.Tensor], masks: List[Optional[torch.Tensor]],
                keys: List[torch.Tensor], values: List[torch.Tensor], past: int, hidden: bool,
                layers: List[LayerWeights], shape: StackShape) -> List[torch.Tensor]:
    """The decoder layers over new rows ``x`` ``[n, d]`` (after the embeddings). ``cos`` / ``sin``:
    each rotary table ``[n, head_dim]`` (``sin`` signed, ``native_decode._signed_sin``); ``masks``:
    the keys each row may see, causal and sliding-window, ``[1, n, past + n]`` or None for all;
    each layer's new keys and values are written into ``keys[i]`` / ``values[i]``
    ``[1, kv_heads, >= past + n, head_dim]`` at ``past``. Returns the last layer's output ``[n, d]``,
    or with ``hidden`` every layer's."""
    n = x.shape[0]
    q_heads, kv_heads, head_dim, eps = shape.q_heads, shape.kv_heads, shape.head_dim, shape.eps
    q_width, k_width = q_heads * head_dim, kv_heads * head_dim
    out: List[torch.Tensor] = []
    delta: Optional[torch.Tensor] = None  # the last layer's MLP output, added before this layer's norm
    for i, layer in enumerate(layers):
        x, h = torch.ops.constrained_spec.add_rms_norm(x, delta, layer.input_norm, eps)
        if hidden and i > 0:
            out.append(x)
        qkv = _project(h, layer.qkv)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        if q_norm is not None and k_norm is not None:
            qkv = torch.cat([_head_norm(qkv[:, :q_width], q_norm, q_heads, head_dim, eps),
                             _head_norm(qkv[:, q_width : q_width + k_width], k_norm, kv_heads, head_dim, eps),
                             qkv[:, q_width + k_width :]], dim=1)
        q = torch.ops.constrained_spec.rope_store(qkv.contiguous(), cos[layer.rope], sin[layer.rope], keys[i], values[i],
                                                  past, q_heads, head_dim).transpose(1, 2)
        a = torch.ops.constrained_spec.attend_rows(q, keys[i][:, :, : past + n], values[i][:, :, : past + n],
                                                   masks[layer.mask], shape.scale)
        attended = _linear(a.reshape(n, -1), layer.o)
        attn_out_norm = layer.attn_out_norm
        if attn_out_norm is not None:
            attended = torch.ops.constrained_spec.add_rms_norm(attended, None, attn_out_norm, eps)[1]
        x, h = torch.ops.constrained_spec.add_rms_norm(x, attended, layer.mlp_norm, eps)
        gu = _project(h, layer.gate_up)
        gate, up = gu[:, : shape.intermediate], gu[:, shape.intermediate :]
        act = F.gelu(gate, approximate="tanh") if shape.gelu else F.silu(gate)
        delta = _linear(act * up, layer.down)
        mlp_out_norm = layer.mlp_out_norm
        if mlp_out_norm is not None:
            delta = torch.ops.constrained_spec.add_rms_norm(delta, None, mlp_out_norm, eps)[1]
    if delta is not None:
        x = x + delta
    out.append(x)
    return out


def scripted_stack() -> Any:
    """``_gguf_stack`` compiled by TorchScript (``native_decode.scripted``: once per process, run
    by the plain interpreter), or None where this torch cannot script it."""
    return scripted(_gguf_stack)


class NotScriptable(Exception):
    """A model the scripted loop cannot run exactly (the message says why)."""


def _linear_weights(module: Any) -> LinearWeights:
    if not isinstance(module, QuantLinear):
        raise NotScriptable(f"a {type(module).__name__} layer")
    empty = torch.empty(0)
    dense = module.kind == "dense"
    return LinearWeights(
        kind=KINDS[module.kind], packed=empty if dense else module.packed, scales=empty if dense else module.scales,
        mins=module.mins if module.kind == "eight_bit" else empty,
        weights=[getattr(module, f"weight{i}") for i in range(len(module.parts))] if dense else [],
        bias=module.bias, keep=module._keep, in_features=module.in_features, padded_in=module.padded_in,
        dense_rows=DENSE_ROWS)


def _shared(parent: Any, names: tuple[str, ...]) -> List[LinearWeights]:
    """The layers of ``names`` in ``parent`` as calls: one where they share a fused call
    (``gguf_model.SharedInputPart``), else one each."""
    parts = [getattr(parent, n) for n in names]
    call = getattr(parts[0], "call", None)
    if call is not None and all(getattr(p, "call", None) is call for p in parts) and \
            [p.index for p in parts] == list(range(len(parts))) == list(range(len(call.sizes))):
        return [_linear_weights(call.layer)]
    if any(hasattr(p, "call") for p in parts):
        raise NotScriptable("layers fused in another grouping")
    return [_linear_weights(p) for p in parts]


def _norm_weight(norm: Any, eps: float) -> torch.Tensor:
    """The weight ``add_rms_norm`` multiplies by for an invariant norm (``make_batch_invariant``'s forms)."""
    form = getattr(norm.forward, "__func__", None)
    name = getattr(form, "__name__", "")
    if name == "fused_offset_rms_norm":  # Gemma's: (1 + weight), precomputed at install
        weight, norm_eps = norm.offset_weight, norm.eps
    elif name == "invariant_rms_norm":  # llama's: weight
        weight, norm_eps = norm.weight.detach(), norm.variance_epsilon
    else:
        raise NotScriptable(f"a {type(norm).__name__} that is not batch-invariant")
    if float(norm_eps) != eps or weight.dtype != torch.float32:
        raise NotScriptable("norms of different epsilons or dtypes")
    return weight.contiguous()


def _window(model_type: str, config: Any, attn: Any) -> int | None:
    """The layer's sliding window (keys before ``position - window`` hidden), or None."""
    if model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return getattr(attn, "sliding_window", None)


class GGUFDecode:
    """The scripted forward of a native GGUF model's decoder stack (module docstring); built by
    ``install_gguf_decode``, which raises ``NotScriptable`` where it cannot be exact."""

    def __init__(self, base: Any, model_type: str) -> None:
        config = base.config
        self.base = base
        #: Off: every forward takes transformers' path (tests compare the two; profiles hook its modules).
        self.enabled = True
        if getattr(config, "use_bidirectional_attention", False) or getattr(config, "attn_logit_softcapping", None):
            raise NotScriptable("bidirectional attention or attention softcapping")
        first = base.layers[0].self_attn
        head_dim = first.head_dim
        q_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        if head_dim % 32 or not attention_kernel.fits(q_heads, kv_heads, head_dim):
            raise NotScriptable(f"attention of {q_heads} heads over {kv_heads} of width {head_dim}")
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.rope_types = sorted(set(self.layer_types)) if model_type == "gemma3_text" else [None]
        self.windows: list[int | None] = []
        activations = set()
        self.layers: list[LayerWeights] = []
        intermediate = None
        for i, block in enumerate(base.layers):
            attn, mlp = block.self_attn, block.mlp
            if attn.head_dim != head_dim or float(attn.scaling) != float(first.scaling):
                raise NotScriptable("layers of different attention shapes")
            activations.add(type(mlp.act_fn).__name__)
            gemma = hasattr(block, "pre_feedforward_layernorm")
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if (q_norm is None) != (k_norm is None):
                raise NotScriptable("a q norm without a k norm")
            window = _window(model_type, config, attn)
            if window not in self.windows:
                self.windows.append(window)
            gate_up = _shared(mlp, ("gate_proj", "up_proj"))
            width = mlp.gate_proj.out_features
            if intermediate not in (None, width):
                raise NotScriptable("layers of different MLP widths")
            intermediate = width
            self.layers.append(LayerWeights(
                input_norm=_norm_weight(block.input_layernorm, eps),
                qkv=_shared(attn, ("q_proj", "k_proj", "v_proj")),
                q_norm=None if q_norm is None else _norm_weight(q_norm, eps),
                k_norm=None if k_norm is None else _norm_weight(k_norm, eps),
                o=_linear_weights(attn.o_proj),
                attn_out_norm=_norm_weight(block.post_attention_layernorm, eps) if gemma else None,
                mlp_norm=_norm_weight(block.pre_feedforward_layernorm if gemma else block.post_attention_layernorm, eps),
                gate_up=gate_up,
                mlp_out_norm=_norm_weight(block.post_feedforward_layernorm, eps) if gemma else None,
                down=_linear_weights(mlp.down_proj),
                rope=self.rope_types.index(self.layer_types[i]) if self.rope_types != [None] else 0,
                mask=self.windows.index(window)))
        if len(activations) != 1 or not activations <= {"SiLU", "SiLUActivation", "GELUTanh"}:
            raise NotScriptable(f"activations {sorted(activations)}")
        if "GELUTanh" in activations and base.layers[0].mlp.act_fn.act.__class__.__name__ != "partial":
            raise NotScriptable("the python form of tanh GELU")
        self.shape = StackShape(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
                                scale=float(first.scaling), eps=eps, gelu="GELUTanh" in activations)

    def can_run(self, cache: Any, device: torch.device) -> bool:
        """Whether this forward can take the scripted loop: on the CPU with the layer kernels, a
        cache whose float32 or bfloat16 layers let their buffers be written
        (``GrowingLayer.room_for``), each already holding positions of this request."""
        return (self.enabled and device.type == "cpu" and layer_kernels.enabled()
                and len(cache.layers) == len(self.layers)
                and all(hasattr(layer, "room_for") and layer.get_seq_length() > 0
                        and layer.keys.dtype in (torch.float32, torch.bfloat16) for layer in cache.layers))

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cos, sin = [], []
        for kind in self.rope_types:
            c, s = self.base.rotary_emb(x, positions) if kind is None else self.base.rotary_emb(x, positions, kind)
            cos.append(c[0].contiguous())
            sin.append(_signed_sin(s[0]).contiguous())
        return cos, sin

    def _masks(self, past: int, n: int) -> list[torch.Tensor | None]:
        """Per window (None: causal only), the keys each new row sees ``[1, n, past + n]``, or None
        where every row sees every key (one row inside its window)."""
        keys = torch.arange(past + n)[None, :]
        positions = torch.arange(past, past + n)[:, None]
        causal = keys <= positions
        out: list[torch.Tensor | None] = []
        for window in self.windows:
            allowed = causal if window is None else causal & (keys > positions - window)
            out.append(None if bool(allowed.all()) else allowed[None])
        return out

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, cache: Any, hidden: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Feed ``input_ids`` ``[1, n]`` after the ``cache``'s positions; returns the final hidden
        states ``[1, n, d]`` and, with ``hidden``, the hidden states transformers'
        ``output_hidden_states`` gives (the embeddings, each block's output, the last normed)."""
        base = self.base
        x = base.embed_tokens(input_ids)
        n = x.shape[1]
        past = cache.get_seq_length()
        positions = (torch.arange(n) + past)[None]
        cos, sin = self._rotary(x, positions)
        like = torch.empty(1, self.shape.kv_heads, n, self.shape.head_dim, dtype=torch.float32)
        rooms = [layer.room_for(like, like) for layer in cache.layers]
        with torch.jit.optimized_execution(False):
            outs = scripted_stack()(x[0], cos, sin, self._masks(past, n), [r[0] for r in rooms], [r[1] for r in rooms],
                                    past, hidden, self.layers, self.shape)
        for layer in cache.layers:
            layer.advance(n)
        out = base.norm(outs[-1])[None]
        if not hidden:
            return out, None
        return out, tuple([x] + [o[None] for o in outs[:-1]] + [out])


def install_gguf_decode(model: nn.Module) -> GGUFDecode | None:
    """Give a native GGUF model's decoder stack the scripted loop for its plain decode and verify
    forwards (in place; ``model.model.gguf_decode`` holds it). None where the loop cannot run
    this model exactly or at all (no AVX-512 kernels, no TorchScript): its forwards stay transformers'."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    base = model.model
    if not (layer_kernels.enabled() and scripted_stack() is not None):
        return None
    try:
        flat = GGUFDecode(base, model.config.model_type)
    except (NotScriptable, AttributeError):
        return None
    stock = base.forward

    def forward(input_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> Any:
        if not (plain_forward(input_ids, cache, use_cache, kwargs) and flat.can_run(cache, input_ids.device)):
            return stock(input_ids=input_ids, cache=cache, use_cache=use_cache, output_hidden_states=output_hidden_states,
                         **kwargs)
        last, states = flat.run(input_ids, cache, bool(output_hidden_states))
        return BaseModelOutputWithPast(last_hidden_state=last, cache=cache, hidden_states=states)

    base.forward = forward
    base.gguf_decode = flat
    return flat
