"""The batch engine: every row equals its single-request run, the sampled law holds in a batch,
rows join, leave, roll back and cancel independently, and the cache stays bounded.

Greedy checks use float64 tiny models over the real SmolLM2 tokenizer (no near-ties), rows of
different prompt lengths, drafters and K (a target drafting for itself: every draft accepted;
a random draft model: most drafts rejected), more requests than slots (rows join mid-run),
and different token limits (rows leave early).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

import constrained_spec.decoding.decoder as decoder_mod
from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.errors import InvalidOptionError
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.drafters import LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama
from tests.test_exactness import EOS, MODEL_VOCAB, N, N_CONTROL, PATTERN, PROMPT, TOKENS, _correction_from_p, exact_law, sample_pvalue
from tests.test_greedy_identity import SCHEMAS, TEXT, models  # noqa: F401  (models: the float64 target and draft)


@pytest.fixture(scope="module")
def compiled(smol_tokenizer):
    return {path: compile_constraint(path, smol_tokenizer, backend="llguidance") for path in SCHEMAS}


def request_specs(smol_tokenizer, target, draft):
    """(schema, prompt, drafter factory, K, max_new_tokens) for 7 requests unlike each other."""
    ids = smol_tokenizer(TEXT)["input_ids"]
    specs = [
        (SCHEMAS[0], ids, None, 0, 48),  # target-only row
        (SCHEMAS[1], ids[:40], lambda m: ModelDrafter(target, m), 5, 48),  # drafts all accepted
        (SCHEMAS[2], ids[5:], lambda m: ModelDrafter(draft, m), 4, 48),  # drafts mostly rejected
        (SCHEMAS[0], ids[:12], LookupDrafter, 3, 48),
        (SCHEMAS[1], ids, lambda m: ModelDrafter(draft, m), 2, 9),  # leaves early at its limit
        (SCHEMAS[2], ids[:25], None, 0, 20),
        (SCHEMAS[0], ids[3:30], lambda m: ModelDrafter(target, m), 8, 48),  # joins once a slot frees
    ]
    return specs


def single(target, compiled, spec):
    schema, prompt, make, k, limit = spec
    m = compiled[schema].matcher()
    return decode(target, m, prompt, drafter=make(m) if make else None, k_policy=FixedK(k), max_new_tokens=limit)


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_every_row_equals_its_single_request(smol_tokenizer, models, compiled, max_batch):
    target, draft = models
    specs = request_specs(smol_tokenizer, target, draft)
    engine = BatchEngine(target, max_batch=max_batch)
    streamed: dict[int, list[int]] = {}
    reqs = []
    for schema, prompt, make, k, limit in specs:
        m = compiled[schema].matcher()
        req = engine.submit(prompt, m, drafter=make(m) if make else None, k_policy=FixedK(k), max_new_tokens=limit,
                            on_tokens=lambda toks, i=len(reqs): streamed.setdefault(i, []).extend(toks))
        reqs.append(req)
    done = list(engine.run())
    assert sorted(r.id for r in done) == [r.id for r in reqs] and not engine.busy
    for i, (spec, req) in enumerate(zip(specs, reqs)):
        ref = single(target, compiled, spec)
        assert req.error is None and req.done
        assert req.result.tokens == ref.tokens, i
        assert req.result.finished == ref.finished, i
        assert streamed.get(i, []) == ref.tokens, i
        assert req.result.stats.target_forwards == ref.stats.target_forwards, i  # the same steps, batched
    assert engine.cache.active == 0
    if max_batch > 1:
        assert engine.batch_forwards < sum(r.result.stats.target_forwards - 1 for r in reqs)  # rows shared forwards


def test_cancel_frees_the_slot_and_leaves_the_others_alone(smol_tokenizer, models, compiled):
    target, draft = models
    specs = request_specs(smol_tokenizer, target, draft)[:3]
    engine = BatchEngine(target, max_batch=2)
    reqs = []
    for schema, prompt, make, k, limit in specs:
        m = compiled[schema].matcher()
        reqs.append(engine.submit(prompt, m, drafter=make(m) if make else None, k_policy=FixedK(k), max_new_tokens=limit))
    engine.step()
    engine.step()
    engine.cancel(reqs[0])
    done = list(engine.run())
    assert reqs[0].cancelled and reqs[0].done and reqs[0] in done
    ref0 = single(target, compiled, specs[0]).tokens
    assert 0 < len(reqs[0].result.tokens) < len(ref0) and ref0[: len(reqs[0].result.tokens)] == reqs[0].result.tokens
    for spec, req in zip(specs[1:], reqs[1:]):
        assert req.result.tokens == single(target, compiled, spec).tokens


def test_a_failing_row_does_not_stop_the_batch(smol_tokenizer, models, compiled):
    target, draft = models
    specs = request_specs(smol_tokenizer, target, draft)[:2]
    engine = BatchEngine(target, max_batch=2)
    m0 = compiled[specs[0][0]].matcher()

    class Broken(LookupDrafter):
        calls = 0

        def propose(self, context, state, k):
            Broken.calls += 1
            if Broken.calls == 3:
                raise RuntimeError("drafter broke")
            return super().propose(context, state, k)

    bad = engine.submit(specs[0][1], m0, drafter=Broken(m0), k_policy=FixedK(2), max_new_tokens=48)
    m1 = compiled[specs[1][0]].matcher()
    good = engine.submit(specs[1][1], m1, drafter=ModelDrafter(target, m1), k_policy=FixedK(5), max_new_tokens=48)
    list(engine.run())
    assert isinstance(bad.error, RuntimeError) and bad.done
    assert good.error is None and good.result.tokens == single(target, compiled, specs[1]).tokens


def test_a_finished_request_is_freed_without_a_garbage_collection(smol_tokenizer, models, compiled):
    """The server's callback closes over the job that holds the request (job -> request ->
    callback -> job): once the row is done the engine drops the callback, so the decoder, its
    matcher's masks and its keys go at once, not at the next full collection (the soak's climb)."""
    import gc
    import weakref

    target, _ = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    engine = BatchEngine(target, max_batch=2)
    gc.collect()
    gc.disable()
    try:
        holder: dict = {"seen": []}
        m = compiled[SCHEMAS[0]].matcher()
        req = engine.submit(ids[:20], m, drafter=LookupDrafter(m), k_policy=FixedK(3), max_new_tokens=12,
                            on_tokens=lambda toks, job=holder: job["seen"].extend(toks))
        holder["request"] = req
        decoder, matcher = weakref.ref(req.decoder), weakref.ref(m)
        done = list(engine.run())
        assert done == [req] and holder["seen"] == req.result.tokens
        del req, done, m, holder
        assert decoder() is None and matcher() is None
    finally:
        gc.enable()


def test_cache_memory_stays_bounded_over_a_long_run(smol_tokenizer, models, compiled):
    """40 requests through 2 slots: the buffers never exceed the slots times the longest row's
    size rounded up to a power of two, a position costs 2 x layers x kv_heads x head_dim x 8
    bytes, and every byte is given back each time the engine empties."""
    target, _ = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    engine = BatchEngine(target, max_batch=2)
    sizes = []
    for i in range(40):
        m = compiled[SCHEMAS[i % 3]].matcher()
        engine.submit(ids[i % 7 :], m, drafter=LookupDrafter(m), k_policy=FixedK(3), max_new_tokens=24)
        if i % 2:
            while engine.busy:
                engine.step()
                sizes.append(engine.cache.allocated_bytes)
            assert engine.cache.allocated_bytes == 0
    cfg = target.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8
    longest = len(ids) + 24 + 4
    assert max(sizes) == 2 * max(256, 2 ** (longest - 1).bit_length()) * per_token
    assert sizes.count(max(sizes)) >= 20


def test_a_long_row_gives_its_memory_back_when_it_leaves():
    """One long row among short ones sits on a shelf of its own: the short rows' slots are not
    sized by it; when it leaves its shelf is freed and the short rows keep their keys; empty,
    nothing is held."""
    from constrained_spec.batching.cache import RowCache

    cache = RowCache(num_layers=2, slots=8, max_capacity=8192, capacity=256)
    block = lambda n, x=1.0: [torch.full((1, n, 4), x, dtype=torch.float64)] * 2  # noqa: E731
    for i, n in enumerate((100, 3000, 120, 90)):
        row = cache.add_row(DynamicCache())
        cache.append(row, block(n, i), block(n, i))
    per_slot = 2 * 2 * 4 * 8  # layers x (keys, values) x head_dim x float64, per position
    assert sorted(cache.shelves) == [256, 3072]
    assert cache.allocated_bytes == (4 * 256 + 1 * 3072) * per_slot  # dense slots: 4 x 4096
    cache.remove_row(1)  # the long row; the last row takes its number
    cache.release()
    assert sorted(cache.shelves) == [256] and cache.allocated_bytes == 4 * 256 * per_slot
    assert torch.equal(cache.block(1, 0, 90)[0][0], block(90, 3)[0])  # the renumbered row kept its keys
    assert cache.lengths[:3].tolist() == [100, 90, 120]
    for row in (2, 1, 0):
        cache.remove_row(row)
    cache.release()
    assert cache.allocated_bytes == 0 and not cache.shelves


def test_random_joins_growth_rollbacks_and_leaves_keep_every_row_exact_and_return_every_byte():
    """A long random run of joins, appends that move rows to larger shelves, steps that keep
    part of what they wrote (rollback), and leaves: every row's keys equal a reference copy
    after every operation, the buffers stay within 4x what the rows' shelves need after each
    release, and every byte is returned at the end."""
    import random

    from constrained_spec.batching.cache import RowCache

    rng = random.Random(7)
    cache = RowCache(num_layers=2, slots=6, max_capacity=4096, capacity=16)
    reference: list[torch.Tensor] = []  # per row: its keys [1, n, 2]
    counter = itertools.count(1)
    per_token = 2 * 2 * 2 * 8
    moves = 0
    for step in range(400):
        op = rng.random()
        if cache.active < cache.slots and (op < 0.2 or not cache.active):
            cache.add_row(DynamicCache())
            reference.append(torch.zeros(1, 0, 2, dtype=torch.float64))
        elif op < 0.6:
            row = rng.randrange(cache.active)
            n = rng.choice([1, 3, 17, 40, 200])
            if int(cache.lengths[row]) + n > cache.max_capacity:
                continue
            x = torch.full((1, n, 2), float(next(counter)), dtype=torch.float64)
            before = cache.capacity_of(row)
            cache.append(row, [x, x], [x, -x])
            moves += cache.capacity_of(row) != before
            reference[row] = torch.cat([reference[row], x], dim=1)
        elif op < 0.8:  # a step wrote drafts and keeps some: the rest is rolled back
            row = rng.randrange(cache.active)
            keep = rng.randrange(int(cache.lengths[row]) + 1)
            cache.lengths[row] = keep
            reference[row] = reference[row][:, :keep]
        else:
            row = rng.randrange(cache.active)
            moved = cache.remove_row(row)
            last = reference.pop()
            if moved is not None:
                reference[row] = last
            cache.release()
            # a rolled-back row keeps its shelf: the bound is the shelves the rows sit on
            held = cache.footprint([cache.capacity_of(r) for r in range(cache.active)]) * per_token
            assert cache.allocated_bytes <= 4 * held or not cache.active
        for row in range(cache.active):
            n = int(cache.lengths[row])
            assert n == reference[row].shape[1]
            if n:
                keys, values = cache.block(row, 0, n)
                assert torch.equal(keys[0], reference[row]) and torch.equal(values[1], -reference[row])
    assert moves > 10  # rows did change shelves
    while cache.active:
        cache.remove_row(cache.active - 1)
    cache.release()
    assert cache.allocated_bytes == 0


def test_a_full_kv_bound_makes_requests_wait_and_one_that_never_fits_is_refused(smol_tokenizer, models, compiled):
    """``kv_memory`` room for one row: three requests decode one at a time, the cache never holds
    more than the bound, the outputs equal single requests'; a bound below one row refuses the
    request at submit, naming the limit."""
    from constrained_spec import KVMemoryError

    target, _ = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    one = BatchEngine(target).kv_bytes_alone(len(ids), 24)
    engine = BatchEngine(target, max_batch=4, kv_memory=one)
    reqs = []
    for i in range(3):
        m = compiled[SCHEMAS[i]].matcher()
        reqs.append(engine.submit(ids, m, drafter=LookupDrafter(m), k_policy=FixedK(3), max_new_tokens=24))
    most = 0
    while engine.busy:
        engine.step()
        most = max(most, len(engine.active))
    assert most == 1 and 0 < engine.peak_kv_bytes <= one
    for i, r in enumerate(reqs):
        m = compiled[SCHEMAS[i]].matcher()
        assert r.result.tokens == decode(target, m, ids, drafter=LookupDrafter(m), k_policy=FixedK(3),
                                         max_new_tokens=24).tokens
    tight = BatchEngine(target, kv_memory=one - 1)
    with pytest.raises(KVMemoryError, match=r"kv_memory of 0 MiB|more than this engine's kv_memory"):
        tight.submit(ids, compiled[SCHEMAS[0]].matcher(), max_new_tokens=24)
    assert not tight.busy
    with pytest.raises(InvalidOptionError, match="kv_memory"):
        BatchEngine(target, kv_memory=0)


def test_row_cache_rows_move_to_larger_shelves_within_the_context():
    """A packed step writes each token at its row's slot; a row that outgrows its shelf moves to
    one of twice the capacity (then steps of 1,024 past 2,048, never past the context) with its
    keys, and its old shelf, empty, is freed."""
    from constrained_spec.batching.packing import pack_rows
    from constrained_spec.batching.cache import RowCache

    cache = RowCache(num_layers=2, slots=3, max_capacity=5000, capacity=16)
    k = torch.randn(2, 1, 5, 4, dtype=torch.float64)
    for _ in range(2):
        cache.add_row(DynamicCache())
    cache.packing = pack_rows(cache.lengths[:2], [5, 3], parts=cache.parts())  # row 0's 5 tokens, then row 1's 3
    packed = torch.cat([k[0, :, :5], k[1, :, :3]], dim=1)[None]
    keys, _ = cache.update(packed, packed, 0)
    assert [t.shape for t in keys] == [(2, 1, 16, 4)]  # one shelf: both rows' keys as a view
    cache.packing = None
    cache.keep(0, 5)
    cache.keep(1, 3)
    cache.reserve_row(0, 40)
    assert sorted(cache.shelves) == [16, 64] and cache.capacity_of(0) == 64
    assert torch.equal(cache.block(0, 0, 5)[0][0], k[0]) and torch.equal(cache.block(1, 0, 3)[0][0], k[1, :, :3])
    cache.reserve_row(1, 900)
    assert sorted(cache.shelves) == [64, 1024]  # the 16 shelf emptied and went
    assert [cache.capacity_for(n) for n in (2049, 3072, 3073, 4900)] == [3072, 3072, 4096, 5000]
    with pytest.raises(ValueError, match="context"):
        cache.reserve_row(0, 5001)


@pytest.fixture(scope="module")
def small():
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    return compile_constraint(PATTERN, vocab, kind="regex"), tiny_llama(MODEL_VOCAB, seed=1), tiny_llama(MODEL_VOCAB, seed=2)


def engine_draws(compiled, target, draft, batch=8, n=N):
    """``n`` sampled requests (seeds 0..n-1) through one engine, ``batch`` rows at once; K = 1 so
    that most tokens come from batched steps, not from a request's first step."""
    engine = BatchEngine(target, max_batch=batch)
    reqs = []
    for seed in range(n):
        m = compiled.matcher()
        reqs.append(engine.submit(PROMPT, m, drafter=ModelDrafter(draft, m, temperature=1.0), k_policy=FixedK(1),
                                  temperature=1.0, seed=seed, max_new_tokens=16))
    list(engine.run())
    assert max(r.result.stats.target_forwards for r in reqs) >= 2
    return {i: r.result.tokens for i, r in enumerate(reqs)}


def test_sampling_in_a_batch_is_exact(small):
    compiled, target, draft = small
    law = exact_law(compiled, target, PROMPT)
    draws = engine_draws(compiled, target, draft)
    assert sample_pvalue(law, lambda s: draws[s]) > 1e-3


def test_negative_control_in_a_batch_is_caught(small, monkeypatch):
    compiled, target, draft = small
    law = exact_law(compiled, target, PROMPT)
    monkeypatch.setattr(decoder_mod, "verify_sampled", _correction_from_p)
    draws = engine_draws(compiled, target, draft, n=N_CONTROL)
    assert sample_pvalue(law, lambda s: draws[s], N_CONTROL) < 1e-4


def test_budget_keeps_the_drafts_that_pay_for_their_tokens():
    from constrained_spec.batching.budget import BatchCost, choose_drafts

    cpu = BatchCost(0.040, 0.0022)  # native on this CPU: every packed token costs
    flat = BatchCost(0.020, 0.0)  # an accelerator with room to spare
    sure, unsure = [0.97 ** j for j in range(1, 21)], [0.4 ** j for j in range(1, 21)]
    alone = choose_drafts([sure], 1, 1.0, cpu)[0]
    assert alone > 10  # one row: verify a long forced span
    full = choose_drafts([sure] * 16, 16, 16.0, cpu)
    assert len(set(full)) == 1 and full[0] < alone  # a full batch: less room, the same for equal rows
    assert choose_drafts([unsure] * 16, 16, 16.0, cpu) == [0] * 16  # guesses that mostly fail: K = 0 at batch 16
    assert choose_drafts([sure] * 16, 16, 16.0, flat) == [20] * 16  # flat cost: everything pays
    # Rows are cut on their own: the sure span is kept where the guesses beside it are not.
    mixed = choose_drafts([sure, unsure, unsure, unsure], 4, 4.0, cpu)
    assert mixed[0] > 4 and mixed[1:] == [mixed[1]] * 3 and mixed[1] <= 1
    # Survival is non-increasing along a row, so the kept tokens are always a prefix.
    assert choose_drafts([[0.9, 0.9, 0.9]], 1, 1.0, flat) == [3]


def test_batch_cost_fit_moves_from_the_prior_to_the_data():
    from constrained_spec.batching.budget import BatchCost

    cost = BatchCost(0.040, 0.0022)
    assert cost.seconds(10) == pytest.approx(0.062)
    for rows in (16, 32, 64, 128, 256) * 20:
        cost.add(rows, 0.010 + 0.001 * rows)
    t0, t1 = cost.fitted()
    assert t0 == pytest.approx(0.010, rel=0.25) and t1 == pytest.approx(0.001, rel=0.15)  # prior: 8 of 108 forwards


def test_adaptive_rows_are_cut_to_the_budget_and_still_equal_single_requests(smol_tokenizer, models, compiled):
    """With the CPU's cost prior and 8 rows, the engine verifies fewer drafts per row than each
    request would alone; greedy tokens do not depend on K, so every row still equals its
    single-request output. (The draft gate is held open and the rows' host time at zero: on
    this tiny model the draft model's host time dwarfs the forward, and counted it would switch
    drafting off or let every draft through; ``tests/test_batch_drafting_pays.py``.)"""
    from constrained_spec.batching.drafting import HostCost
    from constrained_spec.decoding import AdaptiveK

    target, _ = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    engine = BatchEngine(target, max_batch=8, precision="native", profile="cpu")
    engine.scheduler.gate.forced = True
    engine.scheduler.gate.host = HostCost(0.0, 0.0, frozen=True)
    reqs, refs = [], []
    for i in range(8):
        schema = SCHEMAS[i % 3]
        m = compiled[schema].matcher()
        reqs.append(engine.submit(ids[i:], m, drafter=ModelDrafter(target, m), k_policy=AdaptiveK(12, costly_draft=False),
                                  max_new_tokens=40))
        m2 = compiled[schema].matcher()
        refs.append(decode(target, m2, ids[i:], drafter=ModelDrafter(target, m2), k_policy=FixedK(12), max_new_tokens=40))
    list(engine.run())
    assert all(r.result.tokens == ref.tokens for r, ref in zip(reqs, refs))
    assert all(max(r.result.stats.ks) < 12 for r in reqs)  # cut below the 12 drafts each row proposed


def test_the_engine_composes_a_scheduler_that_decides_and_a_runner_that_runs():
    """Policy apart from mechanism: admission, KV accounting, prefill turns and the draft budget
    are the scheduler's, the row cache and the packed forward the runner's; the engine's own
    names reach the same objects, and a prefix cache set on the engine is the one its
    scheduler dedupes prompt blocks against."""
    from constrained_spec.batching.runner import StepRunner
    from constrained_spec.batching.scheduler import Scheduler
    from constrained_spec.decoding.prefix import PrefixCache

    engine = BatchEngine(tiny_llama(MODEL_VOCAB, seed=2), max_batch=3, prefix_cache=False, kv_memory=2**30)
    assert isinstance(engine.scheduler, Scheduler) and isinstance(engine.runner, StepRunner)
    assert engine.active is engine.scheduler.active and engine.waiting is engine.scheduler.waiting
    assert engine.cache is engine.runner.cache and engine.step_tokens is engine.runner.step_tokens
    assert (engine.max_batch, engine.kv_memory, engine.prefix_cache) == (3, 2**30, None)
    cache = PrefixCache()
    engine.prefix_cache = cache
    assert engine.scheduler.prefix_cache is cache
    assert not any(hasattr(engine.runner, name) for name in ("waiting", "active", "prefill_turn", "budget"))
    assert not any(hasattr(engine.scheduler, name) for name in ("cache", "run", "target"))
