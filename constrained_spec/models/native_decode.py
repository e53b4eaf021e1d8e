"""The native model's decode and verify forwards as one flat loop of tensor ops.

A one-token forward of the embedded model at native precision spends about a third of its time
outside any kernel: transformers' decorated forwards, thirteen module calls a layer with their
hooks and keyword handling, the row split that routes prompt rows, and dtype conversions that
the next op could do for free (measured here: 27.6 ms a forward, 7.2 ms in the int4 kernels
and 4.6 ms in attention). torch.compile, which would remove that, was slower than eager on
this CPU (``models.q8_output``'s notes); no library runs a transformers model without it, so
this module hand-writes the llama decoder stack for the forwards that dominate decoding: the
request's own decode and verify passes (one row of the batch, no prompt rows, no padding).
Everything else (prompt passes, packed batch steps, training, hooks, other caches' kwargs)
goes through transformers' forward as before.

Bit for bit the same as that forward (tested): the same ops in the same order on the same
dtypes, with two kinds of op left out because they change no bit: a bfloat16 kernel output
converted to float32 before an op that promotes it to float32 anyway (a residual add, the
rotary products: bfloat16 -> float32 is exact, and the promoted op computes in float32), and
the row split's bookkeeping for forwards that have no prompt rows. The norms, the float64
attention and the int4 kernels are the batch-invariant ones of ``models.invariant`` and
``models.int4``, so invariance holds as before.

Measured (one run each, this 2-core machine, ``constrained-spec bench --fixed-k ""``): with the
fused float64 attention, the one-token target step went from 30.0 to 21.3 ms and extraction
target-only from 27.9 to 36.8 tokens/s (llama.cpp's grammar path 28-29 in the same runs). q and
k rotated together, without the negation (2026-12-03): the decoder stack's one-token pass after
a 300-token prompt, median of 40, alternated twice with the code before: 17.0 / 18.2 against
23.2 / 21.9 ms.

The layer loop itself runs as one TorchScript function (``scripted_stack``) wherever every
attention row lies before ``LONG_CONTEXT`` and the cache lets its buffers be written
(``GrowingLayer.room_for``): the same ops in the same order, run by TorchScript's plain
interpreter instead of Python, the same bits (tested against transformers' forward with the
Python loop as a control). On the Intel Xeon with AMX, after a 300-token prompt, median of 20,
alternated twice (2026-12-04): 1 row 10.5 against 13.9 ms, 4 rows 15.9 against 19.7, 21 rows
60-62 against 66.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch
from torch.nn import functional as F

from .int4 import GROUP, Int4Linear, Int4Part
from . import attention_kernel, invariant, layer_kernels
from . import cpu_kernels  # noqa: F401  (defines the ops the scripted stack names)
from .invariant import _allowed, attend_new_rows, float64_variance

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


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int, vnni: bool,
             split: bool) -> torch.Tensor:
    """``Int4Linear.kernel_bfloat16`` for the scripted stack: torch's int4 kernel (bfloat16 out)
    or, with ``vnni``, ``models.q4_vnni``'s (float32 out; the next ops promote either exactly)."""
    if vnni:
        return torch.ops.constrained_spec.q4_1_mm(x.contiguous(), packed, scales, split)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group, scales)


def _scripted_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                    keys: List[torch.Tensor], values: List[torch.Tensor], past: int, hidden: bool,
                    norm1: List[torch.Tensor], eps1: List[float], qkv: List[torch.Tensor], qkv_sz: List[torch.Tensor],
                    o: List[torch.Tensor], o_sz: List[torch.Tensor], norm2: List[torch.Tensor], eps2: List[float],
                    gate_up: List[torch.Tensor], gate_up_sz: List[torch.Tensor], down: List[torch.Tensor],
                    down_sz: List[torch.Tensor], q_heads: int, qk_width: int, head_dim: int, inter: int, scale: float,
                    gqa: bool, group: int, vnni: bool, split: bool, row_kernel: bool,
                    layer_ops: bool) -> List[torch.Tensor]:
    """``NativeDecode.run``'s layer loop, op for op (the same ops on the same dtypes in the same
    order: ``_norm``, ``_rotate``, the cache write of ``GrowingLayer.update``, the float64
    attention of ``attend_new_rows`` below ``LONG_CONTEXT``, or with ``row_kernel`` the
    ``models.attention_kernel`` it takes at any length, ``mask`` then ``[1, n, kv]``), for
    TorchScript: ``x`` ``[n, d]`` after the embeddings; each layer's new keys and values are
    written into ``keys[i]`` / ``values[i]`` at ``past``. Returns the last layer's output, or
    with ``hidden`` every layer's. With ``vnni`` the weight lists hold ``models.q4_vnni``'s
    layout (``_int4_mm``, ``split`` its activations' two parts). With ``layer_ops``,
    ``models.layer_kernels`` does the small ops, the same bits as the ops it replaces: each
    residual add and the norm after it are one ``add_rms_norm``, and where q/k/v and the caches
    are float32 the rotary embedding and the cache write one ``rope_store``."""
    n = x.shape[0]
    d = x.shape[1]
    out: List[torch.Tensor] = []
    delta: Optional[torch.Tensor] = None  # the last layer's MLP output, added before this layer's norm
    for i in range(len(norm1)):
        if layer_ops:
            x, h = torch.ops.constrained_spec.add_rms_norm(x, delta, norm1[i], eps1[i])
        else:
            if delta is not None:
                x = x + delta
            var = (x.double().square().sum(-1, keepdim=True) / d).to(torch.float32)
            h = norm1[i] * (x * torch.rsqrt(var + eps1[i]))
        if hidden and i > 0:
            out.append(x)
        qkv_out = _int4_mm(h, qkv[i], qkv_sz[i], group, vnni, split)
        if layer_ops and vnni and keys[i].dtype == torch.float32:  # float32 q/k/v and caches: one call
            q = torch.ops.constrained_spec.rope_store(qkv_out, cos, sin, keys[i], values[i], past, q_heads,
                                                      head_dim).transpose(1, 2)
        else:
            xq = qkv_out[:, :qk_width].view(1, n, -1, head_dim).transpose(1, 2)
            qk = xq * cos + xq.roll(head_dim // 2, -1) * sin
            keys[i][:, :, past : past + n] = qk[:, q_heads:]
            values[i][:, :, past : past + n] = qkv_out[:, qk_width:].view(1, n, -1, head_dim).transpose(1, 2).float()
            q = qk[:, :q_heads]
        if row_kernel:  # [1, n, heads, dim]
            a = torch.ops.constrained_spec.attend_rows(q, keys[i][:, :, : past + n].float(),
                                                       values[i][:, :, : past + n].float(), mask, scale)
        else:
            a = torch.nn.functional.scaled_dot_product_attention(
                q.double(), keys[i][:, :, : past + n].double(), values[i][:, :, : past + n].double(),
                attn_mask=mask, scale=scale, enable_gqa=gqa).float().transpose(1, 2)
        # A bfloat16 kernel output is made float32 before the add: exact, the bits of the promoting add.
        attended = _int4_mm(a.reshape(n, -1), o[i], o_sz[i], group, vnni, split).float()
        if layer_ops:
            x, h = torch.ops.constrained_spec.add_rms_norm(x, attended, norm2[i], eps2[i])
        else:
            x = x + attended
            var = (x.double().square().sum(-1, keepdim=True) / d).to(torch.float32)
            h = norm2[i] * (x * torch.rsqrt(var + eps2[i]))
        gu = _int4_mm(h, gate_up[i], gate_up_sz[i], group, vnni, split).to(torch.float32)
        delta = _int4_mm(F.silu(gu[:, :inter]) * gu[:, inter:], down[i], down_sz[i], group, vnni, split).float()
    if delta is not None:
        x = x + delta
    out.append(x)
    return out


_SCRIPTED: list[Any] = []


def scripted_stack() -> Any:
    """``_scripted_stack`` compiled by TorchScript, once per process (about 0.01 s, at the first
    forward that takes it). Why: a one-row forward is some 45 small ops a layer, and Python's share of
    dispatching them was about a quarter of the forward (the decoder stack after a 300-token
    prompt: 10.0-10.4 against 13.6-14.2 ms, median of 40, the same bits). Run by the plain
    interpreter (``torch.jit.optimized_execution(False)``): no fusion, no rewritten graph, each
    op the eager one, so the bits are the flat loop's (tested). TorchScript is deprecated in favour
    of ``torch.compile``, whose inductor graphs were slower than eager on this CPU and may fuse
    float ops (``models.q8_output``'s notes); a torch that can no longer script it gets None, and
    ``run`` keeps its Python loop."""
    if not _SCRIPTED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _SCRIPTED.append(torch.jit.script(_scripted_stack))
        except (AttributeError, RuntimeError, NotImplementedError):
            _SCRIPTED.append(None)
    return _SCRIPTED[0]


class NativeDecode:
    """The flat forward of one llama-family model whose linear layers are fused int4 layers
    (``models.native``): ``run`` returns the final hidden states (and, when asked, every layer's)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        #: Off: every forward takes transformers' path (a profile that hooks the modules).
        self.enabled = True
        self.layers = []
        for block in base.layers:
            attn, mlp = block.self_attn, block.mlp
            qkv, gate_up = attn.q_proj.fused, mlp.gate_proj.fused
            # q's heads and q + k's width in the fused q/k/v output (q and k are rotated together).
            q_heads, qk_width = qkv.sizes[0] // attn.head_dim, qkv.sizes[0] + qkv.sizes[1]
            self.layers.append((block.input_layernorm, qkv.layer, q_heads, qk_width, attn.o_proj, attn.head_dim,
                                attn.scaling, block.post_attention_layernorm, gate_up.layer, gate_up.sizes, mlp.down_proj))
        #: Off: every forward takes the Python loop (tests compare the two).
        self.scripted = True
        first = self.layers[0]
        kv_heads = (first[1].out_features - first[3]) // first[5]
        # Every int4 layer on the VNNI kernel, or none: one model's rows take one kernel.
        vnni = all(la[i].vnni_packed is not None for la in self.layers for i in (1, 4, 8, 10))
        weights, scales = ("vnni_packed", "vnni_scales") if vnni else ("packed", "scales_and_zeros")

        def each(index: int, name: str) -> list[torch.Tensor]:
            return [getattr(la[index], name) for la in self.layers]

        self._weights = dict(
            norm1=[la[0].weight for la in self.layers], eps1=[float(la[0].variance_epsilon) for la in self.layers],
            qkv=each(1, weights), qkv_sz=each(1, scales), o=each(4, weights), o_sz=each(4, scales),
            norm2=[la[7].weight for la in self.layers], eps2=[float(la[7].variance_epsilon) for la in self.layers],
            gate_up=each(8, weights), gate_up_sz=each(8, scales), down=each(10, weights), down_sz=each(10, scales),
            q_heads=first[2], qk_width=first[3], head_dim=first[5], inter=first[9][0], scale=float(first[6]),
            gqa=kv_heads != first[2], group=GROUP, vnni=vnni, split=vnni and first[1].vnni_split, row_kernel=attention_kernel.fits(first[2], kv_heads, first[5]))
        self._kv_shape = (kv_heads, first[5])
        uniform = all(la[2:4] == first[2:4] and la[5:7] == first[5:7] and la[9] == first[9] for la in self.layers)
        self._scriptable = uniform and len(first[9]) == 2

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
        return (self.scripted and self._scriptable and device.type == "cpu"
                and (positions <= invariant.LONG_CONTEXT or self._weights["row_kernel"])
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
            if mask is not None and self._weights["row_kernel"]:
                mask = mask[0]
            with torch.jit.optimized_execution(False):
                outs = stack(x[0], cos, sin, mask, [r[0] for r in rooms], [r[1] for r in rooms], past, hidden,
                             layer_ops=layer_kernels.usable(x), **self._weights)
            for layer in cache.layers:
                layer.advance(n)
            out = _norm(base.norm, outs[-1])[None]
            if hidden:
                states += [o[None] for o in outs[:-1]] + [out]
            return out, tuple(states) if hidden else None
        x = x[0]
        for i, (norm1, qkv, q_heads, qk_width, o_proj, head_dim, scale, norm2, gate_up, gu_sizes, down) in enumerate(self.layers):
            qkv_out = qkv.kernel_bfloat16(_norm(norm1, x))
            # q and k rotated as one tensor of their heads side by side: the same elementwise
            # ops on the same values (the same bits), five ops a layer fewer.
            qk = _rotate(qkv_out[:, :qk_width].view(1, n, -1, head_dim).transpose(1, 2), cos, sin)
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            v = qkv_out[:, qk_width:]
            keys, values = cache.update(k, v.view(1, n, -1, head_dim).transpose(1, 2).float(), i)
            a = attend_new_rows(q, keys, values, mask, scale)
            x = x + o_proj.kernel_bfloat16(a.transpose(1, 2).reshape(n, -1))
            gate, up = gate_up.kernel_bfloat16(_norm(norm2, x)).to(torch.float32).split(gu_sizes, dim=-1)
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
