"""How many tokens a batched step verifies: the drafts with the most expected tokens per second.

A batched step packs every row's tokens into one sequence (``batching.packing``), so a step
costs what its ``N`` tokens cost, whichever rows they belong to. On a CPU a forward grows with
its tokens, so the room for drafts shrinks as the batch grows; on a GPU a forward stays flat
far longer (see docs/performance.md). Each step the engine keeps the draft tokens that maximize

    sum_i E_i(k_i) / (T(sum_i (1 + k_i)) + H),   E_i(k) = 1 + sum_{j <= k} P_i(drafts 1..j accepted)

from each row's own acceptance estimates (``AdaptiveK.survival``, per drafter kind), a cost
model ``T(tokens) = t0 + t1 tokens`` fitted on the engine's own forwards (shrunk towards a
measured prior per profile and precision) and ``H`` the rows' host seconds beside the forward
(``batching.drafting.HostCost``), which the step pays whatever it keeps: the longer the step
takes anyway, the less a second of it earns, the less a draft token needs to pay its place.
Drawing the drafts costs host time too; whether it is worth paying at all is decided before
they are drawn (``batching.drafting``), and this budget only cuts drafts that were drawn.

Since a row's survival only falls along its draft, the best set is the ``m`` most likely draft
tokens over all rows for the best ``m``: forced text
that is almost surely accepted is kept (a 12-token span in one row costs 12 tokens, not 12 per
row), a long guess that would mostly be rejected is not. Rows whose K is fixed, or whose seeded
sampling must not depend on the batch, are not cut.

Sampling stays exact: whether a draft token x_j is verified must not depend on x_j itself.
Adding the next most likely token raises the objective iff its survival exceeds the current
rate times the per-token cost, and once one does not, none after it does (the rate only falls
towards it), so the best m is the first stop: x_j's fate is decided by the survivals ranked
above it, which are its own row's earlier positions (kinds fixed before x_j is drawn) and other
rows' drafts, never by x_j or what follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding.linefit import LineSums

#: Prior (t0 seconds, t1 seconds per packed token) by (profile, precision): the fit of batched
#: forwards on a 2-core CPU (see docs/performance.md), refitted online by each engine.
BATCH_COST_PRIORS: dict[tuple[str, str], tuple[float, float]] = {
    ("cpu", "native"): (0.040, 0.0022),
    ("cpu", "native-exact"): (0.040, 0.0022),
    ("cpu", "float32"): (0.031, 0.0017),
}
#: Where nothing was measured: an accelerator whose forward barely grows with tokens.
DEFAULT_BATCH_COST = (0.020, 0.0002)


def batch_cost_prior(profile: str, precision: str) -> tuple[float, float]:
    """The prior ``(t0, t1)`` of a profile and precision (``DEFAULT_BATCH_COST`` if unmeasured;
    the cpu profile falls back to float32's)."""
    if (profile, precision) in BATCH_COST_PRIORS:
        return BATCH_COST_PRIORS[(profile, precision)]
    return BATCH_COST_PRIORS[("cpu", "float32")] if profile == "cpu" else DEFAULT_BATCH_COST


@dataclass
class BatchCost:
    """Forward seconds against packed tokens, ``t0 + t1 tokens``: least squares over the engine's forwards,
    shrunk towards the prior (``prior_weight`` forwards' worth) so a few noisy steps at one
    width cannot send ``t1`` to zero or below."""

    t0: float
    t1: float
    prior_weight: float = 8.0
    sums: LineSums = field(default_factory=LineSums)

    def add(self, tokens: int, seconds: float) -> None:
        """Fold one forward over ``tokens`` packed tokens in."""
        self.sums.add(tokens, seconds)

    def fitted(self) -> tuple[float, float]:
        """``(t0, t1)`` now."""
        w, n = self.prior_weight, self.sums.n
        if n < 2 or self.sums.spread <= 0:
            if not n:
                return self.t0, self.t1
            # One width so far: keep the prior's slope, move the intercept to the data.
            t1 = self.t1
            t0 = (n * (self.sums.sy / n - t1 * self.sums.sx / n) + w * self.t0) / (n + w)
            return max(t0, 1e-4), t1
        t0_fit, t1_fit = self.sums.line()
        t1 = max((n * t1_fit + w * self.t1) / (n + w), 0.0)
        t0 = max((n * t0_fit + w * self.t0) / (n + w), 1e-4)
        return t0, t1

    def seconds(self, tokens: float) -> float:
        """Predicted seconds of a forward over ``tokens`` packed tokens."""
        t0, t1 = self.fitted()
        return t0 + t1 * tokens


def _ranked(survivals: list[list[float]]) -> list[tuple[float, int, int]]:
    """Every draft token as ``(survival, position, row)``, most likely first; a row's earlier
    draft before its later one when they tie, so the chosen tokens of each row are a prefix of
    its draft."""
    return sorted(((s, j, i) for i, row in enumerate(survivals) for j, s in enumerate(row)),
                  key=lambda c: (-c[0], c[1]))


def _first_stop(ranked: list[tuple[float, int, int]], fixed_tokens: float, fixed_expected: float, cost: BatchCost,
                weight: float, extra_seconds: float) -> tuple[int, float]:
    """``(m, rate)``: how many of the ranked tokens to keep (each standing for ``weight``
    tokens) and the expected tokens per second of the step that keeps them."""
    expected, best_m = fixed_expected, 0
    best = expected / (cost.seconds(fixed_tokens) + extra_seconds)
    for m, (s, _, _) in enumerate(ranked, start=1):
        expected += s * weight
        value = expected / (cost.seconds(fixed_tokens + m * weight) + extra_seconds)
        if value > best + 1e-12:
            best_m, best = m, value
    return best_m, best


def choose_drafts(survivals: list[list[float]], fixed_tokens: int, fixed_expected: float, cost: BatchCost,
                  extra_seconds: float = 0.0) -> list[int]:
    """How many of its drafts each cuttable row keeps (see the module docstring).

    Args:
        survivals: per cuttable row, P(drafts 1..j accepted) for its proposed drafts (non-increasing).
        fixed_tokens: tokens the step feeds whatever is chosen: every row's last token and the
            drafts of rows that cannot be cut.
        fixed_expected: the tokens those are expected to emit (one per row at least).
        cost: the forward cost model.
        extra_seconds: what the step costs beside its forward whatever is kept (the rows' own
            host work, ``batching.drafting``): a step that takes longer anyway earns less per
            second, so a draft token needs less to pay for its place.
    """
    ranked = _ranked(survivals)
    best_m, _ = _first_stop(ranked, fixed_tokens, fixed_expected, cost, 1.0, extra_seconds)
    keep = [0] * len(survivals)
    for _, j, i in ranked[:best_m]:
        keep[i] = max(keep[i], j + 1)
    return keep


def best_rate(survivals: list[list[float]], fixed_tokens: int, fixed_expected: float, cost: BatchCost, *,
              weight: float = 1.0, extra_seconds: float = 0.0) -> float:
    """The expected tokens per second of the step ``choose_drafts`` would choose, each row of
    ``survivals`` standing for ``weight`` rows (a sample of drafts scaled to a batch's size;
    ``batching.drafting``); with no survivals, that of the step that drafts nothing."""
    return _first_stop(_ranked(survivals), fixed_tokens, fixed_expected, cost, weight, extra_seconds)[1]
