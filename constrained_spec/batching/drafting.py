"""Whether a batched step drafts at all: speculation only where it pays, drafting's own cost included.

The step budget (``batching.budget``) cuts drafts already drawn, by what their tokens cost in
the forward. Drawing them costs too, whatever the budget keeps: the drafters' proposals, the
constraint's masks along each draft, verifying and rolling back. That host work grows with the
rows, so in a large batch it can eat all that speculation gains (see docs/extraction.md). So
each step, before any row proposes, the gate compares two predicted rates:

    plain:    B / (T(F) + h_plain B)
    drafting: max_m (B + G(m)) / (T(F + m) + h_plain B + h_draft n)

``T``: the forward's cost model (``BatchCost``); ``F``: the tokens fed whatever is chosen; ``B``:
the rows; ``n``: the rows that would draft; ``h_plain``, ``h_draft``: a row's host seconds in a
plain step and what drafting adds (``HostCost``, measured on the engine's steps); ``G(m)``: the
expected tokens of the best ``m`` draft tokens of the most recent drafts, scaled to ``n`` rows
(their survivals by their rows' acceptance estimates now). Each rate is then scaled by how that
mode's past steps fared, measured tokens per second over the model's (``DraftGate.fared``): the
model misses what it does not see (acceptance estimates that run low or high, drafts that differ
from the last ones), and a plain step's and a drafting step's misses differ. Where drafting
loses, the gated rows take a plain step: their drafters are not called, and their K policies
are not told of it (a step that examined no draft is no reason to fade their estimates).

Probes: while off, a step drafts anyway after ``PROBE_FIRST`` plain steps in a row, the gap
doubling after each probe up to ``PROBE_LAST`` and back to ``PROBE_FIRST`` once drafting pays,
so the estimates are never older than ``PROBE_LAST + 1`` steps and probing costs at most one
step in ``PROBE_FIRST + 1``.

Exactness: the decision reads past steps only (costs, acceptance estimates, earlier drafts),
never the tokens a row is about to draft, and a row that does not draft takes target-only's
plain step: greedy output is unchanged, sampled output keeps its law. Rows the budget never
cuts (a fixed K, seeded sampling that must not depend on the batch:
``SpeculativeDecoder.budgeted``) are not gated either.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..drafters.base import Confidences
from .budget import BatchCost, best_rate

#: Prior host seconds of one row's plain step and what drafting adds to it: the embedded model's
#: extraction jobs with the auto drafter on a 2-core CPU (see docs/extraction.md); ``HostCost``
#: moves from them to the engine's own steps within a step or two.
PRIOR_HOST_PLAIN = 0.0005
PRIOR_HOST_DRAFT = 0.0015
#: Plain steps before the first probe of a gate that is off, and the longest gap between probes.
PROBE_FIRST = 4
PROBE_LAST = 32
#: How many recent rows' drafts predict the next step's (at batch 64, the last drafting step's).
RECENT_DRAFTS = 64

#: The weight, in steps, of the prior that the cost model's rates are right (``DraftGate.fared``).
FARED_WEIGHT = 2.0

#: A drawn draft as the gate keeps it: its row's survival function (``AdaptiveK.survival``),
#: the kinds of its tokens and their drafters' confidences.
DrawnDraft = tuple[Callable[[Sequence[str], Confidences], list[float]], list[str], Confidences]


@dataclass
class _Mean:
    """A decayed mean, shrunk towards a prior (``weight`` units' worth)."""

    prior: float
    weight: float = 8.0
    decay: float = 0.8
    total: float = 0.0
    count: float = 0.0

    def add(self, count: int, total: float) -> None:
        """Fold in one step's ``count`` units that came to ``total``; older steps fade so the
        mean follows the job (rows grow longer, drafters change)."""
        self.total = self.total * self.decay + total
        self.count = self.count * self.decay + count

    @property
    def value(self) -> float:
        return (self.total + self.prior * self.weight) / (self.count + self.weight)


@dataclass
class HostCost:
    """Host seconds per row beside the forward: a plain step's (plan, masks, verify, commit of
    one token) and what a drafting step adds (proposals, masks along the drafts, verifying and
    rolling them back, the budget's own work), each measured on the engine's steps."""

    plain_prior: float = PRIOR_HOST_PLAIN
    draft_prior: float = PRIOR_HOST_DRAFT
    #: Keep the priors, ignoring the steps (tests, what-if figures).
    frozen: bool = False
    _plain: _Mean = field(init=False)
    _drafting: _Mean = field(init=False)

    def __post_init__(self) -> None:
        self._plain = _Mean(self.plain_prior)
        self._drafting = _Mean(self.plain_prior + self.draft_prior)

    def add(self, drafting: bool, rows: int, seconds: float) -> None:
        """Fold in ``rows`` gated rows of one step, plain or drafting, that took ``seconds`` of host time."""
        if rows and not self.frozen:
            (self._drafting if drafting else self._plain).add(rows, seconds)

    @property
    def plain(self) -> float:
        """Host seconds of one row's plain step."""
        return self._plain.value

    @property
    def draft(self) -> float:
        """Host seconds drafting adds to one row's step (never below zero)."""
        return max(self._drafting.value - self._plain.value, 0.0)


class DraftGate:
    """Decides, each step, whether the rows the budget may cut draft at all (see the module
    docstring).

    Args:
        cost: the batched forward's cost model (shared with the step budget).
        host: the host cost per row; a fresh ``HostCost`` if None.
    """

    def __init__(self, cost: BatchCost, host: HostCost | None = None) -> None:
        self.cost = cost
        self.host = host or HostCost()
        #: True or False to force the decision (tests, benchmarks); None: decide.
        self.forced: bool | None = None
        #: The most recent rows' drafts (no kinds: a row that drew none).
        self.recent: deque[DrawnDraft] = deque(maxlen=RECENT_DRAFTS)
        #: Per mode (plain, drafting), measured rate over the model's rate of its past steps.
        self._fared = {False: _Mean(1.0, FARED_WEIGHT), True: _Mean(1.0, FARED_WEIGHT)}
        #: The mode of the step decided last and the model's rate for it (None: no prediction).
        self._pending: tuple[bool, float] | None = None
        self._plain_steps = 0
        self._gap = PROBE_FIRST
        #: Steps decided so far, those that drafted, and those of them that were probes.
        self.steps = self.drafting_steps = self.probes = 0

    def model_rates(self, rows: int, drafting_rows: int, fixed_tokens: int) -> tuple[float, float]:
        """The cost model's expected tokens per second of a plain and of a drafting step:
        ``rows`` rows, ``drafting_rows`` of them gated, ``fixed_tokens`` fed whatever they draft
        (needs ``recent``)."""
        h_plain = self.host.plain * rows
        plain = rows / (self.cost.seconds(fixed_tokens) + h_plain)
        drafts = [survival(kinds, confidence) if kinds else [] for survival, kinds, confidence in self.recent]
        drafting = best_rate(drafts, fixed_tokens, float(rows), self.cost, weight=drafting_rows / len(drafts),
                             extra_seconds=h_plain + self.host.draft * drafting_rows)
        return plain, drafting

    def fared(self, drafting: bool) -> float:
        """How the mode's past steps fared: measured tokens per second over the model's, shrunk
        towards 1 (``FARED_WEIGHT`` steps' worth)."""
        return self._fared[drafting].value

    def pays(self, rows: int, drafting_rows: int, fixed_tokens: int) -> bool:
        """Whether drafting pays at this step (each mode's model rate times how it fared)."""
        return self._pays(self._rates(rows, drafting_rows, fixed_tokens))

    def _rates(self, rows: int, drafting_rows: int, fixed_tokens: int) -> tuple[float, float] | None:
        """``model_rates``, or None while no draft has been seen."""
        return self.model_rates(rows, drafting_rows, fixed_tokens) if self.recent else None

    def _pays(self, rates: tuple[float, float] | None) -> bool:
        if rates is None:
            return True  # nothing drawn yet: its worth is unknown until a step drafts
        return rates[1] * self.fared(True) > rates[0] * self.fared(False)

    def decide(self, rows: int, drafting_rows: int, fixed_tokens: int) -> bool:
        """This step's decision (``pays`` or the probe schedule; ``forced`` overrides both), and
        the schedule moved on."""
        rates = self._rates(rows, drafting_rows, fixed_tokens)
        self.steps += 1
        if self.forced is not None:
            on = self.forced
        elif self._pays(rates):
            on, self._plain_steps, self._gap = True, 0, PROBE_FIRST
        elif self._plain_steps >= self._gap:  # a probe: keep the estimates fresh
            on, self._plain_steps, self._gap = True, 0, min(2 * self._gap, PROBE_LAST)
            self.probes += 1
        else:
            on = False
            self._plain_steps += 1
        self.drafting_steps += on
        self._pending = (on, rates[on]) if rates is not None else None
        return on

    def outcome(self, tokens: int, seconds: float) -> None:
        """What the step decided last emitted and took (host time and forward): how its mode's
        model rate fared. Called only for steps whose rate the model prices (no prompt fed)."""
        if self._pending is not None and seconds > 0:
            on, predicted = self._pending
            self._fared[on].add(1, tokens / seconds / predicted)
        self._pending = None

    def observe(self, drafts: list[DrawnDraft]) -> None:
        """A drafting step's gated rows' drafts, before the budget cut them (a row that drew
        none is kept too: it paid for drafting)."""
        self.recent.extend(drafts)
