"""The draft head's inference path: one request's head cache and its steps, without transformers' decoder layer.

``DraftHead.forward`` runs transformers' ``LlamaDecoderLayer`` over a ``DynamicCache``: right for
training (autograd, any batch) but, for one request drafting a token at a time, much of a step
goes to the decoder layer's dispatch, the cache's list bookkeeping and the mask built per call
(see docs/drafters.md). ``HeadRunner`` computes the same
layer from the same weights (q/k/v and gate/up each fused into one matrix: their int8 rows keep
their own scales, so the fused product is the separate ones' bits), with the keys and values in
preallocated tensors; the norms and the rotary embedding are transformers' own. Hand-written
because no library runs a single decoder layer this way.

Its numbers may differ from ``DraftHead.forward`` in the last bits (another matmul blocking in
float32); that changes which tokens are drafted, never the output law: the drafter's q is what
this path computes, and the target verifies it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .int8_linear import Int8Linear

if TYPE_CHECKING:
    from .head import DraftHead

#: Positions the first cache of a request holds; it doubles when a request outgrows it.
INITIAL_CAPACITY = 1024


def fused_linear(parts: list[nn.Module]) -> nn.Module:
    """One bias-free linear layer whose output is the ``parts``' outputs concatenated (their
    weights stacked by rows), int8 when every part is."""
    if all(isinstance(p, Int8Linear) for p in parts):
        return Int8Linear(torch.cat([p.weight for p in parts]), torch.cat([p.scale.float() for p in parts]))
    weights = [p.weight.detach() for p in parts]
    fused = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=False,
                      dtype=weights[0].dtype, device=weights[0].device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights))
    fused.requires_grad_(False)
    return fused


class _FusedWeights:
    """A head's q/k/v and gate/up matrices fused, built once per head and weight version."""

    def __init__(self, head: "DraftHead") -> None:
        attn, mlp = head.layer.self_attn, head.layer.mlp
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj])
        self.version = _weights_version(head)


def _weights_version(head: "DraftHead") -> tuple[int, ...]:
    """Changes when any of the fused matrices is replaced or trained in place."""
    attn, mlp = head.layer.self_attn, head.layer.mlp
    mats = [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    return tuple(x for w in mats for x in (id(w), w._version))


_FUSED: "weakref.WeakKeyDictionary[DraftHead, _FusedWeights]" = weakref.WeakKeyDictionary()


def fused_weights(head: "DraftHead") -> _FusedWeights:
    """The head's fused matrices (rebuilt if its weights changed since)."""
    fused = _FUSED.get(head)
    if fused is None or fused.version != _weights_version(head):
        fused = _FUSED[head] = _FusedWeights(head)
    return fused


class HeadRunner:
    """One request's head: its cache of keys and values, and steps over new pairs.

    ``length`` positions are cached (pairs fed so far, in order); ``step`` appends more and
    ``crop`` forgets the last ones, as ``DynamicCache`` would.
    """

    def __init__(self, head: "DraftHead") -> None:
        self.head = head
        c = head.config
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
        self.head_dim = c.hidden_size // c.num_heads
        self.weights = fused_weights(head)
        self.keys = self.values = torch.empty(0)
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        self.length = min(self.length, max(0, length))

    def _room(self, extra: int) -> None:
        need = self.length + extra
        if self.keys.numel() and need <= self.keys.shape[2]:
            return
        cap = max(INITIAL_CAPACITY, 2 * need)
        shape = (1, self.num_kv_heads, cap, self.head_dim)
        keys = torch.zeros(shape, dtype=self.head.dtype)
        values = torch.zeros(shape, dtype=self.head.dtype)
        if self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    @torch.no_grad()
    def step(self, g: torch.Tensor, next_tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs ``(g_t, x_{t+1})``: ``g`` ``[T, d]``, ``next_tokens`` ``[T]``, at absolute
        positions ``start..start+T-1`` after the cached ones -> (the last pair's hidden state
        ``[d]``, its logits over ``V_d``). Appends the pairs' keys and values to the cache."""
        head, w = self.head, self.weights
        layer = head.layer
        t, nh, kvh, hd = g.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        u = head.proj(torch.cat([g.to(head.dtype), head.embed(next_tokens)], dim=-1))  # [T, d]
        qkv = w.qkv(layer.input_layernorm(u))
        cos, sin = head.rotary(u, torch.arange(start, start + t)[None])  # transformers' RoPE, as in training
        q, k = apply_rotary_pos_emb(qkv[None, :, : nh * hd].view(1, t, nh, hd).transpose(1, 2),
                                    qkv[None, :, nh * hd : (nh + kvh) * hd].view(1, t, kvh, hd).transpose(1, 2), cos, sin)
        v = qkv[:, (nh + kvh) * hd :].view(t, kvh, hd).transpose(0, 1)
        self._room(t)
        past = self.length
        self.keys[0, :, past : past + t] = k[0]
        self.values[0, :, past : past + t] = v
        self.length = past + t
        # Causal within the new pairs, every cached one visible (one pair: no mask at all).
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(past) if t > 1 else None
        a = F.scaled_dot_product_attention(q, self.keys[:, :, : past + t], self.values[:, :, : past + t],
                                           attn_mask=mask, enable_gqa=True)  # [1, nh, T, hd]
        x = u + layer.self_attn.o_proj(a[0].transpose(0, 1).reshape(t, nh * hd))
        gate_up = w.gate_up(layer.post_attention_layernorm(x))
        inter = gate_up.shape[-1] // 2
        h = x + layer.mlp.down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        last = h[-1]
        return last, head.logits(last)
