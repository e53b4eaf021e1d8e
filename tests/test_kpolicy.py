"""The K policies and the hardware / task profiles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from constrained_spec import ModelHandle, generate_json
from constrained_spec.decoding.estimates import RecentEstimates, recent_estimates
from constrained_spec.decoding.kpolicy import AdaptiveK, FixedK, _CurveFit, optimal_k
from constrained_spec.drafters.base import Draft
from constrained_spec.drafters.order import DraftOrder
from constrained_spec.decoding.profiles import K_MAX_PROFILES, PROFILE_ENV, detect_profile, k_max_for, profile_for_device
from tests.conftest import tiny_llama


@pytest.mark.parametrize("alpha, c, k_max", itertools.product([0.05, 0.3, 0.5, 0.7, 0.9, 0.99], [0.01, 0.1, 0.5, 2.0], [1, 4, 12]))
def test_optimal_k_is_the_argmax_of_the_formula(alpha, c, k_max):
    ks = np.arange(0, k_max + 1)
    values = (1 - alpha ** (ks + 1)) / ((1 - alpha) * (ks * c + 1))
    assert optimal_k(alpha, c, k_max) == int(np.argmax(values))


def test_optimal_k_drops_to_plain_decoding_when_speculation_does_not_pay():
    assert optimal_k(0.05, 0.5, 8) == 0
    assert optimal_k(0.95, 0.02, 8) == 8


def test_trim_stops_at_the_first_maximum_of_the_objective():
    """The verified prefix is where the objective first stops rising (deciding position i from
    the kinds of 1..i only keeps sampling exact), with the fitted concave verify cost."""
    policy = AdaptiveK(k_max=12)
    policy._succ = {"grammar": 90.0, "grammar+": 20.0, "lookup": 3.0, "lookup+": 6.0, "model": 30.0}
    policy._trials = {"grammar": 100.0, "grammar+": 21.0, "lookup": 10.0, "lookup+": 10.0, "model": 50.0}
    for k, t in [(0, 0.031), (1, 0.040), (8, 0.055), (12, 0.060), (20, 0.066)]:  # a CPU's verify times
        policy.update([], 0, t, 0.0) if k == 0 else policy._curve.add(k, t)
    r = policy._curve.ratio()
    assert 0.05 < r < 0.5  # fitted, not the prior
    rng = np.random.default_rng(0)
    for _ in range(200):
        kinds = list(rng.choice(["grammar", "lookup", "model"], size=rng.integers(1, 13)))
        keys = [k + "+" if i and kinds[i - 1] == k else k for i, k in enumerate(kinds)]
        survive = np.cumprod([policy.alpha(k) for k in keys])
        values = np.concatenate([[1.0], (1 + np.cumsum(survive)) / (1 + r * np.log2(2 + np.arange(len(kinds))))])
        falls = np.flatnonzero(np.diff(values) <= 1e-12)
        best = int(falls[0]) if len(falls) else len(kinds)
        got = policy.trim(kinds)
        assert got == best or (best == 0 and got == 1)  # 1 = the periodic probe
    assert policy.trim(["grammar"] * 12) == 12  # a likely forced span is verified whole
    assert policy.trim(["lookup"] * 12) < 12  # an unlikely guess is cut


@pytest.mark.parametrize("truth, prior", [("linear", "concave"), ("concave", "linear"), ("linear", "linear")])
def test_the_verify_cost_curve_takes_the_shape_the_steps_have(truth, prior):
    """Verify passes timed with noise from a linear (int4 here: each row pays) or a concave cost
    (float32 matmul): the fit moves to the true shape from either prior, and its predicted extra
    cost of a 1-token and a 12-token draft is within 15% of the truth."""
    rng = np.random.default_rng(1)
    g = {"linear": lambda k: k, "concave": lambda k: np.log2(1 + k)}[truth]
    r = {"linear": 0.11, "concave": 0.3}[truth]
    fit = _CurveFit(shape=prior, prior=0.4)
    assert fit.best_shape() == prior
    for _ in range(100):
        k = int(rng.choice([1, 2, 3, 5, 8, 12, 16, 20]))
        fit.add(k, 0.08 * (1 + r * g(k)) * (1 + 0.03 * rng.standard_normal()))
    assert fit.best_shape() == truth
    for k in (1, 12):
        assert fit.extra(k) == pytest.approx(r * g(k), rel=0.15)


def test_a_cheap_linear_cost_lets_a_head_draft_where_the_concave_prior_refused():
    """The native profile's prior (linear, +0.11 per token) against the concave r = 0.4 that long
    forced spans' passes gave: a head at its prior acceptance 0.6 and cost 0.15 drafts two tokens
    under the first, at most one under the second; a fitted curve is passed on with its shape."""
    recent = RecentEstimates()
    linear = AdaptiveK(12, cost_shape="linear", cost_prior=0.11, recent=recent)
    concave = AdaptiveK(12, cost_shape="concave", cost_prior=0.4)
    assert DraftOrder(linear).draft_room([], "head", 4, 0.0) >= 2
    assert DraftOrder(concave).draft_room([], "head", 4, 0.0) <= 1
    for k in [1, 4, 12, 20] * 3:
        linear.update(["grammar"] * k, k, 0.08 * (1 + 0.11 * k), 0.0)
    assert recent.curve[""][0] == "linear" and recent.curve[""][1] == pytest.approx(0.11, rel=0.1)
    assert AdaptiveK(12, recent=recent)._curve.best_shape() == "linear"  # the next request starts from it
    assert AdaptiveK(12)._curve.best_shape() == "concave"  # one that shares no estimates does not


def test_adaptive_estimates_follow_acceptance():
    recent = RecentEstimates()
    policy = AdaptiveK(k_max=8, costly_draft=True, recent=recent)
    start = policy.alpha("model+")
    for _ in range(30):
        policy.update(["model"] * 4, 0, 0.05, 0.02)
    assert policy.alpha("model") < 0.25 < start
    assert policy.next_k() == 0  # a draft that is always wrong is switched off
    for _ in range(30):
        policy.update(["model"] * 4, 4, 0.05, 0.001)
    assert policy.alpha("model+") > 0.8
    assert policy.next_k() > 0
    assert recent.alpha[""]["model+"] == pytest.approx(policy.alpha("model+"))  # seeds the next request
    assert AdaptiveK(k_max=8, recent=recent)._seed["model+"] == pytest.approx(policy.alpha("model+"))
    # Only requests with the same drafters: another configuration starts from the prior.
    assert AdaptiveK(k_max=8, history_key="other", recent=recent)._seed["model+"] == pytest.approx(0.6)


def test_two_handles_do_not_share_estimates(smol_tokenizer):
    """What requests learn stays with the object that owns the estimates: requests on one handle
    seed each other, a second handle (or an engine given its own) starts from the priors, and
    a policy given none shares with nobody, so no test needs clearing anything."""
    first = ModelHandle(tiny_llama(64, seed=1), smol_tokenizer, "tiny")
    second = ModelHandle(tiny_llama(64, seed=1), smol_tokenizer, "tiny")
    assert recent_estimates(first) is recent_estimates(first) is first.estimates
    assert recent_estimates(second) is not recent_estimates(first)
    policy = AdaptiveK(k_max=8, costly_draft=True, recent=recent_estimates(first))
    for _ in range(30):
        policy.update(["model"] * 4, 0, 0.05, 0.02)
    assert AdaptiveK(k_max=8, recent=recent_estimates(first))._seed["model"] == pytest.approx(policy.alpha("model"))
    assert AdaptiveK(k_max=8, recent=recent_estimates(second))._seed["model"] == pytest.approx(0.6)
    assert AdaptiveK(k_max=8)._seed["model"] == pytest.approx(0.6)
    assert not recent_estimates(second).alpha


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
def test_adaptive_k_for_a_draft_model_is_the_formula_when_alphas_agree(alpha):
    policy = AdaptiveK(k_max=10, costly_draft=True)
    policy._seed = {"model": alpha, "model+": alpha}
    assert policy.next_k() == optimal_k(alpha, policy.cost_ratio(), 10)


def test_fixed_k_verifies_everything():
    assert FixedK(3).next_k() == 3 and FixedK(3).trim(["lookup"] * 3) == 3


@pytest.mark.parametrize("name, count, profile", [
    ("NVIDIA A100-SXM4-80GB", 1, "a100-80gb"), ("NVIDIA H100 80GB HBM3", 1, "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", 8, "h100-80gb-x8"), ("NVIDIA H200", 1, "h100-80gb"), ("NVIDIA GB200", 72, "gb200-nvl72"),
])
def test_profile_from_device(name, count, profile):
    assert profile_for_device(name, count) == profile


def test_profile_override_and_values(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "gb200-nvl72")
    assert detect_profile() == "gb200-nvl72"
    assert k_max_for(None, "json") == ("gb200-nvl72", 12)
    monkeypatch.delenv(PROFILE_ENV)
    assert detect_profile() == "cpu"  # no accelerator on the test machines
    assert K_MAX_PROFILES["a100-80gb"] == {"text": 4, "code": 3, "json": 6, "chat": 5}
    assert k_max_for("h100-80gb", "chat") == ("h100-80gb", 6)
    with pytest.raises(ValueError, match="Invalid profile"):
        k_max_for("tpu-v5", "json")
    monkeypatch.setenv(PROFILE_ENV, "nonsense")
    with pytest.raises(ValueError, match="Invalid profile"):
        detect_profile()


def test_stats_report_profile_and_k_max(smol_tokenizer):
    handle = ModelHandle(tiny_llama(49152, seed=5, init=0.3), smol_tokenizer, "tiny")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    _, stats = generate_json(handle, schema, "ok?", profile="h100-80gb", return_stats=True)
    assert (stats.profile, stats.k_max, stats.k_policy) == ("h100-80gb", 8, "AdaptiveK")
    _, stats = generate_json(handle, schema, "ok?", profile="gb200-nvl72", adaptive=False, return_stats=True)
    assert (stats.profile, stats.k_max, stats.k_policy) == ("gb200-nvl72", 12, "FixedK")
    assert max(stats.ks) <= 12


def test_a_costly_draft_that_keeps_failing_is_probed_ever_more_rarely():
    """A head whose estimate says it does not pay is still tried now and then (an estimate that
    fell too low must recover): after 8 skipped positions, then 16, 32, 64, 64 while its probes
    are rejected, and after 8 again once one is accepted."""
    policy = AdaptiveK(12, cost_shape="linear", cost_prior=0.11)
    policy._seed["head"] = 0.05
    order = DraftOrder(policy)
    probes, accept_from = [], 5
    for i in range(400):
        if order.draft_room([], "head", 4, 0.0):
            probes.append(i)
            learn(policy, order, ["head"], int(len(probes) > accept_from), None, 0.0)
    gaps = [b - a for a, b in zip([-1, *probes], probes)]
    assert gaps[:6] == [8, 16, 32, 64, 64, 64]
    assert gaps[6] == 8  # the 6th probe was accepted


def test_a_costly_drafter_is_asked_while_its_tokens_cost_less_than_the_steps_do():
    """Steps of 10 ms emitting 2 tokens price a token at 5 ms. An ask that costs 1 ms pays
    while an ask brings at least 0.2 accepted head tokens: asked every time at 0.5 per ask,
    then, once its asks bring none, refused except every 8th (a probe); a seeded sampled
    request (no timings) always asks."""
    policy = AdaptiveK(12)
    order = DraftOrder(policy)
    for _ in range(10):
        learn(policy, order, ["lookup"], 1, 0.010, 0.0)
    spent, emitted = policy.step_price()
    assert spent / emitted == pytest.approx(0.005)
    for i in range(20):  # each ask: a lookup token and a head token, the head's accepted every other time
        assert order.worth_asking("head", 0.001)
        learn(policy, order, ["lookup", "head"], 1 + i % 2, 0.010, 0.0)
    assert order.ask_gain("head") > 0.2
    asked = []
    for i in range(120):  # now the head's asks bring nothing (the steps still emit 2 tokens)
        if order.worth_asking("head", 0.001):
            asked.append(i)
            learn(policy, order, ["lookup", "head"], 1, 0.010, 0.0)
    spent, emitted = policy.step_price()
    assert spent / emitted == pytest.approx(0.005, rel=0.2)
    assert order.ask_gain("head") < 0.2
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[-5:] == [8] * 5
    assert len(asked) < 40
    seeded = AdaptiveK(12, deterministic=True)
    seeded_order = DraftOrder(seeded)
    for _ in range(10):
        learn(seeded, seeded_order, ["head"], 0, 0.010, 0.0)
    assert all(seeded_order.worth_asking("head", 0.001) for _ in range(20))
    assert DraftOrder(FixedK(4).estimates).worth_asking("head", 1.0)


def test_the_k_policy_only_chooses_k_and_the_order_passes_ask_gains_on():
    """The ordering of a composite drafter's parts lives in its ``DraftOrder``, not in the K
    policy; what an order learns about asking a head seeds the next request's order through the
    same estimates object, and a seeded sampled request neither reads nor leaves any."""
    for name in ("rank_free", "prefers_costly", "worth_asking", "costly_gate", "draft_room"):
        assert not hasattr(AdaptiveK, name) and not hasattr(FixedK, name)
    recent = RecentEstimates()
    policy = AdaptiveK(8, recent=recent)
    order = DraftOrder(policy)
    for _ in range(5):
        assert order.worth_asking("head", 0.001)
        learn(policy, order, ["head"], 0, 0.010, 0.0)
    assert recent.ask_gain[""]["head"] == pytest.approx(order.ask_gain("head"))
    assert DraftOrder(AdaptiveK(8, recent=recent)).ask_gain("head") == pytest.approx(order.ask_gain("head"))
    assert DraftOrder(AdaptiveK(8, recent=recent, deterministic=True)).ask_gain("head") == pytest.approx(0.5)


def learn(policy, order, kinds, accepted, verify_seconds, draft_seconds, confidence=None):
    """What a decoder's step teaches both: the order sees the verdict (as its drafter does),
    the K policy its counts and timings."""
    order.update(Draft([0] * len(kinds), [None] * (len(kinds) + 1), kinds=list(kinds), confidence=confidence), accepted)
    policy.update(kinds, accepted, verify_seconds, draft_seconds, confidence)
