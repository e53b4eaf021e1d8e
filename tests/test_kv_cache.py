"""After every step the KV caches equal those of a fresh forward over the accepted prefix."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, SpeculativeDecoder
from constrained_spec.drafters import ModelDrafter
from tests.conftest import tiny_llama

TOKENS = {1: b"a", 2: b"b", 3: b"ab", 4: b"c", 5: b"ba", 6: b"x"}


def fresh_cache(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def assert_same_cache(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(la.values, lb.values, rtol=0, atol=1e-10)


def test_caches_after_rollback_equal_fresh_forward():
    vocab = TokenVocabulary.build(TOKENS, 0, size=7)
    constraint = compile_constraint(r"[abx]{20,30}c", vocab, kind="regex", backend="outlines-core")
    target, draft = tiny_llama(10, seed=3), tiny_llama(10, seed=4)
    for temperature, seed in [(0.0, None), (1.0, 5)]:
        matcher = constraint.matcher()
        # the decoder seeds one generator and hands it to the drafter (shared, as before)
        drafter = ModelDrafter(draft, matcher, temperature=temperature)
        dec = SpeculativeDecoder(target, matcher, [6, 1, 2, 3], drafter=drafter, k_policy=FixedK(4),
                                 temperature=temperature, seed=seed, max_new_tokens=40)
        assert drafter.generator is dec.generator
        dec.start()
        rejected_steps = 0
        while not dec.finished and len(dec.output) < 30:
            before = dec.prompt_ids + dec.output
            dec.step()
            rejected_steps += dec.stats.accepted_per_step[-1] < dec.stats.ks[-1]
            seq = dec.prompt_ids + dec.output
            if not dec.finished:  # once finished (EOS or a done state) nothing is pending
                assert_same_cache(dec.cache, fresh_cache(target, seq[:-1]))
                assert dec.last == seq[-1]
            assert dec.state == matcher.walk(matcher.initial_state, dec.output)[-1]
            # the drafter crops lazily, at its next proposal: its cache holds the context it was
            # given plus the drafted tokens, and exactly matches the ids it records
            assert drafter.cached_ids[: len(before)] == before
            assert_same_cache(drafter.cache, fresh_cache(draft, drafter.cached_ids))
        assert rejected_steps > 0, "the test must exercise rollback"


def test_forced_language_and_one_token_prompt():
    """Every state allows one token: no vocabulary row is computed, yet the output is the forced
    text, the cache matches a fresh forward, and a one-token prompt (nothing to carry) works."""
    vocab = TokenVocabulary.build({1: b"a", 2: b"b", 4: b"c"}, 0, size=7)
    constraint = compile_constraint(r"abcab", vocab, kind="regex", backend="outlines-core")
    target = tiny_llama(10, seed=8)
    for prompt in ([6], [6, 1, 2]):
        dec = SpeculativeDecoder(target, constraint.matcher(), prompt, k_policy=FixedK(0), max_new_tokens=10)
        rows: list[int] = []
        real = dec._verify_forward
        dec._verify_forward = lambda plan: (rows.append(len(plan.rows)), real(plan))[1]
        for _ in dec.run():
            pass
        assert dec.output == [1, 2, 4, 1, 2] and dec.finished
        assert rows and all(n == 0 for n in rows)  # single-token states: no logits computed
        assert_same_cache(dec.cache, fresh_cache(target, (prompt + dec.output)[:-1]))


@torch.no_grad()
def test_growing_cache_gives_dynamic_cache_bits_and_grows_by_doubling():
    """A batch-invariant model with the decoder's cache (float64 copies in doubling buffers)
    computes the same bits as with transformers' DynamicCache, through a prompt pass, steps of
    several tokens and rollbacks; the buffers grow by doubling and a rollback only shortens."""
    from constrained_spec.models.growing_cache import INITIAL_CAPACITY, growing_cache
    from constrained_spec.models.invariant import make_batch_invariant

    model = make_batch_invariant(tiny_llama(64, seed=5, dtype=torch.float32, context=1024))
    n = model.config.num_hidden_layers
    grow, ref = growing_cache(n, torch.float64), DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (1, 40), generator=gen)
    for cache in (grow, ref):
        model(input_ids=prompt, cache=cache, use_cache=True, prompt_rows=39)
    capacities = set()
    for step in range(60):
        x = torch.randint(0, 64, (1, 1 + step % 7), generator=gen)
        a = model(input_ids=x, cache=grow, use_cache=True).logits
        b = model(input_ids=x, cache=ref, use_cache=True).logits
        assert torch.equal(a, b), f"step {step}"
        if step % 3 == 0:
            grow.crop(-(x.shape[1] // 2))
            ref.crop(-(x.shape[1] // 2))
        assert grow.get_seq_length() == ref.get_seq_length()
        capacities.add(grow.layers[0].capacity)
    assert all(torch.equal(g.keys, r.keys.double()) and g.keys.dtype == torch.float64
               for g, r in zip(grow.layers, ref.layers))
    assert capacities <= {INITIAL_CAPACITY * 2 ** i for i in range(4)} and len(capacities) >= 1
    held = grow.get_seq_length()
    assert INITIAL_CAPACITY * len(capacities) >= held
