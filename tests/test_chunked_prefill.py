"""Chunked prefill and block prefix caching (``decoding.prefix``): prompts cut at fixed absolute
positions, a long prompt fed chunk by chunk between the other rows' steps with the very keys its
own first pass computes, and blocks reused bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, PrefixCache, SpeculativeDecoder, decode
from constrained_spec.decoding import prefix as prefix_module
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.decoding.prefix import prompt_chunks
from constrained_spec.drafters import LookupDrafter, build_drafter
from tests.conftest import tiny_llama
from tests.test_prefix import ROOT, SHARED

CHUNK = 64  # tests shrink the chunk so that a few hundred tokens make several


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(prefix_module, "PREFILL_CHUNK", CHUNK)


def _documents() -> list[str]:
    path = ROOT / "constrained_spec" / "data" / "people.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _long_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` extraction prompts over one long document made of the shipped ones, each asking
    about another person at its end (so they share their leading chunks)."""
    docs = _documents()
    body = " ".join(docs[:16])
    return [tokenizer(SHARED + body + f"\n\nOnly the person in sentence {i + 1}.")["input_ids"] for i in range(n)]


def test_prompt_chunks_cut_at_fixed_absolute_positions():
    tokens = list(range(600))
    chunks = prompt_chunks(tokens)
    assert [(c.start, c.end) for c in chunks] == [(0, 256), (256, 512), (512, 600)]
    assert [c.key is not None for c in chunks] == [True, True, False]  # the tail ends wherever the prompt does
    assert chunks[1].key == (tuple(range(512)), (256, 512))
    with_prefix = prompt_chunks(tokens, prefix_len=40)
    assert [(c.start, c.end) for c in with_prefix] == [(0, 40), (40, 256), (256, 512), (512, 600)]
    assert with_prefix[2].key != chunks[1].key  # the same tokens cut otherwise: other bits, another block
    assert [(c.start, c.end) for c in prompt_chunks(tokens[:512])] == [(0, 256), (256, 512)]
    assert prompt_chunks([]) == [] and [(c.start, c.end) for c in prompt_chunks(tokens[:8], prefix_len=8)] == [(0, 8)]


def _reference(smol, compiled, prompt, cache=None, prefix_len=None):
    """A request alone: its first step's tokens, logits, and every fed position's keys; then its output."""
    m = compiled.matcher()
    dec = SpeculativeDecoder(smol.model, m, prompt, drafter=build_drafter("auto", m, smol.tokenizer),
                             k_policy=FixedK(6), max_new_tokens=24, prefix_cache=cache, prefix_len=prefix_len)
    dec.begin()
    plan = dec.plan()
    logits = dec._verify_forward(plan)[0]
    dec.store_prompt_blocks(plan.chunks, dec._cache_block)  # as its step does
    keys = [layer.keys[0].clone() for layer in dec.cache.layers]
    m2 = compiled.matcher()
    out = decode(smol.model, m2, prompt, drafter=build_drafter("auto", m2, smol.tokenizer), k_policy=FixedK(6),
                 max_new_tokens=24, prefix_len=prefix_len)
    return plan, logits, keys, out.tokens


def test_a_long_prompt_is_fed_chunk_by_chunk_beside_decoding_rows(smol, small_chunks, monkeypatch):
    """A long request, then a short one with a shared prefix of its own: the short prompt's
    chunk goes first (least prompt left), the long prompt is fed one chunk per step at most, the
    short row keeps stepping meanwhile, and the long row's keys equal its own first pass bit for
    bit (its outputs too, and the short one's)."""
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol.tokenizer)
    long_prompt = _long_prompts(smol.tokenizer, 1)[0]
    short_prompt = smol.tokenizer(SHARED + "Ada Lovelace, 36, London, mathematician.")["input_ids"][-40:]
    assert len(long_prompt) > 4 * CHUNK and len(short_prompt) < CHUNK
    plan, logits, keys, long_tokens = _reference(smol, compiled, long_prompt)
    short_tokens = _reference(smol, compiled, short_prompt, prefix_len=16)[3]

    engine = BatchEngine(smol.model, max_batch=2, prefix_cache=PrefixCache())
    captured = {}
    finish = SpeculativeDecoder.finish

    def spy(self, p, lg, seconds, prompt_seconds=None):
        if p.first and self is reqs[0].decoder:
            n = int(engine.cache.lengths[reqs[0].slot]) + len(p.tokens)
            captured.update(tokens=p.tokens, logits=lg.clone(), keys=[k.clone() for k in engine.cache.block(reqs[0].slot, 0, n)[0]])
        return finish(self, p, lg, seconds, prompt_seconds)

    monkeypatch.setattr(SpeculativeDecoder, "finish", spy)
    reqs = []
    for prompt, prefix_len in ((long_prompt, None), (short_prompt, 16)):
        m = compiled.matcher()
        reqs.append(engine.submit(prompt, m, drafter=build_drafter("auto", m, smol.tokenizer), k_policy=FixedK(6),
                                  max_new_tokens=24, prefix_len=prefix_len))
    short_steps_while_prefilling = 0
    while engine.busy:
        before = len(reqs[1].decoder.output)
        engine.step()
        if reqs[0].decoder.prompt_chunks and len(reqs[1].decoder.output) > before:
            short_steps_while_prefilling += 1
    assert engine.step_chunk_tokens[0] == 16  # the short prompt's chunk first, alone (16 + 64 > 64)
    assert max(engine.step_chunk_tokens) == CHUNK and sum(engine.step_chunk_tokens) == plan.chunks[-1].start + 16
    assert short_steps_while_prefilling >= 2  # the short row was not held until the long prompt was in
    assert [r.result.tokens for r in reqs] == [long_tokens, short_tokens]
    assert captured["tokens"] == plan.tokens[len(plan.tokens) - len(captured["tokens"]):]
    assert len(captured["keys"][0][0]) == len(keys[0][0])
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(captured["keys"], keys)), "chunked keys differ"
    assert torch.equal(captured["logits"].argmax(-1), logits.argmax(-1))


def test_cached_blocks_equal_cold_ones_bit_for_bit(smol, small_chunks):
    """Prompts that share their leading chunks reuse them from the cache: the keys of every
    position equal a cold run's exactly, the outputs too, alone and in the engine."""
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol.tokenizer)
    first, second = _long_prompts(smol.tokenizer, 2)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    cache = PrefixCache()
    _reference(smol, compiled, first, cache)
    m = compiled.matcher()
    _, _, cold_keys, cold_tokens = _reference(smol, compiled, second)
    warm = SpeculativeDecoder(smol.model, m, second, drafter=build_drafter("auto", m, smol.tokenizer),
                              k_policy=FixedK(6), max_new_tokens=24, prefix_cache=cache)
    warm.begin()
    assert warm.stats.prefix_cached_tokens == shared // CHUNK * CHUNK > 2 * CHUNK
    plan = warm.plan()
    warm._verify_forward(plan)
    assert all(torch.equal(layer.keys[0], k) for layer, k in zip(warm.cache.layers, cold_keys))

    engine = BatchEngine(smol.model, max_batch=2, prefix_cache=cache)
    reqs = []
    for prompt in (second, first):
        m = compiled.matcher()
        reqs.append(engine.submit(prompt, m, drafter=build_drafter("auto", m, smol.tokenizer), k_policy=FixedK(6),
                                  max_new_tokens=24))
    list(engine.run())
    assert reqs[0].result.tokens == cold_tokens
    assert all(r.result.stats.prefix_cached_tokens >= shared // CHUNK * CHUNK for r in reqs)
    assert sum(engine.step_chunk_tokens) <= 2 * CHUNK  # only what no block held was fed


def test_rows_that_join_together_feed_a_shared_chunk_once(smol, small_chunks):
    """Requests with the same template admitted at once: the first feeds the shared chunk, the
    others copy its block as soon as it is there."""
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol.tokenizer)
    prompts = _long_prompts(smol.tokenizer, 3)
    engine = BatchEngine(smol.model, max_batch=3, prefix_cache=PrefixCache())
    for p in prompts:
        m = compiled.matcher()
        engine.submit(p, m, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=8)
    list(engine.run())
    # Every distinct chunk before a prompt's last (which rides with its first draft), once.
    distinct = {c.key: c.length for p in prompts for c in prompt_chunks(p[:-1])[:-1]}
    assert len(distinct) < 2 * len(prompts[0]) // CHUNK  # most are shared
    assert sum(engine.step_chunk_tokens) == sum(distinct.values())


def test_a_model_that_is_not_batch_invariant_gets_exact_blocks_too(smol_tokenizer, small_chunks):
    """A float64 tiny model (no row split): each chunk but the last in a forward of its own, so
    a cached block is the very tensor a cold run computes."""
    target = tiny_llama(49152 + 64, seed=5, init=0.3, context=1024)
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol_tokenizer)
    first, second = _long_prompts(smol_tokenizer, 2)
    cache = PrefixCache()

    def run(prompt, store):
        m = compiled.matcher()
        return decode(target, m, prompt, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=16,
                      prefix_cache=store)

    run(first, cache)
    assert len(cache) == len(prompt_chunks(first[:-1])) - 1  # all but the last, which rides with the first draft
    warm, cold = run(second, cache), run(second, None)
    assert warm.stats.prefix_cached_tokens > 2 * CHUNK and warm.tokens == cold.tokens
