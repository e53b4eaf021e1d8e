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

from ..drafters.base import Confidences, DraftKind
from ..drafters.order import Estimates, alpha_key, alpha_keys
from .estimates import RecentEstimates
from .linefit import LineSums

#: Priors for alpha per drafter kind, for a run's first token and for the tokens continuing it
#: (seeds before any request has been seen, overwritten by what recent requests measured:
#: ``RecentEstimates.alpha``). The two are estimated apart (``alpha_key``) because one alpha per
#: kind would make long spans look too risky to verify.
PRIOR_RUNS = {DraftKind.GRAMMAR: (0.85, 0.95), DraftKind.COPY: (0.6, 0.85), DraftKind.LOOKUP: (0.5, 0.75),
              DraftKind.CORPUS: (0.45, 0.6), DraftKind.MODEL: (0.6, 0.6), DraftKind.HEAD: (0.6, 0.6)}
PRIOR_ALPHA = {alpha_key(kind, continues): prior
               for kind, runs in PRIOR_RUNS.items() for continues, prior in zip((False, True), runs)}
#: Prior cost of one extra verified token, as a fraction of a one-token forward (a CPU's; see
#: docs/performance.md).
PRIOR_C_VERIFY = 0.1
#: Default prior of the fit verify = t0 (1 + r g(K)) where no profile gives one
#: (``profiles.verify_cost_prior``); recent requests' fits on the same model and precision
#: replace it (``RecentEstimates.curve``, keyed by ``AdaptiveK.cost_key``: the shape and r).
PRIOR_R_CURVE = 0.25
PRIOR_CURVE_SHAPE = "concave"
#: Upper edges of the confidence buckets a gated draft token is estimated by (its drafter's
#: probability of the token it drafts, before drawing it). The acceptance of a learned head's
#: token depends far more on its confidence than on its kind, which one kind-wide estimate
#: cannot tell apart (see docs/drafters.md).
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.85, 0.95, 1.0)
#: A bucket's prior acceptance (its middle confidence, EAGLE-2's observation that a draft
#: head's confidence approximates its acceptance) and the weight of that prior in steps.
CONFIDENCE_PRIOR = (0.15, 0.4, 0.6, 0.775, 0.9, 0.975)
CONFIDENCE_PRIOR_WEIGHT = 2.0
#: Forgetting factor of a key's bucket counts, applied at each step that examines the key.
CONFIDENCE_DECAY = 0.97


def confidence_bucket(confidence: float) -> int:
    """The index in ``CONFIDENCE_EDGES`` of the bucket holding ``confidence``."""
    return next((i for i, edge in enumerate(CONFIDENCE_EDGES) if confidence <= edge), len(CONFIDENCE_EDGES) - 1)


class KPolicy(Protocol):
    """Chooses the draft length of each step; a composite drafter orders its parts by the
    policy's ``estimates`` (``drafters.order``), which the policy keeps but does not use to order."""

    @property
    def estimates(self) -> Estimates | None:
        """The acceptance and cost estimates drafters weigh their parts by (None: a fixed policy,
        under which they keep their declared order and draft all they may)."""

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


@dataclass
class FixedK:
    """The baseline: always propose and verify up to ``k`` tokens."""

    k: int

    @property
    def estimates(self) -> None:
        """None: the baseline estimates nothing, so drafters keep their own order."""
        return None

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


def _concave(k: int) -> float:
    return math.log2(1 + k)


def _linear(k: int) -> float:
    return float(k)


#: The shapes g of a verify pass's cost t(K) = t0 (1 + r g(K)) over K drafted tokens. Concave
#: where checking more rows costs little more (a float32 matmul, an accelerator with room to
#: spare); linear where each row pays on its own (the int4 kernel, whose cost per token a
#: concave fit through long spans would overstate at small K, shutting a head out; see
#: docs/performance.md).
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
    costly_kind: str = DraftKind.MODEL
    deterministic: bool = False
    cost_prior: float = PRIOR_R_CURVE
    cost_shape: str = PRIOR_CURVE_SHAPE
    cost_key: str = ""
    history_key: str = ""
    #: What past requests measured: seeds this request and receives its estimates (None: a
    #: private one, so the request learns from nobody and teaches nobody).
    recent: RecentEstimates | None = field(default=None, repr=False, compare=False)
    decay: float = 0.9
    prior_weight: float = 4.0
    _succ: dict[str, float] = field(default_factory=dict)
    _trials: dict[str, float] = field(default_factory=dict)
    _cost: _CostFit = field(default_factory=_CostFit)
    _curve: _CurveFit = field(init=False)
    _draft_per_token: float = 0.0
    _skipped: int = 0
    _seed: dict[str, float] = field(default_factory=dict)
    #: Per (alpha key, confidence bucket) of gated tokens: decayed accepted / examined counts,
    #: and the seed (the bucket's prior, or what recent requests measured).
    _conf_succ: dict[tuple[str, int], float] = field(default_factory=dict)
    _conf_trials: dict[tuple[str, int], float] = field(default_factory=dict)
    _conf_seed: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Decayed seconds and emitted tokens of the timed steps: the request's price per token.
    _spent: float = 0.0
    _emitted: float = 0.0

    def __post_init__(self) -> None:
        # Seed this request from what recent requests measured (a snapshot: this request's
        # own updates must not feed back into its prior).
        if self.recent is None:
            self.recent = RecentEstimates()
        past = self.recent
        recent_alpha = {} if self.deterministic else past.alpha.get(self.history_key, {})
        self._seed = {**PRIOR_ALPHA, **recent_alpha}
        self._conf_seed = {} if self.deterministic else dict(past.confidence.get(self.history_key, {}))
        recent = None if self.deterministic else past.curve.get(self.cost_key)
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

    def cost_ratio(self) -> float:
        """c: the cost of one more drafted-and-verified token relative to a one-token step."""
        t0 = self._cost.one_token_seconds()
        draft = self._draft_per_token / t0 if t0 > 0 else 0.0
        return self._cost.ratio() + (draft if self.costly_draft else 0.0)

    def next_k(self) -> int:
        """For a draft model, the formula's K; for free drafters, the cap (trimmed later)."""
        if self.costly_draft:
            # The formula's objective with the first and the continuing tokens' alphas; equal
            # to optimal_k(alpha, c, k_max) when the two estimates agree.
            c = self.cost_ratio()
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
    def estimates(self) -> "AdaptiveK":
        """The policy itself: it keeps the estimates a drafter orders its parts by."""
        return self

    def verify_extra(self, k: int) -> float:
        """r g(K): the cost of verifying ``k`` drafted tokens beyond a plain pass, over a plain pass."""
        return self._curve.extra(k)

    def one_token_seconds(self) -> float:
        """The estimated seconds of a plain (K = 0) verify pass (0: not timed yet)."""
        return self._cost.one_token_seconds()

    def step_price(self) -> tuple[float, float]:
        """Decayed (seconds, emitted tokens) of the timed steps: the request's price per token."""
        return self._spent, self._emitted

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
        if self.deterministic:
            return  # no timings, and nothing passed on to other requests
        past = self.recent
        assert past is not None
        recent_alpha = past.alpha.setdefault(self.history_key, {})
        for key in set(keys):
            recent_alpha[key] = self.alpha(key)
        recent_conf = past.confidence.setdefault(self.history_key, {})
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
                past.curve[self.cost_key] = (self._curve.best_shape(), self._curve.ratio())
        if k and self.costly_draft and draft_seconds > 0:
            per = draft_seconds / k
            self._draft_per_token = per if not self._draft_per_token else 0.8 * self._draft_per_token + 0.2 * per


def _padded(confidence: Confidences, n: int) -> list[float | None]:
    """``confidence`` as a list of ``n`` entries (None where unknown)."""
    out = list(confidence or [])[:n]
    return out + [None] * (n - len(out))
