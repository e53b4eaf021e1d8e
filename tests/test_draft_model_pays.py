"""A draft model inside auto is priced by what it measurably costs, as a learned head is: it
times its own asks and tokens, hands them to the next request, and a draft too slow to pay is
asked rarely, with greedy output unchanged (float64 tiny models over the SmolLM2 tokenizer)."""

from __future__ import annotations

import time

import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import RecentEstimates, SpecOptions, decode
from constrained_spec.drafters import build_drafter
from tests.test_greedy_identity import PADDED_VOCAB, TEXT, models  # noqa: F401  (the float64 target and draft)


class Slowed(torch.nn.Module):
    """``inner`` with ``delay`` seconds added to every forward (a draft model far larger than it)."""

    def __init__(self, inner: torch.nn.Module, delay: float) -> None:
        super().__init__()
        self.inner, self.config, self.delay = inner, inner.config, delay

    def forward(self, **inputs):
        time.sleep(self.delay)
        return self.inner(**inputs)


def _auto(target, draft, matcher, tokenizer, prompt, recent):
    drafter = build_drafter("auto", matcher, tokenizer, draft_model=draft)
    policy = SpecOptions(drafter="auto").k_policy(8, estimates=recent)
    return decode(target, matcher, prompt, drafter=drafter, k_policy=policy, max_new_tokens=48), drafter


def test_a_draft_model_times_its_asks_and_tokens_and_the_next_request_starts_from_them(smol, models):
    """Untimed, a draft model was priced at a head's prior (a few percent of a target forward)
    and asked wherever that prior paid: a 0.5B draft beside a 1.5B target costs about 0.4 of
    it, and auto with it ran slower than auto without it."""
    target, _ = models
    compiled = compile_constraint("schemas/person.json", smol.tokenizer, backend="llguidance")
    prompt = smol.tokenizer(TEXT)["input_ids"]
    baseline = decode(target, compiled.matcher(), prompt, max_new_tokens=48)
    measured = {}
    for label, draft in (("fast", target), ("slow", Slowed(target, 0.05))):
        recent = RecentEstimates()
        out, drafter = _auto(target, draft, compiled.matcher(), smol.tokenizer, prompt, recent)
        assert out.tokens == baseline.tokens
        model_part = next(p for p in drafter.parts if p.name == "model")
        assert out.stats.per_kind["model"]["drafted"] > 0  # it was asked, so it has timings
        measured[label] = (model_part.seconds_per_token, model_part.seconds_per_ask)
        assert recent.draft_timings[draft] == measured[label]
        # The next request's draft of the same model starts from them, before its first ask.
        follower = build_drafter("auto", compiled.matcher(), smol.tokenizer, draft_model=draft)
        follower.set_recent_estimates(recent)
        part = next(p for p in follower.parts if p.name == "model")
        assert (part.seconds_per_token, part.seconds_per_ask) == measured[label]
    assert measured["slow"][0] >= 0.05 > measured["fast"][0] > 0, measured


def test_the_order_prices_a_slow_draft_model_out_of_a_step(models):
    """``draft_room`` weighs a token by its measured cost over a one-token pass: where a draft
    token costs several target forwards, even a sure one is not worth drafting (bar a probe)."""
    from constrained_spec.decoding import AdaptiveK
    from constrained_spec.drafters.order import DraftOrder

    policy = AdaptiveK(8, costly_draft=True, costly_kind="model")
    policy.one_token_seconds = lambda: 0.01  # a one-token pass: 10 ms
    policy.alpha = lambda key: 0.95
    policy.survival = lambda kinds, confidence=None: [0.95 ** j for j in range(1, len(kinds) + 1)]
    order = DraftOrder(policy)
    assert order.draft_room([], "model", 4, seconds_per_token=0.001) >= 3
    order = DraftOrder(policy)
    assert order.draft_room([], "model", 4, seconds_per_token=0.05) == 0
