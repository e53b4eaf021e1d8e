"""Choosing the draft length K: a fixed baseline and an adaptive policy.

The adaptive policy estimates online, per drafter kind, the probability alpha that a drafted
token is accepted given that the ones before it were, and the cost of a step:
verify(K) = t0 + t1 K (fitted on the step timings) plus the draft's own cost per token. It
chooses K by the expected tokens per unit of time (Leviathan et al. 2023):

    K* = argmax_K (1 - a^(K+1)) / ((1 - a)(K c + 1)),   c = (draft cost + t1) / t0

For deterministic drafters (forced text, copy, lookup) the draft is free and its tokens are
known before the target runs, so the same objective picks how much of the proposal to verify,
with the survival probability of each position taken from the kind that drafted it, and the
verify cost fitted as t0 (1 + r g(K)), g linear or concave (log2(1 + K)): whichever fits the
steps, starting from the profile's (``_CurveFit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ..drafters.base import Confidences, DraftGate
from ..drafters.hybrid import COSTLY_KINDS
from .linefit import LineSums

#: Priors for alpha per drafter kind (seeds before any request has been seen), overwritten by
#: what recent requests measured (``_RECENT_ALPHA``). A kind's first token of a run and the
#: tokens continuing it are estimated apart ("copy" vs "copy+"): acceptance is not
#: independent along a span (a copied value is usually right or wrong at its first token),
#: and one alpha per kind would make long spans look too risky to verify.
PRIOR_ALPHA = {"grammar": 0.85, "grammar+": 0.95, "copy": 0.6, "copy+": 0.85, "lookup": 0.5, "lookup+": 0.75,
               "corpus": 0.45, "corpus+": 0.6,
               "model": 0.6, "model+": 0.6, "head": 0.6, "head+": 0.6}
#: Prior cost of one extra verified token, as a fraction of a one-token forward (CPU, measured).
PRIOR_C_VERIFY = 0.1
#: Prior cost of one token of a learned head, as a fraction of a one-token forward, until the
#: request has timed both (and always for a seeded sampled request, which uses no timings).
PRIOR_C_HEAD = 0.15
#: Default prior of the fit verify = t0 (1 + r g(K)) where no profile gives one
#: (``profiles.verify_cost_prior``); recent requests' fits on the same model and precision
#: replace it (``_RECENT_CURVE``, keyed by ``AdaptiveK.cost_key``: the shape and r).
PRIOR_R_CURVE = 0.25
PRIOR_CURVE_SHAPE = "concave"
_RECENT_ALPHA: dict[str, dict[str, float]] = {}
_RECENT_CURVE: dict[str, tuple[str, float]] = {}
#: Upper edges of the confidence buckets a gated draft token is estimated by (its drafter's
#: probability of the token it drafts, before drawing it). The acceptance of a learned head's
#: token depends far more on its confidence than on its kind: inside auto on 8 held-out
#: generation prompts, a head's first token was accepted 0.57 of the time at confidence >= 0.8
#: and 0.16 below it (0.20 overall), while one kind-wide estimate treats both alike.
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.85, 0.95, 1.0)
#: A bucket's prior acceptance (its middle confidence, EAGLE-2's observation that a draft
#: head's confidence approximates its acceptance) and the weight of that prior in steps.
CONFIDENCE_PRIOR = (0.15, 0.4, 0.6, 0.775, 0.9, 0.975)
CONFIDENCE_PRIOR_WEIGHT = 2.0
#: Forgetting factor of a key's bucket counts, applied at each step that examines the key.
CONFIDENCE_DECAY = 0.97
_RECENT_CONFIDENCE: dict[str, dict[tuple[str, int], float]] = {}
#: Tokens a costly drafter's ask brings (accepted tokens of its kind per ask, refused asks
#: included) before a request has measured it (``AdaptiveK.worth_asking``), the weight of that
#: prior in asks, the forgetting factor per ask, and the refused asks between two probes.
PRIOR_ASK_GAIN = 0.5
ASK_PRIOR_WEIGHT = 2.0
ASK_DECAY = 0.9
ASK_PROBE_GAP = 8
_RECENT_ASK_GAIN: dict[str, dict[str, float]] = {}


def confidence_bucket(confidence: float) -> int:
    """The index in ``CONFIDENCE_EDGES`` of the bucket holding ``confidence``."""
    return next((i for i, edge in enumerate(CONFIDENCE_EDGES) if confidence <= edge), len(CONFIDENCE_EDGES) - 1)



def alpha_keys(kinds: Sequence[str]) -> list[str]:
    """The estimate each position uses: its kind, with "+" when it continues a run of that kind."""
    return [k + "+" if i and kinds[i - 1] == k else k for i, k in enumerate(kinds)]


class KPolicy(Protocol):
    """Chooses the draft length of each step."""

    @property
    def k_max(self) -> int:
        """The most tokens a step may verify."""

    def next_k(self) -> int:
        """How many tokens the drafter may propose (0 means plain decoding)."""

    def trim(self, kinds: Sequence[str], confidence: Confidences = None) -> int:
        """How many of the proposed tokens (of these kinds, with their drafters' confidences
        where known) to send to the verifier."""

    def update(self, kinds: Sequence[str], accepted: int, verify_seconds: float | None, draft_seconds: float,
               confidence: Confidences = None) -> None:
        """Learn from the last step (``verify_seconds`` None: the pass also carried the prompt)."""

    def draft_room(self, kinds: Sequence[str], kind: str, room: int, seconds_per_token: float) -> int:
        """How many tokens (at most ``room``) a costly drafter of ``kind`` should add after a
        proposal of ``kinds`` so far."""

    def costly_gate(self, kinds: Sequence[str], confidence: Confidences, kind: str,
                    seconds_per_token: float) -> DraftGate:
        """A gate for a costly drafter that knows its confidence: called with the confidence of
        each next token before it is drawn, True while that token is worth drafting."""

    def worth_asking(self, kind: str, seconds_per_ask: float) -> bool:
        """Whether to ask a costly drafter of ``kind`` at the next position at all."""

    def prefers_costly(self, kinds: Sequence[str], free_kind: str, costly_kind: str, seconds_per_token: float) -> bool:
        """Whether the costly kind should draft the next position before a free part of ``free_kind``."""

    def rank_free(self, kinds: Sequence[str], free_kinds: Sequence[str]) -> list[int]:
        """The order in which free parts are asked for the next position."""


@dataclass
class FixedK:
    """The baseline: always propose and verify up to ``k`` tokens."""

    k: int

    @property
    def k_max(self) -> int:
        """The cap is ``k`` itself."""
        return self.k

    def next_k(self) -> int:
        """Always ``k``."""
        return self.k

    def trim(self, kinds: Sequence[str], confidence: Confidences = None) -> int:
        """Verify the whole proposal."""
        return len(kinds)

    def update(self, kinds: Sequence[str], accepted: int, verify_seconds: float | None, draft_seconds: float,
               confidence: Confidences = None) -> None:
        """Nothing to learn."""

    def draft_room(self, kinds: Sequence[str], kind: str, room: int, seconds_per_token: float) -> int:
        """All of it: the baseline drafts what it is allowed."""
        return room

    def costly_gate(self, kinds: Sequence[str], confidence: Confidences, kind: str,
                    seconds_per_token: float) -> DraftGate:
        """Always open: the baseline drafts what it is allowed."""
        return lambda c: True

    def worth_asking(self, kind: str, seconds_per_ask: float) -> bool:
        """Always: the baseline asks every drafter."""
        return True

    def prefers_costly(self, kinds: Sequence[str], free_kind: str, costly_kind: str, seconds_per_token: float) -> bool:
        """Never: the baseline keeps the drafter's own order."""
        return False

    def rank_free(self, kinds: Sequence[str], free_kinds: Sequence[str]) -> list[int]:
        """The declared order."""
        return list(range(len(free_kinds)))


def _concave(k: int) -> float:
    return math.log2(1 + k)


def _linear(k: int) -> float:
    return float(k)


#: The shapes g of a verify pass's cost t(K) = t0 (1 + r g(K)) over K drafted tokens. Concave
#: where checking more rows costs little more (a float32 matmul here, an accelerator with room
#: to spare); linear where each row pays on its own (the int4 kernel here: native passes over 1,
#: 4, 12, 21 new tokens took 84, 108, 206, 266 ms, about +0.11 of a pass per token at every K,
#: where a concave fit through the long spans' passes puts K = 1 at +0.4 and shuts the head out).
CURVE_SHAPES: dict[str, Callable[[int], float]] = {"linear": _linear, "concave": _concave}


def optimal_k(alpha: float, c: float, k_max: int) -> int:
    """argmax over K in 0..k_max of (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1))."""
    alpha = min(max(alpha, 1e-6), 1 - 1e-6)
    best_k, best = 0, 1.0  # K = 0: one token per unit cost
    for k in range(1, k_max + 1):
        value = (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))
        if value > best + 1e-12:
            best_k, best = k, value
    return best_k


@dataclass
class _CostFit:
    """Least-squares fit of verify seconds = t0 + t1 * g(k), with a prior ratio until data varies.

    ``g`` is the shape of the cost in K: linear for the formula with a draft model; one of
    ``CURVE_SHAPES`` inside ``_CurveFit`` for trimming free drafts and sizing a head's.
    """

    g: Callable[[int], float] = float
    #: The ratio before data (the prior), and how many steps of data it weighs.
    prior: float = PRIOR_C_VERIFY
    prior_weight: float = 4.0
    sums: LineSums = field(default_factory=LineSums)

    @property
    def n(self) -> float:
        """Steps fitted so far."""
        return self.sums.n

    def add(self, k: int, t: float) -> None:
        self.sums.add(self.g(k), t)

    def one_token_seconds(self) -> float:
        """Estimated t0, the time of a plain (K = 0) verify pass."""
        if not self.n:
            return 0.0
        mean_k, mean_t = self.sums.sx / self.n, self.sums.sy / self.n
        return mean_t / (1 + self.ratio() * mean_k)

    def ratio(self) -> float:
        """t1 / t0: the cost of one more unit of g(K) relative to a plain pass.

        The fit is shrunk towards the prior (a few noisy steps whose K barely varies can put
        t0 near zero and the ratio sky-high) and capped at 1.
        """
        if self.n < 2 or self.sums.spread / self.n**2 < 0.25:  # the K values seen do not span a range yet
            return self.prior
        t0, t1 = self.sums.line()
        fit = min(max(t1 / t0, 0.0), 1.0) if t0 > 0 else self.prior
        return (self.n * fit + self.prior_weight * self.prior) / (self.n + self.prior_weight)


@dataclass
class _CurveFit:
    """The verify-cost curve t(K) = t0 (1 + r g(K)), fitted on the same steps in every shape of
    ``CURVE_SHAPES``. The prior's shape is used until another fits clearly better (under 0.7 of
    its squared residuals, once 8 steps span a range of K); the other shapes' priors are the
    prior's r converted so that all predict the same cost at K = 8."""

    shape: str = PRIOR_CURVE_SHAPE
    prior: float = PRIOR_R_CURVE
    fits: dict[str, _CostFit] = field(init=False)

    def __post_init__(self) -> None:
        at8 = self.prior * CURVE_SHAPES[self.shape](8)
        self.fits = {name: _CostFit(g=g, prior=at8 / g(8)) for name, g in CURVE_SHAPES.items()}
        self._refit()

    @property
    def n(self) -> float:
        """Steps fitted so far."""
        return self.fits[self.shape].n

    def add(self, k: int, t: float) -> None:
        for fit in self.fits.values():
            fit.add(k, t)
        self._refit()

    def _refit(self) -> None:
        # Once per step fitted, not at every position a trim or a head's room weighs.
        self._best = self._choose_shape()
        self._r = self.fits[self._best].ratio()

    def _choose_shape(self) -> str:
        own = self.fits[self.shape].sums
        if own.n < 8 or own.spread / own.n**2 < 0.25:
            return self.shape
        best = min(self.fits, key=lambda name: self.fits[name].sums.residual())
        return best if self.fits[best].sums.residual() < 0.7 * own.residual() else self.shape

    def best_shape(self) -> str:
        """The shape the decisions use now."""
        return self._best

    def ratio(self) -> float:
        """r of the shape in use."""
        return self._r

    def extra(self, k: int) -> float:
        """r g(K): the cost of verifying ``k`` drafted tokens beyond a plain pass, over a plain pass."""
        return self._r * CURVE_SHAPES[self._best](k)


@dataclass
class AdaptiveK:
    """Online acceptance and cost estimates; K from the expected-throughput formula.

    Args:
        k_max: the profile's cap.
        costly_draft: True for a draft model (K is chosen before drafting, each token costs);
            False for deterministic drafters (propose up to k_max, then trim).
        decay: forgetting factor of the acceptance counts, so estimates follow the request.
        deterministic: choose K from the tokens seen only, never from timings or from other
            requests, so that a seeded sampled request draws the same output every time (the
            verifier's random draws depend on how many tokens each step verifies). The cost
            model then stays at its prior. Used whenever ``seed`` is given with temperature > 0.
        cost_prior: the verify-cost curve's r before any timing (``profiles.verify_cost_prior``).
        cost_shape: that curve's shape before the timings say otherwise ("linear" or "concave").
        cost_key: which model and precision the timings come from; recent fits seed only
            requests with the same key (a native forward's cost grows twice as fast with K as
            a float32 one's).
        history_key: which model and drafter configuration the acceptance estimates come
            from; recent requests seed only requests with the same key. The same kind is right
            at different rates in different company: lookup alone drafts every position it can,
            inside auto only those forced text and copies leave it; a head alone is asked
            everywhere, inside auto only where nothing else drafts. Shared by kind alone, the
            rows of one bench run seeded one another.
    """

    k_max: int
    costly_draft: bool = False
    #: The kind whose acceptance a costly draft is estimated by ("model" or "head").
    costly_kind: str = "model"
    deterministic: bool = False
    cost_prior: float = PRIOR_R_CURVE
    cost_shape: str = PRIOR_CURVE_SHAPE
    cost_key: str = ""
    history_key: str = ""
    decay: float = 0.9
    prior_weight: float = 4.0
    _succ: dict[str, float] = field(default_factory=dict)
    _trials: dict[str, float] = field(default_factory=dict)
    _cost: _CostFit = field(default_factory=_CostFit)
    _curve: _CurveFit = field(init=False)
    _draft_per_token: float = 0.0
    _skipped: int = 0
    _skipped_costly: int = 0
    #: Skipped costly drafts between two probes: doubles (up to 64) each time the first token of
    #: a costly run is rejected, back to 8 when one is accepted (a head that is wrong where it is
    #: asked costs a feed, a draft token and a verified row per probe).
    _costly_probe_gap: int = 8
    _seed: dict[str, float] = field(default_factory=dict)
    #: Per (alpha key, confidence bucket) of gated tokens: decayed accepted / examined counts,
    #: and the seed (the bucket's prior, or what recent requests measured).
    _conf_succ: dict[tuple[str, int], float] = field(default_factory=dict)
    _conf_trials: dict[tuple[str, int], float] = field(default_factory=dict)
    _conf_seed: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Per costly kind: decayed asks and the accepted tokens of that kind they brought, the
    #: seed of their ratio, and refused asks since the last probe (``worth_asking``).
    _asks: dict[str, float] = field(default_factory=dict)
    _ask_gain: dict[str, float] = field(default_factory=dict)
    _ask_seed: dict[str, float] = field(default_factory=dict)
    _asks_refused: int = 0
    #: Decayed seconds and emitted tokens of the timed steps: the request's price per token.
    _spent: float = 0.0
    _emitted: float = 0.0

    def __post_init__(self) -> None:
        # Seed this request from what recent requests measured (a snapshot: this request's
        # own updates must not feed back into its prior).
        recent_alpha = {} if self.deterministic else _RECENT_ALPHA.get(self.history_key, {})
        self._seed = {**PRIOR_ALPHA, **recent_alpha}
        self._conf_seed = {} if self.deterministic else dict(_RECENT_CONFIDENCE.get(self.history_key, {}))
        self._ask_seed = {} if self.deterministic else dict(_RECENT_ASK_GAIN.get(self.history_key, {}))
        recent = None if self.deterministic else _RECENT_CURVE.get(self.cost_key)
        shape, r = recent if recent is not None else (self.cost_shape, self.cost_prior)
        self._curve = _CurveFit(shape=shape, prior=r)

    def alpha(self, kind: str) -> float:
        """Current acceptance estimate of a kind, seeded from recent requests or the prior."""
        seed = self._seed.get(kind, 0.5)
        s, t = self._succ.get(kind, 0.0), self._trials.get(kind, 0.0)
        return (s + seed * self.prior_weight) / (t + self.prior_weight)

    def alpha_at(self, key: str, confidence: float | None) -> float:
        """The acceptance estimate of one drafted token: its confidence bucket's (calibrated on
        this key's accepted and rejected tokens of that confidence) where its drafter gave a
        confidence, else its key's."""
        if confidence is None:
            return self.alpha(key)
        b = confidence_bucket(confidence)
        seed = self._conf_seed.get((key, b), CONFIDENCE_PRIOR[b])
        s, t = self._conf_succ.get((key, b), 0.0), self._conf_trials.get((key, b), 0.0)
        return (s + seed * CONFIDENCE_PRIOR_WEIGHT) / (t + CONFIDENCE_PRIOR_WEIGHT)

    def c(self) -> float:
        """Cost of one more drafted-and-verified token relative to a one-token step."""
        t0 = self._cost.one_token_seconds()
        draft = self._draft_per_token / t0 if t0 > 0 else 0.0
        return self._cost.ratio() + (draft if self.costly_draft else 0.0)

    def next_k(self) -> int:
        """For a draft model, the formula's K; for free drafters, the cap (trimmed later)."""
        if self.costly_draft:
            # The formula's objective with the first and the continuing tokens' alphas; equal
            # to optimal_k(alpha, c, k_max) when the two estimates agree.
            c = self.c()
            return self._best_prefix([self.costly_kind] * self.k_max, lambda j: c * j)
        return self.k_max

    def trim(self, kinds: Sequence[str], confidence: Confidences = None) -> int:
        """The prefix length maximizing expected emitted tokens per unit of step cost.

        Decided position by position (stop at the first token that does not raise the
        objective, which is unimodal because survival only falls), so whether position i is
        verified depends on the kinds (and drafters' confidences) of positions 1..i only, which
        are fixed before x_i is drawn. Looking further ahead would make the verified length
        depend on sampled draft tokens and bias the output distribution.
        """
        keep = self._best_prefix(kinds[: self.k_max], self._curve.extra, confidence)
        if keep == 0 and kinds:
            # Probe now and then, so an estimate that fell too low can recover.
            self._skipped += 1
            if self._skipped % 8 == 0:
                keep = 1
        return keep

    @property
    def budgeted(self) -> bool:
        """Whether a batch engine may cut this request's drafts to its step budget (not when the
        request must be reproducible from its seed: the budget depends on the other rows)."""
        return not self.deterministic

    def survival(self, kinds: Sequence[str], confidence: Confidences = None) -> list[float]:
        """P(draft tokens 1..j are all accepted) for j = 1..len(kinds), from the current estimates."""
        out, p = [], 1.0
        for key, conf in zip(alpha_keys(kinds), _padded(confidence, len(kinds))):
            p *= self.alpha_at(key, conf)
            out.append(p)
        return out

    def costly_gate(self, kinds: Sequence[str], confidence: Confidences, kind: str,
                    seconds_per_token: float) -> DraftGate:
        """A gate for a costly drafter that knows its confidence (a learned head): its next
        token is drafted while it raises the expected tokens per unit of step cost, that token's
        acceptance taken from its confidence bucket (``alpha_at``), its cost its verify share
        and the drafter's steps after the first (whose law it has computed when it asks). The
        gate sees each token's confidence before the token is drawn (a property of the draft
        prefix), so whether a position is drafted never depends on the token drawn there and the
        output law is untouched. A first token refused counts towards the probes of
        ``draft_room``."""
        c = self._costly_ratio(seconds_per_token)
        extra = self._curve.extra
        base = len(kinds)
        survive, expected = self._survival_sums(kinds, confidence)
        value, j, prev = expected / (1 + extra(base)), 0, kinds[-1] if kinds else None

        def gate(conf: float) -> bool:
            nonlocal survive, expected, value, j, prev
            s = survive * self.alpha_at(kind + "+" if prev == kind else kind, conf)
            # The drafter has computed this token's law already (that is where its confidence
            # comes from): what drafting it adds is its verify share and the rolls for the
            # tokens after it, so the (j + 1)-th token is charged j of the drafter's own steps.
            nxt = (expected + s) / (1 + extra(base + j + 1) + c * j)
            if nxt <= value + 1e-12 and (j > 0 or not self._costly_probe_due()):
                return False
            survive, expected, value, j, prev = s, expected + s, max(nxt, value), j + 1, kind
            return True

        return gate

    def draft_room(self, kinds: Sequence[str], kind: str, room: int, seconds_per_token: float) -> int:
        """Tokens of a costly ``kind`` (a learned head) worth drafting after ``kinds``: the
        first-stop argmax of expected tokens per unit of step cost, where each of them costs its
        verify share and its own drafting (``seconds_per_token`` over a one-token pass, the
        prior ``PRIOR_C_HEAD`` until both are timed). Decided before any of them is drawn, so
        the output law is untouched; a draft that does not pay is not drafted."""
        c = self._costly_ratio(seconds_per_token)
        extra = self._curve.extra
        base = len(kinds)
        keys = alpha_keys([*kinds, *([kind] * room)])
        survive, expected = self._survival_sums(kinds)
        value, keep = expected / (1 + extra(base)), 0
        for j, key in enumerate(keys[base:], start=1):
            survive *= self.alpha(key)
            nxt = (expected + survive) / (1 + extra(base + j) + c * j)
            if nxt <= value + 1e-12:
                break
            expected, value, keep = expected + survive, nxt, j
        if keep == 0 and room and self._costly_probe_due():
            keep = 1
        return keep

    def _costly_probe_due(self) -> bool:
        """Count a costly first token refused; True (and the count restarts) once the probe gap
        is reached, so an estimate that fell too low can recover (as ``trim`` probes)."""
        self._skipped_costly += 1
        if self._skipped_costly < self._costly_probe_gap:
            return False
        self._skipped_costly = 0
        return True

    def _survival_sums(self, kinds: Sequence[str], confidence: Confidences = None) -> tuple[float, float]:
        """(P(all of ``kinds`` accepted), 1 + the expected accepted tokens among them): where a
        costly drafter's tokens start from."""
        survive, expected = 1.0, 1.0
        for p in self.survival(kinds, confidence):
            survive, expected = p, expected + p
        return survive, expected

    def worth_asking(self, kind: str, seconds_per_ask: float) -> bool:
        """Whether to ask a costly drafter of ``kind`` (a learned head) at the next position:
        while the tokens of that kind an ask brings (``ask_gain``), at the request's price per
        emitted token (its timed steps' seconds over their tokens), are worth more than the
        ask's measured seconds. An ask costs the drafter a step even when its gate then refuses
        every token (about 3.5 ms for the shipped head here), so a head that is rarely
        confident where it is asked buys its tokens dearer than the steps do and lowers the
        rate. A refused ask is probed every ``ASK_PROBE_GAP``, so a low estimate can recover.
        Decided from past steps only, before anything is drawn at the position, so the output
        law is untouched; a seeded sampled request (no timings) always asks. True counts an ask."""
        ask = True
        if not self.deterministic and seconds_per_ask > 0 and self._emitted > 0:
            ask = self.ask_gain(kind) * self._spent / self._emitted >= seconds_per_ask
            if not ask:
                self._asks_refused += 1
                if self._asks_refused >= ASK_PROBE_GAP:
                    ask, self._asks_refused = True, 0
        if ask:
            self._asks[kind] = self._asks.get(kind, 0.0) * ASK_DECAY + 1
            self._ask_gain[kind] = self._ask_gain.get(kind, 0.0) * ASK_DECAY
        return ask

    def ask_gain(self, kind: str) -> float:
        """Accepted tokens of the costly ``kind`` per ask (decayed counts over the prior)."""
        seed = self._ask_seed.get(kind, PRIOR_ASK_GAIN)
        return (self._ask_gain.get(kind, 0.0) + seed * ASK_PRIOR_WEIGHT) / (self._asks.get(kind, 0.0) + ASK_PRIOR_WEIGHT)

    def prefers_costly(self, kinds: Sequence[str], free_kind: str, costly_kind: str, seconds_per_token: float) -> bool:
        """Whether the costly kind (a learned head) should draft the next position before a free
        part (lookup, a copy) that has a proposal there: when its acceptance estimate at that
        position, less its own cost per token, beats what the free part's run is worth there:
        its first token's estimate times one plus its continuing tokens' (a free run's first
        token accepted opens the rest of its span at no drafting cost; weighed by the first
        token alone, a copy whose first token was accepted half the time lost the position to
        the head although its spans then ran on at 0.87: inside auto on the 6 extraction
        prompts that cost 0.91-0.93x of auto without the head, against 1.00x run by spans).
        Where lookup's spans are mostly rejected at their first token (values the model writes
        itself) the head drafts instead. Decided from the kinds so far and past estimates only,
        before anything is drawn at that position, so the output law is untouched. A skipped
        kind's estimate drifts back to its seed as the counts decay, so it is tried again later."""
        free = alpha_keys([*kinds, free_kind])[-1]
        costly = alpha_keys([*kinds, costly_kind])[-1]
        run = self.alpha(free) * (1 + self.alpha(free_kind + "+"))
        return self.alpha(costly) - self._costly_ratio(seconds_per_token) > run

    def rank_free(self, kinds: Sequence[str], free_kinds: Sequence[str]) -> list[int]:
        """Free parts (forced text, a copy, lookup) by their acceptance estimate at the next
        position, highest first, the declared order among equals: each is free to propose, but
        the first with a proposal takes the position, and where copies are mostly wrong
        (values the model writes itself) lookup's spans should come first, where they are
        right (extraction) copies. Decided from the kinds so far and past estimates only."""
        est = [self.alpha(alpha_keys([*kinds, kind])[-1]) for kind in free_kinds]
        return sorted(range(len(free_kinds)), key=lambda i: -est[i])

    def _costly_ratio(self, seconds_per_token: float) -> float:
        """A costly draft token's own cost over a one-token pass (``PRIOR_C_HEAD`` until both are
        timed, and always for a seeded sampled request)."""
        t0 = self._cost.one_token_seconds()
        return seconds_per_token / t0 if t0 > 0 and seconds_per_token > 0 and not self.deterministic else PRIOR_C_HEAD

    def _best_prefix(self, kinds: Sequence[str], extra: Callable[[int], float], confidence: Confidences = None) -> int:
        """First-stop argmax over j of (1 + sum_{i<=j} prod_{m<=i} alpha_m) / (1 + extra(j)),
        ``extra(j)`` the cost of verifying j more tokens relative to a plain pass."""
        survive, expected, value, keep = 1.0, 1.0, 1.0, 0
        for j, (key, conf) in enumerate(zip(alpha_keys(kinds), _padded(confidence, len(kinds))), start=1):
            survive *= self.alpha_at(key, conf)
            nxt = (expected + survive) / (1 + extra(j))
            if nxt <= value + 1e-12:
                break
            expected, value, keep = expected + survive, nxt, j
        return keep

    def update(self, kinds: Sequence[str], accepted: int, verify_seconds: float | None, draft_seconds: float,
               confidence: Confidences = None) -> None:
        """Count accepted / examined positions per kind (and per confidence bucket where the
        drafter gave one); refit the cost model (not on the prompt's pass)."""
        keys = alpha_keys(kinds)
        for key in set(self._succ) | set(keys):
            self._succ[key] = self._succ.get(key, 0.0) * self.decay
            self._trials[key] = self._trials.get(key, 0.0) * self.decay
        confs = _padded(confidence, len(kinds))
        examined = list(zip(keys, confs))[: accepted + 1]  # positions after the first rejection were not examined
        for gated in {key for key, conf in examined if conf is not None}:  # once per key a step
            for b in range(len(CONFIDENCE_EDGES)):
                cell = (gated, b)
                if cell in self._conf_trials:
                    self._conf_succ[cell] *= CONFIDENCE_DECAY
                    self._conf_trials[cell] *= CONFIDENCE_DECAY
        for i, (key, conf) in enumerate(examined):
            self._trials[key] += 1
            self._succ[key] += i < accepted
            if conf is not None:
                cell = (key, confidence_bucket(conf))
                self._conf_trials[cell] = self._conf_trials.get(cell, 0.0) + 1
                self._conf_succ[cell] = self._conf_succ.get(cell, 0.0) + (i < accepted)
            if key in COSTLY_KINDS:  # the first token of a costly run
                self._costly_probe_gap = 8 if i < accepted else min(64, 2 * self._costly_probe_gap)
        for kind in self._asks:
            self._ask_gain[kind] += sum(1 for x in kinds[:accepted] if x == kind)
        if self.deterministic:
            return  # no timings, and nothing passed on to other requests
        recent_alpha = _RECENT_ALPHA.setdefault(self.history_key, {})
        for key in set(keys):
            recent_alpha[key] = self.alpha(key)
        recent_gain = _RECENT_ASK_GAIN.setdefault(self.history_key, {})
        for kind in self._asks:
            recent_gain[kind] = self.ask_gain(kind)
        recent_conf = _RECENT_CONFIDENCE.setdefault(self.history_key, {})
        for key, conf in examined:
            if conf is not None:
                recent_conf[(key, confidence_bucket(conf))] = self.alpha_at(key, conf)
        k = len(kinds)
        if verify_seconds is not None:
            self._spent = 0.9 * self._spent + verify_seconds + draft_seconds
            self._emitted = 0.9 * self._emitted + accepted + 1
            self._cost.add(k, verify_seconds)
            self._curve.add(k, verify_seconds)
            if self._curve.n >= 4:
                _RECENT_CURVE[self.cost_key] = (self._curve.best_shape(), self._curve.ratio())
        if k and self.costly_draft and draft_seconds > 0:
            per = draft_seconds / k
            self._draft_per_token = per if not self._draft_per_token else 0.8 * self._draft_per_token + 0.2 * per


def _padded(confidence: Confidences, n: int) -> list[float | None]:
    """``confidence`` as a list of ``n`` entries (None where unknown)."""
    out = list(confidence or [])[:n]
    return out + [None] * (n - len(out))
