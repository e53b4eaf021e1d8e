"""Packed batched steps: the layout round-trips, and on the embedded model at native precision
a request that joins inside a batched step (its prompt packed among other rows' new tokens)
gets bit for bit the keys its own first pass computes, in every layer."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, PrefixCache, SpeculativeDecoder
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.batching.packing import pack_rows
from constrained_spec.decoding.prefix import shared_prefix_length
from constrained_spec.drafters import build_drafter
from tests.test_prefix import DOCS, ROOT, SHARED


def test_pack_rows_places_every_token_once():
    lengths = torch.tensor([7, 3, 10, 5])
    # row 0: 3 new; row 1: a joining prompt of 4, then 2 new; row 2 sits out; row 3: 3 new
    p = pack_rows(lengths, [3, 2, 0, 3], [0, 4, 0, 0])
    assert p.tokens == 12 and p.batch == 4 and p.starts == [0, 3, 9, 9]
    assert p.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 3, 3, 3]
    assert p.positions.tolist() == [7, 8, 9, 3, 4, 5, 6, 7, 8, 5, 6, 7]
    [grid] = p.grids
    assert grid.slots is None and grid.width == 3
    assert grid.tokens.tolist() == [0, 1, 2, 7, 8, 9, 10, 11]  # the prompt tokens (3..6) are not in the grid
    cells = torch.full((4 * 3,), -1)
    cells[grid.scatter] = grid.tokens
    assert cells.view(4, 3).tolist() == [[0, 1, 2], [7, 8, -1], [-1, -1, -1], [9, 10, 11]]
    assert torch.equal(grid.gather[grid.scatter], grid.tokens)  # grid -> packed undoes packed -> grid
    [seg] = p.prompts
    assert (seg.row, seg.start, seg.length, seg.past, seg.fed) == (1, 3, 4, 3, 6)
    assert p.key_length == 10 + 3  # the longest base (row 2: 10) plus the widest row
    assert grid.mask.shape == (4, 1, 3, 10)  # row 0's and row 1's base 7 plus the width (row 2 feeds nothing)
    assert grid.mask[1, 0, 0].nonzero().flatten().tolist() == list(range(8))  # row 1's first new token: position 7
    assert grid.mask[0, 0, 2].nonzero().flatten().tolist() == list(range(10))


def test_one_long_row_goes_to_a_second_grid():
    """Eight rows feed 2 tokens, one a 12-token forced span: its tokens past the others' width go
    to a grid of their own instead of padding every row to 12."""
    counts = [2] * 8 + [12]
    p = pack_rows(torch.arange(10, 19), counts)
    a, b = p.grids
    assert (a.slots, a.width, a.offset) == (None, 2, 0)
    assert b.slots.tolist() == [8] and (b.width, b.offset) == (10, 2)
    assert sorted(a.tokens.tolist() + b.tokens.tolist()) == list(range(sum(counts)))  # every token once
    # The long row's first grid query sits at position 18 (its cache length), the second grid's first at 20.
    assert a.mask[8, 0, 0].nonzero().flatten().tolist() == list(range(19))
    assert b.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(21))
    assert pack_rows(torch.arange(10, 19), [2] * 9).grids[0].width == 2  # even rows: one grid


@pytest.fixture(scope="module")
def native(smol):
    assert getattr(smol.model, "batch_invariant", False), "the default precision on the CPU is native, batch-invariant"
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol.vocabulary)
    prompts = [smol.tokenizer(SHARED + d)["input_ids"] for d in DOCS]
    shared = shared_prefix_length(prompts[0], smol.tokenizer(SHARED)["input_ids"])
    return smol, compiled, prompts, shared


def _decoder(smol, compiled, prompt, prefix_len, cache):
    m = compiled.matcher()
    drafter = build_drafter("auto", m, smol.tokenizer)
    return SpeculativeDecoder(smol.model, m, prompt, drafter=drafter, k_policy=FixedK(6), max_new_tokens=24,
                              prefix_len=prefix_len, prefix_cache=cache)


def test_rows_of_very_different_lengths_attend_in_grids_of_their_own():
    """A 4,000-token row beside short ones: its queries get a grid of their own, the short rows'
    grid spans their keys only; while it feeds nothing (waiting for its next prompt chunk) it is
    in no grid at all."""
    lengths = torch.tensor([300, 4000, 280, 350])
    p = pack_rows(lengths, [2, 1, 3, 1])
    assert len(p.grids) == 2 and p.key_length == 4000 + 3
    short, long = sorted(p.grids, key=lambda g: g.keys)
    assert short.slots.tolist() == [0, 2, 3] and short.keys == 350 + 3 and short.mask.shape == (3, 1, 3, 353)
    assert long.slots.tolist() == [1] and long.keys == 4001 and long.width == 1
    assert sorted(short.tokens.tolist() + long.tokens.tolist()) == list(range(7))
    waiting = pack_rows(lengths, [2, 0, 3, 1])
    [grid] = waiting.grids
    assert grid.slots.tolist() == [0, 2, 3] and grid.keys == 353
    near = pack_rows(torch.tensor([300, 500, 280]), [2, 0, 1])  # similar lengths: one grid over all, no gather
    assert [g.slots for g in near.grids] == [None]


def test_a_shelf_grid_spans_only_the_keys_its_rows_tokens_need():
    """Two rows on one shelf of 16: one full and feeding nothing, one feeding 4 tokens after 5.
    Their grid reads the shelf's view and spans 9 keys (the feeding row's 5 plus the width), not
    the full row's 16 plus the width, which would lie past the shelf."""
    from transformers import DynamicCache

    from constrained_spec.batching.cache import RowCache

    cache = RowCache(num_layers=1, slots=4, max_capacity=64, capacity=16)
    for n in (16, 5):
        row = cache.add_row(DynamicCache())
        block = [torch.zeros(1, n, 2, dtype=torch.float64)]
        cache.append(row, block, block)
    cache.reserve_row(1, 9)
    assert cache.parts() == [[0, 1]]
    [grid] = pack_rows(cache.lengths[:2], [0, 4], parts=cache.parts()).grids
    assert grid.slots is None and grid.keys == 9 and grid.mask.shape == (2, 1, 4, 9)
    assert grid.mask[1, 0].sum(-1).tolist() == [6, 7, 8, 9]


def test_every_query_lies_where_the_kernels_take_it_and_within_its_shelf():
    """Random layouts on shelves: in every grid, each row's real query in column ``t`` sits at
    key ``keys - width + t`` or before (the kernels' causal assumption, ``models.invariant``),
    and no grid spans past a shelf once the rows that feed have room for the widest row."""
    import random

    from transformers import DynamicCache

    from constrained_spec.batching.cache import RowCache

    rng = random.Random(3)
    for _ in range(200):
        cache = RowCache(num_layers=1, slots=6, max_capacity=4096, capacity=16)
        b = rng.randint(1, 6)
        for _ in range(b):
            n = rng.choice([0, 3, 15, 16, 31, 32, 60])
            row = cache.add_row(DynamicCache())
            if n:
                block = [torch.zeros(1, n, 2, dtype=torch.float64)]
                cache.append(row, block, block)
        counts = [rng.choice([0, 1, 1, 2, 5, 13]) for _ in range(b)]
        if not any(counts):
            counts[0] = 1
        for i in range(b):
            cache.reserve_row(i, int(cache.lengths[i]) + (max(counts) if counts[i] else 0))
        p = pack_rows(cache.lengths[:b], counts, parts=cache.parts())
        capacity = [cache.capacity_of(i) for i in range(b)]
        for grid in p.grids:
            rows = cache.parts()[grid.part] if grid.slots is None else [cache.parts()[grid.part][s] for s in grid.slots.tolist()]
            assert grid.keys <= min(capacity[i] for i in rows)
            for g, i in enumerate(rows):
                for t in range(grid.offset, min(counts[i], grid.offset + grid.width)):
                    col = t - grid.offset
                    position = int(cache.lengths[i]) + t
                    assert position <= grid.keys - grid.width + col
                    assert grid.mask[g, 0, col, : position + 1].all() and not grid.mask[g, 0, col, position + 1 :].any()


def test_a_joining_prompt_gets_its_own_first_pass_bit_for_bit(native, monkeypatch):
    """Three requests join one engine at different times (one with no shared prefix, two from
    the prefix cache; one while the others decode): each one's keys equal those of its own first
    pass exactly, and its first-step logits up to the output projection's rounding."""
    smol, compiled, prompts, shared = native
    cache = PrefixCache()
    specs = [(prompts[0], None), (prompts[1], shared), (prompts[2], shared)]
    reference = []
    for prompt, prefix_len in specs:
        dec = _decoder(smol, compiled, prompt, prefix_len, cache)
        dec.begin()
        plan = dec.plan()
        logits = dec._verify_forward(plan)[0]
        dec.store_prompt_blocks(plan.chunks, dec._cache_block)  # as its step does: the shared prefix's block for the next ones
        keys = [layer.keys[0].double() for layer in dec.cache.layers]
        reference.append((plan.tokens, logits, keys, len(plan.draft.tokens)))
        dec.close()

    engine = BatchEngine(smol.model, max_batch=2, prefix_cache=cache)
    captured: dict[int, tuple[list[int], torch.Tensor, list[torch.Tensor]]] = {}
    finish = SpeculativeDecoder.finish

    def spy(self, plan, logits, seconds, prompt_seconds=None):
        if plan.first:
            req = next(r for r in engine.active if r.decoder is self)
            n = int(engine.cache.lengths[req.slot]) + len(plan.tokens)
            keys = [k.clone() for k in engine.cache.block(req.slot, 0, n)[0]]
            captured[reqs.index(req)] = (plan.tokens, logits.clone(), keys)
        return finish(self, plan, logits, seconds, prompt_seconds)

    monkeypatch.setattr(SpeculativeDecoder, "finish", spy)
    reqs = [engine.submit(prompt, (m := compiled.matcher()), drafter=build_drafter("auto", m, smol.tokenizer),
                          k_policy=FixedK(6), max_new_tokens=24, prefix_len=prefix_len) for prompt, prefix_len in specs]
    list(engine.run())
    assert sorted(captured) == [0, 1, 2]
    for i, (tokens, logits, keys, _) in enumerate(reference):
        got_tokens, got_logits, got_keys = captured[i]
        assert got_tokens == tokens[len(tokens) - len(got_tokens):]  # its prompt's uncached part, last token, drafts
        assert all(torch.equal(a, b) for a, b in zip(got_keys, keys)), f"request {i}: keys differ"
        # The output projection is a plain float32 matmul whose blocking follows its row count
        # (``models.invariant``): equal up to its rounding, and the same tokens win.
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-4)
        assert torch.equal(got_logits.argmax(-1), logits.argmax(-1))
    assert all(drafts for *_, drafts in reference)  # every first step verified drafts beside its prompt
