"""A draft model inside auto is priced by what it measurably costs, as a learned head is: it
times its own asks and tokens, hands them to the next request, and a draft too slow to pay is
asked rarely, with greedy output unchanged (float64 tiny models over the SmolLM2 tokenizer)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import AdaptiveK, RecentEstimates, SpecOptions, decode
from constrained_spec.drafters import build_drafter
from constrained_spec.drafters.order import DraftOrder
from tests.test_kpolicy import learn
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
        measured[label] = (model_part.seconds_per_token, model_part.seconds_per_ask,
                           model_part.seconds_per_context_token)
        assert recent.draft_timings[draft] == measured[label]
        # The next request's draft of the same model starts from them, before its first ask.
        follower = build_drafter("auto", compiled.matcher(), smol.tokenizer, draft_model=draft)
        follower.set_recent_estimates(recent)
        part = next(p for p in follower.parts if p.name == "model")
        assert (part.seconds_per_token, part.seconds_per_ask, part.seconds_per_context_token) == measured[label]
    # An ask runs the draft at least once past its catch-up; a token costs a share of that.
    assert measured["slow"][1] >= 0.05 > measured["fast"][1] > 0, measured
    assert measured["slow"][0] >= 0.05 / 4 > measured["fast"][0] > 0, measured
    assert measured["slow"][2] > 0 and measured["fast"][2] > 0  # its prompt pass, per context token


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


class Oracle(torch.nn.Module):
    """A draft model that knows the target's greedy output (right at every token, nearly free
    per step) and sleeps ``delay`` seconds in a forward over more than 8 tokens: its prompt pass."""

    def __init__(self, ids: list[int], vocab: int, delay: float) -> None:
        super().__init__()
        self.ids, self.vocab, self.delay = ids, vocab, delay
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where the drafter reads its device

    def new_cache(self) -> "_Positions":
        return _Positions()

    def forward(self, input_ids, cache, **_):
        if input_ids.shape[1] > 8:
            time.sleep(self.delay)
        cache.length += input_ids.shape[1]
        logits = torch.zeros(1, 1, self.vocab)
        if cache.length < len(self.ids):
            logits[0, 0, self.ids[cache.length]] = 10.0
        return SimpleNamespace(logits=logits)


class _Positions:
    """The oracle's cache: only how many positions it holds."""

    length = 0

    def crop(self, n: int) -> None:
        self.length += n  # negative: drop that many


def test_a_draft_model_is_asked_only_while_what_it_brings_pays_for_its_prompt_pass(smol, models):
    """A draft model's first ask of a request feeds it the whole prompt. The first request with
    it times that pass; from the next on, the first ask must pay for it out of what asking
    brought per request before. A draft right at every token whose prompt pass takes 1 s is
    never fed again, the same draft with a free pass keeps being asked; greedy output is
    target-only's every time."""
    target, _ = models
    compiled = compile_constraint("schemas/person.json", smol.tokenizer, backend="llguidance")
    prompt = smol.tokenizer(TEXT)["input_ids"]
    baseline = decode(target, compiled.matcher(), prompt, max_new_tokens=48)
    drafted = {}
    for label, delay in (("free prompt pass", 0.0), ("1 s prompt pass", 1.0)):
        draft = Oracle(prompt + baseline.tokens, PADDED_VOCAB, delay)
        recent = RecentEstimates()
        drafted[label] = []
        for _ in range(3):
            out, drafter = _auto(target, draft, compiled.matcher(), smol.tokenizer, prompt, recent)
            assert out.tokens == baseline.tokens
            drafted[label].append(out.stats.per_kind.get("model", {}).get("drafted", 0))
        # Its prompt pass, per context token (the prompt and the tokens before the first ask).
        assert recent.draft_timings[draft][2] >= delay / (len(prompt) + 48)
    assert all(n > 0 for n in drafted["free prompt pass"]), drafted
    assert drafted["1 s prompt pass"][0] > 0 and drafted["1 s prompt pass"][1:] == [0, 0], drafted


def test_a_first_ask_pays_for_the_prompt_pass_from_the_asks_past_requests_had_ahead():
    """The order's arithmetic: steps of 10 ms emitting 2 tokens price a token at 5 ms; an ask of
    1 ms bringing 0.5 accepted tokens (the prior) is worth 1.5 ms net. Past requests had 10
    chances to ask in wide regions: a prompt pass of 10 ms is paid for by the asks ahead, one
    of 50 ms is not, and is never asked as a probe (a probe would pay the whole pass); once fed
    (no catch-up left) the draft is asked wherever an ask pays. Without past chances only the
    ask itself counts, and a request's chances update the mean the next one reads."""
    recent = RecentEstimates()
    policy = AdaptiveK(12, recent=recent)
    teacher = DraftOrder(policy)
    for _ in range(10):
        learn(policy, teacher, ["lookup"], 1, 0.010, 0.0)

    def order(chances: float | None) -> DraftOrder:
        recent.ask_chances[""] = {} if chances is None else {"model@wide": chances}
        recent.ask_gain[""] = {"model@wide": 0.5}  # each order from the same ask gain
        return DraftOrder(policy)

    assert order(10.0).worth_asking("model", 0.001, region="wide", catch_up_seconds=0.010)
    expensive = order(10.0)
    assert not any(expensive.worth_asking("model", 0.001, region="wide", catch_up_seconds=0.050) for _ in range(30))
    assert expensive.worth_asking("model", 0.001, region="wide", catch_up_seconds=0.0)
    assert not order(None).worth_asking("model", 0.001, region="wide", catch_up_seconds=0.010)
    assert order(None).worth_asking("model", 0.001, region="wide", catch_up_seconds=0.001)
    seen = order(10.0)
    for _ in range(3):
        seen.worth_asking("model", 0.001, region="wide", catch_up_seconds=0.050)
    assert recent.ask_chances[""]["model@wide"] == pytest.approx(0.7 * 10.0 + 0.3 * 3)


def test_asks_are_counted_per_region_and_a_region_where_a_draft_is_wrong_is_left_to_probes():
    """A draft model right in narrow regions (numbers, enums) and wrong in wide ones (free
    strings) keeps being asked in the narrow ones and, in the wide ones, only every 8th time."""
    policy = AdaptiveK(12)
    order = DraftOrder(policy)
    for _ in range(10):
        learn(policy, order, ["lookup"], 1, 0.010, 0.0)
    narrow, wide = [], []
    for i in range(80):
        region = "narrow" if i % 2 else "wide"
        if order.worth_asking("model", 0.001, region=region):
            (narrow if i % 2 else wide).append(i)
            learn(policy, order, ["model", "model"], 2 if i % 2 else 0, 0.010, 0.0)
    assert len(narrow) == 40
    assert order.ask_gain("model@narrow") > 1.0 > 0.2 > order.ask_gain("model@wide")
    assert len(wide) < 15


def test_the_region_of_a_state_is_read_off_its_mask(smol):
    """Narrow where few tokens may follow (digits), wide inside a free string, and None where
    only the end of the sequence is left: a costly drafter is never asked there (its ask would
    draft nothing: drafts never end the sequence)."""
    from constrained_spec.drafters.hybrid import region_of

    compiled = compile_constraint(r'[0-9]{1,3} "[^"]{0,40}"', smol.tokenizer, kind="regex")
    matcher = compiled.matcher()
    assert region_of(matcher, matcher.initial_state) == "narrow"
    text = smol.tokenizer('12 "abc', add_special_tokens=False)["input_ids"]
    states = matcher.walk(matcher.initial_state, text)
    assert len(states) == len(text) + 1
    assert region_of(matcher, states[-1]) == "wide"
    done = matcher.walk(matcher.initial_state, smol.tokenizer('12 "abc"', add_special_tokens=False)["input_ids"])[-1]
    assert matcher.is_final(done) and region_of(matcher, done) is None


def test_a_draft_model_reads_only_the_rows_of_its_output_matrix_a_narrow_state_allows(tmp_path, monkeypatch):
    """Where the constraint allows few tokens (digits here), a draft model's logits come from
    those rows of its output matrix alone (``models.output_rows``), as the target's do: its full
    vocabulary projection never runs, and the output is target-only's (tiny GGUF files)."""
    from constrained_spec import generate_regex, load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    shape = dict(arch="llama", types={"attn_q": "Q4_0"}, hidden=256, ff=512, gpt2_vocab=2000)
    target = load_model(str(write_tiny_gguf(tmp_path / "target.gguf", layers=2, seed=0, **shape)))
    draft = load_model(str(write_tiny_gguf(tmp_path / "draft.gguf", layers=1, seed=7, default="Q4_1", **shape)))
    pattern, prompt = r"[0-9]{8,20}", "Twenty digits: "
    base = generate_regex(target, pattern, prompt, drafter="none", max_new_tokens=24)
    full_projections = count_full_projections(monkeypatch, draft)
    text, stats = generate_regex(target, pattern, prompt, drafter="model", draft=draft, k_max=4, max_new_tokens=24,
                                 return_stats=True)
    assert text == base and stats.drafted > 0
    assert not full_projections


def count_full_projections(monkeypatch, handle) -> list:
    """A list that gets an entry each time ``handle``'s model runs its whole output layer."""
    output = handle.model.get_output_embeddings()
    calls: list = []
    plain = type(output).forward
    monkeypatch.setattr(type(output), "forward",
                        lambda self, *a, **k: (calls.append(self) if self is output else None) or plain(self, *a, **k))
    return calls
