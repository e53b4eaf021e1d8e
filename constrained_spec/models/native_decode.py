"""The native model's decode and verify forwards as one flat loop of tensor ops.

Why: a one-token forward of the embedded model at native precision spent about a third of its
time outside any kernel, in transformers' decorated forwards, thirteen module calls a layer with
their hooks and keyword handling, the row split that routes prompt rows, and dtype conversions
that the next op could do for free (docs/performance.md has the profile). torch.compile, which
would remove that, was slower than eager on this CPU and may fuse float ops; no library runs a
transformers model without it, so this module hand-writes the llama decoder stack for the
forwards that dominate decoding: the request's own decode and verify passes (one row of the
batch, no prompt rows, no padding). Everything else (prompt passes, packed batch steps,
training, hooks, other caches' kwargs) goes through transformers' forward.

Bit for bit the same as that forward (tested): the same ops in the same order on the same
dtypes, with two kinds of op left out because they change no bit: a bfloat16 kernel output
converted to float32 before an op that promotes it to float32 anyway (a residual add, the
rotary products: bfloat16 -> float32 is exact, and the promoted op computes in float32), and
the row split's bookkeeping for forwards that have no prompt rows. The norms, the attention and
the int4 kernels are the batch-invariant ones of ``models.invariant`` and ``models.int4``, so
invariance holds as before.

The layer loop itself runs as one TorchScript function (``scripted_stack``) wherever every
attention row lies before ``LONG_CONTEXT`` (or the attention kernel is on) and the cache lets
its buffers be written (``GrowingLayer.room_for``): the same ops in the same order, run by
TorchScript's plain interpreter instead of Python, so the same bits (tested against
transformers' forward with the Python loop as a control), without Python's dispatch of each
small op.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, List, NamedTuple, Optional

import torch
from torch.nn import functional as F

from .int4 import GROUP, Int4Linear, Int4Part
from . import attention_kernel, invariant, layer_kernels
from . import growing_cache as kv_cache
from . import cpu_kernels  # noqa: F401  (defines the ops the scripted stack names)
from .invariant import _allowed, attend_new_rows, float64_variance


class NativeLayer(NamedTuple):
    """One decoder layer's modules and sizes, as ``NativeDecode.run``'s Python loop reads them."""

    input_norm: Any  # the RMSNorm before attention
    qkv: Int4Linear  # q, k and v fused: q's rows, then k's, then v's
    q_heads: int
    qk_width: int  # q's and k's rows of the fused output (rotated together)
    o_proj: Int4Linear
    head_dim: int
    scale: float  # attention's
    post_norm: Any  # the RMSNorm before the MLP
    gate_up: Int4Linear  # gate and up fused
    gate_up_sizes: List[int]
    down: Int4Linear


# The two tuples the scripted stack takes, in NamedTuple's functional form: TorchScript reads
# their fields' types, which this module's postponed annotations would leave as strings.
LayerWeights = NamedTuple("LayerWeights", [
    ("input_norm", torch.Tensor), ("input_norm_eps", float),
    ("qkv", torch.Tensor), ("qkv_scales", torch.Tensor),  # q, k and v fused
    ("o", torch.Tensor), ("o_scales", torch.Tensor),
    ("post_norm", torch.Tensor), ("post_norm_eps", float),
    ("gate_up", torch.Tensor), ("gate_up_scales", torch.Tensor),  # gate and up fused
    ("down", torch.Tensor), ("down_scales", torch.Tensor),
])
LayerWeights.__doc__ = """One decoder layer's weights as ``_scripted_stack`` reads them: its two norms'
weights and epsilons, and each int4 layer's packed weights and scales in the layout of the kernel
the model runs (``StackShape.vnni``)."""

StackShape = NamedTuple("StackShape", [
    ("q_heads", int), ("qk_width", int), ("head_dim", int), ("intermediate", int), ("scale", float),
    ("gqa", bool), ("group", int), ("vnni", bool), ("vnni_split", bool), ("row_kernel", bool),
])
StackShape.__doc__ = """What every layer of ``_scripted_stack`` shares: query heads, q's and k's rows of
the fused q/k/v output (``qk_width``), the head and MLP widths, attention's scale, whether there are
fewer key heads than query heads (``gqa``), weights per int4 group (torch's kernel), and which
kernels run: ``models.q4_vnni``'s (``vnni``, with activations in two int8 parts: ``vnni_split``) or
torch's, ``models.attention_kernel`` (``row_kernel``) or float64 attention."""


def _norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``models.invariant.invariant_rms_norm`` on float32 rows with no prompt rows among them."""
    return norm.weight * (x * torch.rsqrt(float64_variance(x) + norm.variance_epsilon))


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, so that ``_rotate`` needs no negation of ``x``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor, ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x2, x1)``: here ``cat(x2, x1) * cat(-sin1, sin2)``, the same
    products to the bit (a sign moves exactly), one op fewer. ``x`` may be bfloat16: the
    products promote it to float32 exactly."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, shape: StackShape) -> torch.Tensor:
    """``Int4Linear.kernel_bfloat16`` for the scripted stack: ``x`` ``[n, K]`` times one layer's
    packed weights, ``[n, N]``: torch's int4 kernel (bfloat16 out) or, with ``shape.vnni``,
    ``models.q4_vnni``'s (float32 out; the next ops promote either exactly)."""
    if shape.vnni:
        return torch.ops.constrained_spec.q4_1_mm(x.contiguous(), packed, scales, shape.vnni_split)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, shape.group, scales)


def _scripted_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                    keys: List[torch.Tensor], values: List[torch.Tensor], past: int, hidden: bool,
                    layers: List[LayerWeights], shape: StackShape, layer_ops: bool) -> List[torch.Tensor]:
    """``NativeDecode.run``'s layer loop, op for op (the same ops on the same dtypes in the same
    order: ``_norm``, ``_rotate``, the cache write of ``GrowingLayer.update``, the float64
    attention of ``attend_new_rows`` below ``LONG_CONTEXT``, or with ``shape.row_kernel`` the
    ``models.attention_kernel`` it takes at any length, ``mask`` then ``[1, n, kv]``), for
    TorchScript. ``x`` ``[n, d]``: the new rows after the embeddings; ``cos`` / ``sin``
    ``[1, 1, n, head_dim]`` (``sin`` signed, ``_signed_sin``); each layer's new keys and values
    are written into ``keys[i]`` / ``values[i]`` ``[1, kv_heads, >= past + n, head_dim]`` at
    ``past``. Returns the last layer's output ``[n, d]``, or with ``hidden`` every layer's. With
    ``layer_ops``, ``models.layer_kernels`` does the small ops, the same bits as the ops it
    replaces: each residual add and the norm after it are one ``add_rms_norm``, and where q/k/v
    and the caches are float32 the rotary embedding and the cache write one ``rope_store``."""
    n = x.shape[0]
    d = x.shape[1]
    q_heads, qk_width, head_dim = shape.q_heads, shape.qk_width, shape.head_dim
    out: List[torch.Tensor] = []
    delta: Optional[torch.Tensor] = None  # the last layer's MLP output, added before this layer's norm
    for i, layer in enumerate(layers):
        if layer_ops:
            x, h = torch.ops.constrained_spec.add_rms_norm(x, delta, layer.input_norm, layer.input_norm_eps)
        else:
            if delta is not None:
                x = x + delta
            var = (x.double().square().sum(-1, keepdim=True) / d).to(torch.float32)
            h = layer.input_norm * (x * torch.rsqrt(var + layer.input_norm_eps))
        if hidden and i > 0:
            out.append(x)
        qkv_out = _int4_mm(h, layer.qkv, layer.qkv_scales, shape)
        # Float32 q/k/v and float32 or bfloat16 caches: one call.
        if layer_ops and shape.vnni and (keys[i].dtype == torch.float32 or keys[i].dtype == torch.bfloat16):
            q = torch.ops.constrained_spec.rope_store(qkv_out, cos, sin, keys[i], values[i], past, q_heads,
                                                      head_dim).transpose(1, 2)
        else:
            xq = qkv_out[:, :qk_width].view(1, n, -1, head_dim).transpose(1, 2)
            qk = xq * cos + xq.roll(head_dim // 2, -1) * sin
            keys[i][:, :, past : past + n] = qk[:, q_heads:]
            values[i][:, :, past : past + n] = qkv_out[:, qk_width:].view(1, n, -1, head_dim).transpose(1, 2).float()
            q = qk[:, :q_heads]
        if shape.row_kernel:  # [1, n, heads, dim]
            held_k, held_v = keys[i][:, :, : past + n], values[i][:, :, : past + n]
            if held_k.dtype == torch.float64:  # exact float64 copies: the kernel reads float32 or bfloat16
                held_k, held_v = held_k.float(), held_v.float()
            a = torch.ops.constrained_spec.attend_rows(q, held_k, held_v, mask, shape.scale)
        else:
            a = torch.nn.functional.scaled_dot_product_attention(
                q.double(), keys[i][:, :, : past + n].double(), values[i][:, :, : past + n].double(),
                attn_mask=mask, scale=shape.scale, enable_gqa=shape.gqa).float().transpose(1, 2)
        # A bfloat16 kernel output is made float32 before the add: exact, the bits of the promoting add.
        attended = _int4_mm(a.reshape(n, -1), layer.o, layer.o_scales, shape).float()
        if layer_ops:
            x, h = torch.ops.constrained_spec.add_rms_norm(x, attended, layer.post_norm, layer.post_norm_eps)
        else:
            x = x + attended
            var = (x.double().square().sum(-1, keepdim=True) / d).to(torch.float32)
            h = layer.post_norm * (x * torch.rsqrt(var + layer.post_norm_eps))
        gu = _int4_mm(h, layer.gate_up, layer.gate_up_scales, shape).to(torch.float32)
        inter = shape.intermediate
        delta = _int4_mm(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down, layer.down_scales, shape).float()
    if delta is not None:
        x = x + delta
    out.append(x)
    return out


@functools.lru_cache(maxsize=None)
def scripted(function: Callable[..., Any]) -> Any:
    """``function`` (a layer loop) compiled by TorchScript, once per process (at the first forward
    that takes it). Why: a one-row forward is some 45 small ops a layer, and Python's dispatch of
    them was a large share of the forward. Run by the plain interpreter
    (``torch.jit.optimized_execution(False)``): no fusion, no rewritten graph, each op the eager
    one, so the bits are the flat loop's (tested). TorchScript is deprecated in favour of
    ``torch.compile``, whose inductor graphs were slower than eager on this CPU and may fuse
    float ops; a torch that can no longer script it gets None, and the forwards keep their Python
    or transformers' path."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(function)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def scripted_stack() -> Any:
    """``_scripted_stack`` compiled (``scripted``), or None."""
    return scripted(_scripted_stack)


class NativeDecode:
    """The flat forward of one llama-family model whose linear layers are fused int4 layers
    (``models.native``): ``run`` returns the final hidden states (and, when asked, every layer's)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        #: Off: every forward takes transformers' path, whose modules hooks can see
        #: (``bench.forward_profile`` times them so).
        self.enabled = True
        self.layers: list[NativeLayer] = []
        for block in base.layers:
            attn, mlp = block.self_attn, block.mlp
            qkv, gate_up = attn.q_proj.fused, mlp.gate_proj.fused
            self.layers.append(NativeLayer(
                input_norm=block.input_layernorm, qkv=qkv.layer, q_heads=qkv.sizes[0] // attn.head_dim,
                qk_width=qkv.sizes[0] + qkv.sizes[1], o_proj=attn.o_proj, head_dim=attn.head_dim, scale=attn.scaling,
                post_norm=block.post_attention_layernorm, gate_up=gate_up.layer, gate_up_sizes=gate_up.sizes,
                down=mlp.down_proj))
        first = self.layers[0]
        kv_heads = (first.qkv.out_features - first.qk_width) // first.head_dim
        # Every int4 layer on the VNNI kernel, or none: one model's rows take one kernel.
        vnni = all(m.vnni_packed is not None for la in self.layers for m in (la.qkv, la.o_proj, la.gate_up, la.down))
        weights, scales = ("vnni_packed", "vnni_scales") if vnni else ("packed", "scales_and_zeros")
        self.stack_layers = [LayerWeights(
            input_norm=la.input_norm.weight, input_norm_eps=float(la.input_norm.variance_epsilon),
            qkv=getattr(la.qkv, weights), qkv_scales=getattr(la.qkv, scales),
            o=getattr(la.o_proj, weights), o_scales=getattr(la.o_proj, scales),
            post_norm=la.post_norm.weight, post_norm_eps=float(la.post_norm.variance_epsilon),
            gate_up=getattr(la.gate_up, weights), gate_up_scales=getattr(la.gate_up, scales),
            down=getattr(la.down, weights), down_scales=getattr(la.down, scales)) for la in self.layers]
        self.shape = StackShape(
            q_heads=first.q_heads, qk_width=first.qk_width, head_dim=first.head_dim,
            intermediate=first.gate_up_sizes[0], scale=float(first.scale), gqa=kv_heads != first.q_heads, group=GROUP,
            vnni=vnni, vnni_split=vnni and first.qkv.vnni_split,
            row_kernel=attention_kernel.fits(first.q_heads, kv_heads, first.head_dim))
        self._kv_shape = (kv_heads, first.head_dim)
        same = lambda la: (la.q_heads, la.qk_width, la.head_dim, la.scale, la.gate_up_sizes)  # noqa: E731
        self._scriptable = all(same(la) == same(first) for la in self.layers) and len(first.gate_up_sizes) == 2

    @staticmethod
    def supports(base: Any) -> bool:
        """Whether every block of ``base`` has fused int4 q/k/v and gate/up, int4 o/down
        projections and SiLU (what ``run`` computes)."""
        try:
            return all(isinstance(b.self_attn.q_proj, Int4Part) and b.self_attn.q_proj.index == 0
                       and isinstance(b.self_attn.v_proj, Int4Part) and b.self_attn.v_proj.fused is b.self_attn.q_proj.fused
                       and isinstance(b.mlp.up_proj, Int4Part) and b.mlp.up_proj.fused is b.mlp.gate_proj.fused
                       and isinstance(b.self_attn.o_proj, Int4Linear) and isinstance(b.mlp.down_proj, Int4Linear)
                       and type(b.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
                       for b in base.layers)
        except AttributeError:
            return False

    def _can_script(self, cache: Any, positions: int, device: torch.device) -> bool:
        """Whether this forward can take the scripted stack: on the CPU, every attention row
        before ``LONG_CONTEXT`` (the float64 path) or the attention kernel on, and a cache whose layers let their buffers
        be written (``GrowingLayer.room_for``), each already holding positions of this request."""
        return (self._scriptable and device.type == "cpu"
                and (positions <= kv_cache.LONG_CONTEXT or self.shape.row_kernel)
                and len(cache.layers) == len(self.layers)
                and all(hasattr(layer, "room_for") and layer.get_seq_length() > 0 for layer in cache.layers))

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, cache: Any, hidden: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Feed ``input_ids`` ``[1, n]`` after the ``cache``'s positions; returns the final hidden
        states ``[1, n, d]`` and, with ``hidden``, the hidden states transformers'
        ``output_hidden_states`` gives (the embeddings, each block's output, the last normed)."""
        base = self.base
        x = base.embed_tokens(input_ids)
        n = x.shape[1]
        past = cache.get_seq_length()
        positions = (torch.arange(n, device=x.device) + past)[None]
        cos, sin = base.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1))
        # What the causal mask and ``invariant_attention`` make of it: none for one row.
        mask = None if n == 1 else _allowed(None, past + n, past, 0, x.device)[None, None]
        states = [x] if hidden else None
        stack = scripted_stack() if self._can_script(cache, past + n, x.device) else None
        if stack is not None:
            like = torch.empty(1, self._kv_shape[0], n, self._kv_shape[1], dtype=torch.float32)
            rooms = [layer.room_for(like, like) for layer in cache.layers]
            if mask is not None and self.shape.row_kernel:
                mask = mask[0]
            with torch.jit.optimized_execution(False):
                outs = stack(x[0], cos, sin, mask, [r[0] for r in rooms], [r[1] for r in rooms], past, hidden,
                             self.stack_layers, self.shape, layer_kernels.usable(x))
            for layer in cache.layers:
                layer.advance(n)
            out = _norm(base.norm, outs[-1])[None]
            if hidden:
                states += [o[None] for o in outs[:-1]] + [out]
            return out, tuple(states) if hidden else None
        x = x[0]
        for i, (input_norm, qkv, q_heads, qk_width, o_proj, head_dim, scale, post_norm, gate_up, gate_up_sizes,
                down) in enumerate(self.layers):
            qkv_out = qkv.kernel_bfloat16(_norm(input_norm, x))
            # q and k rotated as one tensor of their heads side by side: the same elementwise
            # ops on the same values (the same bits), five ops a layer fewer.
            qk = _rotate(qkv_out[:, :qk_width].view(1, n, -1, head_dim).transpose(1, 2), cos, sin)
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            v = qkv_out[:, qk_width:]
            keys, values = cache.update(k, v.view(1, n, -1, head_dim).transpose(1, 2).float(), i)
            a = attend_new_rows(q, keys, values, mask, scale)
            x = x + o_proj.kernel_bfloat16(a.transpose(1, 2).reshape(n, -1))
            gate, up = gate_up.kernel_bfloat16(_norm(post_norm, x)).to(torch.float32).split(gate_up_sizes, dim=-1)
            x = x + down.kernel_bfloat16(F.silu(gate) * up)
            if hidden:
                states.append(x[None])
        out = _norm(base.norm, x)[None]
        if hidden:
            states[-1] = out
        return out, tuple(states) if hidden else None


#: Keyword arguments a forward may carry and still take the flat path (with these values).
_PLAIN = {"attention_mask": None, "position_ids": None, "inputs_embeds": None, "prompt_rows": (None, 0, []),
          "return_dict": (None, True)}


def plain_forward(input_ids: torch.Tensor | None, cache: Any, use_cache: bool | None, kwargs: dict[str, Any]) -> bool:
    """Whether a decoder stack's forward is a request's own decode or verify pass: one row of
    new tokens after a cache, no gradient, and no keyword argument beyond ``_PLAIN``'s values
    (what the flat path here and the CUDA graphs of ``models.cuda_graphs`` compute)."""
    return (input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] > 0
            and cache is not None and bool(use_cache) and not torch.is_grad_enabled()
            and all(k in _PLAIN and (v in _PLAIN[k] if isinstance(_PLAIN[k], tuple) else v is _PLAIN[k])
                    for k, v in kwargs.items()))


def install_native_decode(model: Any) -> bool:
    """Give ``model``'s decoder stack the flat path for plain decode and verify forwards (in
    place); returns whether it could (a model that is not fused int4 keeps its forward)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    base = model.model
    if not NativeDecode.supports(base):
        return False
    flat = NativeDecode(base)
    stock = base.forward

    def forward(input_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> Any:
        if not (flat.enabled and plain_forward(input_ids, cache, use_cache, kwargs)):
            return stock(input_ids=input_ids, cache=cache, use_cache=use_cache, output_hidden_states=output_hidden_states,
                         **kwargs)
        last, states = flat.run(input_ids, cache, bool(output_hidden_states))
        return BaseModelOutputWithPast(last_hidden_state=last, cache=cache, hidden_states=states)

    base.forward = forward
    base.native_decode = flat
    return True
