"""The speculative decoder: draft, verify in one target forward, roll back to the accepted prefix.

Target-only constrained decoding is the same loop with K = 0, so the baseline and the fast
path share every line that could make them differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..constraint import Matcher, State, apply_mask
from ..drafters import Draft, Drafter
from ..errors import ConstraintViolationError, DeadEndError, InvalidOptionError, InvalidPromptError, ModelLoadError
from ..models.threads import thread_governor
from ..models.growing_cache import growing_cache
from .kpolicy import FixedK, KPolicy
from ..models.output_rows import allowed_subset, forward_logits, supports_subsets
from .prefix import Chunk, PrefixCache, load_blocks, prefill_alone, prompt_chunks, store_blocks
from .repetition import first_repetition
from .stats import DecodeResult, DecodeStats
from .verifier import Verdict, masked_probs, verify_greedy, verify_sampled


@dataclass
class StepPlan:
    """What one step feeds the target: ``tokens`` (the pending prompt, the last token, the
    draft), the positions that need logits (``rows``, each >= ``first``, the number of prompt
    tokens in front), the draft and the masks along its path; when the step started, when its
    draft was done and when its plan was (``time.perf_counter``, for the stats); ``subsets``:
    per row of ``rows``, the token ids its logits are computed over when its state allows few
    (``models.output_rows``), None for the whole vocabulary."""

    tokens: list[int]
    rows: list[int]
    first: int
    draft: Draft
    masks: list[torch.Tensor]
    started_at: float
    drafted_at: float
    planned_at: float
    subsets: list[torch.Tensor | None] | None = None
    #: The prompt chunks among ``tokens[:first]`` (absolute positions; ``decoding.prefix``).
    chunks: tuple[Chunk, ...] = ()
    #: A batch engine's draft gate held this step's draft back (``plan(draft=False)``): the
    #: step examined no draft, so it teaches the K policy nothing.
    held_back: bool = False

    def row_subsets(self) -> list[torch.Tensor | None]:
        """``subsets``, or None for every row (the whole vocabulary)."""
        return self.subsets if self.subsets is not None else [None] * len(self.rows)

    def cut(self, k: int) -> "StepPlan":
        """This plan with its draft cut to its first ``k`` tokens (a batch's step budget)."""
        if k >= len(self.draft.tokens):
            return self
        front = self.first + 1
        kept = [i for i, r in enumerate(self.rows) if r < front + k]
        subsets = self.row_subsets()
        return StepPlan(self.tokens[: front + k], [self.rows[i] for i in kept], self.first,
                        self.draft.prefix(k), self.masks[: k + 1], self.started_at, self.drafted_at,
                        self.planned_at, [subsets[i] for i in kept], self.chunks)

    def full_logits(self, computed: torch.Tensor | None, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """The logits ``[k+1, V]`` of positions ``first..`` from ``computed`` ``[len(rows), V]``
        (the rows the forward computed, in order); the rows nobody reads stay zero."""
        full = torch.zeros(len(self.tokens) - self.first, vocab, dtype=dtype)
        if self.rows:
            full[torch.tensor(self.rows) - self.first] = computed
        return full


def _check_request(target: Any, matcher: Matcher, prompt_ids: list[int], drafter: Drafter | None,
                   prefill_chunk: int | None, temperature: float) -> None:
    """Refuse a request the decoder cannot run, with what was expected and how to fix it."""
    if not isinstance(matcher, Matcher):
        raise InvalidOptionError(
            f"Invalid matcher: expected a Matcher, got {type(matcher).__name__}; "
            "pass compiled.matcher(), one per request."
        )
    if matcher.num_tokens:
        raise InvalidOptionError(
            f"Invalid matcher: it has already committed {matcher.num_tokens} tokens; "
            "each request needs a fresh compiled.matcher()."
        )
    if drafter is not None and any(m is not matcher for m in drafter.matchers()):
        raise InvalidOptionError("Invalid drafter: it walks another matcher than the decoder's; "
                                 "build it with the request's matcher.")
    if not prompt_ids:
        raise InvalidPromptError("Invalid prompt: expected at least one token, got an empty prompt.")
    context = getattr(target.config, "max_position_embeddings", None)
    if context is not None and len(prompt_ids) >= context:
        raise InvalidPromptError(
            f"Invalid prompt: {len(prompt_ids)} tokens do not fit the model's context of {context} tokens "
            "(at least one must be left to generate). Shorten the prompt."
        )
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool)
                                      or prefill_chunk < 0):
        raise InvalidOptionError(f"Invalid prefill_chunk: expected an integer >= 0 or None, got {prefill_chunk!r}.")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise InvalidOptionError(f"Invalid temperature: expected a number >= 0, got {temperature!r}.")


class SpeculativeDecoder:
    """One request's decoding state: the target KV cache, the matcher, the output so far.

    Invariants between steps: the target cache holds ``prompt + output`` minus its last token
    (``self.last``), which is fed at the start of the next step; the matcher has committed
    exactly ``output``.

    Args:
        target: a causal LM (transformers), called with ``cache=`` and ``logits_to_keep=``.
        matcher: a fresh matcher for this request (``compiled.matcher()``); the drafter walks it too.
        prompt_ids: the prompt's token ids.
        drafter: proposes tokens (None: target-only decoding).
        k_policy: chooses K each step (default: ``FixedK(0)``, target-only).
        temperature: 0 for greedy; above 0, exact sampling from the masked target law.
        seed: seeds the one generator the verifier and every drafter share.
        max_new_tokens: the generation limit (also bounded by the model's context).
        prefix_len: how many leading prompt tokens other requests share (a template, a system
            prompt): a cut between prompt chunks (``decoding.prefix``), so that part is a block
            of its own even when it is shorter than a chunk.
        prefix_cache: where the prompt's blocks are looked up and kept (``decoding.prefix``; the
            same output with or without it); None computes them.
        max_repeats: stop when the output ends in this many copies of one token cycle with the
            constraint in the same state after each (``decoding.repetition``); 0: never.
        prefill_chunk: tokens per prompt chunk (``decoding.prefix``); None: ``PREFILL_CHUNK``;
            0: the prompt in one piece (no chunked prefill in a batch, no blocks but the prefix's).
    """

    def __init__(
        self,
        target: Any,
        matcher: Matcher,
        prompt_ids: list[int],
        *,
        drafter: Drafter | None = None,
        k_policy: KPolicy | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        max_new_tokens: int = 512,
        prefix_len: int | None = None,
        prefix_cache: PrefixCache | None = None,
        max_repeats: int = 0,
        prefill_chunk: int | None = None,
    ) -> None:
        _check_request(target, matcher, prompt_ids, drafter, prefill_chunk, temperature)
        context = getattr(target.config, "max_position_embeddings", None)
        self.target = target
        self.matcher = matcher
        self.prompt_ids = list(prompt_ids)
        self.drafter = drafter
        self.k_policy: KPolicy = k_policy or FixedK(0)
        self.temperature = float(temperature)
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.max_new_tokens = max_new_tokens if context is None else min(max_new_tokens, context - len(prompt_ids))
        self.max_repeats = max_repeats
        self.prefix_len = prefix_len
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.device = next(target.parameters()).device
        self._batch_invariant = bool(getattr(target, "batch_invariant", False))
        self._wire_drafter()
        self._reset_state()
        self.stats = DecodeStats(drafter=drafter.name if drafter else "none", prompt_tokens=len(prompt_ids),
                                 backend=matcher.compiled.backend, relaxed=list(matcher.compiled.warnings),
                                 k_policy=type(self.k_policy).__name__,
                                 k_max=getattr(self.k_policy, "k_max", 0) if drafter else 0)

    def _wire_drafter(self) -> None:
        """Give the drafter the request's generator, the K policy's estimates (to order its parts;
        a learned part drafts only as many tokens as its cost and acceptance pay for) and what
        past requests left."""
        if self.drafter is not None:
            estimates = getattr(self.k_policy, "estimates", None)
            self.drafter.set_generator(self.generator)
            self.drafter.set_estimates(estimates)
            self.drafter.set_recent_estimates(getattr(estimates, "recent", None))

    def _reset_state(self) -> None:
        """The state of a request that has not started: no output, an empty cache."""
        #: The matcher state after each output token (for the repetition guard).
        self._states: list[State] = []
        #: (cycle length, copies) when the repetition guard stopped the request.
        self.repetition: tuple[int, int] | None = None
        self._prefilled = 0
        self.output: list[int] = []
        self.finished = False
        # A batch-invariant model names its cache's kind (``new_cache``: the dtype its attention
        # reads, so a step converts its new tokens only); any other keeps its keys' own dtype.
        self.cache = (self.target.new_cache() if self._batch_invariant
                      else growing_cache(self.target.config.num_hidden_layers))
        self.last = self.prompt_ids[-1]
        self._single: dict[State, bool] = {}
        #: Per state, the ids its logits are computed over (``models.output_rows``); None: all.
        self._subsets: dict[State, torch.Tensor | None] = {}
        self._use_subsets = supports_subsets(self.target)
        self._pending: list[int] = []
        self._pending_chunks: list[Chunk] = []
        #: Prompt chunks a batch engine feeds in steps of their own before this request's
        #: first step (``batching.engine``); empty alone.
        self.prompt_chunks: list[Chunk] = []
        self._started = time.perf_counter()
        #: Set by a batch engine that decodes this request among others (``batching.engine``).
        self.in_batch = False

    @property
    def budgeted(self) -> bool:
        """Whether a batch engine's step budget cuts this request's drafts (in a batch, with an
        adaptive policy that allows it: not a fixed K, not seeded sampling)."""
        return self.in_batch and bool(getattr(self.k_policy, "budgeted", False))

    @property
    def state(self) -> State:
        """The matcher state after the output so far."""
        return self.matcher.state

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target ``hidden_states`` the drafter reads (empty: none to compute)."""
        return self.drafter.feature_layers if self.drafter is not None else ()

    @property
    def done(self) -> bool:
        """Whether decoding has stopped: EOS, only EOS left, the token limit, or a loop."""
        return self.finished or len(self.output) >= self.max_new_tokens or self.repetition is not None

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One speculative step; returns the tokens it emitted (EOS excluded) and updates all state."""
        if self.device.type == "cpu" and not self.in_batch:
            thread_governor().update()  # the cores other processes leave free (models.threads)
        plan = self.plan()  # K, draft, masks along the draft path
        start = self.cache.get_seq_length()
        logits, hidden, seconds = self._verify_forward(plan)  # [k+1, V] for positions first..
        self.keep_prompt_blocks(plan, self._cache_block)
        emitted, dropped = self.finish(plan, logits, seconds)  # mask, verify, commit, stop checks
        if dropped:
            self.cache.crop(-dropped)  # roll back to the accepted prefix
        self.observe_features(hidden, 0, start, plan, dropped)
        return emitted

    def plan(self, draft: bool = True) -> StepPlan:
        """The first half of a step, before the target runs: choose K, draft, the masks along the
        draft path. Returns what the target must see (``tokens``) and which of its positions
        need logits (``rows``). ``draft`` False: a plain step whatever the policy would choose,
        the drafter not called (a batch engine's draft gate, ``batching.drafting``)."""
        k = self._choose_k() if draft else 0
        started_at = time.perf_counter()
        proposal = self._draft(k)
        drafted_at = time.perf_counter()
        masks = self._masks(proposal)
        plan = self._feed(proposal, masks, started_at, drafted_at)
        plan.held_back = not draft
        return plan

    def finish(self, plan: StepPlan, logits: torch.Tensor, forward_seconds: float,
               prompt_seconds: float | None = None) -> tuple[list[int], int]:
        """The second half of a step, given the target's logits for positions ``plan.first..``
        (``[k+1, V]``, rows not in ``plan.rows`` zero): mask, verify, commit, stop checks,
        book-keeping. Returns the emitted tokens (EOS excluded) and how many fed positions the
        caller must drop from the KV cache (the rejected drafts). ``prompt_seconds``: the part
        of the forward that fed the prompt (a batch's step shares its forward; alone, the whole
        forward counts)."""
        draft = plan.draft
        began_at = time.perf_counter()
        if plan.first:
            self.stats.prefill_seconds += forward_seconds if prompt_seconds is None else prompt_seconds
        self._mask(plan.masks, logits)
        masked_at = time.perf_counter()
        verdict = self._verify(draft, logits)
        verified_at = time.perf_counter()
        if draft.tokens and self.drafter is not None:
            self.drafter.update(draft, verdict.accepted, verdict.next_token)
        committing_at = time.perf_counter()
        emitted = self._commit(draft, verdict)
        emitted, dropped = self._stop_checks(draft, verdict.accepted, emitted)
        ended_at = time.perf_counter()
        if not plan.held_back:
            self._learn(plan, verdict.accepted, forward_seconds)
        self.stats.record_step(
            draft.token_kinds(), verdict.accepted, verdict.next_token != self.matcher.eos_token_id, len(self.output),
            draft_seconds=plan.drafted_at - plan.started_at, target_seconds=forward_seconds,
            verify_seconds=verified_at - masked_at,
            constraint_seconds=(plan.planned_at - plan.drafted_at) + (masked_at - began_at) + (ended_at - committing_at),
            step_seconds=ended_at - plan.started_at, since_start=ended_at - self._started)
        return emitted, dropped

    # -- plan: K, draft, masks ------------------------------------------------------------------
    def _choose_k(self) -> int:
        """The policy's K, within the token limit: a step emits at most K + 1 tokens."""
        room = self.max_new_tokens - len(self.output)
        return max(0, min(self.k_policy.next_k(), room - 1))

    def _draft(self, k: int) -> Draft:
        """Up to ``k`` tokens, each allowed by the matcher along the draft path, cut to the
        prefix expected to pay (in a batch engine its step budget decides instead: the
        single-request cost does not apply there)."""
        if k <= 0 or self.drafter is None:
            return Draft([], [self.state])
        draft = self.drafter.propose(self.prompt_ids + self.output, self.state, k)
        keep = len(draft.tokens) if self.budgeted else self.k_policy.trim(draft.token_kinds(), draft.confidence)
        return draft.prefix(keep) if keep < len(draft.tokens) else draft

    def _masks(self, draft: Draft) -> list[torch.Tensor]:
        """The allowed-token masks of the states s_0..s_k along the draft path."""
        masks = [self.matcher.allowed_mask(s) for s in draft.states]
        if not bool(masks[0].any()):
            raise self._dead_end()
        return masks

    def _feed(self, draft: Draft, masks: list[torch.Tensor], started_at: float, drafted_at: float) -> StepPlan:
        """The plan's tokens (the pending prompt, the last token, the draft) and the rows whose
        logits are read. A state that allows a single token has a one-hot masked law whatever the
        logits say, so its row is not computed (zeros, masked)."""
        pending, self._pending = self._pending, []
        chunks, self._pending_chunks = tuple(self._pending_chunks), []
        first = len(pending)
        read = [i for i, (s, m) in enumerate(zip(draft.states, masks)) if not self._single_token(s, m)]
        subsets = [self._subset(draft.states[i], masks[i]) for i in read] if self._use_subsets else None
        return StepPlan([*pending, self.last, *draft.tokens], [first + i for i in read], first, draft, masks,
                        started_at, drafted_at, time.perf_counter(), subsets, chunks)

    def _single_token(self, state: State, mask: torch.Tensor) -> bool:
        """Whether ``state`` allows exactly one token (EOS included): its masked law is one-hot."""
        single = self._single.get(state)
        if single is None:
            single = self._single[state] = int(mask.sum()) == 1
        return single

    def _subset(self, state: State, mask: torch.Tensor) -> torch.Tensor | None:
        """The ids ``state``'s logits are computed over, None for all (``models.output_rows``)."""
        if state not in self._subsets:
            self._subsets[state] = allowed_subset(mask)
        return self._subsets[state]

    # -- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def _verify_forward(self, plan: StepPlan) -> tuple[torch.Tensor, Sequence[torch.Tensor] | None, float]:
        """Feed ``plan.tokens`` through the target with the cache. Returns the logits ``[k+1, V]``
        of positions ``plan.first..`` (only ``plan.rows`` computed, the others zero: the
        vocabulary projection is a fifth of a forward here, and a row with a subset is computed
        over those ids only), the hidden states where the drafter reads them, and the seconds.
        Each prompt chunk among the first ``plan.first`` tokens is computed on its own."""
        extra: dict[str, Any] = {}
        if self._batch_invariant:  # see models.invariant
            base = plan.chunks[0].start if plan.chunks else 0
            extra["prompt_rows"] = [(c.start - base, c.length) for c in plan.chunks] if plan.chunks else plan.first
        if self.feature_layers:  # a learned head reads the target's hidden states: this forward returns them
            extra["output_hidden_states"] = True
        began_at = time.perf_counter()
        out, computed = forward_logits(self.target, plan.rows, plan.subsets, self._use_subsets,
                                       input_ids=torch.tensor([plan.tokens], device=self.device), cache=self.cache,
                                       use_cache=True, **extra)
        seconds = time.perf_counter() - began_at
        if not self.stats.target_forwards and self.cache.get_seq_length() != self._prefilled + len(plan.tokens):
            import transformers

            raise ModelLoadError(f"transformers {transformers.__version__} did not fill the KV cache passed as "
                                 "cache= (older 5.x releases ignore it); install transformers>=5.24.")
        hidden = out.hidden_states if self.feature_layers else None
        return plan.full_logits(computed, computed.shape[-1], computed.dtype), hidden, seconds

    # -- finish: mask, verify, commit, stop checks, learn ---------------------------------------
    @staticmethod
    def _mask(masks: Sequence[torch.Tensor], logits: torch.Tensor) -> None:
        """Mask each position's logits to its state's allowed tokens, in place."""
        for i, mask in enumerate(masks):
            apply_mask(logits[i], mask)

    def _verify(self, draft: Draft, logits: torch.Tensor) -> Verdict:
        """Accept or reject x_1..x_k against the masked target law (``decoding.verifier``)."""
        x = torch.tensor(draft.tokens, dtype=torch.long)
        if self.temperature == 0:
            return verify_greedy(logits, x)
        return verify_sampled(masked_probs(logits, self.temperature), x, draft.q, self.generator)

    def _commit(self, draft: Draft, verdict: Verdict) -> list[int]:
        """Append the accepted drafts and the recovered or bonus token to the output and the
        matcher (EOS finishes the request instead). Returns the emitted tokens."""
        n, y = verdict.accepted, verdict.next_token
        emitted = draft.tokens[:n]
        if y == self.matcher.eos_token_id:
            self.finished = True
        else:
            emitted = emitted + [y]
            self.last = y
        try:
            self.matcher.advance(emitted)
        except ConstraintViolationError:
            # The mask allowed y but the matcher cannot consume it (llguidance, for a character
            # no token sequence of this vocabulary can spell): target-only decoding stops at the
            # same token, after the accepted drafts, which the matcher did consume along the walk.
            self.matcher.advance(emitted[:n])
            self.output.extend(emitted[:n])
            raise self._dead_end() from None
        self.output.extend(emitted)
        if not self.finished and self.matcher.is_done(self.state):
            self.finished = True  # only EOS is left: target-only decoding would emit it with p = 1
        return emitted

    def _stop_checks(self, draft: Draft, accepted: int, emitted: list[int]) -> tuple[list[int], int]:
        """The repetition guard over this step's tokens (the token limit is kept by ``_choose_k``).
        Returns the emitted tokens, cut where the guard fired, and the fed positions to drop
        from the cache: the rejected drafts, and past the cut the kept ones too."""
        dropped = len(draft.tokens) - accepted
        if not self.max_repeats:
            return emitted, dropped
        start = len(self.output) - len(emitted)
        self._states.extend(draft.states[1 : accepted + 1])
        if len(self._states) < len(self.output):
            self._states.append(self.state)  # after y
        hit = first_repetition(self.output, self._states, start, self.max_repeats, self.matcher)
        if hit is None:
            return emitted, dropped
        end, cycle = hit
        self.finished = False  # target-only decoding stops there, before any EOS after it
        if end < len(self.output):
            # The cache keeps the output minus its last token: of this step's fed positions
            # (last, x_1..x_k), the first end - start.
            dropped = len(draft.tokens) + 1 - (end - start)
            self._cut_output(end)
            emitted = emitted[: end - start]
        copies = 1
        while self.output[-(copies + 1) * cycle : -copies * cycle] == self.output[-cycle:]:
            copies += 1
        self.repetition = (cycle, copies)
        return emitted, dropped

    def _learn(self, plan: StepPlan, accepted: int, forward_seconds: float) -> None:
        """Teach the K policy the step's verdict. A batched step's time is the batch's, not this
        request's verify cost: only alone does it teach the cost curve (the prompt pass never does)."""
        verify_seconds = None if plan.first or self.in_batch else forward_seconds
        self.k_policy.update(plan.draft.token_kinds(), accepted, verify_seconds, plan.drafted_at - plan.started_at,
                             plan.draft.confidence)

    def _dead_end(self) -> DeadEndError:
        """The error of a state with no token to go on with, carrying the output so far."""
        text = b"".join(self.matcher.vocab.token_bytes.get(t, b"") for t in self.output)
        return DeadEndError(text.decode("utf-8", errors="replace"), len(self.output))

    def _cut_output(self, end: int) -> None:
        """Keep the first ``end`` output tokens (the repetition guard fired there): uncommit the
        rest from the matcher."""
        self.matcher.rollback(len(self.output) - end)
        del self.output[end:]
        del self._states[end:]
        self.last = self.output[-1]

    # -- what a step hands on: prompt blocks, the head's features -------------------------------
    def keep_prompt_blocks(self, plan: StepPlan, block: Callable[[int, int], Any]) -> None:
        """Keep the prompt chunks ``plan`` fed, each computed on its own (a batch-invariant
        model), as blocks of the prefix cache; ``block(start, end)`` reads their keys and values
        from wherever this request's cache lives (its own, or a batch engine's row)."""
        if plan.chunks and self._batch_invariant:
            self.store_prompt_blocks(plan.chunks, block)

    def store_prompt_blocks(self, chunks: Sequence[Chunk], block: Callable[[int, int], Any]) -> None:
        """Keep the blocks of ``chunks`` in the prefix cache (``block`` as in ``keep_prompt_blocks``)."""
        store_blocks(self.prefix_cache, list(chunks), block, getattr(self.target, "dtype", None))

    def _cache_block(self, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of positions ``start..end-1`` in this request's own cache, per layer."""
        layers = self.cache.layers
        return [la.keys[0, :, start:end] for la in layers], [la.values[0, :, start:end] for la in layers]

    def observe_features(self, hidden_states: Sequence[torch.Tensor] | None, offset: int, start: int,
                         plan: StepPlan, dropped: int) -> None:
        """Hand the drafter the target's features of the positions a step fed and kept:
        ``hidden_states`` of the forward (None: none computed), in which this request's tokens
        sit at ``offset..`` (0 alone, its packed start in a batch); ``start``: the first one's
        absolute position."""
        layers = self.feature_layers
        if hidden_states is None or not layers or self.drafter is None:
            return
        features = tap_features(hidden_states, layers, offset, offset + len(plan.tokens))
        kept = len(plan.tokens) - dropped
        self.drafter.observe(start, plan.tokens[:kept], features[:kept])

    # -- a request's life: begin, step until done, close ----------------------------------------
    def begin(self) -> None:
        """Start the clock and queue the prompt (see ``start``); a request whose constraint
        allows only EOS from the start is finished at once."""
        self._started = time.perf_counter()
        self.start()
        if self.matcher.is_done(self.state):
            self.finished = True

    def start(self) -> None:
        """Reset the drafter, copy the prompt's leading blocks from the prefix cache where it
        holds them and queue the rest (``decoding.prefix``): the remaining chunks ride in the
        first step's verify pass, one forward less; a batch engine feeds all but the last in
        steps of their own first (``prompt_chunks``); a model that is not batch-invariant gets
        all but the last in forwards of their own now."""
        if self.drafter is not None:
            self.drafter.reset(self.prompt_ids)
        t0 = time.perf_counter()
        tokens = self.prompt_ids[:-1]
        chunks = prompt_chunks(tokens, self.prefix_len, self.prefill_chunk)
        # In a batch engine the cached blocks go straight into its row cache (``StepRunner.catch_up``):
        # loaded here first, a long document's keys would be held twice for a moment.
        batched = self.in_batch and self._batch_invariant
        loaded = 0 if batched else load_blocks(self.cache, chunks, self.prefix_cache, self.device)
        self.stats.prefix_cached_tokens = chunks[loaded - 1].end if loaded else 0
        rest = chunks[loaded:]
        if len(rest) > 1 and not self._batch_invariant:
            prefill_alone(self.target, self.cache, tokens, rest[:-1])
            self.store_prompt_blocks(rest[:-1], self._cache_block)
            rest = rest[-1:]
        elif len(rest) > 1 and batched:
            self.prompt_chunks, rest = rest[:-1], rest[-1:]
        self._pending_chunks = rest
        self._prefilled = rest[0].start if rest else len(tokens)
        self.stats.prefill_seconds = time.perf_counter() - t0
        self._pending = tokens[self._prefilled :]

    def close(self) -> None:
        """Final book-keeping once ``done``: at the limit, a complete member of the language is a
        valid result; the figures are filled in."""
        if not self.finished and self.repetition is None and self.matcher.is_final(self.state):
            self.finished = True
        self.stats.output_tokens = len(self.output)
        self.stats.finished = self.finished
        self.stats.total_seconds = time.perf_counter() - self._started
        if self.drafter is not None:
            self.stats.draft_seconds_by_kind = self.drafter.timings()
        self.stats.finish()

    def run(self) -> Iterator[list[int]]:
        """Start, then yield each step's emitted tokens until final, EOS or the token limit."""
        self.begin()
        while not self.done:
            emitted = self.step()
            if emitted:
                yield emitted
        self.close()


def tap_features(hidden_states: Sequence[torch.Tensor], taps: Sequence[int], start: int, stop: int) -> torch.Tensor:
    """The tapped ``hidden_states`` of positions ``start..stop-1`` of a (packed) forward,
    concatenated, on the CPU: float64 where the model computes in it, else float32."""
    feats = torch.cat([hidden_states[t][0, start:stop] for t in taps], dim=-1)
    return (feats if feats.dtype == torch.float64 else feats.float()).cpu()


def decode(target: Any, matcher: Matcher, prompt_ids: list[int], **options: Any) -> DecodeResult:
    """Generate token ids under ``matcher``; with no drafter (or K = 0), target-only decoding.

    Options as in ``SpeculativeDecoder``. Greedy (``temperature = 0``) output equals target-only
    greedy output token for token; sampled output follows the target-only grammar-masked law
    exactly.
    """
    dec = SpeculativeDecoder(target, matcher, prompt_ids, **options)
    for _ in dec.run():
        pass
    return DecodeResult(dec.output, dec.finished, dec.stats)
