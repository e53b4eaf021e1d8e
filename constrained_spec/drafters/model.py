"""A draft model: a smaller causal LM sharing the target's tokenizer, masked by the same matcher."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ..constraint import Matcher, State, apply_mask
from .base import Draft, Drafter, DraftKind, draw_masked

#: Where a state allows many tokens a draft model proposes among the first this many token ids
#: and its prompt's tokens: byte-pair merges are numbered in the order they were learned, most
#: frequent first, so these cover nearly all of what a model writes, for a fraction of the output
#: matrix's reads (docs/draft-models.md, "A draft vocabulary").
DRAFT_VOCABULARY = 32768


class ModelDrafter(Drafter):
    """Samples (or, greedy, takes the argmax of) the draft model's law masked by the request's
    matcher, walking its own states. Its KV cache keeps the tokens it has seen; before a
    proposal it is cropped to the longest prefix it shares with the context, so rejected draft
    tokens are dropped without recomputation.
    """

    name = DraftKind.MODEL

    def __init__(self, model: Any, matcher: Matcher, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None, vocabulary: int | None = DRAFT_VOCABULARY) -> None:
        """``vocabulary``: the draft vocabulary's leading token ids (``DRAFT_VOCABULARY``); None,
        or a model whose vocabulary is under twice that, proposes among all tokens."""
        super().__init__(matcher)
        self.model = model
        self.temperature = temperature
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache: Any = None  # a transformers Cache
        self.cached_ids: list[int] = []
        self.seconds = 0.0
        self.seconds_per_token, self.seconds_per_ask, self.seconds_per_context_token = 0.0, 0.0, 0.0
        self._fed_prompt = False
        #: The tokens and seconds of this request's prompt catch-up (its first ask's feed).
        self._caught_up: tuple[int, float] | None = None
        #: The model's logits over a few rows of its output matrix (``models.output_rows``, set
        #: by ``models.invariant.make_batch_invariant``); None: the full projection only.
        self._subset_logits = getattr(model, "subset_logits", None)
        self.vocabulary_size = vocabulary
        #: This request's draft vocabulary (``models.output_rows.VocabularyRows``; None: all rows),
        #: gathered at its first ask (a request that never asks the draft gathers no rows), and
        #: the prompt it holds the tokens of.
        self._vocabulary: Any = None
        self._vocabulary_prompt: list[int] | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a fresh cache for a new request: the kind a batch-invariant model names
        (``new_cache``, set by ``models.invariant.make_batch_invariant``: the decoder's, whose
        layers a native model's scripted loop writes), else transformers' own."""
        new_cache = getattr(self.model, "new_cache", None)
        self.cache = new_cache() if callable(new_cache) else DynamicCache(config=self.model.config)
        self.cached_ids = []
        self._fed_prompt = False
        self._caught_up = None
        self._vocabulary, self._vocabulary_prompt = None, list(prompt_ids)

    def _draft_vocabulary(self, prompt_ids: list[int]) -> Any:
        """The leading ids and the prompt's tokens (a copy of a value the draft must be able to
        propose), where the model offers the rows (``vocabulary_rows``, set by
        ``models.invariant.make_batch_invariant``) and its vocabulary is at least twice as large
        (a smaller one would save too little to lose any token)."""
        rows = getattr(self.model, "vocabulary_rows", None)
        size = self.vocabulary_size
        if rows is None or self._subset_logits is None or size is None or size < 1:
            return None
        if getattr(self.model.config, "vocab_size", 0) < 2 * size:
            return None
        return rows(size).with_tokens(prompt_ids)

    def timings(self) -> dict[str, float]:
        """Seconds spent proposing (catching up on the context and drafting)."""
        return {self.name: self.seconds}

    def set_recent_estimates(self, recent: Any) -> None:
        """Start from the timings the last request with this draft model left in ``recent`` (so
        its first asks are priced by what asking cost, not by a head's prior) and leave this
        request's there."""
        self.adopt_recent_timings(recent, self.model)

    def set_generator(self, generator: torch.Generator | None) -> None:
        """Sample from the request's generator, so ``seed=`` reproduces the draft too."""
        self.generator = generator

    def catch_up_seconds(self, context: Sequence[int]) -> float:
        """Before this request's first ask: the draft's prompt pass over ``context`` at its
        measured seconds per context token (0 until a request has timed one); after it, 0 (the
        accepted tokens an ask catches up on are in its price per ask)."""
        return 0.0 if self._fed_prompt else len(context) * self.seconds_per_context_token

    def _sync(self, context: list[int], state: State) -> torch.Tensor:
        """Crop the cache to its common prefix with ``context``, feed the rest; logits of the last
        position, whose constraint state is ``state``."""
        if self.cache is None:
            raise RuntimeError("ModelDrafter.reset(prompt_ids) must be called before propose().")
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)  # always feed at least one token
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        if common < len(self.cached_ids):
            self.cache.crop(common - len(self.cached_ids))  # negative: drop that many positions
            del self.cached_ids[common:]
        if self._fed_prompt:
            return self._feed(context[common:], state)
        t0 = time.perf_counter()
        logits = self._feed(context[common:], state)
        self._caught_up = (len(context) - common, time.perf_counter() - t0)
        return logits

    @torch.no_grad()
    def _feed(self, ids: list[int], state: State) -> torch.Tensor:
        """Feed ``ids``; the logits after the last, whose constraint state is ``state``: over the
        tokens that state allows where it allows few (the model's ``subset_logits``, as the
        target's verify rows: a draft's vocabulary projection is a quarter of a 0.5B model's
        step), else over the draft vocabulary where it holds an allowed token (-inf outside it),
        else over all."""
        inputs = dict(input_ids=torch.tensor([ids], device=self.device), cache=self.cache, use_cache=True)
        if self._subset_logits is not None:
            mask = self.matcher.allowed_mask(state)
            logits = self._subset_logits([len(ids) - 1], [mask], vocabulary=self._vocabulary_for(mask), **inputs)
        else:
            logits = self.model(**inputs, logits_to_keep=1).logits[0, -1:].float().cpu()
        self.cached_ids.extend(ids)
        return logits[0]

    def _vocabulary_for(self, mask: torch.Tensor) -> Any:
        """The draft vocabulary where it holds a token ``mask`` allows besides the end (which a
        draft never proposes), else None (the full projection)."""
        if self._vocabulary_prompt is not None:
            self._vocabulary, self._vocabulary_prompt = self._draft_vocabulary(self._vocabulary_prompt), None
        vocabulary = self._vocabulary
        if vocabulary is None:
            return None
        n = min(mask.shape[0], vocabulary.member.shape[0])
        usable = mask[:n] & vocabulary.member[:n]
        eos = self.matcher.eos_token_id
        if eos < n:
            usable[eos] = False
        return vocabulary if bool(usable.any()) else None

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Sample up to ``k`` tokens from the masked draft law q."""
        if k <= 0:
            return self.empty(state)
        t0 = time.perf_counter()
        first = not self._fed_prompt
        draft = self._propose(context, state, k)
        spent = time.perf_counter() - t0
        self.seconds += spent
        self._fed_prompt = True
        # What the K policy weighs this drafter by (moving averages), as a head's: per drafted
        # token and per ask, the tokens accepted since the last ask included (a draft asked
        # rarely catches up on many); the request's first catch-up (its prompt pass) per
        # context token, apart (``catch_up_seconds``).
        caught_up = self._caught_up if first else None
        spent -= caught_up[1] if caught_up else 0.0
        self.record_ask(self.model, spent, len(draft.tokens), per_ask=True, keep=True, caught_up=caught_up)
        return draft

    def _propose(self, context: list[int], state: State, k: int) -> Draft:
        states = [state]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        logits = self._sync(context, state)
        eos = self.matcher.eos_token_id
        for i in range(k):
            s = states[-1]
            if self.matcher.is_done(s):
                break
            mask = self.matcher.allowed_mask(s).clone()
            if eos < mask.shape[0]:
                mask[eos] = False  # drafts never end the sequence; see drafters.base
            if not bool(mask.any()):
                break
            masked = apply_mask(logits.double(), mask)
            x, q = draw_masked(masked, self.temperature, self.generator)
            nxt = self.matcher.next_state(s, x)
            if nxt is None:  # the mask allowed what the parser refuses (see drafters.base)
                break
            if q is not None:
                qs.append(q)
            tokens.append(x)
            states.append(nxt)
            if i + 1 < k:
                logits = self._feed([x], nxt)
        return Draft(tokens, states, torch.stack(qs) if qs else None, self.name)
