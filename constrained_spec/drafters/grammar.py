"""Grammar-forced text: what the constraint forces next, tokenized as the tokenizer would."""

from __future__ import annotations

from typing import Callable

from ..constraint import Matcher, State
from .base import Draft, Drafter, DraftKind, cut_to_constraint


class GrammarDrafter(Drafter):
    """Text the constraint forces next (keys, quotes, colons, commas, brackets, enum prefixes).

    The matcher says which bytes every continuation from a state starts with; the text is
    tokenized as the tokenizer would tokenize it, cut where the matcher rejects, and proposed
    with a one-hot q. Costs no model call.

    Cached per state in the matcher's ``memo``. When the target rejects a forced token
    and emits another one in that state (it tokenizes the same text differently, e.g. ``{``
    then ``"name`` rather than ``{"`` then ``name``), that token is remembered and proposed
    first from then on.
    """

    name = DraftKind.GRAMMAR

    def __init__(self, matcher: Matcher, tokenize: Callable[[str], list[int]]) -> None:
        super().__init__(matcher)
        self.tokenize = tokenize
        self._forced: dict[State, tuple[list[int], list[State]]] = matcher.memo.setdefault("grammar.forced", {})
        self._learned: dict[State, int] = matcher.memo.setdefault("grammar.learned", {})

    def forced(self, state: State) -> tuple[list[int], list[State]]:
        """Tokens of the forced text from ``state`` and the matcher states along them (cached)."""
        hit = self._forced.get(state)
        if hit is None:
            learned = self._learned.get(state)
            if learned is not None:
                nxt = self.matcher.next_state(state, learned)
                rest_tokens, rest_states = self.forced(nxt) if nxt is not None else ([], [state])
                tokens, states = [learned, *rest_tokens], [state, *rest_states]
            else:
                text = self.matcher.forced_bytes(state).decode("utf-8", errors="ignore")
                tokens = self.tokenize(text) if text else []
                states = cut_to_constraint(self.matcher, state, tokens)
            hit = self._forced[state] = (tokens[: len(states) - 1], states)
        return hit

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Up to ``k`` forced tokens; empty where the constraint leaves a choice."""
        tokens, states = self.forced(state)
        return Draft(tokens[:k], states[: min(k, len(tokens)) + 1], None, self.name)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """Learn the target's own tokenization where it rejected a forced token."""
        kinds = draft.token_kinds()
        if accepted < len(kinds) and kinds[accepted] == self.name and next_token != self.matcher.eos_token_id:
            state = draft.states[accepted]
            if self._learned.get(state) != next_token and self.matcher.next_state(state, next_token) is not None:
                self._learned[state] = next_token
                self._forced.clear()  # forced spans through this state change
