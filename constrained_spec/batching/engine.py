"""The batch engine: many constrained requests in one target forward per step, each speculating.

Requests join and leave between steps: a finished row frees its slot at once and a waiting
request takes it. Each row keeps its own matcher, drafter, K policy and rollback; a step plans
every row (K, draft, masks: ``SpeculativeDecoder.plan``), runs one forward over all rows'
``[last, drafts...]``, packed into one sequence with each row at its own positions
(``batching.packing``, ``RowCache``), then lets each row verify and commit
(``SpeculativeDecoder.finish``), so a row in the engine runs the very lines a single request
runs. Target-only batched decoding is the same engine with K = 0. Speculation in the batch
must pay for itself: before the rows plan, the scheduler's draft gate (``batching.drafting``)
decides from the engine's measured forward and host costs whether the rows the budget may cut
draft at all this step; where it does not pay they plan the plain step, their drafters not called.

A joining request's leading prompt blocks come from the prefix cache where it holds them; its
other prompt chunks (``decoding.prefix``: fixed absolute cuts every ``PREFILL_CHUNK`` tokens)
are fed beside the other rows' decode steps, at most one chunk's tokens a step and only as
often as the prefilling rows' share of the steps allows (``Scheduler.prefill_turn``), so a long document
never holds the batch for more than one chunk; its last chunk rides in its first batched step
with its first draft after it, as its own first step would feed it. Its prompt rows are
attended and normalized per chunk with the kernels its own first pass uses
(``batching.packing``), so with a batch-invariant model (native precision, GPUs; see
``models.invariant``) each row's keys are bit for bit those of that request alone (tested; its
logits up to the output projection's float32 rounding), its greedy tokens equal its
single-request tokens, and every chunk ending at a cut is kept as a block for later prompts
that start the same way; in float64 they agree too (tested); a float32 model on the CPU rounds
a batched row differently by ~1e-5, which can flip an exact near-tie.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..constraint import Matcher
from ..decoding.decoder import SpeculativeDecoder, StepPlan
from ..decoding.kpolicy import KPolicy
from ..decoding.prefix import Chunk, PrefixCache, prefix_cache_for
from ..decoding.profiles import detect_profile
from ..decoding.stats import DecodeResult
from ..drafters import Drafter
from ..errors import InvalidOptionError, KVMemoryError
from ..models.threads import thread_governor
from .budget import BatchCost, batch_cost_prior
from .runner import StepOutput, StepRunner
from .scheduler import DRAFT_MARGIN, Scheduler, default_kv_memory

__all__ = ["DRAFT_MARGIN", "BatchEngine", "Request", "default_kv_memory"]


@dataclass(eq=False)
class Request:
    """One request in the engine: its decoder (tokens, matcher, stats), and how it ended.

    ``on_tokens``, if given, is called with each step's emitted tokens (a per-row stream).
    """

    id: int
    decoder: SpeculativeDecoder
    on_tokens: Callable[[list[int]], None] | None = None
    error: BaseException | None = None
    cancelled: bool = False
    done: bool = False
    slot: int | None = field(default=None, repr=False)

    @property
    def result(self) -> DecodeResult:
        """Tokens, whether the constraint was satisfied, and the figures."""
        d = self.decoder
        return DecodeResult(d.output, d.finished, d.stats)


class BatchEngine:
    """Continuous batching with speculation inside the batch (see the module docstring): a
    ``Scheduler`` decides (admission, KV memory, prefill turns, the draft budget), a
    ``StepRunner`` runs (packing, the forward, unpacking), each row's decoder plans and finishes
    its own step.

    Args:
        target: a causal LM (transformers) whose attention takes a 4D boolean mask (sdpa or the
            batch-invariant implementation; eager attention gets an additive mask).
        max_batch: the most rows decoded at once; more requests wait for a free slot.
        precision, profile: pick the forward-cost prior of the step budget (``batching.budget``);
            None: the target's dtype and the detected profile.
        prefix_cache: where requests' prompt blocks are kept (``decoding.prefix``): True for the
            model's shared one, False for none, or a ``PrefixCache``.
        prefill_chunk: tokens per prompt chunk (None: ``PREFILL_CHUNK``; 0: every prompt fed
            in one step).
        kv_memory: bytes the row cache may hold (None: ``default_kv_memory()``, half the
            machine's memory). A request joins only when the cache, sized for every row's prompt
            and token limit, stays within it, and waits otherwise; one that cannot fit even alone
            is refused at ``submit`` (``KVMemoryError``).
    """

    def __init__(self, target: Any, *, max_batch: int = 16, precision: str | None = None,
                 profile: str | None = None, prefix_cache: PrefixCache | bool = True,
                 prefill_chunk: int | None = None, kv_memory: int | None = None) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise InvalidOptionError(f"Invalid max_batch: expected an integer >= 1, got {max_batch!r}.")
        if kv_memory is not None and (not isinstance(kv_memory, int) or isinstance(kv_memory, bool) or kv_memory < 1):
            raise InvalidOptionError(f"Invalid kv_memory: expected a number of bytes >= 1, got {kv_memory!r}.")
        self.target = target
        self.prefill_chunk = prefill_chunk
        self.device = next(target.parameters()).device
        shared = (prefix_cache_for(target) if prefix_cache is True else
                  prefix_cache if isinstance(prefix_cache, PrefixCache) else None)
        self._ids = itertools.count()
        self.runner = StepRunner(target, max_batch)
        precision = precision or str(next(target.parameters()).dtype).replace("torch.", "")
        self.scheduler = Scheduler(max_batch=max_batch,
                                   kv_memory=kv_memory if kv_memory is not None else default_kv_memory(),
                                   kv_bytes=self.runner.kv_bytes,
                                   cost=BatchCost(*batch_cost_prior(profile or detect_profile(), precision)),
                                   prefix_cache=shared, prefill_chunk=prefill_chunk)
        #: The most bytes the row cache held at the end of a step (it gives memory back as rows leave).
        self.peak_kv_bytes = 0

    # -- the parts' state, under the names the engine always had --------------------------------
    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Where requests' prompt blocks are kept (None: nowhere); requests submitted after it
        is replaced use the new one."""
        return self.scheduler.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self.scheduler.prefix_cache = cache

    @property
    def cache(self) -> Any:
        """The rows' KV cache (``batching.cache.RowCache``)."""
        return self.runner.cache

    @property
    def waiting(self) -> list[Request]:
        """Requests queued for a free slot."""
        return self.scheduler.waiting

    @property
    def active(self) -> list[Request]:
        """Requests decoding now; ``active[i]`` is the cache's row i."""
        return self.scheduler.active

    @property
    def max_batch(self) -> int:
        """The most rows decoded at once."""
        return self.scheduler.max_batch

    @property
    def kv_memory(self) -> int:
        """Bytes the row cache may hold."""
        return self.scheduler.kv_memory

    @property
    def cost(self) -> BatchCost:
        """The batched forward's cost model the draft budget weighs (``batching.budget``)."""
        return self.scheduler.cost

    @property
    def batch_forwards(self) -> int:
        """Forwards run by the engine for batched steps (prompt chunks included)."""
        return self.runner.batch_forwards

    @property
    def step_tokens(self) -> list[int]:
        """Tokens fed by each batched step (rows plus kept drafts), for figures and tests."""
        return self.runner.step_tokens

    @property
    def step_chunk_tokens(self) -> list[int]:
        """Prompt-chunk tokens fed by each batched step (at most ``PREFILL_CHUNK``)."""
        return self.runner.step_chunk_tokens

    def kv_bytes_alone(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The KV bytes a request of this size needs with no other row (what ``submit`` checks
        against ``kv_memory``)."""
        return self.scheduler.kv_bytes_alone(prompt_tokens, max_new_tokens)

    # -- the public API -------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], matcher: Matcher, *, drafter: Drafter | None = None,
               k_policy: KPolicy | None = None, temperature: float = 0.0, seed: int | None = None,
               max_new_tokens: int = 512, prefix_len: int | None = None, max_repeats: int = 0,
               on_tokens: Callable[[list[int]], None] | None = None) -> Request:
        """Queue a request (a fresh ``compiled.matcher()`` and, optionally, a drafter walking it;
        options as in ``SpeculativeDecoder``, which checks them now; ``prefix_len``: the prompt
        tokens other requests share, kept in the engine's prefix cache). It joins at the next
        step with a free slot."""
        dec = SpeculativeDecoder(self.target, matcher, prompt_ids, drafter=drafter, k_policy=k_policy,
                                 temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                                 prefix_len=prefix_len, prefix_cache=self.prefix_cache, max_repeats=max_repeats,
                                 prefill_chunk=self.prefill_chunk)
        dec.in_batch = True
        alone = self.kv_bytes_alone(len(dec.prompt_ids), dec.max_new_tokens)
        if alone > self.kv_memory:
            raise KVMemoryError(
                f"The request needs {alone / 2**20:.0f} MiB of KV cache ({len(prompt_ids)} prompt tokens and up to "
                f"{dec.max_new_tokens} new ones), more than this engine's kv_memory of "
                f"{self.kv_memory / 2**20:.0f} MiB; shorten the prompt or the token limit, or raise kv_memory "
                "(--kv-memory on the server).")
        req = Request(next(self._ids), dec, on_tokens)
        self.waiting.append(req)
        return req

    def cancel(self, request: Request) -> None:
        """Stop a request; its slot is freed at the next step (its tokens so far are kept)."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
            self._close(request)

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or decoding."""
        return bool(self.waiting or self.active)

    def run(self) -> Iterator[Request]:
        """Step until every submitted request is done, yielding each as it finishes."""
        while self.busy:
            yield from self.step()

    def step(self) -> list[Request]:
        """Admit waiting requests into free slots, run one batched step over the active rows,
        retire finished rows. Returns the requests that finished."""
        finished: list[Request] = []
        if self.device.type == "cpu":
            thread_governor().update()  # the cores other processes leave free (models.threads)
        self._retire(finished)
        while (req := self.scheduler.next_to_admit()) is not None:
            self._admit(req, finished)
        if self.active:
            self._batched_step()
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.allocated_bytes)
            self._retire(finished)
        return finished

    # -- one batched step -----------------------------------------------------------------------
    @torch.no_grad()
    def _batched_step(self) -> None:
        """Let the scheduler choose the prompt chunks and whether the cuttable rows draft, plan
        every row, let the scheduler cut the drafts, run one packed forward, then each row
        verifies, commits and rolls back."""
        self.runner.catch_up(self.active, self.prefix_cache)
        step_began_at = time.perf_counter()
        feeding = self.scheduler.prefill_turn()
        chunk_tokens = sum(c.length for c in feeding.values())
        plans, host, drafting = self._plan_rows(chunk_tokens)
        live = [(i, p) for i, p in enumerate(plans) if p is not None]
        if not live and not feeding:
            return
        began_at = time.perf_counter()
        live = self.scheduler.budget(live, chunk_tokens, drafted=drafting)
        for i in host:  # the budget's work is the gated rows', shared evenly
            host[i] += (time.perf_counter() - began_at) / len(host)
        prompts = {i: (c, self.active[i].decoder.prompt_ids[c.start : c.end]) for i, c in feeding.items()}
        out = self.runner.run(len(self.active), live, prompts,
                              {i: self.active[i].decoder.feature_layers for i, _ in live})
        if not feeding:  # a chunk's rows take the dense prompt path: another cost per token
            self.cost.add(out.packing.tokens, out.seconds)
        self._book_chunks(feeding, out)
        emitted = 0
        for i, plan in live:
            began_at = time.perf_counter()
            emitted += self._finish_row(i, plan, out)
            if i in host:
                host[i] += time.perf_counter() - began_at
        if host:
            self._teach_gate(live, host, drafting, bool(feeding), emitted, time.perf_counter() - step_began_at)

    def _teach_gate(self, live: list[tuple[int, StepPlan]], host: dict[int, float], drafting: bool, fed_prompt: bool,
                    emitted: int, seconds: float) -> None:
        """Teach the draft gate what the gated rows' step cost beside the forward (planning, the
        budget, finishing: ``host``, by slot) and how the step's rate compared with its model's
        (``emitted`` tokens in ``seconds``). A joining row's first step (its last prompt chunk in
        front) is left out of the host time, its one-time work (new states' masks, first
        proposals) no drafting cost; a step that fed prompt tokens is not priced by the model."""
        gate = self.scheduler.gate
        timed = [i for i, plan in live if i in host and not plan.first]
        gate.host.add(drafting, len(timed), sum(host[i] for i in timed))
        priced = not fed_prompt and not any(plan.first for _, plan in live)
        gate.outcome(emitted, seconds if priced else 0.0)

    def _plan_rows(self, chunk_tokens: int) -> tuple[list[StepPlan | None], dict[int, float], bool]:
        """Each row's plan (``SpeculativeDecoder.plan``); None for a row still feeding its prompt
        or one whose plan failed (its error kept: one request's failure must not stop the others).
        The rows the draft gate leaves alone plan first, so the gate knows what they feed; then
        the gate decides for the others, before any of them proposes, and they plan with their
        drafters or without. Returns the plans, the seconds each gated row's plan took (by
        slot), and whether the gated rows drafted."""
        plans: list[StepPlan | None] = [None] * len(self.active)
        ready = [i for i, req in enumerate(self.active) if not req.decoder.prompt_chunks]
        gated = [i for i in ready if self.scheduler.gated(i)]
        for i in ready:
            if i not in gated:
                plans[i] = self._plan(self.active[i], draft=True)
        fixed = len(ready) + chunk_tokens + sum(len(p.draft.tokens) for p in plans if p is not None)
        drafting = self.scheduler.drafting_pays(len(ready), len(gated), fixed) if gated else True
        host: dict[int, float] = {}
        for i in gated:
            began_at = time.perf_counter()
            plans[i] = self._plan(self.active[i], draft=drafting)
            host[i] = time.perf_counter() - began_at
        return plans, host, drafting

    @staticmethod
    def _plan(req: Request, *, draft: bool) -> StepPlan | None:
        """The row's plan; with ``draft`` False its plain step (the drafter not called). None if
        planning failed (the error kept on the request)."""
        try:
            return req.decoder.plan(draft=draft)
        except Exception as e:
            req.error = e
            return None

    def _book_chunks(self, feeding: dict[int, Chunk], out: StepOutput) -> None:
        """The prompt chunks fed this step: off each row's queue, into its cache and the prefix
        cache, their share of the forward into its prefill time and the scheduler's turns."""
        long = self.scheduler.long_prompts()  # before the fed chunks are booked
        shares: dict[int, float] = {}
        for slot, chunk in feeding.items():
            dec = self.active[slot].decoder
            dec.prompt_chunks.pop(0)
            shares[slot] = out.seconds * chunk.length / out.packing.tokens
            dec.stats.prefill_seconds += shares[slot]
            self.cache.keep(slot, chunk.length)
            dec.store_prompt_blocks([chunk], self.runner.block_reader(slot))
        self.scheduler.book_prefill(long, shares, out.seconds)

    def _finish_row(self, slot: int, plan: StepPlan, out: StepOutput) -> int:
        """The row's second half of the step (``SpeculativeDecoder.finish``; a plain step the
        draft gate chose teaches its K policy nothing), then what its own step does after: its
        prompt blocks kept, its cache cut to the accepted prefix, the head's features handed
        on, the tokens streamed. Returns how many tokens it emitted."""
        req = self.active[slot]
        dec = req.decoder
        try:
            # A joining row's prompt pass is its share of the forward, by tokens.
            emitted, dropped = dec.finish(plan, out.logits[slot], out.seconds,
                                          prompt_seconds=out.seconds * plan.first / out.packing.tokens)
        except Exception as e:
            req.error = e
            return 0
        dec.keep_prompt_blocks(plan, self.runner.block_reader(slot))
        self.cache.keep(slot, len(plan.tokens) - dropped)
        dec.observe_features(out.hidden, out.packing.starts[slot], out.starts[slot], plan, dropped)
        if emitted and req.on_tokens is not None:
            req.on_tokens(emitted)
        return len(emitted)

    # -- joining and leaving --------------------------------------------------------------------
    def _close(self, req: Request) -> None:
        req.decoder.close()
        req.done = True
        # A finished row emits nothing more. The caller's callback usually closes over what holds
        # this request (the server's job), a reference cycle that only a full garbage collection
        # frees, with the decoder's masks and keys inside: drop it so refcounting frees them now.
        req.on_tokens = None

    def _admit(self, req: Request, finished: list[Request]) -> None:
        """Start the request (its shared prefix from the prefix cache, or computed in a pass of
        its own) and give it a slot; the rest of its prompt rides in its first batched step."""
        dec = req.decoder
        try:
            dec.begin()
        except Exception as e:  # one request's failure must not stop the others
            req.error = e
        if req.error is not None or dec.done or req.cancelled:
            self._close(req)
            finished.append(req)
            return
        req.slot = self.cache.add_row(dec.cache, len(dec.prompt_ids) + DRAFT_MARGIN)
        dec.cache = None  # type: ignore[assignment]  # the engine's cache holds its keys now
        self.active.append(req)

    def _retire(self, finished: list[Request]) -> None:
        """Free the slots of rows that are done, failed or cancelled (highest slot first, so the
        rows that move down are ones that stay)."""
        released = False
        for slot in range(len(self.active) - 1, -1, -1):
            req = self.active[slot]
            if not (req.decoder.done or req.error is not None or req.cancelled):
                continue
            moved = self.cache.remove_row(slot)
            last = self.active.pop()
            if moved is not None:
                self.active[slot] = last
                last.slot = slot
            req.slot = None
            self._close(req)
            finished.append(req)
            released = True
        if released:
            self.cache.release()  # a long row's memory goes back when it leaves (batching.cache)
