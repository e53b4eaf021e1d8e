"""The hybrid drafter: forced text, a copy from the prompt and lookup (asked most likely first),
then a learned head or a draft model; its ``DraftOrder`` decides which part drafts where."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..constraint import Matcher, State
from .base import Draft, Drafter, DraftKind
from .order import COSTLY_KINDS, DraftOrder, Estimates

__all__ = ["COSTLY_KINDS", "HybridDrafter", "region_of"]


class HybridDrafter(Drafter):
    """Concatenates its parts' proposals: each part continues from the state the previous one
    reached, so the whole draft is one path of the matcher. After a part proposes, the parts
    are asked again from the first (forced text may follow a copied span). Model positions carry
    q rows, deterministic ones one-hot rows. Every hook reaches every part.
    """

    name = DraftKind.HYBRID

    def __init__(self, parts: list[Drafter], *, max_model_tokens: int = 4) -> None:
        if not parts:
            raise ValueError("Invalid hybrid drafter: expected at least one part.")
        matchers = {id(m) for part in parts for m in part.matchers()}
        if len(matchers) != 1:
            raise ValueError("Invalid hybrid drafter: every part must walk the same matcher (the request's).")
        super().__init__(parts[0].matcher)
        self.parts = parts
        #: A draft model pays per token, so its share of one proposal is capped.
        self.max_model_tokens = max_model_tokens
        #: Which part drafts the next position and how much a costly one drafts (None: the
        #: declared order, outside a decoder).
        self.order: DraftOrder | None = None

    def set_estimates(self, estimates: Estimates | None) -> None:
        """Order the parts by the K policy's estimates (None: a fixed policy's declared order)."""
        self.order = DraftOrder(estimates)

    def set_recent_estimates(self, recent: Any) -> None:
        """Hand the past requests' estimates to every part."""
        for part in self.parts:
            part.set_recent_estimates(recent)

    def reset(self, prompt_ids: list[int]) -> None:
        """Reset every part."""
        for part in self.parts:
            part.reset(prompt_ids)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """Let the order and every part see the verdict."""
        if self.order is not None:
            self.order.update(draft, accepted)
        for part in self.parts:
            part.update(draft, accepted, next_token)

    def set_generator(self, generator: torch.Generator | None) -> None:
        """Hand the request's generator to every part (the draft model's sampling included)."""
        for part in self.parts:
            part.set_generator(generator)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The layers the first part that reads target features asks for."""
        return next((part.feature_layers for part in self.parts if part.feature_layers), ())

    def observe(self, start: int, tokens: Sequence[int], features: torch.Tensor) -> None:
        """Hand the target's features to every part that reads them."""
        for part in self.parts:
            if part.feature_layers:
                part.observe(start, tokens, features)

    def timings(self) -> dict[str, float]:
        """Every part's own drafting seconds, by kind."""
        out: dict[str, float] = {}
        for part in self.parts:
            for kind, seconds in part.timings().items():
                out[kind] = out.get(kind, 0.0) + seconds
        return out

    def matchers(self) -> list[Matcher]:
        """The one matcher all parts walk."""
        return [self.matcher]

    @property
    def signature(self) -> str:
        """``hybrid(part, part, ...)`` in the declared order."""
        return f"{self.name}({','.join(part.signature for part in self.parts)})"

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Concatenate the parts' proposals until ``k`` tokens are drafted."""
        tokens: list[int] = []
        states = [state]
        kinds: list[str] = []
        confidence: list[float | None] = []
        q_rows: list[torch.Tensor | None] = []
        while len(tokens) < k:
            grew = False
            for part in self._order(kinds):
                room = k - len(tokens)
                gate = None
                if part.name in COSTLY_KINDS:
                    if tokens and not part.follows_others:
                        continue  # it would return nothing: not an ask
                    region = region_of(self.matcher, states[-1])
                    if region is None:
                        continue  # only the end of the sequence is left: nothing to draft
                    room = min(room, self.max_model_tokens)
                    if self.order is not None and not part.confidence_gated:
                        # How many tokens pay is known before asking: none, no ask.
                        room = self.order.draft_room(kinds, part.name, room, part.seconds_per_token)
                        if room <= 0:
                            continue
                    if self.order is not None and not self.order.worth_asking(
                            part.name, part.seconds_per_ask, region=region, position=len(tokens),
                            catch_up_seconds=part.catch_up_seconds(context + tokens)):
                        continue
                    if self.order is not None and part.confidence_gated:
                        # Each of its tokens is weighed at its own confidence as it is drafted.
                        gate = self.order.costly_gate(kinds, confidence, part.name, part.seconds_per_token)
                ctx = context + tokens
                d = part.propose(ctx, states[-1], room) if gate is None else part.propose_gated(ctx, states[-1], room, gate)
                if not d.tokens:
                    continue
                tokens += d.tokens
                states += d.states[1:]
                kinds += d.token_kinds()
                confidence += d.token_confidence()
                q_rows += list(d.q) if d.q is not None else [None] * len(d.tokens)
                grew = True
                break  # start again from the first part: forced text may follow a copied span
            if not grew:
                break
        q = None
        if any(r is not None for r in q_rows):
            v = next(r for r in q_rows if r is not None).shape[0]
            q = torch.stack([r if r is not None else _one_hot(t, v) for r, t in zip(q_rows, tokens)])
        return Draft(tokens, states, q, self.name, kinds,
                     confidence if any(c is not None for c in confidence) else None)

    def _order(self, kinds: list[str]) -> list[Drafter]:
        """The parts in the order they are asked at the next position: the free parts before the
        first costly one ranked by the order (their acceptance estimates there), then the first
        costly part moved ahead of the first free part it beats (forced text is never overtaken
        in practice: its estimate is near 1). Without an order, the declared order."""
        if self.order is None:
            return self.parts
        at = next((i for i, p in enumerate(self.parts) if p.name in COSTLY_KINDS), len(self.parts))
        free = self.parts[:at]
        if len(free) > 1:
            free = [free[i] for i in self.order.rank_free(kinds, [p.name for p in free])]
        if at == len(self.parts):
            return free
        costly = self.parts[at]
        for i, part in enumerate(free):
            if self.order.prefers_costly(kinds, part.name, costly.name, costly.seconds_per_token):
                return [*free[:i], costly, *free[i:], *self.parts[at + 1 :]]
        return [*free, *self.parts[at:]]


#: A state allowing at most this share of the vocabulary is a narrow region (a number, an enum,
#: a literal), more a wide one (a free string): a draft's acceptance differs between them.
NARROW_SHARE = 1 / 16


def region_of(matcher: Matcher, state: State) -> str | None:
    """The kind of region ``state`` is in, as a costly drafter's asks are counted by: "narrow"
    or "wide" (``NARROW_SHARE``); None where nothing but the end of the sequence is allowed.
    Read off the state's mask, which the verifier computes there anyway (cached)."""
    memo = matcher.memo.setdefault("region", {})
    if state not in memo:
        mask = matcher.allowed_mask(state)
        eos = matcher.eos_token_id
        allowed = int(mask.sum()) - int(eos < mask.shape[0] and bool(mask[eos]))
        memo[state] = None if allowed <= 0 else "narrow" if allowed <= mask.shape[0] * NARROW_SHARE else "wide"
    return memo[state]


def _one_hot(token: int, size: int) -> torch.Tensor:
    row = torch.zeros(size, dtype=torch.float64)
    row[token] = 1.0
    return row
