"""Speculation in the batch engine pays for itself (``batching.drafting``): each step drafts only
where the measured cost of drafting (forward tokens and host work) buys more tokens per second
than a plain step, probes on a bounded schedule while it does not, never touches rows whose K is
fixed or whose seeded sampling must not depend on the batch, and changes no greedy token."""

from __future__ import annotations

import pytest

from constrained_spec.batching.budget import BatchCost, choose_drafts
from constrained_spec.batching.drafting import (
    PROBE_FIRST,
    PROBE_LAST,
    DraftGate,
    HostCost,
)
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import AdaptiveK, FixedK, decode
from constrained_spec.drafters import ModelDrafter
from tests.test_greedy_identity import SCHEMAS, TEXT, models  # noqa: F401  (models: the float64 target and draft)

CPU = BatchCost(0.040, 0.0022)  # the native prior on a 2-core CPU: every packed token costs


def sure(kinds, confidence=None):
    """A survival function of forced text: each token accepted with probability 0.97."""
    return [0.97 ** j for j in range(1, len(kinds) + 1)]


def gate(plain: float, draft: float, spans: int = 64, span: int = 6) -> DraftGate:
    """A gate whose host costs are fixed (``plain``, ``draft`` seconds per row) and whose recent
    drafts are ``spans`` forced spans of ``span`` tokens."""
    g = DraftGate(CPU, HostCost(plain, draft, frozen=True))
    g.observe([(sure, ["grammar"] * span, None)] * spans)
    return g


def test_drafting_is_off_where_its_host_cost_makes_it_lose_and_on_where_it_wins():
    # Forced spans are nearly free in the forward; at batch 64 a few ms of drafting per row
    # cost more than the whole step's forward saves.
    assert gate(0.0005, 0.0).pays(64, 64, 64)
    assert not gate(0.0005, 0.010).pays(64, 64, 64)
    # One row: the same overhead is small beside a forward's fixed cost, and the span pays.
    assert gate(0.0005, 0.010).pays(1, 1, 1)
    # The break-even overhead falls as the batch grows: measured, not a fixed batch size.
    breakeven = [next(d / 1e4 for d in range(1, 2000) if not gate(0.0005, d / 1e4).pays(b, b, b)) for b in (4, 16, 64)]
    assert breakeven[0] > breakeven[1] > breakeven[2]
    # Drafts that are mostly rejected do not pay even when drawing them is free.
    g = DraftGate(CPU, HostCost(0.0005, 0.0, frozen=True))
    g.observe([(lambda k, c=None: [0.3 ** j for j in range(1, len(k) + 1)], ["lookup"] * 6, None)] * 64)
    assert not g.pays(64, 64, 64)


def test_rows_that_drew_nothing_count_against_drafting():
    """A row that was asked and proposed nothing paid for asking: a batch where most rows draw
    nothing is worth less than one where every row draws a span."""
    full, sparse = gate(0.0005, 0.002), DraftGate(CPU, HostCost(0.0005, 0.002, frozen=True))
    sparse.observe([(sure, ["grammar"] * 6, None)] * 8 + [(sure, [], None)] * 56)
    assert full.pays(64, 64, 64) and not sparse.pays(64, 64, 64)


def test_a_gate_with_nothing_drawn_yet_drafts():
    assert DraftGate(CPU, HostCost(0.0005, 1.0, frozen=True)).decide(64, 64, 64)


def test_probes_follow_the_stated_schedule_and_reset_when_drafting_pays():
    g = gate(0.0005, 0.010)
    decisions = [g.decide(64, 64, 64) for _ in range(200)]
    drafted = [i for i, on in enumerate(decisions) if on]
    gaps = [b - a - 1 for a, b in zip([-1, *drafted], drafted)]
    expected = [min(PROBE_FIRST * 2 ** i, PROBE_LAST) for i in range(len(gaps))]
    assert gaps == expected  # PROBE_FIRST plain steps, then doubling, capped at PROBE_LAST
    assert g.probes == len(drafted) and g.drafting_steps == len(drafted) and g.steps == 200
    assert max(gaps) == PROBE_LAST
    # Drafting pays again (the batch shrank): on at once, and the gap starts over.
    assert g.decide(1, 1, 1)
    after = [g.decide(64, 64, 64) for _ in range(PROBE_FIRST + 1)]
    assert after == [False] * PROBE_FIRST + [True]


def test_forcing_overrides_the_decision():
    g = gate(0.0005, 0.010)
    g.forced = True
    assert all(g.decide(64, 64, 64) for _ in range(10))
    g = gate(0.0005, 0.0)
    g.forced = False
    assert not any(g.decide(1, 1, 1) for _ in range(10))


def test_host_cost_moves_from_its_prior_to_the_steps():
    host = HostCost(0.0005, 0.001)
    assert host.plain == pytest.approx(0.0005) and host.draft == pytest.approx(0.001)
    for _ in range(30):
        host.add(False, 64, 64 * 0.002)
        host.add(True, 64, 64 * 0.005)
    assert host.plain == pytest.approx(0.002, rel=0.02) and host.draft == pytest.approx(0.003, rel=0.05)
    host.add(True, 0, 10.0)  # no rows: nothing to learn
    assert host.draft == pytest.approx(0.003, rel=0.05)
    frozen = HostCost(0.0005, 0.001, frozen=True)
    frozen.add(True, 64, 64.0)
    assert frozen.draft == pytest.approx(0.001)


def test_each_mode_is_scaled_by_how_its_past_steps_fared():
    """The model's rate of each mode is scaled by measured over predicted rates of the steps
    that took it, which moves the break-even overhead; a step the model does not price (a
    prompt fed: no seconds) teaches nothing."""
    def guesses(kinds, confidence=None):
        return [0.7 ** j for j in range(1, len(kinds) + 1)]

    def make(draft: float) -> DraftGate:
        g = DraftGate(CPU, HostCost(0.0005, draft, frozen=True))
        g.observe([(guesses, ["lookup"] * 6, None)] * 16)
        return g

    def step(g: DraftGate, on: bool, fared: float) -> None:
        g.forced = on
        g.decide(16, 16, 16)
        rate = g.model_rates(16, 16, 16)[on]
        g.outcome(100, 100 / (rate * fared))
        g.forced = None

    breakeven = next(d / 1e5 for d in range(1, 10000) if not make(d / 1e5).pays(16, 16, 16))
    low, high = make(breakeven * 1.2), make(breakeven * 0.8)
    assert low.fared(True) == pytest.approx(1.0) and not low.pays(16, 16, 16) and high.pays(16, 16, 16)
    for _ in range(10):
        step(low, True, 1.4)  # drafting steps did better than the model said
        step(low, False, 1.0)
        step(high, True, 0.6)  # worse
        step(high, False, 1.0)
        low.decide(16, 16, 16)
        low.outcome(1000, 0.0)  # not priced: ignored
    assert low.fared(True) > 1.2 and high.fared(True) < 0.8 and low.fared(False) == pytest.approx(1.0)
    assert low.pays(16, 16, 16) and not high.pays(16, 16, 16)


def test_host_time_lowers_the_bar_a_draft_must_clear():
    """Host work the step pays whatever is kept makes each second of the step earn less, so a
    kept draft token needs a lower survival to raise the rate."""
    rows = [[0.6 ** j for j in range(1, 9)]] * 16
    assert sum(choose_drafts(rows, 16, 16.0, CPU, extra_seconds=0.2)) > sum(choose_drafts(rows, 16, 16.0, CPU))


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(smol_tokenizer):
    return {path: compile_constraint(path, smol_tokenizer, backend="llguidance") for path in SCHEMAS}


class Counting(ModelDrafter):
    """A model drafter that counts its proposals."""

    calls = 0

    def propose(self, *args, **kwargs):
        Counting.calls += 1
        return super().propose(*args, **kwargs)


def run_engine(target, draft, compiled, ids, forced):
    """Six greedy adaptive rows (one drafting with the target itself: every draft accepted) and
    one fixed-K row through one engine with the gate forced (None: deciding)."""
    engine = BatchEngine(target, max_batch=4, precision="native", profile="cpu")
    engine.scheduler.gate.forced = forced
    reqs = []
    for i in range(6):
        m = compiled[SCHEMAS[i % 3]].matcher()
        drafter = Counting(target if i == 0 else draft, m)
        reqs.append(engine.submit(ids[i:], m, drafter=drafter, k_policy=AdaptiveK(6), max_new_tokens=30))
    m = compiled[SCHEMAS[0]].matcher()
    fixed = engine.submit(ids, m, drafter=ModelDrafter(draft, m), k_policy=FixedK(3), max_new_tokens=30)
    Counting.calls = 0
    list(engine.run())
    assert all(r.error is None for r in [*reqs, fixed])
    return engine, reqs, fixed


@pytest.mark.parametrize("forced", [True, False, None])
def test_greedy_rows_equal_target_only_whatever_the_gate_decides(smol_tokenizer, models, compiled, forced):
    target, draft = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    engine, reqs, fixed = run_engine(target, draft, compiled, ids, forced)
    for i, req in enumerate(reqs):
        alone = decode(target, compiled[SCHEMAS[i % 3]].matcher(), ids[i:], max_new_tokens=30)
        assert req.result.tokens == alone.tokens, i
        assert req.result.finished == alone.finished, i
    alone = decode(target, compiled[SCHEMAS[0]].matcher(), ids, max_new_tokens=30)
    assert fixed.result.tokens == alone.tokens
    gate = engine.scheduler.gate
    drafted = sum(k for r in reqs for k in r.result.stats.ks)
    if forced is False:
        # No adaptive row proposed or verified a draft; the fixed-K row drafted every step.
        assert Counting.calls == 0 and drafted == 0 and gate.drafting_steps == 0 and gate.steps > 0
    else:
        assert Counting.calls > 0 and drafted > 0
    if forced is True:
        assert gate.drafting_steps == gate.steps
    assert min(fixed.result.stats.ks) == 3 or fixed.result.stats.ks[-1] < 3  # fixed K: never cut, never gated


def test_the_gate_switches_a_costly_drafter_off_and_probes(smol_tokenizer, models, compiled):
    """On this tiny model a draft model's host time dwarfs the forward: the engine measures it
    and turns drafting off but for its probes."""
    target, draft = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    engine, _, _ = run_engine(target, draft, compiled, ids, None)
    gate = engine.scheduler.gate
    assert gate.host.draft > gate.host.plain  # drafting measured dearer than a plain step
    assert 0 < gate.drafting_steps < gate.steps
    assert gate.steps - gate.drafting_steps > gate.drafting_steps


def test_seeded_sampled_rows_are_not_gated(smol_tokenizer, models, compiled):
    """A seeded sampled row must draw the same tokens in any batch: the gate leaves it alone, so
    it drafts (and draws) exactly as it would with the gate open."""
    target, draft = models
    ids = smol_tokenizer(TEXT)["input_ids"]
    out = {}
    for forced in (True, False):
        engine = BatchEngine(target, max_batch=3, precision="native", profile="cpu")
        engine.scheduler.gate.forced = forced
        rows = []
        for i in range(3):
            m = compiled[SCHEMAS[i]].matcher()
            seeded = i == 1
            rows.append(engine.submit(ids[i:], m, drafter=ModelDrafter(draft, m, temperature=1.0 if seeded else 0.0),
                                      k_policy=AdaptiveK(4, deterministic=seeded), temperature=1.0 if seeded else 0.0,
                                      seed=7 if seeded else None, max_new_tokens=24))
        list(engine.run())
        out[forced] = rows
        assert not rows[1].decoder.budgeted and rows[0].decoder.budgeted
        assert sum(rows[1].result.stats.ks) > 0  # it drafted either way
    assert out[True][1].result.tokens == out[False][1].result.tokens
    assert sum(out[False][0].result.stats.ks) == 0 < sum(out[True][0].result.stats.ks)
