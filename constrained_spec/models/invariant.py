"""Batch-invariant forwards: a position's hidden states do not depend on how many positions
share the forward, so a k-token verify pass and k one-token passes agree bit for bit (tested
for k = 1..24), and greedy speculative output equals greedy target-only output.

What varies with the number of rows in a forward, and what is done about it:
- linear layers: matmul kernels pick their blocking by shape. On the CPU the int4 kernel
  (``Int4Linear``) computes each row alone, so it is invariant as it is. On a GPU, cuBLAS picks
  another kernel (tile, split-K) for another row count, so every other linear layer becomes a
  ``BucketedLinear``: its new rows go through the matmul in blocks of exactly ``ROW_BUCKET``
  rows (zero-padded), one kernel shape for every forward, and a kernel of one shape computes
  each output element with the same reduction order whichever row it sits in. Padding costs
  nothing there: a forward of a small model is bound by reading the weights, not by rows;
- RMSNorm: the mean of squares is a reduction whose CPU strategy depends on the row count;
  here it is summed in float64 and rounded to float32 (on a CPU with AVX-512, by
  ``models.layer_kernels`` in one fixed order: exactly invariant);
- attention over the new rows: computed in float64 and rounded to float32 (on a CPU with
  AVX-512, by ``models.attention_kernel`` in float32, row by row: exactly invariant).
  In both torch paths, a different reduction order changes the float64 result by ~1e-16
  relative, which the rounding to float32 removes unless the value lies that close to a float32
  rounding boundary (odds ~1e-8 per value). A fixed tree of elementwise adds would be invariant with
  no odds at all, but cost several times the reduction;
- the prompt rows of the first pass (``prompt_rows=``) keep the stock kernels (attention over
  their own keys, a plain matmul; at native precision a dense matmul over the stored weights,
  faster a row than the int4 kernel, see ``models.int4``): they are the same rows with the same
  keys in every run of a request, so they get the same bits anyway. A hook on the model puts the forward's
  ``prompt_rows`` into a ``RowSplit`` that the linear layers read, since keyword arguments of a
  forward reach attention but not the linear layers.
- the output projection on the CPU: ``x @ W.T`` picks another sgemm path for 2+ rows, which
  both changes a row's logits with the row count and costs more than twice a one-row pass.
  ``W @ X.T`` over a zero-padded block of exactly ``OUTPUT_BUCKET`` rows costs what one row
  costs for any 1 to 8 rows and, one kernel shape for every forward, gives each row the same
  bits wherever it sits in the block (tested), so greedy logits are the same for every K and
  batch. Wider blocks cost more for the 1-8 rows a single request's verify pass has.
Everything else (embedding, rotary embedding, residual adds, SiLU) is elementwise.
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch
from torch import nn

from . import attention_kernel, layer_kernels, prompt_attention_kernel
from . import growing_cache as kv_cache
from .bucketed_linear import OUTPUT_BUCKET, BucketedLinear, RowSplit, prompt_segments

IMPLEMENTATION = "constrained_spec_invariant"
#: The float32 path's fixed shapes: query rows per call, and the key block it pads keys to (the
#: CPU flash kernel's key block, so a padded block changes no bit of the blocks before it).
F32_QUERY_BLOCK = 8
F32_KEY_BLOCK = 512


def float64_variance(x: torch.Tensor) -> torch.Tensor:
    """The mean of squares of float32 rows ``x`` over the last dimension, summed in float64 and
    rounded to float32 (batch-invariant, see the module docstring); on the CPU, one call of
    ``models.layer_kernels``'s fixed-order sum where it is built."""
    if layer_kernels.usable(x):
        return layer_kernels.row_variance(x)
    return (x.double().square().sum(-1, keepdim=True) / x.shape[-1]).to(torch.float32)


def _variance(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The norm's mean of squares of float32 ``x``: batch-invariant (``float64_variance``) for every
    row, but prompt rows (``self.rows``, where set) take the stock float32 mean, a tenth of a long
    prompt pass cheaper. A norm over each head's slice (q/k norms) has no row split: its input's
    rows are not the forward's rows."""
    if self.rows is None:
        return float64_variance(x)
    return self.rows.apply(x, lambda p: p.pow(2).mean(-1, keepdim=True), float64_variance)


def invariant_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (llama, qwen2, qwen3) with ``_variance``'s mean of squares."""
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    x = x * torch.rsqrt(_variance(self, x) + self.variance_epsilon)
    return self.weight * x.to(input_dtype)


def invariant_offset_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Gemma's ``_norm`` (its forward then scales by ``1 + weight``) with ``_variance``'s mean of squares."""
    return x * torch.rsqrt(_variance(self, x) + self.eps)


def fused_offset_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Gemma's whole norm forward as one ``layer_kernels`` call where it computes the same bits:
    float32 rows, no prompt rows among them (those take the stock mean), the kernels built. The
    kernel's ``w * (x * (1 / sqrt(ms + eps)))`` is Gemma's ``(x * rsqrt(ms + eps)) * (1 + w)``
    with the same mean of squares and ``1 + w`` added once at install (a product's operands
    commute exactly; torch's CPU rsqrt is 1 / sqrt): tested bit for bit. Why: about a hundred
    norms a step cost a quarter of a one-token step as four small ops each."""
    if x.dtype == torch.float32 and not (self.rows is not None and self.rows.segments) and layer_kernels.usable(x):
        return torch.ops.constrained_spec.add_rms_norm(x.contiguous(), None, self.offset_weight, self.eps)[1]
    return type(self).forward(self, x)


def invariant_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface`` (shapes as there: ``query`` ``[b, h, q, d]``,
    ``key`` / ``value`` ``[b, h_kv, kv, d]``; returns ``[b, q, h, d]``). The first ``prompt_rows``
    query rows go to the stock kernel over their own keys only; the others to float64 attention."""
    q_len, kv_len = query.shape[2], key.shape[2]
    past = kv_len - q_len
    segments = prompt_segments(kwargs.pop("prompt_rows", 0))
    if [s for s, _ in segments] != list(itertools.accumulate((n for _, n in segments), initial=0))[: len(segments)]:
        raise ValueError("invariant_attention takes leading prompt rows only; a packed step goes through "
                         "batching.packing, which calls it per prompt segment")
    prompt_rows = sum(n for _, n in segments)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    parts = []
    # Prompt rows in ``prompt_attention_dtype`` (set at load; None: the query's), on the bfloat16
    # kernel where it takes them, else the keys converted once for every chunk of the forward.
    prompt_dtype = getattr(module, "prompt_attention_dtype", None) or query.dtype
    window = kwargs.get("sliding_window") or 0  # the kernel's masks include a sliding window
    kernel = (prompt_dtype == torch.bfloat16 and not dropout and _plain_attention(kwargs)
              and isinstance(window, int) and prompt_attention_kernel.usable(query, key))
    prompt_keys = prompt_values = None
    for chunk, (start, rows) in enumerate(segments):  # each prompt chunk on its own keys (decoding.prefix)
        keys = past + start + rows
        if kernel and (attention_mask is None or _causal_chunk(attention_mask, past, start, rows, keys, window)):
            # Bfloat16 on the CPU's pair instruction, row by row (models.prompt_attention_kernel).
            out = prompt_attention_kernel.attend(query[:, :, start : start + rows], key[:, :, :keys], value[:, :, :keys],
                                                 past + start, scale, window)
            parts.append(out.to(query.dtype))
            continue
        kernel = False  # a mask of another shape (padding): torch's kernel from this chunk on
        if prompt_keys is None:
            prompt_keys, prompt_values = (t[:, :, : past + prompt_rows].to(prompt_dtype) for t in (key, value))
        if attention_mask is not None:
            mask = attention_mask[..., start : start + rows, :keys]
        elif past + start:  # a chunk after others: causal over the keys before it too
            # Additive, in the kernel's dtype, as the kernel makes a boolean mask (the same
            # bits, tested), and once a forward for every layer rather than twice a layer.
            mask = _remembered(f"prompt chunk {chunk}", None, (keys, past + start, rows, prompt_dtype, query.device),
                               lambda: _additive_causal(keys, past + start, rows, prompt_dtype, query.device))
        else:
            mask = None
        # A request's cache may hold float64 copies (models.growing_cache): converted exactly
        # to the query's dtype (or rounded to the prompt dtype) for the stock kernel.
        out = prompt_attention(module, query[:, :, start : start + rows].to(prompt_dtype), prompt_keys[:, :, :keys],
                               prompt_values[:, :, :keys], mask, scale, dropout, kwargs)
        parts.append(out.to(query.dtype))
    if prompt_rows < q_len:
        rows = q_len - prompt_rows
        # One new row at the end with no padding sees every key: nothing to mask, and masking
        # nothing changes no bit. Otherwise each row's causal keys and the mask's padding.
        mask = None
        if not (rows == 1 and attention_mask is None and past + prompt_rows == kv_len - 1):
            mask = _remembered("allowed", attention_mask, (kv_len, past + prompt_rows, prompt_rows, query.device),
                               lambda: _allowed(attention_mask, kv_len, past + prompt_rows, prompt_rows, query.device))
        out = attend_new_rows(query[:, :, prompt_rows:], key, value, mask, scale).to(query.dtype)
        parts.append(out.transpose(1, 2))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).contiguous(), None


def _plain_attention(kwargs: dict[str, Any]) -> bool:
    """Whether the attention call asks for nothing the prompt kernel lacks beyond scaled causal
    attention and a sliding window (no logit soft cap, position bias or attention sinks)."""
    return all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux"))


def _causal(mask: torch.Tensor, first: int, window: int = 0) -> bool:
    """Whether ``mask`` (``[1, 1, rows, keys]``, boolean or additive) lets row ``i`` see exactly
    keys ``0 .. first + i`` (with ``window``, only the last ``window`` of them): the masks a
    request's own pass and a packed step give a prompt chunk (a padded batch's are not, nor a
    sliding cache's, whose keys do not start at position 0)."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return False
    rows, keys = mask.shape[-2:]
    position = first + torch.arange(rows, device=mask.device)[:, None]
    key = torch.arange(keys, device=mask.device)[None, :]
    allowed = (key <= position) & ((key > position - window) if window else True)
    if mask.dtype == torch.bool:
        return torch.equal(mask[0, 0], allowed)
    # Additive: 0 where seen, and at most the dtype's lowest where hidden (its weight is 0).
    return bool(torch.equal(mask[0, 0] == 0, allowed) and (mask[0, 0][~allowed] <= torch.finfo(mask.dtype).min).all())


def _causal_chunk(mask: torch.Tensor, past: int, start: int, rows: int, keys: int, window: int) -> bool:
    """``_causal`` for the prompt chunk of rows ``start .. start + rows`` of a forward's ``mask``,
    checked once for all the layers a forward hands the same mask (a model with sliding layers
    hands two): the check of every layer's every chunk was a visible share of a prompt pass."""
    checked = _remembered(f"causal chunks, window {window}", mask, (past, window), dict)
    if (start, rows, keys) not in checked:
        checked[start, rows, keys] = _causal(mask[..., start : start + rows, :keys], past + start, window)
    return checked[start, rows, keys]


def _additive_causal(keys: int, first: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 1, rows, keys]``: 0 where row ``i`` may see key ``j`` (``j <= first + i``), else -inf,
    what torch's attention makes of the boolean causal mask."""
    allowed = torch.arange(keys, device=device)[None, :] <= first + torch.arange(rows, device=device)[:, None]
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[None, None]


def prompt_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, dropout: float = 0.0,
                     kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """Prompt rows' attention, ``[b, q, h, d]``: transformers' ``sdpa_attention_forward`` where
    it would repeat the key heads for a masked GQA call, torch's kernel told the heads are
    grouped instead. The same bits (tested): the kernel runs each query head over its key head
    either way, without copying the keys and values three times a chunk of a layer (most of a
    long prompt's copies). Anything else (no GQA, no mask, one row, a position bias): theirs."""
    extra = kwargs or {}
    if (mask is not None and getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and not dropout
            and key.shape[-1] == value.shape[-1] and "is_causal" not in extra
            and extra.get("position_bias") is None and extra.get("softcap") is None):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scale, **extra)
    return out


def cache_dtype(model: Any) -> torch.dtype | None:
    """The dtype a batch-invariant model's KV cache should keep. Where new rows attend with
    ``models.attention_kernel`` (on the CPU, for the model's shapes), which reads float32 or
    bfloat16: ``model.kv_cache_dtype``, set at load (bfloat16 where ``RuntimeConfig.kv_cache``
    asks for it, ``models.loading``), else None, the keys' own. Elsewhere float64, exact copies
    of the float32 keys that the float64 path reads without converting the cache each layer."""
    config, device = model.config, next(model.parameters()).device
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if device.type == "cpu" and attention_kernel.fits(heads, kv_heads, head_dim):
        return getattr(model, "kv_cache_dtype", None)
    return torch.float64


def attend_new_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Batch-invariant attention of new query rows (``[b, h, r, d]``) over ``key`` / ``value``
    (``[b, h_kv, kv, d]``, float32 or exact float64 copies), ``allowed`` the keys each row sees
    (``[r, kv]`` or ``[b, 1, r, kv]``; None: one row that sees every key); float32 ``[b, h, r, d]``.

    On a CPU with AVX-512 (float32 rows): ``models.attention_kernel``, every row computed alone.
    Otherwise, rows before ``LONG_CONTEXT``: torch's fused attention in float64 (GQA without repeating the
    keys): any float64 summation order rounds to the same float32 (module docstring), in one
    call where eleven small ops took twice as long.
    Rows from ``LONG_CONTEXT`` on: ``_float32_blocks``, exactly invariant by its fixed shapes.
    Why the split: float64 over a long context reads twice the bytes and is several times slower
    than the float32 blocks there, while over a few hundred keys the blocks' fixed shapes cost
    twice the float64 call (see docs/extraction.md, long prompts)."""
    if attention_kernel.usable(query, key):  # exactly invariant at any length, and faster
        return attention_kernel.attend(query, key, value, allowed, scale)
    kv = key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    # On a GPU the fused kernels' shapes are not this module's to fix: float64 everywhere.
    if kv <= kv_cache.LONG_CONTEXT or query.device.type != "cpu":  # (on the CPU: every row before LONG_CONTEXT)
        return _float64_rows(query, key, value, allowed, scale, gqa)
    given = allowed
    allowed, long, seen = _remembered("rows", given, (query.shape[2], kv, kv_cache.LONG_CONTEXT, query.device),
                                      lambda: _row_positions(given, query.shape[2], kv, query.device))
    if long is None:  # no row at LONG_CONTEXT or later
        return _float64_rows(query, key, value, allowed, scale, gqa)
    out = _float32_blocks(query, key, value, allowed, seen, scale, gqa)
    if long is True:
        return out
    # A pass that straddles LONG_CONTEXT (rare): each row takes its own position's path.
    short = _float64_rows(query, key, value, allowed, scale, gqa)
    return torch.where(long, out, short)


def _row_positions(allowed: torch.Tensor | None, rows: int, kv: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | bool | None, int]:
    """``(allowed, long, seen)`` for ``attend_new_rows``: the mask (all keys where None), which rows
    lie at ``LONG_CONTEXT`` or later (None: none, True: all, else a ``[1 | b, 1, r, 1]`` pick), and
    the most keys a row sees."""
    if allowed is None:
        allowed = torch.ones(rows, kv, dtype=torch.bool, device=device)
    # Each row's position: the keys it sees, less one (causal rows see 0 .. position).
    positions = allowed.sum(-1) - 1  # [r] or [b, 1, r]
    long = positions >= kv_cache.LONG_CONTEXT
    if not bool(long.any()):
        return allowed, None, 0
    if bool(long.all()):
        return allowed, True, int(positions.max()) + 1
    pick = long[None, None, :, None] if long.dim() == 1 else long[..., None]
    return allowed, pick, int(positions.max()) + 1


#: The last derived masks, per purpose: ``(key, the mask they came from, what was built)``.
_REMEMBERED: dict[str, tuple[Any, Any, Any]] = {}


def _remembered(purpose: str, allowed: torch.Tensor | None, shape_key: Any, build: Callable[[], Any]) -> Any:
    """``build()``, or what it returned last for the same ``allowed`` mask (the same tensor object,
    not modified since, or None for both) and ``shape_key``. Why: a forward hands one mask to every
    layer, and what the float32 path derives from it (row positions, padded and folded masks over
    thousands of keys) is a noticeable share of a one-row long-context forward when built again
    in each layer. The entry keeps a reference to the mask, so no
    new tensor can take over its identity while it is remembered."""
    key = (shape_key, None if allowed is None else (id(allowed), allowed._version))
    hit = _REMEMBERED.get(purpose)
    if hit is not None and hit[0] == key and hit[1] is allowed:
        return hit[2]
    value = build()
    _REMEMBERED[purpose] = (key, allowed, value)
    return value


def _float64_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                  scale: float, gqa: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=allowed, scale=scale, enable_gqa=gqa).float()


def _float32_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                    seen: int, scale: float, gqa: bool) -> torch.Tensor:
    """Float32 attention whose every call has one shape class: ``F32_QUERY_BLOCK`` query rows
    (zero-padded) against keys padded to whole ``F32_KEY_BLOCK``s (masked). The CPU flash kernel
    then computes each row with the same matmul shapes and the same key blocks wherever the row
    sits (which block, which batch row, how many rows the pass has, how many masked blocks
    follow), so a row's result has the same bits in a one-token pass, a verify pass and a packed
    batch step (tested). ``seen``: the most keys any row sees.

    Where it saves blocks, the query heads that share a key head (GQA) are folded into that key
    head's rows: a one-row pass of the embedded model computes 3 blocks of 8 rows instead of 9
    (one per query head). One request's folded blocks go into the batch dimension of one call
    over a stride-0 view of the keys; a batch grid's take one call each, so there it folds only
    what fits one block. A row meets the same shapes and the same keys in every layout, so its bits do
    not depend on the layout (checked against one block per head, batch 1 and 3, 1-21 rows)."""
    b, heads, r, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads if gqa else 1
    span = -(-seen // F32_KEY_BLOCK) * F32_KEY_BLOCK
    key, value = _key_span(key, span), _key_span(value, span)
    per_block = F32_QUERY_BLOCK
    # Fold where it saves a third of the blocks or more: smaller savings measured slower (see
    # docs/extraction.md, long prompts); in a batch grid only what fits one block (one call per block there).
    if b == 1:
        folded, unfolded = kv_heads * -(-group * r // per_block), heads * -(-r // per_block)
        fold = 3 * folded <= 2 * unfolded
    else:
        fold = group * r <= per_block
    fold = fold and group > 1
    repeat = group if fold else 1  # each row of the mask, once per query head folded beside it
    if fold:
        q, gqa = query.float().reshape(b, kv_heads, group * r, d), False
    else:
        q = query.float()
    rows = q.shape[2]
    pad = -rows % per_block
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    mask = _remembered("float32 mask", allowed, (span, repeat, pad), lambda: _float32_mask(allowed, span, repeat, pad))
    blocks, q_heads = (rows + pad) // per_block, q.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if fold and b == 1:  # every block in one call: the blocks in the batch dimension, the keys a stride-0 view
        qb = q.view(q_heads, blocks, per_block, d).transpose(0, 1)
        out = sdpa(qb, key.expand(blocks, -1, -1, -1), value.expand(blocks, -1, -1, -1),
                   attn_mask=mask.view(blocks, 1, per_block, span), scale=scale, enable_gqa=gqa)
        out = out.transpose(0, 1).reshape(1, q_heads, rows + pad, d)
    else:
        mask = mask[:, None]
        parts = [sdpa(q[:, :, i : i + per_block], key, value, attn_mask=mask[..., i : i + per_block, :], scale=scale,
                      enable_gqa=gqa) for i in range(0, rows + pad, per_block)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out[:, :, :rows].reshape(b, heads, r, d)


def _float32_mask(allowed: torch.Tensor, span: int, group: int, pad: int) -> torch.Tensor:
    """The additive mask ``[1 | b, rows + pad, span]`` of ``_float32_blocks`` from ``allowed``
    (``[r, kv]`` or ``[b, 1, r, kv]``): keys padded (masked) to ``span``, rows repeated ``group``
    times (folded query heads: row g * r + j of a key head is query head g at row j, and sees row
    j's keys), then ``pad`` padding rows that see key 0 only (no NaN; their output is dropped)."""
    allowed = allowed[..., :span] if allowed.shape[-1] >= span else torch.nn.functional.pad(
        allowed, (0, span - allowed.shape[-1]))
    allowed = allowed[None] if allowed.dim() == 2 else allowed[:, 0]  # [1 | b, r, span]
    if group > 1:
        allowed = allowed.repeat(1, group, 1)
    if pad:
        first_key = torch.zeros(allowed.shape[0], pad, span, dtype=torch.bool, device=allowed.device)
        first_key[..., 0] = True
        allowed = torch.cat([allowed, first_key], dim=-2)
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _key_span(x: torch.Tensor, span: int) -> torch.Tensor:
    """Positions ``0 .. span - 1`` of keys or values ``[b, h_kv, n, d]`` in float32. Past ``n``
    they come from the cache buffer the view lies in when it has them (the caches zero their
    buffers, so they are finite; the mask hides them), else from zero padding (a copy)."""
    x = x if x.dtype == torch.float32 else x.float()  # float64 copies of float32 keys: exact
    n = x.shape[2]
    if n >= span:
        return x[:, :, :span]
    b, h, _, d = x.shape
    s0, s1, s2, s3 = x.stride()
    last = x.storage_offset() + (b - 1) * s0 + (h - 1) * s1 + (span - 1) * s2 + (d - 1) * s3
    if s3 == 1 and s2 == d and s1 >= span * s2 and (b == 1 or s0 >= h * s1) and \
            last < x.untyped_storage().nbytes() // x.element_size():
        return x.as_strided((b, h, span, d), (s0, s1, s2, s3))
    return torch.nn.functional.pad(x, (0, 0, 0, span - n))


def _allowed(attention_mask: torch.Tensor | None, kv_len: int, first: int, prompt_rows: int,
             device: torch.device) -> torch.Tensor:
    """Which keys each new row (positions ``first..kv_len - 1``) may see: causal, and the
    attention mask's padding; ``[rows, kv]`` or ``[b, 1, rows, kv]``, to broadcast over the heads."""
    key_index = torch.arange(kv_len, device=device)[None, :]
    positions = key_index[0, first:, None]  # each new row's own position
    allowed = key_index <= positions  # causal, [rows, kv]
    if attention_mask is not None:
        m = attention_mask[..., prompt_rows:, :]
        allowed = allowed & (m if m.dtype == torch.bool else m > float("-inf"))  # [b, 1, rows, kv]
        # A left-padding row may see no key at all: let it see itself, so no NaN reaches the
        # cache (its output is never read).
        own = key_index == positions
        allowed = allowed | (~allowed.any(dim=-1, keepdim=True) & own)
    return allowed


def make_batch_invariant(model: Any, *, bucket_linears: bool | None = None) -> Any:
    """Install the invariant RMSNorm and attention in a llama-family model (in place) and mark it
    ``model.batch_invariant = True``; the decoder then tells it which rows are prompt rows. On a
    GPU (or with ``bucket_linears=True``) its ``nn.Linear`` layers become ``BucketedLinear``;
    ``Int4Linear`` layers are invariant as they are. On the CPU the output projection always
    becomes a ``BucketedLinear`` of ``OUTPUT_BUCKET`` rows computed as ``W @ X.T``.
    ``model.new_cache()`` then makes a KV cache of the kind its forwards expect (``_cache_factory``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, invariant_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    rows = RowSplit()
    rows.install(model)
    on_cpu = next(model.parameters()).device.type == "cpu"
    if bucket_linears is None:
        bucket_linears = not on_cpu
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Int4Linear":  # prompt rows on its dense path (models.int4)
            module.rows = rows
        elif type(module).__name__.endswith("RMSNorm"):
            per_head = module.weight.shape[-1] != hidden_size
            module.rows = None if per_head else rows
            if hasattr(module, "variance_epsilon"):  # llama's form: weight * normed x
                module.forward = types.MethodType(invariant_rms_norm, module)
            elif callable(getattr(module, "_norm", None)) and hasattr(module, "eps"):  # Gemma's: normed x * (1 + weight)
                module._norm = types.MethodType(invariant_offset_rms_norm, module)
                module.offset_weight = (1.0 + module.weight.detach().float()).contiguous()
                module.forward = types.MethodType(fused_offset_rms_norm, module)
            else:
                raise TypeError(f"{type(module).__name__} is an RMSNorm of a form make_batch_invariant does not know")
        elif type(module) is nn.Linear and (bucket_linears or (on_cpu and module is output)):
            parent_name, _, child = name.rpartition(".")
            bucketed = (BucketedLinear(module, rows, bucket=OUTPUT_BUCKET, transposed=True) if on_cpu and module is output
                        else BucketedLinear(module, rows))
            setattr(model.get_submodule(parent_name) if parent_name else model, child, bucketed)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(IMPLEMENTATION)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = IMPLEMENTATION
    model.batch_invariant = True
    model.new_cache = _cache_factory(model)
    model.subset_logits = _subset_logits(model)
    model.vocabulary_rows = _vocabulary_rows(model)
    return model


def _subset_logits(model: Any) -> Callable[..., Any] | None:
    """``models.output_rows.forward_logits`` on the subset path, bound to this model, for other
    callers of its forwards (a draft model's drafter, which sits beside models/, not above it):
    ``(rows, allowed mask per row, **inputs) -> logits``, each row over the ids its mask allows
    where they are at most ``SUBSET_MAX`` (counted before any index is built: a wide mask costs
    no list of its ids), else over the whole vocabulary. None where the model's logits are more
    than an output layer of the final hidden state."""
    from . import output_rows  # it reads this module's layers

    if not output_rows.supports_subsets(model):
        return None

    def logits(rows: list[int], masks: list[torch.Tensor], vocabulary: Any = None, **inputs: Any) -> torch.Tensor:
        subsets = [m.nonzero().flatten() if 0 < int(m.sum()) <= output_rows.SUBSET_MAX else None for m in masks]
        return output_rows.forward_logits(model, rows, subsets, True, vocabulary, **inputs)[1]

    return logits


def _vocabulary_rows(model: Any) -> Callable[[int], Any] | None:
    """``size -> models.output_rows.VocabularyRows`` of the model's first ``size`` token ids
    (built once per size), for a draft model's drafter to pass to ``subset_logits`` as
    ``vocabulary=``; None where the subset path is not open to the model."""
    from . import output_rows

    if not output_rows.supports_subsets(model):
        return None
    built: dict[int, Any] = {}

    def rows(size: int) -> Any:
        if size not in built:
            built[size] = output_rows.VocabularyRows.leading(model, size)
        return built[size]

    return rows


def _cache_factory(model: Any) -> Callable[[], Any]:
    """A maker of fresh KV caches of the kind the decoder gives this model
    (``models.growing_cache`` in ``cache_dtype``), for other callers of its forwards (a draft
    model's drafter): a native model's scripted loop runs only on such a cache."""
    layers = model.config.num_hidden_layers
    return lambda: kv_cache.growing_cache(layers, cache_dtype(model))
