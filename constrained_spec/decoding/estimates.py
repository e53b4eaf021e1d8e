"""What past requests measured, handed to the next ones: an explicit object, never process-global.

A K policy starts a request from what recent requests on the same model learned (acceptance
per drafter kind, the verify-cost curve, acceptance per confidence bucket, a costly drafter's
tokens per ask), and a costly draft (a learned head, a draft model) from what asking it cost. One ``RecentEstimates`` holds
them; whoever owns it decides who shares it: the model handle (``ModelHandle.estimates``,
through ``recent_estimates``), so every request on one loaded model learns from the others,
while two handles, or two engines given their own, never see each other's figures.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RecentEstimates:
    """The last request's estimates, by key (``AdaptiveK.history_key`` for acceptance,
    ``AdaptiveK.cost_key`` for the cost curve; a head object for its timings).

    Attributes:
        alpha: per history key, the acceptance estimate per alpha key ("copy", "copy+", ...).
        curve: per cost key, the verify-cost curve's (shape, r).
        confidence: per history key, the acceptance per (alpha key, confidence bucket).
        ask_gain: per history key, the accepted tokens per ask of each costly kind (and region:
            ``drafters.order.ask_key``).
        ask_chances: per history key, the mean chances a request had to ask each costly kind
            per region (what a draft model's prompt pass is weighed against).
        draft_timings: per costly draft (a head, a draft model), its (seconds per drafted token,
            seconds per ask, seconds per context token of a prompt's catch-up).
    """

    alpha: dict[str, dict[str, float]] = field(default_factory=dict)
    curve: dict[str, tuple[str, float]] = field(default_factory=dict)
    confidence: dict[str, dict[tuple[str, int], float]] = field(default_factory=dict)
    ask_gain: dict[str, dict[str, float]] = field(default_factory=dict)
    ask_chances: dict[str, dict[str, float]] = field(default_factory=dict)
    draft_timings: "weakref.WeakKeyDictionary[Any, tuple[float, float, float]]" = field(
        default_factory=weakref.WeakKeyDictionary)


def recent_estimates(owner: Any) -> RecentEstimates:
    """The estimates ``owner`` (a ``ModelHandle``, or anything with an ``estimates``
    attribute) keeps for its requests, made on first use."""
    if getattr(owner, "estimates", None) is None:
        owner.estimates = RecentEstimates()
    return owner.estimates
