"""Which part of a composite drafter drafts the next position, and how much a costly part drafts.

The K policy only chooses K; it keeps the acceptance and cost estimates (``Estimates``). A
``DraftOrder`` reads them to order a hybrid drafter's parts: free parts (forced text, a copy,
lookup, the corpus) ranked by their acceptance at the next position, a costly part (a learned
head, a draft model) asked only where an ask pays, ahead of a free part it beats, and drafting
only the tokens whose expected acceptance pays for their verify share and their own cost.
Without estimates (a fixed K) it keeps the declared order and drafts everything it may.

Every decision here is taken from the kinds drafted so far, the confidences known before a
token is drawn and past steps' estimates, never from a token drawn at the position decided, so
the verifier's output law is untouched.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .base import Confidences, Draft, DraftGate, DraftKind

#: Parts that pay per drafted token.
COSTLY_KINDS = (DraftKind.MODEL, DraftKind.HEAD)
#: Prior cost of one token of a learned head, as a fraction of a one-token forward, until the
#: request has timed both (and always for a seeded sampled request, which uses no timings).
PRIOR_C_HEAD = 0.15
#: Tokens a costly drafter's ask brings (accepted tokens of its kind per ask, refused asks
#: included) before a request has measured it (``DraftOrder.worth_asking``), the weight of that
#: prior in asks, the forgetting factor per ask, and the refused asks between two probes.
PRIOR_ASK_GAIN = 0.5
ASK_PRIOR_WEIGHT = 2.0
ASK_DECAY = 0.9
ASK_PROBE_GAP = 8
#: The weight of one request's count of chances to ask a costly drafter (per region) in the
#: moving mean that prices a draft model's prompt pass (``DraftOrder.worth_asking``).
CHANCES_WEIGHT = 0.3


def ask_key(kind: str, region: str = "") -> str:
    """The key a costly drafter's asks are counted by: its kind, and where given the kind of
    region it is asked in ("model@wide": a free string; see ``drafters.hybrid.region_of``)."""
    return f"{kind}@{region}" if region else str(kind)


def alpha_key(kind: str, continues: bool) -> str:
    """The key a token's acceptance is estimated by: its kind, with "+" when it continues a run
    of that kind (acceptance is not independent along a span: a copied value is usually right
    or wrong at its first token)."""
    return f"{kind}+" if continues else str(kind)


def alpha_keys(kinds: Sequence[str]) -> list[str]:
    """The key of each position of a draft of these kinds (``alpha_key``)."""
    return [alpha_key(k, bool(i) and kinds[i - 1] == k) for i, k in enumerate(kinds)]


class Estimates(Protocol):
    """What a ``DraftOrder`` reads from the K policy (``decoding.kpolicy.AdaptiveK``)."""

    #: A seeded sampled request: no timings, nothing from or for other requests.
    deterministic: bool
    #: Past requests' figures (``decoding.estimates.RecentEstimates``) and this request's key there.
    recent: Any
    history_key: str

    def alpha(self, key: str) -> float:
        """The acceptance estimate of an alpha key ("copy", "copy+", ...)."""

    def alpha_at(self, key: str, confidence: float | None) -> float:
        """The acceptance estimate of one token of ``key`` drafted at ``confidence``."""

    def survival(self, kinds: Sequence[str], confidence: Confidences = None) -> list[float]:
        """P(draft tokens 1..j all accepted) for j = 1..len(kinds)."""

    def verify_extra(self, k: int) -> float:
        """The cost of verifying ``k`` drafted tokens beyond a plain pass, over a plain pass."""

    def one_token_seconds(self) -> float:
        """The estimated seconds of a plain (K = 0) verify pass (0: not timed yet)."""

    def step_price(self) -> tuple[float, float]:
        """Decayed (seconds, emitted tokens) of the request's timed steps."""


class DraftOrder:
    """The ordering policy of one request's composite drafter (see the module docstring).

    Args:
        estimates: the K policy's estimates; None for a fixed K (the declared order, every
            part asked, every token it may draft drafted).
    """

    def __init__(self, estimates: Estimates | None) -> None:
        self.estimates = estimates
        self._skipped_costly = 0
        #: Skipped costly drafts between two probes: doubles (up to 64) each time the first token
        #: of a costly run is rejected, back to 8 when one is accepted (a head that is wrong where
        #: it is asked costs a feed, a draft token and a verified row per probe).
        self._costly_probe_gap = 8
        #: Per costly kind: decayed asks and the accepted tokens of that kind they brought, the
        #: seed of their ratio, and refused asks since the last probe (``worth_asking``).
        self._asks: dict[str, float] = {}
        self._ask_gain: dict[str, float] = {}
        self._asks_refused = 0
        #: This step's asks: (ask key, the draft position it drafted from), credited in ``update``.
        self._step_asks: list[tuple[str, int]] = []
        #: Per ask key: chances to ask seen in this request, and past requests' mean.
        self._chances: dict[str, int] = {}
        est = estimates
        self._seeded = est is not None and not est.deterministic and est.recent is not None
        self._ask_seed = dict(est.recent.ask_gain.get(est.history_key, {})) if self._seeded else {}  # type: ignore[union-attr]
        self._chance_seed = dict(est.recent.ask_chances.get(est.history_key, {})) if self._seeded else {}  # type: ignore[union-attr]
        for key in self._chance_seed:  # a request that never reaches a key counts 0 chances there
            self._pass_on_chances(key)

    # -- which part drafts ----------------------------------------------------------------------
    def rank_free(self, kinds: Sequence[str], free_kinds: Sequence[str]) -> list[int]:
        """Free parts (forced text, a copy, lookup) by their acceptance estimate at the next
        position, highest first, the declared order among equals: each is free to propose, but
        the first with a proposal takes the position, so where copies are mostly wrong (values
        the model writes itself) lookup's spans should come first, where they are right
        (extraction) copies."""
        if self.estimates is None:
            return list(range(len(free_kinds)))
        est = [self.estimates.alpha(alpha_keys([*kinds, kind])[-1]) for kind in free_kinds]
        return sorted(range(len(free_kinds)), key=lambda i: -est[i])

    def prefers_costly(self, kinds: Sequence[str], free_kind: str, costly_kind: str, seconds_per_token: float) -> bool:
        """Whether the costly kind (a learned head) should draft the next position before a free
        part (lookup, a copy) that has a proposal there: when its acceptance estimate at that
        position, less its own cost per token, beats what the free part's run is worth there:
        its first token's estimate times one plus its continuing tokens' (a free run's first
        token accepted opens the rest of its span at no drafting cost). A skipped kind's
        estimate drifts back to its seed as the counts decay, so it is tried again later."""
        est = self.estimates
        if est is None:
            return False
        free = alpha_keys([*kinds, free_kind])[-1]
        costly = alpha_keys([*kinds, costly_kind])[-1]
        run = est.alpha(free) * (1 + est.alpha(alpha_key(free_kind, True)))
        return est.alpha(costly) - self._costly_ratio(seconds_per_token) > run

    def worth_asking(self, kind: str, seconds_per_ask: float, *, region: str = "", catch_up_seconds: float = 0.0,
                     position: int = 0) -> bool:
        """Whether to ask a costly drafter of ``kind`` (a learned head, a draft model) at the
        next position, in a ``region`` of that kind (``drafters.hybrid.region_of``; "": not told),
        ``position`` tokens into this step's draft: while the tokens of that kind an ask there
        brings (``ask_gain``), at the request's price per emitted token (its timed steps'
        seconds over their tokens), are worth more than the ask's measured seconds. An ask
        costs the drafter a step even when its gate then refuses every token. A refused ask is
        probed every ``ASK_PROBE_GAP``, so a low estimate can recover; a seeded sampled request
        (no timings) always asks. True counts an ask.

        ``catch_up_seconds`` is what the ask would cost first (a draft model's prompt pass, at
        its first ask of a request): then the ask must also pay for that, from what asking is
        expected to bring over the rest of the request where it pays (past requests' chances to
        ask per region, less those seen), and is never asked as a probe: a probe would pay the
        whole prompt pass to learn about one ask.
        """
        est = self.estimates
        if est is None:
            return True
        key = ask_key(kind, region)
        spent, emitted = est.step_price()
        ask = True
        if not est.deterministic and catch_up_seconds > 0 and emitted <= 0:
            ask = False  # a prompt pass is not paid before the request has priced a token
        elif not est.deterministic and seconds_per_ask > 0 and emitted > 0:
            price = spent / emitted
            net = self.ask_gain(key) * price - seconds_per_ask
            if catch_up_seconds > 0:
                ask = net >= 0 and net + self._value_ahead(kind, key, price, seconds_per_ask) >= catch_up_seconds
            else:
                ask = net >= 0
                if not ask:
                    self._asks_refused += 1
                    if self._asks_refused >= ASK_PROBE_GAP:
                        ask, self._asks_refused = True, 0
        self._chances[key] = self._chances.get(key, 0) + 1
        self._pass_on_chances(key)
        if ask:
            self._asks[key] = self._asks.get(key, 0.0) * ASK_DECAY + 1
            self._ask_gain[key] = self._ask_gain.get(key, 0.0) * ASK_DECAY
            self._step_asks.append((key, position))
            self._pass_on_ask_gain()
        return ask

    def ask_gain(self, key: str) -> float:
        """Accepted tokens of a costly kind per ask under ``key`` (``ask_key``: the kind, and
        the region asked in; decayed counts over the prior)."""
        seed = self._ask_seed.get(key, PRIOR_ASK_GAIN)
        return (self._ask_gain.get(key, 0.0) + seed * ASK_PRIOR_WEIGHT) / (self._asks.get(key, 0.0) + ASK_PRIOR_WEIGHT)

    def _value_ahead(self, kind: str, key: str, price: float, seconds_per_ask: float) -> float:
        """Seconds the asks of ``kind`` after the one at ``key`` are expected to save in this
        request: in each region where an ask pays, its net worth times the chances past
        requests met there, less those this request has seen (0 without past requests)."""
        value = 0.0
        for other, mean in self._chance_seed.items():
            if other.partition("@")[0] != kind:
                continue
            ahead = mean - self._chances.get(other, 0) - (other == key)
            value += max(self.ask_gain(other) * price - seconds_per_ask, 0.0) * max(ahead, 0.0)
        return value

    # -- how much a costly part drafts ----------------------------------------------------------
    def costly_gate(self, kinds: Sequence[str], confidence: Confidences, kind: str,
                    seconds_per_token: float) -> DraftGate:
        """A gate for a costly drafter that knows its confidence (a learned head): its next
        token is drafted while it raises the expected tokens per unit of step cost, that token's
        acceptance taken from its confidence bucket, its cost its verify share and the drafter's
        steps after the first (whose law it has computed when it asks). The gate sees each
        token's confidence before the token is drawn. A first token refused counts towards the
        probes of ``draft_room``."""
        est = self.estimates
        if est is None:
            return lambda c: True
        c = self._costly_ratio(seconds_per_token)
        extra = est.verify_extra
        base = len(kinds)
        survive, expected = self._survival_sums(kinds, confidence)
        value, j, prev = expected / (1 + extra(base)), 0, kinds[-1] if kinds else None

        def gate(conf: float) -> bool:
            nonlocal survive, expected, value, j, prev
            s = survive * est.alpha_at(alpha_key(kind, prev == kind), conf)
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
        """Tokens of a costly ``kind`` (a draft model) worth drafting after ``kinds``: the
        first-stop argmax of expected tokens per unit of step cost, where each of them costs its
        verify share and its own drafting (``seconds_per_token`` over a one-token pass, the
        prior ``PRIOR_C_HEAD`` until both are timed). Decided before any of them is drawn."""
        est = self.estimates
        if est is None:
            return room
        c = self._costly_ratio(seconds_per_token)
        base = len(kinds)
        keys = alpha_keys([*kinds, *([kind] * room)])
        survive, expected = self._survival_sums(kinds)
        value, keep = expected / (1 + est.verify_extra(base)), 0
        for j, key in enumerate(keys[base:], start=1):
            survive *= est.alpha(key)
            nxt = (expected + survive) / (1 + est.verify_extra(base + j) + c * j)
            if nxt <= value + 1e-12:
                break
            expected, value, keep = expected + survive, nxt, j
        if keep == 0 and room and self._costly_probe_due():
            keep = 1
        return keep

    # -- learning from the verdict --------------------------------------------------------------
    def update(self, draft: Draft, accepted: int) -> None:
        """See the verdict on ``draft``: a costly run's first token examined resets or doubles
        the probe gap; the accepted tokens of each asked kind count towards its ask gain."""
        if self.estimates is None:
            return
        kinds = draft.token_kinds()
        for i, key in enumerate(alpha_keys(kinds)[: accepted + 1]):  # examined positions only
            if key in COSTLY_KINDS:  # the first token of a costly run
                self._costly_probe_gap = 8 if i < accepted else min(64, 2 * self._costly_probe_gap)
        asks, self._step_asks = self._step_asks, []
        for i, (key, start) in enumerate(asks):  # each ask is credited with its own accepted tokens
            end = min(accepted, asks[i + 1][1] if i + 1 < len(asks) else accepted)
            kind = key.partition("@")[0]
            self._ask_gain[key] += sum(1 for x in kinds[start:end] if x == kind)
        self._pass_on_ask_gain()

    def _pass_on_ask_gain(self) -> None:
        """Leave this request's ask gains for the next requests (not a seeded sampled one's)."""
        est = self.estimates
        if est is None or est.deterministic or est.recent is None:
            return
        recent_gain = est.recent.ask_gain.setdefault(est.history_key, {})
        for key in self._asks:
            recent_gain[key] = self.ask_gain(key)

    def _pass_on_chances(self, key: str) -> None:
        """Leave the mean chances to ask per request under ``key``, this request's count so far
        weighed in (not a seeded sampled request's)."""
        if not self._seeded:
            return
        est = self.estimates
        seen, mean = self._chances.get(key, 0), self._chance_seed.get(key)
        chances = est.recent.ask_chances.setdefault(est.history_key, {})  # type: ignore[union-attr]
        chances[key] = float(seen) if mean is None else (1 - CHANCES_WEIGHT) * mean + CHANCES_WEIGHT * seen

    def _costly_probe_due(self) -> bool:
        """Count a costly first token refused; True (and the count restarts) once the probe gap
        is reached, so an estimate that fell too low can recover."""
        self._skipped_costly += 1
        if self._skipped_costly < self._costly_probe_gap:
            return False
        self._skipped_costly = 0
        return True

    def _survival_sums(self, kinds: Sequence[str], confidence: Confidences = None) -> tuple[float, float]:
        """(P(all of ``kinds`` accepted), 1 + the expected accepted tokens among them): where a
        costly drafter's tokens start from."""
        survive, expected = 1.0, 1.0
        for p in self.estimates.survival(kinds, confidence):  # type: ignore[union-attr]
            survive, expected = p, expected + p
        return survive, expected

    def _costly_ratio(self, seconds_per_token: float) -> float:
        """A costly draft token's own cost over a one-token pass (``PRIOR_C_HEAD`` until both are
        timed, and always for a seeded sampled request)."""
        est = self.estimates
        t0 = est.one_token_seconds()  # type: ignore[union-attr]
        return seconds_per_token / t0 if t0 > 0 and seconds_per_token > 0 and not est.deterministic else PRIOR_C_HEAD  # type: ignore[union-attr]
