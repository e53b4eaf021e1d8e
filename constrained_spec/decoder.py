"""The speculative decoder: draft, verify in one target forward, roll back to the accepted prefix.

Target-only constrained decoding is the same loop with K = 0, so the baseline and the fast
path share every line that could make them differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from transformers import DynamicCache

from .constraint import Constraint, apply_mask
from .drafters import Draft, Drafter
from .errors import ConstrainedSpecError, InvalidPromptError
from .kpolicy import FixedK, KPolicy
from .verifier import masked_probs, verify_greedy, verify_sampled


@dataclass
class DecodeStats:
    """Figures of one generation. ``dataclasses.asdict`` gives a JSON-ready dict.

    Times are wall-clock seconds; ``constraint_seconds`` counts masking and FSM walks in the
    verifier's path (a drafter's own FSM walks are inside ``draft_seconds``).
    """

    drafter: str = "none"
    backend: str = ""
    #: Schema keywords the backend relaxed (llguidance lenient mode); empty when all are enforced.
    relaxed: list[str] = field(default_factory=list)
    profile: str = ""
    k_policy: str = ""
    k_max: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    ks: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    #: Seconds since the request started, and output length, at the end of each step.
    step_ends: list[float] = field(default_factory=list)
    tokens_after_step: list[int] = field(default_factory=list)
    #: Per step: constraint seconds and the step's total seconds (for p50 / p99 and the share).
    constraint_step_seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    #: The first step's pass, which carries the prompt and verifies the first draft.
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    constraint_seconds: float = 0.0
    total_seconds: float = 0.0
    #: Output tokens over the whole request (prompt pass included).
    tokens_per_second: float = 0.0
    forwards_per_token: float = 0.0
    finished: bool = False
    #: Per drafter kind: drafted, accepted, and supplied (output tokens it provided; the
    #: target supplies every recovered or bonus token, under the kind "target").
    per_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def count_kind(self, kind: str, drafted: int = 0, accepted: int = 0) -> None:
        """Add to one kind's counters (accepted tokens are also supplied tokens)."""
        row = self.per_kind.setdefault(kind, {"drafted": 0, "accepted": 0, "supplied": 0})
        row["drafted"] += drafted
        row["accepted"] += accepted
        row["supplied"] += accepted

    def finish(self) -> None:
        """Fill the derived ratios."""
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.tokens_per_second = self.output_tokens / self.total_seconds if self.total_seconds > 0 else 0.0
        self.forwards_per_token = self.target_forwards / self.output_tokens if self.output_tokens else 0.0


@dataclass
class DecodeResult:
    """Token ids generated (EOS not included), whether the constraint was satisfied, and stats."""

    tokens: list[int]
    finished: bool
    stats: DecodeStats


def _cut(draft: Draft, keep: int) -> Draft:
    """The first ``keep`` tokens of a draft, with their states, q rows and kinds."""
    return Draft(
        draft.tokens[:keep],
        draft.states[: keep + 1],
        draft.q[:keep] if draft.q is not None else None,
        draft.kind,
        draft.kinds[:keep] if draft.kinds is not None else None,
    )


class SpeculativeDecoder:
    """One request's decoding state: the target KV cache, the FSM state, the output so far.

    Invariants between steps: the target cache holds ``prompt + output`` minus its last token
    (``self.last``), which is fed at the start of the next step; ``self.state`` is the FSM state
    after ``output``.
    """

    def __init__(
        self,
        target: Any,
        constraint: Constraint,
        prompt_ids: list[int],
        *,
        drafter: Drafter | None = None,
        k_policy: KPolicy | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        max_new_tokens: int = 512,
    ) -> None:
        if not prompt_ids:
            raise InvalidPromptError("Invalid prompt: expected at least one token, got an empty prompt.")
        context = getattr(target.config, "max_position_embeddings", None)
        if context is not None and len(prompt_ids) >= context:
            raise InvalidPromptError(
                f"Invalid prompt: {len(prompt_ids)} tokens do not fit the model's context of {context} tokens "
                "(at least one must be left to generate). Shorten the prompt."
            )
        if temperature < 0:
            raise ValueError(f"Invalid temperature: expected >= 0, got {temperature}.")
        self.target = target
        self.constraint = constraint
        self.prompt_ids = list(prompt_ids)
        self.drafter = drafter
        self.k_policy: KPolicy = k_policy or FixedK(0)
        self.temperature = temperature
        self.generator = generator
        self.max_new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - len(prompt_ids))
        self.device = next(target.parameters()).device
        self.output: list[int] = []
        self.state = constraint.initial_state
        self.finished = False
        self.cache = DynamicCache(config=target.config)
        self.last = self.prompt_ids[-1]
        self._single: dict[int, bool] = {}
        self._pending: list[int] = []
        self.stats = DecodeStats(drafter=drafter.name if drafter else "none", prompt_tokens=len(prompt_ids))
        self._started = time.perf_counter()

    @torch.no_grad()
    def _forward(self, ids: list[int], rows: list[int], first: int = 0) -> torch.Tensor:
        """Feed ``ids`` through the target with the cache; logits ``[len(ids) - first, V]`` for
        positions ``first..``, where only the listed ``rows`` (each >= ``first``) are computed and
        the others are zero: the vocabulary projection is a fifth of a forward here, so rows
        nobody reads are skipped."""
        keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        out = self.target(input_ids=torch.tensor([ids], device=self.device), cache=self.cache, use_cache=True,
                          logits_to_keep=keep)
        logits = out.logits[0].float().cpu() if out.logits.dtype != torch.float64 else out.logits[0].cpu()
        full = torch.zeros(len(ids) - first, logits.shape[-1], dtype=logits.dtype)
        full[[r - first for r in rows]] = logits
        return full

    def _single_token(self, state: int, mask: torch.Tensor) -> bool:
        """Whether ``state`` allows exactly one token (EOS included): its masked law is one-hot."""
        single = self._single.get(state)
        if single is None:
            single = self._single[state] = int(mask.sum()) == 1
        return single

    def prefill(self) -> None:
        """Reset the drafter. The prompt (minus its last token) is not fed on its own: it rides
        in the first step's verify pass, which saves one forward per request."""
        if self.drafter is not None:
            self.drafter.reset(self.prompt_ids)
        self._pending = self.prompt_ids[:-1]

    def step(self) -> list[int]:
        """One speculative step; returns the tokens it emitted (EOS excluded) and updates all state."""
        st = self.stats
        # 1. Choose K; a step emits at most K + 1 tokens, so stay within max_new_tokens.
        room = self.max_new_tokens - len(self.output)
        k = max(0, min(self.k_policy.next_k(), room - 1))
        # 2. Draft: every proposed token is allowed by the constraint along the draft path.
        t0 = time.perf_counter()
        if k > 0 and self.drafter is not None:
            draft = self.drafter.propose(self.prompt_ids + self.output, self.state, k)
            keep = self.k_policy.trim(draft.token_kinds())
            if keep < len(draft.tokens):  # verify only the prefix that is expected to pay
                draft = _cut(draft, keep)
        else:
            draft = Draft([], [self.state])
        t1 = time.perf_counter()
        k = len(draft.tokens)
        # 3. The FSM masks along the draft path (s_0..s_k). A state that allows a single token has
        # a one-hot masked law whatever the logits say, so its row is not computed (zeros, masked).
        masks = [self.constraint.allowed_mask(s) for s in draft.states]
        if not bool(masks[0].any()):
            raise ConstrainedSpecError(
                "The constraint reached a state where no token is allowed (a dead end of the grammar); "
                f"output so far has {len(self.output)} tokens. Simplify the schema or pattern."
            )
        pending, self._pending = self._pending, []
        first = len(pending)
        rows = [first + i for i, (s, m) in enumerate(zip(draft.states, masks)) if not self._single_token(s, m)]
        tc = time.perf_counter()
        # 4. Verify: one target forward over [last, x_1..x_k] (after the prompt, in the first
        # step) -> logits for k + 1 positions, masked.
        logits = self._forward([*pending, self.last, *draft.tokens], rows, first)  # [k+1, V]
        t2 = time.perf_counter()
        if pending:
            st.prefill_seconds = t2 - tc
        for i, mask in enumerate(masks):
            apply_mask(logits[i], mask)
        x = torch.tensor(draft.tokens, dtype=torch.long)
        if self.temperature == 0:
            verdict = verify_greedy(logits, x)
        else:
            verdict = verify_sampled(masked_probs(logits, self.temperature), x, draft.q, self.generator)
        n, y = verdict.accepted, verdict.next_token
        if draft.tokens and hasattr(self.drafter, "update"):
            self.drafter.update(draft, n, y)  # type: ignore[union-attr]
        # 5. Roll back: drop the k - n rejected positions from the cache, move the FSM state.
        if k > n:
            self.cache.crop(-(k - n))
        emitted = draft.tokens[:n]
        if y == self.constraint.eos_token_id:
            self.finished = True
            self.state = draft.states[n]
        else:
            emitted = emitted + [y]
            self.state = self.constraint.next_state(draft.states[n], y)  # type: ignore[assignment]
            self.last = y
        self.output.extend(emitted)
        if not self.finished and self.constraint.is_done(self.state):
            self.finished = True  # only EOS is left: target-only decoding would emit it with p = 1
        t3 = time.perf_counter()
        # 6. Book-keeping for the K policy and the stats.
        self.k_policy.update(draft.token_kinds(), n, None if first else t2 - tc, t1 - t0)
        st.target_forwards += 1
        st.drafted += k
        st.accepted += n
        st.ks.append(k)
        st.accepted_per_step.append(n)
        for i, kind in enumerate(draft.token_kinds()):
            st.count_kind(kind, drafted=1, accepted=int(i < n))
        if y != self.constraint.eos_token_id:
            st.count_kind("target", accepted=1)
        st.step_ends.append(t3 - self._started)
        st.tokens_after_step.append(len(self.output))
        st.draft_seconds += t1 - t0
        st.target_seconds += t2 - tc
        st.constraint_seconds += (t3 - t2) + (tc - t1)
        st.constraint_step_seconds.append((t3 - t2) + (tc - t1))
        st.step_seconds.append(t3 - t0)
        return emitted

    def run(self) -> Iterator[list[int]]:
        """Prefill, then yield each step's emitted tokens until final, EOS or the token limit."""
        t0 = self._started = time.perf_counter()
        self.prefill()
        if self.constraint.is_done(self.state):
            self.finished = True
        while not self.finished and len(self.output) < self.max_new_tokens:
            emitted = self.step()
            if emitted:
                yield emitted
        if not self.finished and self.constraint.is_final(self.state):
            self.finished = True  # at the limit, a complete member of the language is a valid result
        self.stats.output_tokens = len(self.output)
        self.stats.finished = self.finished
        self.stats.total_seconds = time.perf_counter() - t0
        self.stats.finish()


def make_decoder(
    target: Any,
    constraint: Constraint,
    prompt_ids: list[int],
    *,
    drafter: Drafter | None = None,
    k: int = 0,
    k_policy: KPolicy | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    max_new_tokens: int = 512,
) -> SpeculativeDecoder:
    """A ready ``SpeculativeDecoder``; ``run()`` it to stream the emitted tokens step by step."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if drafter is not None and generator is not None and hasattr(drafter, "generator"):
        drafter.generator = generator
    policy: KPolicy = k_policy or FixedK(k if drafter is not None else 0)
    dec = SpeculativeDecoder(
        target,
        constraint,
        prompt_ids,
        drafter=drafter,
        k_policy=policy,
        temperature=temperature,
        generator=generator,
        max_new_tokens=max_new_tokens,
    )
    dec.stats.k_max = getattr(policy, "k_max", getattr(policy, "k", 0)) if drafter is not None else 0
    dec.stats.k_policy = type(policy).__name__
    return dec


def decode(
    target: Any,
    constraint: Constraint,
    prompt_ids: list[int],
    **options: Any,
) -> DecodeResult:
    """Generate token ids under ``constraint``; with ``k = 0`` or no drafter, target-only decoding.

    Options as in ``make_decoder``. Greedy (``temperature = 0``) output equals target-only greedy
    output token for token; sampled output follows the target-only grammar-masked distribution
    exactly.
    """
    dec = make_decoder(target, constraint, prompt_ids, **options)
    for _ in dec.run():
        pass
    return DecodeResult(dec.output, dec.finished, dec.stats)
