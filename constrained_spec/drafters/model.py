"""A draft model: a smaller causal LM sharing the target's tokenizer, masked by the same matcher."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from ..constraint import Matcher, State, apply_mask
from .base import Draft, Drafter, DraftKind, draw_masked


class ModelDrafter(Drafter):
    """Samples (or, greedy, takes the argmax of) the draft model's law masked by the request's
    matcher, walking its own states. Its KV cache keeps the tokens it has seen; before a
    proposal it is cropped to the longest prefix it shares with the context, so rejected draft
    tokens are dropped without recomputation.
    """

    name = DraftKind.MODEL

    def __init__(self, model: Any, matcher: Matcher, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(matcher)
        self.model = model
        self.temperature = temperature
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache: Any = None  # a transformers Cache
        self.cached_ids: list[int] = []

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a fresh cache for a new request: the kind a batch-invariant model names
        (``new_cache``, set by ``models.invariant.make_batch_invariant``: the decoder's, whose
        layers a native model's scripted loop writes), else transformers' own."""
        new_cache = getattr(self.model, "new_cache", None)
        self.cache = new_cache() if callable(new_cache) else DynamicCache(config=self.model.config)
        self.cached_ids = []

    def set_generator(self, generator: torch.Generator | None) -> None:
        """Sample from the request's generator, so ``seed=`` reproduces the draft too."""
        self.generator = generator

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Crop the cache to its common prefix with ``context``, feed the rest; logits of the last position."""
        if self.cache is None:
            raise RuntimeError("ModelDrafter.reset(prompt_ids) must be called before propose().")
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)  # always feed at least one token
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        if common < len(self.cached_ids):
            self.cache.crop(common - len(self.cached_ids))  # negative: drop that many positions
            del self.cached_ids[common:]
        return self._feed(context[common:])

    @torch.no_grad()
    def _feed(self, ids: list[int]) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device), cache=self.cache, use_cache=True, logits_to_keep=1
        )
        self.cached_ids.extend(ids)
        return out.logits[0, -1].float().cpu()

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Sample up to ``k`` tokens from the masked draft law q."""
        if k <= 0:
            return self.empty(state)
        states = [state]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        logits = self._sync(context)
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
                logits = self._feed([x])
        return Draft(tokens, states, torch.stack(qs) if qs else None, self.name)
