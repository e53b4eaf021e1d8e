"""How many tokens a batched step verifies: the width with the most expected tokens per second.

Rows of a batched step are right-padded to one width ``w`` (the last token plus up to ``w - 1``
drafts each), so a step costs what ``b x w`` rows cost, whoever uses them. On this CPU a forward
grows with its rows (native precision, SmolLM2-135M, ~200 cached tokens per row: about 40 ms
plus 2.2 ms per row, measured for b = 1..16 and w = 1..21), so the room for drafts shrinks as
the batch grows; on a GPU a forward stays flat far longer. Each step the engine picks

    w* = argmax_w  sum_i E_i(w) / T(b w),   E_i(w) = 1 + sum_{j < w} P_i(drafts 1..j accepted)

from each row's own acceptance estimates (``AdaptiveK.survival``, per drafter kind) and a cost
model ``T(rows) = t0 + t1 rows`` fitted on the engine's own forwards (shrunk towards a measured
prior per profile and precision). A row's draft is then cut to ``w* - 1`` tokens: forced text
that is almost surely accepted keeps the width up, a long guess that would mostly be rejected
does not. Rows whose K is fixed, or whose seeded sampling must not depend on the batch, are
not cut (the width is at least theirs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .linefit import LineSums

#: Prior (t0 seconds, t1 seconds per row) by (profile, precision), measured on the 2-core CPU.
#: float32: the issue's measurement (31 ms + 1.7 ms per token in the batch).
BATCH_COST_PRIORS: dict[tuple[str, str], tuple[float, float]] = {
    ("cpu", "native"): (0.040, 0.0022),
    ("cpu", "float32"): (0.031, 0.0017),
}
#: Where nothing was measured: an accelerator whose forward barely grows with rows.
DEFAULT_BATCH_COST = (0.020, 0.0002)


def batch_cost_prior(profile: str, precision: str) -> tuple[float, float]:
    """The prior ``(t0, t1)`` of a profile and precision (``DEFAULT_BATCH_COST`` if unmeasured;
    the cpu profile falls back to float32's)."""
    if (profile, precision) in BATCH_COST_PRIORS:
        return BATCH_COST_PRIORS[(profile, precision)]
    return BATCH_COST_PRIORS[("cpu", "float32")] if profile == "cpu" else DEFAULT_BATCH_COST


@dataclass
class BatchCost:
    """Forward seconds against rows, ``t0 + t1 rows``: least squares over the engine's forwards,
    shrunk towards the prior (``prior_weight`` forwards' worth) so a few noisy steps at one
    width cannot send ``t1`` to zero or below."""

    t0: float
    t1: float
    prior_weight: float = 8.0
    sums: LineSums = field(default_factory=LineSums)

    def add(self, rows: int, seconds: float) -> None:
        """Fold one forward in."""
        self.sums.add(rows, seconds)

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

    def seconds(self, rows: int) -> float:
        """Predicted seconds of a forward over ``rows`` rows."""
        t0, t1 = self.fitted()
        return t0 + t1 * rows


def choose_width(survivals: list[list[float]], min_width: int, rows: int, cost: BatchCost) -> int:
    """The step width (1 + drafts per row) maximizing expected tokens per second.

    Args:
        survivals: per cuttable row, P(drafts 1..j accepted) for its proposed drafts.
        min_width: the width rows that cannot be cut need (1 if none).
        rows: the batch size ``b``; the rows that cannot be cut count one sure token each.
        cost: the forward cost model.
    """
    longest = max([min_width, *[1 + len(s) for s in survivals]])
    fixed = rows - len(survivals)
    best_w, best = min_width, -1.0
    for w in range(min_width, longest + 1):
        expected = fixed + sum(1.0 + sum(s[: w - 1]) for s in survivals)
        value = expected / cost.seconds(rows * w)
        if value > best + 1e-12:
            best_w, best = w, value
    return best_w
