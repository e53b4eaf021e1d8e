"""Attention past ``LONG_CONTEXT``: float32 blocks of fixed shapes (``models.invariant``), bit for
bit the same for a row alone, in a verify pass of any length and in a packed batch grid, and
the caches that keep such rows in float32. The invariance holds on both attention paths
(``attention_path``: the row kernel, and the float64 / float32-blocks path it replaces); the
tests of that path's own arithmetic run on it (``float64_attention``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from constrained_spec.models import growing_cache as growing_cache_module
from constrained_spec.models import invariant
from constrained_spec.models.growing_cache import LONG_CONTEXT
from constrained_spec.models.invariant import _allowed, attend_new_rows

HEADS, KV_HEADS, DIM, CAP = 9, 3, 64, 3072
SCALE = DIM ** -0.5


def _buffers(rows: int, held: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed cache buffers ``[rows, kv_heads, CAP, dim]`` with ``held`` random positions, as the
    caches keep them."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.zeros(rows, KV_HEADS, CAP, DIM), torch.zeros(rows, KV_HEADS, CAP, DIM)
    k[:, :, :held] = torch.randn(rows, KV_HEADS, held, DIM, generator=g)
    v[:, :, :held] = torch.randn(rows, KV_HEADS, held, DIM, generator=g)
    return k, v


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int) -> torch.Tensor:
    """One row at ``position`` in a one-token pass: the cache's view of its keys, no mask."""
    return attend_new_rows(q, k[:, :, : position + 1], v[:, :, : position + 1], None, SCALE)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bit_identical_alone_in_a_pass_and_in_a_batch(threads, attention_path):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, v = _buffers(1, 2600)
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, HEADS, 64, DIM, generator=g)
        first = LONG_CONTEXT - 20  # rows straddle LONG_CONTEXT, then lie past it
        alone = torch.cat([_alone(q[:, :, i : i + 1], k, v, first + i) for i in range(64)], dim=2)
        for start in (0, 13, 20, 37):
            for r in (1, 2, 3, 5, 8, 9, 12, 16, 21, 24):
                if start + r > 64:
                    continue
                kv = first + start + r
                allowed = _allowed(None, kv, first + start, 0, q.device)
                got = attend_new_rows(q[:, :, start : start + r], k[:, :, :kv], v[:, :, :kv], allowed, SCALE)
                assert torch.equal(got, alone[:, :, start : start + r]), (start, r)
        # A packed batch grid: three rows of other lengths side by side, each against its own keys
        # (one buffer, views to the grid's furthest key, a per-row mask).
        kb, vb = _buffers(3, 2600)
        kb[1], vb[1] = k[0], v[0]
        bases = torch.tensor([LONG_CONTEXT + 300, first + 5, LONG_CONTEXT + 40])
        width = 7
        keys = int(bases.max()) + width
        qb = torch.randn(3, HEADS, width, DIM, generator=g)
        qb[1] = q[0, :, 5 : 5 + width]
        query_pos = bases[:, None] + torch.arange(width)
        mask = (torch.arange(keys)[None, None, :] <= query_pos[:, :, None])[:, None]
        allowed = _allowed(mask, keys, keys - width, 0, q.device)
        got = attend_new_rows(qb, kb[:, :, :keys], vb[:, :, :keys], allowed, SCALE)
        assert torch.equal(got[1:2], alone[:, :, 5 : 5 + width])
        for row in (0, 2):
            one = torch.cat([_alone(qb[row : row + 1, :, t : t + 1], kb[row : row + 1], vb[row : row + 1],
                                    int(query_pos[row, t])) for t in range(width)], dim=2)
            assert torch.equal(got[row : row + 1], one), row
    finally:
        torch.set_num_threads(old)


def test_rows_before_long_context_keep_their_float64_bits(float64_attention):
    """Short contexts are unchanged: the float64 attention, bit for bit."""
    k, v = _buffers(1, 600)
    q = torch.randn(1, HEADS, 6, DIM, generator=torch.Generator().manual_seed(2))
    allowed = _allowed(None, 600, 594, 0, q.device)
    want = F.scaled_dot_product_attention(q.double(), k[:, :, :600].double(), v[:, :, :600].double(),
                                          attn_mask=allowed, scale=SCALE, enable_gqa=True).float()
    assert torch.equal(attend_new_rows(q, k[:, :, :600], v[:, :, :600], allowed, SCALE), want)


def test_the_fixed_shapes_are_what_makes_float32_invariant():
    """The control: the stock float32 kernel over the same rows gives a row other bits in a
    longer pass (its matmul shapes follow the row count), so the test above can fail."""
    k, v = _buffers(1, 2600)
    q = torch.randn(1, HEADS, 24, DIM, generator=torch.Generator().manual_seed(3))
    first = LONG_CONTEXT + 100

    def stock(rows: slice) -> torch.Tensor:
        kv = first + rows.stop
        allowed = _allowed(None, kv, first + rows.start, 0, q.device)
        return F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :kv], v[:, :, :kv], attn_mask=allowed,
                                              scale=SCALE, enable_gqa=True)

    alone = torch.cat([stock(slice(i, i + 1)) for i in range(24)], dim=2)
    assert not torch.equal(stock(slice(0, 24)), alone)


def _per_head_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The reference layout: each query head's rows in blocks of 8, one kernel call a block, keys
    padded to whole 512-key blocks (what ``_float32_blocks`` computed before it folded heads)."""
    b, heads, r, d = q.shape
    span = -(-allowed.shape[-1] // invariant.F32_KEY_BLOCK) * invariant.F32_KEY_BLOCK
    kp, vp = F.pad(k, (0, 0, 0, span - k.shape[2])), F.pad(v, (0, 0, 0, span - v.shape[2]))
    allowed = F.pad(allowed if allowed.dim() == 4 else allowed[None, None], (0, span - allowed.shape[-1]))
    pad = -r % invariant.F32_QUERY_BLOCK
    first_key = torch.zeros(*allowed.shape[:2], pad, span, dtype=torch.bool)
    first_key[..., 0] = True
    allowed = torch.cat([allowed, first_key], dim=2)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    qp = F.pad(q, (0, 0, 0, pad))
    block = invariant.F32_QUERY_BLOCK
    out = torch.cat([F.scaled_dot_product_attention(qp[:, :, i : i + block], kp, vp, attn_mask=mask[..., i : i + block, :],
                                                    scale=SCALE, enable_gqa=True) for i in range(0, r + pad, block)], dim=2)
    return out[:, :, :r]


@pytest.mark.parametrize("batch", [1, 3])
def test_folding_query_heads_into_key_heads_changes_no_bit(batch, float64_attention):
    """Folding each key head's query heads into its rows (and one request's blocks into one call
    over a stride-0 view of the keys) gives every row the bits of one block per query head."""
    k, v = _buffers(batch, 2700)
    g = torch.Generator().manual_seed(4)
    for r in (1, 2, 3, 4, 8, 12, 21):
        kv = LONG_CONTEXT + 500 + r
        q = torch.randn(batch, HEADS, r, DIM, generator=g)
        allowed = _allowed(None, kv, kv - r, 0, q.device)
        if batch > 1:  # rows of other lengths: a per-row mask, as in a batch grid
            allowed = allowed[None, None].repeat(batch, 1, 1, 1)
            allowed[1, ..., kv - r - 300 : kv - r] = False
        got = attend_new_rows(q, k[:, :, :kv], v[:, :, :kv], allowed, SCALE)
        assert torch.equal(got, _per_head_blocks(q, k[:, :, :kv], v[:, :, :kv], allowed)), r


def test_the_caches_keep_long_rows_in_float32():
    from constrained_spec.batching.cache import RowCache
    from constrained_spec.models.growing_cache import GrowingLayer

    layer = GrowingLayer(torch.float64)
    x = torch.randn(1, KV_HEADS, 300, DIM)
    layer.update(x, x)
    assert layer.keys.dtype == torch.float64
    y = torch.randn(1, KV_HEADS, LONG_CONTEXT, DIM)
    layer.update(y, -y)
    assert layer.keys.dtype == torch.float32 and layer.length == LONG_CONTEXT + 300
    assert torch.equal(layer.keys[:, :, :300], x) and torch.equal(layer.values[:, :, 300:], -y)  # exact
    # Attention reads whole key blocks past the held positions: finite (zeros), never garbage.
    assert torch.equal(layer._k[:, :, layer.length :], torch.zeros_like(layer._k[:, :, layer.length :]))

    cache = RowCache(num_layers=1, slots=2, max_capacity=8192, dtype=torch.float64)
    assert cache.shelf_dtype(cache.capacity_for(LONG_CONTEXT)) == torch.float64
    assert cache.shelf_dtype(cache.capacity_for(LONG_CONTEXT + 1)) == torch.float32
    from transformers import DynamicCache

    row = cache.add_row(DynamicCache(), positions=LONG_CONTEXT - 100)
    block = torch.randn(KV_HEADS, LONG_CONTEXT - 100, DIM)
    cache.append(row, [block], [block])
    assert cache.block(row, 0, 10)[0][0].dtype == torch.float64
    cache.append(row, [block[:, :200]], [block[:, :200]])  # the row moves up to a float32 shelf
    keys = cache.block(row, 0, LONG_CONTEXT + 100)[0][0]
    assert keys.dtype == torch.float32 and torch.equal(keys[:, : LONG_CONTEXT - 100], block)
    per = 2 * KV_HEADS * DIM
    assert cache.footprint_bytes([LONG_CONTEXT + 100], per, 4) == cache.capacity_for(LONG_CONTEXT + 100) * per * 4
    assert cache.footprint_bytes([300], per, 4) == cache.capacity_for(300) * per * 8


def test_threshold_is_read_at_call_time(monkeypatch):
    """Tests elsewhere move ``LONG_CONTEXT`` into a short prompt; the caches and attention follow."""
    from constrained_spec.models.growing_cache import GrowingLayer

    monkeypatch.setattr(growing_cache_module, "LONG_CONTEXT", 40)
    layer = GrowingLayer(torch.float64)
    x = torch.randn(1, KV_HEADS, 50, DIM)
    layer.update(x, x)
    assert layer.keys.dtype == torch.float32


def _outcome(fn):
    """A request's text, or its error's kind and partial text: greedy identity covers errors too."""
    from constrained_spec.errors import TokenLimitError

    try:
        return fn()
    except TokenLimitError as e:
        return (type(e).__name__, e.partial_text)


@pytest.mark.slow
def test_a_document_past_long_context_gives_target_only_output_with_every_path(smol):
    """A real 2,300-token document (its new rows attend in float32 blocks over a float32 cache):
    speculative output equals target-only output, alone and in the batch engine beside a short
    document."""
    from constrained_spec import extract, generate_json
    from constrained_spec.bench.batch import Person
    from constrained_spec.bench.long_prompt import long_document

    document = long_document(smol.tokenizer, LONG_CONTEXT + 250)
    prompt = "Extract the first person described in this text.\n\n" + document
    assert len(smol.tokenizer(prompt)["input_ids"]) > LONG_CONTEXT + 200
    target_only = _outcome(lambda: generate_json(smol, Person, prompt, drafter="none", max_new_tokens=48).model_dump())
    auto = _outcome(lambda: generate_json(smol, Person, prompt, drafter="auto", max_new_tokens=48).model_dump())
    assert auto == target_only
    short = "Tom Okafor, 52, is a harbour pilot in Rotterdam."
    template = "Extract the first person described in this text.\n\n{text}"
    alone = [r.value or r.error for r in extract(Person, [document, short], model=smol, prompt_template=template,
                                                 max_new_tokens=48)]
    batched = [r.value or r.error for r in extract(Person, [document, short], model=smol, prompt_template=template,
                                                   batch_size=2, max_new_tokens=48)]
    assert batched == alone


def test_masks_derived_once_a_forward_follow_the_mask_they_came_from(attention_path):
    """The float32 path remembers what it derived from the last mask (a forward hands one mask to
    every layer); a mask changed in place, or another mask, gets its own derivation."""
    k, v = _buffers(1, 2600)
    q = torch.randn(1, HEADS, 4, DIM, generator=torch.Generator().manual_seed(5))
    kv = LONG_CONTEXT + 300
    allowed = _allowed(None, kv, kv - 4, 0, q.device)
    first = attend_new_rows(q, k[:, :, :kv], v[:, :, :kv], allowed, SCALE)
    assert torch.equal(attend_new_rows(q, k[:, :, :kv], v[:, :, :kv], allowed, SCALE), first)
    allowed[:, :200] = False  # in place: the same object, another mask
    changed = attend_new_rows(q, k[:, :, :kv], v[:, :, :kv], allowed, SCALE)
    assert not torch.equal(changed, first)
    assert torch.equal(changed, attend_new_rows(q, k[:, :, :kv], v[:, :, :kv], allowed.clone(), SCALE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,keys", [(256, 256), (256, 1300), (40, 700)])
def test_prompt_attention_gives_transformers_bits_without_repeating_the_keys(dtype, rows, keys):
    """``invariant.prompt_attention``: a masked GQA chunk on torch's kernel with the heads grouped
    equals transformers' ``sdpa_attention_forward`` (which repeats the key heads), bit for bit;
    one row and an unmasked chunk take transformers' own path."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from constrained_spec.models.invariant import _additive_causal, _allowed, prompt_attention

    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    g = torch.Generator().manual_seed(rows + keys)
    q = torch.randn(1, 9, rows, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, keys, 64, generator=g).to(dtype) for _ in range(2))
    mask = _allowed(None, keys, keys - rows, 0, q.device)[None, None]
    want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.125)
    assert torch.equal(prompt_attention(module, q, k, v, mask, 0.125, 0.0, {}), want)
    additive = _additive_causal(keys, keys - rows, rows, dtype, q.device)  # what the prompt chunks pass
    assert torch.equal(prompt_attention(module, q, k, v, additive, 0.125, 0.0, {}), want)
    first = prompt_attention(module, q, k[:, :, :rows], v[:, :, :rows], None, 0.125)  # no mask: causal, theirs
    assert torch.equal(first, sdpa_attention_forward(module, q, k[:, :, :rows], v[:, :, :rows], None, scaling=0.125)[0])
