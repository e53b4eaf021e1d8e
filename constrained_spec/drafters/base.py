"""The drafter contract: propose up to K tokens from a matcher state; the verifier decides.

As in transformers' candidate generators, a drafter has two real methods, ``propose`` and
(optionally) ``update`` from the verdict; the others are no-op hooks a drafter overrides when
it needs them, so the decoder calls every hook on every drafter and never asks ``hasattr``.

Every proposed token is allowed by the request's matcher when walked from the given state
(``next_state``, not only the mask: should a mask ever allow a token the parser refuses, as
llguidance's rollback once made it do, see ``constraint.llguidance``, that token cannot be
emitted, target-only decoding stops there with a DeadEndError, and a drafter that draws it ends
its draft before it); a drafter never proposes EOS, so the draft law q is the drafter's own law
over the allowed set minus EOS (the target still emits EOS as a recovered or bonus token). Deterministic drafters
(forced text, copy, lookup) return ``q = None``: q is one-hot at the proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Sequence

import torch

from ..constraint import Matcher, State


class DraftKind(StrEnum):
    """What drafted a token (``Draft.kinds``; the K policy estimates acceptance per kind, the stats
    count per kind) and what a drafter is (``Drafter.name``). A ``StrEnum``: the plain strings
    users pass and stored figures hold ("lookup", "head", ...) compare and hash equal to it."""

    NONE = "none"
    GRAMMAR = "grammar"
    COPY = "copy"
    LOOKUP = "lookup"
    CORPUS = "corpus"
    MODEL = "model"
    HEAD = "head"
    HYBRID = "hybrid"
    #: Not a drafter: the target's own recovered or bonus token, in the stats.
    TARGET = "target"


#: Called by a drafter with the confidence of its next token (its probability of the token it
#: would draft there, known before the token is drawn); True while that token is worth drafting.
#: Deciding from what is known before the draw keeps the verifier exact.
DraftGate = Callable[[float], bool]
#: Per drafted token: its drafter's confidence, or None (a kind estimated as a whole); None: all unknown.
Confidences = Sequence[float | None] | None


@dataclass
class Draft:
    """A proposal.

    Attributes:
        tokens: x_1..x_k (k may be 0).
        states: matcher states s_0..s_k along the path (``len(tokens) + 1`` entries).
        q: ``[k, V]`` draft probabilities, or None for a deterministic drafter.
        kind: the drafter that made it; ``kinds``: the drafter behind each token (hybrid drafts
            mix kinds), defaulting to ``kind``.
        confidence: per token, its drafter's probability of it before it was drawn (a learned
            head's), None where unknown; None: unknown for all. The K policy estimates a token's
            acceptance from it where given.
    """

    tokens: list[int]
    states: list[State]
    q: torch.Tensor | None = None
    kind: str = DraftKind.NONE
    kinds: list[str] | None = None
    confidence: list[float | None] | None = None

    def token_kinds(self) -> list[str]:
        """The drafter kind behind each token."""
        return self.kinds if self.kinds is not None else [self.kind] * len(self.tokens)

    def token_confidence(self) -> list[float | None]:
        """The confidence behind each token (None where unknown)."""
        return self.confidence if self.confidence is not None else [None] * len(self.tokens)

    def prefix(self, keep: int) -> "Draft":
        """The first ``keep`` tokens, with their states, q rows, kinds and confidences."""
        return Draft(self.tokens[:keep], self.states[: keep + 1], self.q[:keep] if self.q is not None else None,
                     self.kind, self.kinds[:keep] if self.kinds is not None else None,
                     self.confidence[:keep] if self.confidence is not None else None)


class Drafter:
    """Base class of every drafter: a name, the request's matcher, and no-op hooks.

    Subclasses implement ``propose``; they override ``reset`` (per-request state), ``update``
    (learning from verdicts) and ``set_generator`` (sampling drafters) when they need them.
    """

    name = "drafter"

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher

    def reset(self, prompt_ids: list[int]) -> None:
        """Forget everything from a previous request; called once before its first proposal."""

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Up to ``k`` tokens continuing ``context`` (prompt + output so far) from matcher ``state``."""
        raise NotImplementedError

    #: Whether ``propose_gated`` asks its gate before each token (a drafter that knows its confidence).
    confidence_gated: bool = False

    def propose_gated(self, context: list[int], state: State, k: int, gate: DraftGate) -> Draft:
        """``propose``, drafting each token only while ``gate`` accepts its confidence (a
        drafter that knows none drafts as ``propose`` does: ``confidence_gated`` is False)."""
        return self.propose(context, state, k)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """See the verdict on ``draft``: ``accepted`` tokens passed, then ``next_token`` came."""

    def set_generator(self, generator: torch.Generator | None) -> None:
        """The random source of the request (from ``seed=``), shared with the verifier."""

    #: Measured seconds per drafted token of a drafter that pays per token (0: free or unknown).
    seconds_per_token: float = 0.0
    #: Measured seconds per ask of such a drafter, refused asks included (0: unknown).
    seconds_per_ask: float = 0.0
    #: Measured seconds per context token such a drafter feeds catching up on a request's prompt
    #: at its first ask (a draft model's prompt pass; 0: nothing to catch up, or unknown).
    seconds_per_context_token: float = 0.0
    #: Whether it can continue a proposal other drafters began (a learned head cannot: it drafts
    #: from the target's features, which the tokens drafted before it in the step do not have).
    follows_others: bool = True

    def timings(self) -> dict[str, float]:
        """Seconds spent drafting, per kind, for drafters that time themselves."""
        return {}

    #: Where a costly drafter's timings of the last request come from and this one's go
    #: (``RecentEstimates.draft_timings``; set by ``adopt_recent_timings``).
    _recent_timings: Any = None

    def catch_up_seconds(self, context: Sequence[int]) -> float:
        """What catching up on ``context`` would cost this drafter beyond an ordinary ask: a
        draft model's prompt pass before its first ask of a request (0: nothing to catch up, or
        not yet timed)."""
        return 0.0

    def adopt_recent_timings(self, recent: Any, key: Any) -> None:
        """For a costly drafter (a head, a draft model): start from the timings the last request
        with ``key`` (its head or model) left in ``recent``, so its first asks are priced by
        what asking cost, and leave this request's there (``record_ask``)."""
        self._recent_timings = recent.draft_timings if recent is not None else None
        if self._recent_timings is not None and not (self.seconds_per_token or self.seconds_per_ask):
            self.seconds_per_token, self.seconds_per_ask, self.seconds_per_context_token = (
                self._recent_timings.get(key, (0.0, 0.0, 0.0)))

    def record_ask(self, key: Any, spent: float, tokens: int, *, per_ask: bool, keep: bool,
                   caught_up: tuple[int, float] | None = None) -> None:
        """Fold one ask's ``spent`` seconds into the moving averages the K policy prices a costly
        drafter by: per ask where ``per_ask``, per drafted token where it drafted ``tokens``, and
        per context token from ``caught_up`` (the tokens and seconds of a prompt's catch-up, not
        part of ``spent``); with ``keep`` leave them under ``key`` for the next request."""
        if per_ask:
            self.seconds_per_ask = _moving(self.seconds_per_ask, spent)
        if tokens:
            self.seconds_per_token = _moving(self.seconds_per_token, spent / tokens)
        if caught_up is not None and caught_up[0] > 0:
            self.seconds_per_context_token = _moving(self.seconds_per_context_token, caught_up[1] / caught_up[0])
        if keep and self._recent_timings is not None:
            self._recent_timings[key] = (self.seconds_per_token, self.seconds_per_ask, self.seconds_per_context_token)

    def set_recent_estimates(self, recent: Any) -> None:
        """What past requests measured (``decoding.estimates.RecentEstimates``; None: nothing):
        a drafter that times itself starts from its last request's timings there and leaves its
        own for the next."""

    def set_estimates(self, estimates: Any) -> None:
        """The K policy's acceptance and cost estimates (``drafters.order.Estimates``; None: a
        fixed K): a composite drafter orders its parts by them, a costly drafter alone weighs
        its own tokens by them (``DraftOrder``)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the target's ``hidden_states`` this drafter reads (a learned head);
        empty: the decoder computes none."""
        return ()

    def observe(self, start: int, tokens: Sequence[int], features: torch.Tensor) -> None:
        """The target's features ``[len(tokens), layers * d]`` (the ``feature_layers``
        concatenated) after each of ``tokens``, fed at absolute positions ``start..`` and kept."""

    def matchers(self) -> list[Matcher]:
        """Every matcher this drafter walks (one per part for composite drafters)."""
        return [self.matcher]

    @property
    def signature(self) -> str:
        """What this drafter is made of (its kind; a composite's parts in order): requests with
        the same signature share the K policy's acceptance estimates."""
        return self.name

    def empty(self, state: State) -> Draft:
        """A proposal of no tokens."""
        return Draft([], [state], None, self.name)


def _moving(average: float, value: float) -> float:
    """One more ``value`` in a drafter's moving average of a timing (0: none yet)."""
    return value if not average else 0.8 * average + 0.2 * value


def cut_to_constraint(matcher: Matcher, state: State, tokens: Sequence[int]) -> list[State]:
    """States along the longest prefix of ``tokens`` the matcher allows (never past a done state)."""
    states = [state]
    for t in tokens:
        if matcher.is_done(states[-1]):
            break
        nxt = matcher.next_state(states[-1], t)
        if nxt is None:
            break
        states.append(nxt)
    return states


def draw_masked(masked_logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """One draft token from logits already masked to what may be drafted: sampled from
    ``q = softmax(masked / T)``, returned for the verifier, or at T = 0 the argmax (q one-hot:
    None)."""
    from ..constraint import masked_probs

    if temperature > 0:
        q = masked_probs(masked_logits, temperature)
        return int(torch.multinomial(q, 1, generator=generator)), q
    return int(masked_logits.argmax()), None
