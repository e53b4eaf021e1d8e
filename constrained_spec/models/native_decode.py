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
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .int4 import Int4Linear, Int4Part
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
        plain = (flat.enabled and input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] > 0
                 and cache is not None and use_cache and not torch.is_grad_enabled()
                 and all(k in _PLAIN and (v in _PLAIN[k] if isinstance(_PLAIN[k], tuple) else v is _PLAIN[k])
                         for k, v in kwargs.items()))
        if not plain:
            return stock(input_ids=input_ids, cache=cache, use_cache=use_cache, output_hidden_states=output_hidden_states,
                         **kwargs)
        last, states = flat.run(input_ids, cache, bool(output_hidden_states))
        return BaseModelOutputWithPast(last_hidden_state=last, cache=cache, hidden_states=states)

    base.forward = forward
    base.native_decode = flat
    return True
