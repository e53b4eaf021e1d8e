"""The batch engine: many constrained requests in one target forward per step, each speculating.

Requests join and leave between steps: a finished row frees its slot at once and a waiting
request takes it. Each row keeps its own matcher, drafter, K policy and rollback; a step plans
every row (K, draft, masks: ``SpeculativeDecoder.plan``), runs one forward over all rows'
``[last, drafts...]``, packed into one sequence with each row at its own positions
(``batching.packing``, ``RowCache``), then lets each row verify and commit
(``SpeculativeDecoder.finish``), so a row in the engine runs the very lines a single request
runs. Target-only batched decoding is the same engine with K = 0.

A joining request's leading prompt blocks come from the prefix cache where it holds them; its
other prompt chunks (``decoding.prefix``: fixed absolute cuts every ``PREFILL_CHUNK`` tokens)
are fed beside the other rows' decode steps, at most one chunk's tokens a step and only as
often as the prefilling rows' share of the steps allows (``_prefill_turn``), so a long document
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

import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..constraint import Matcher
from ..decoding import prefix
from ..decoding.decoder import SpeculativeDecoder, StepPlan, tap_features
from ..decoding.kpolicy import KPolicy
from ..decoding.logits import forward_logits, supports_subsets
from ..decoding.prefix import Chunk, PrefixCache, prefix_cache_for, store_blocks
from ..decoding.profiles import detect_profile
from ..decoding.stats import DecodeResult
from ..drafters import Drafter
from ..errors import InvalidOptionError, KVMemoryError
from ..models.invariant import cache_dtype
from ..models.threads import thread_governor
from .budget import BatchCost, batch_cost_prior, choose_drafts
from .cache import RowCache
from .packing import PACKED_PREFIX, install_packed_attention, pack_rows


#: Positions a row may hold past its prompt and token limit: a step's drafts beyond its last token.
DRAFT_MARGIN = 32


def default_kv_memory() -> int:
    """Half the machine's memory (``/proc/meminfo``; 4 GiB where it cannot be read): the bound is
    sized for every row's token limit, which rows seldom reach."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 4 * 2**30


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
    """Continuous batching with speculation inside the batch (see the module docstring).

    Args:
        target: a causal LM (transformers) whose attention takes a 4D boolean mask (sdpa or the
            batch-invariant implementation; eager attention gets an additive mask).
        max_batch: the most rows decoded at once; more requests wait for a free slot.
        precision, profile: pick the forward-cost prior of the step budget (``batching.budget``);
            None: the target's dtype and the detected profile.
        prefix_cache: where requests' prompt blocks are kept (``decoding.prefix``): True for the
            model's shared one, False for none, or a ``PrefixCache``.
        prefill_chunk: tokens per prompt chunk (None: ``PREFILL_CHUNK``; 0: every prompt fed
            in one step, as before chunked prefill).
        kv_memory: bytes the row cache may hold (None: ``default_kv_memory()``, a quarter of the
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
        self.max_batch = max_batch
        self.kv_memory = kv_memory if kv_memory is not None else default_kv_memory()
        self.prefill_chunk = prefill_chunk
        self.device = next(target.parameters()).device
        context = getattr(target.config, "max_position_embeddings", None) or 4096
        invariant = bool(getattr(target, "batch_invariant", False))
        self.cache = RowCache(target.config.num_hidden_layers, max_batch, context,
                              dtype=cache_dtype(target.config, self.device) if invariant else None)
        self.prefix_cache = (prefix_cache_for(target) if prefix_cache is True else
                             prefix_cache if isinstance(prefix_cache, PrefixCache) else None)
        self.waiting: list[Request] = []
        self.active: list[Request] = []  # active[i] is the cache's row i
        self._ids = itertools.count()
        install_packed_attention(target)
        self._invariant = invariant
        self._subsets = supports_subsets(target)
        self._additive_mask = target.config._attn_implementation == PACKED_PREFIX + "eager"
        cfg = target.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        #: Numbers one cached position holds, and their size where the cache keeps the keys' own dtype.
        self._values_per_position = 2 * cfg.num_hidden_layers * kv_heads * head_dim
        self._element_size = next(target.parameters()).element_size()
        #: Forwards run by the engine for batched steps (prompt chunks included).
        self.batch_forwards = 0
        precision = precision or str(next(target.parameters()).dtype).replace("torch.", "")
        self.cost = BatchCost(*batch_cost_prior(profile or detect_profile(), precision))
        #: Tokens fed by each batched step (rows plus kept drafts), for figures and tests.
        self.step_tokens: list[int] = []
        #: The most bytes the row cache held at the end of a step (it gives memory back as rows leave).
        self.peak_kv_bytes = 0
        #: Prompt-chunk tokens fed by each batched step (at most ``PREFILL_CHUNK``), for figures and tests.
        self.step_chunk_tokens: list[int] = []
        # Seconds of steps the prefilling rows are owed (their share of the steps) less those
        # their chunks took (``_prefill_turn``).
        self._prefill_credit = 0.0

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
        """Admit waiting requests into free slots (each runs its first step alone), run one
        batched step over the active rows, retire finished rows. Returns the requests that
        finished."""
        finished: list[Request] = []
        if self.device.type == "cpu":
            thread_governor().update()  # the cores other processes leave free (models.threads)
        self._retire(finished)
        while self.waiting and len(self.active) < self.max_batch and self._fits(self.waiting[0]):
            self._admit(self.waiting.pop(0), finished)
        if self.active:
            self._batched_step()
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.allocated_bytes)
            self._retire(finished)
        return finished

    # -- internals ------------------------------------------------------------------------------
    def _row_positions(self, dec: SpeculativeDecoder) -> int:
        """Positions a request's row may come to hold: its prompt, its token limit and a step's drafts."""
        return len(dec.prompt_ids) + dec.max_new_tokens + DRAFT_MARGIN

    def _kv_bytes(self, rows: list[int]) -> int:
        """Bytes the row cache holds at most for rows of these positions (slots and capacity as
        ``RowCache`` allocates them)."""
        return self.cache.footprint_bytes(rows, self._values_per_position, self._element_size)

    def kv_bytes_alone(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The KV bytes a request of this size needs with no other row (what ``submit`` checks
        against ``kv_memory``)."""
        return self._kv_bytes([prompt_tokens + max_new_tokens + DRAFT_MARGIN])

    def _fits(self, req: Request) -> bool:
        """Whether ``req`` may join now: the cache sized for every row's limit stays within
        ``kv_memory`` (an engine with no row admits what passed ``submit``)."""
        if not self.active:
            return True
        rows = [self._row_positions(r.decoder) for r in self.active] + [self._row_positions(req.decoder)]
        return self._kv_bytes(rows) <= self.kv_memory


    def _emit(self, req: Request, tokens: list[int]) -> None:
        if tokens and req.on_tokens is not None:
            req.on_tokens(tokens)

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

    def _prefill_turn(self) -> dict[int, Chunk]:
        """The prompt chunks this step feeds, by slot: the next chunk of prefilling rows, the
        row with the least prompt left first (a short request is not held behind a document),
        as many as fit in one chunk's tokens (one at least), a block that several rows start
        with fed by one of them while the others wait to copy it. A long prompt (more than a
        chunk left) is fed every step while no row decodes; else only once the steps' share
        owed to the long prompts (their number over the rows', of each step's time) has caught
        up with the time their chunks took: a chunk costs what hundreds of decode tokens cost
        here, so fed every step it would slow every decoding row's step that much. A short
        prompt's chunk (a template's prefix) is not held back: its last chunk would ride with
        its first draft anyway."""
        waiting = [i for i, r in enumerate(self.active) if r.decoder.prompt_chunks and r.error is None]
        if not waiting:
            self._prefill_credit = 0.0
            return {}
        if len(waiting) == len(self.active):
            self._prefill_credit = 0.0  # nobody else to be fair to
        budget = self._chunk_budget
        turn: dict[int, Chunk] = {}
        for i in sorted(waiting, key=lambda i: (self._prompt_left(i), self.active[i].id)):
            chunk = self.active[i].decoder.prompt_chunks[0]
            if self._prefill_credit < 0 and self._prompt_left(i) > budget:
                continue  # a long prompt waits for its share of the steps
            if (self.prefix_cache is not None and chunk.key is not None
                    and any(c.key == chunk.key for c in turn.values())):
                continue  # another row feeds this very block now: copy it next step (``_catch_up``)
            if turn and sum(c.length for c in turn.values()) + chunk.length > budget:
                break
            turn[i] = chunk
        return turn

    @property
    def _chunk_budget(self) -> int:
        """Prompt-chunk tokens a step may feed."""
        return prefix.PREFILL_CHUNK if self.prefill_chunk is None else max(self.prefill_chunk, 1)

    def _prompt_left(self, slot: int) -> int:
        """Prompt tokens the row in ``slot`` has yet to feed."""
        dec = self.active[slot].decoder
        return len(dec.prompt_ids) - dec.prompt_chunks[0].start if dec.prompt_chunks else 0

    @torch.no_grad()
    def _batched_step(self) -> None:
        """Plan every row, one forward, then each row verifies, commits and rolls back; a
        prefilling row feeds its next prompt chunk when it is its turn (``_prefill_turn``)."""
        self._catch_up()
        plans: list[StepPlan | None] = []
        for req in self.active:
            if req.decoder.prompt_chunks:  # still feeding its prompt: nothing to plan yet
                plans.append(None)
                continue
            try:
                plans.append(req.decoder.plan())
            except Exception as e:
                req.error = e
                plans.append(None)
        feeding = self._prefill_turn()
        chunk_tokens = sum(c.length for c in feeding.values())
        live = [(i, p) for i, p in enumerate(plans) if p is not None]
        if not live and not feeding:
            return
        b = len(self.active)
        live = self._budget(live, chunk_tokens)
        counts, prompts = [0] * b, [0] * b
        for i, p in live:
            counts[i], prompts[i] = len(p.tokens) - p.first, p.first
        for i, c in feeding.items():
            prompts[i] = c.length
        widest = max(counts)
        for i in range(b):  # room for what each row feeds, up to its grid's width (``packing._grid``)
            self.cache.reserve_row(i, int(self.cache.lengths[i]) + prompts[i] + (widest if counts[i] else 0))
        packing = pack_rows(self.cache.lengths, counts, prompts, additive=self._additive_mask, parts=self.cache.parts())
        self.step_tokens.append(packing.tokens)
        self.step_chunk_tokens.append(chunk_tokens)
        fed = {i: p.tokens for i, p in live}
        for i, c in feeding.items():
            fed[i] = self.active[i].decoder.prompt_ids[c.start : c.end]
        ids = torch.tensor([t for i in sorted(fed) for t in fed[i]], dtype=torch.long)
        needed = [packing.starts[i] + r for i, p in live for r in p.rows]  # packed indices whose logits are read
        self.cache.active = b
        self.cache.packing = packing.to(self.device)
        # The grids carry their own masks; any 4D mask keeps transformers from building one (a
        # step that only feeds prompt chunks has no grid).
        grids = self.cache.packing.grids
        mask = grids[0].mask if grids else torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        inputs = dict(input_ids=ids[None].to(self.device), position_ids=self.cache.packing.positions[None],
                      attention_mask=mask, cache=self.cache, use_cache=True,
                      packing=self.cache.packing)
        if self._invariant and packing.prompts:  # joining requests' prompt rows keep the stock kernels
            inputs["prompt_rows"] = [(seg.start, seg.length) for seg in packing.prompts]
        # Rows whose drafter is a learned head read the target's features of what they fed.
        reads = {i: self.active[i].decoder.feature_layers for i, _ in live}
        with_features = any(reads.values())
        if with_features:
            inputs["output_hidden_states"] = True
            starts = [int(n) for n in self.cache.lengths[:b]]  # each row's first fed position
        t0 = time.perf_counter()
        try:
            if needed:  # small states over their allowed ids only (decoding.logits)
                subsets = [s for _, p in live for s in p.row_subsets()]
                out, logits = forward_logits(self.target, needed, subsets, self._subsets, **inputs)
            else:  # every row is in a single-token state, or feeds a chunk: only the keys are needed
                out = self.target.base_model(**inputs)
                logits = None
            hidden = out.hidden_states if with_features else None
        finally:
            self.cache.packing = None
        seconds = time.perf_counter() - t0
        self.batch_forwards += 1
        if not feeding:  # a chunk's rows take the dense prompt path: another cost per token
            self.cost.add(packing.tokens, seconds)
        long = [i for i in range(b) if self._prompt_left(i) > self._chunk_budget]  # before the fed chunks are booked
        for i, c in feeding.items():
            self._fed_chunk(i, c, seconds * c.length / packing.tokens, counted=i in long)
        if long:
            self._prefill_credit = min(self._prefill_credit + len(long) / b * seconds, seconds)
        vocab = logits.shape[-1] if logits is not None else int(self.target.config.vocab_size)
        dtype = logits.dtype if logits is not None else torch.float32
        read = 0  # ``needed`` lists each row's positions in turn: its logits are the next len(rows)
        for i, p in live:
            req = self.active[i]
            rows = torch.zeros(len(p.tokens) - p.first, vocab, dtype=dtype)
            if p.rows:
                rows[torch.tensor(p.rows) - p.first] = logits[read : read + len(p.rows)]
                read += len(p.rows)
            try:
                # A joining row's prompt pass is its share of the forward, by tokens.
                emitted, dropped = req.decoder.finish(p, rows, seconds, prompt_seconds=seconds * p.first / packing.tokens)
            except Exception as e:
                req.error = e
                continue
            if p.chunks and self._invariant:  # its last chunk, computed on its own: a block if it ends at a cut
                self._store_blocks(i, p.chunks)
            self.cache.keep(i, len(p.tokens) - dropped)
            if hidden is not None and reads[i]:
                at = packing.starts[i]
                req.decoder.observe_features(starts[i], p, tap_features(hidden, reads[i], at, at + len(p.tokens)),
                                             dropped)
            self._emit(req, emitted)

    def _catch_up(self) -> None:
        """Copy into each prefilling row the chunks it has yet to feed that the prefix cache
        holds: cached before it joined, or fed since by another row (requests that share a
        template and joined together)."""
        if self.prefix_cache is None:
            return
        for slot, req in enumerate(self.active):
            dec = req.decoder
            while dec.prompt_chunks and dec.prompt_chunks[0].key in self.prefix_cache:
                chunk = dec.prompt_chunks.pop(0)
                keys, values = self.prefix_cache.get(chunk.key)  # type: ignore[misc]
                self.cache.append(slot, keys, values)
                dec.stats.prefix_cached_tokens = chunk.end

    def _fed_chunk(self, slot: int, chunk: Chunk, seconds: float, counted: bool) -> None:
        """Book a prompt chunk the row in ``slot`` fed this step (``seconds``: its share;
        ``counted``: a long prompt's, against the long prompts' share of the steps)."""
        dec = self.active[slot].decoder
        dec.prompt_chunks.pop(0)
        dec.stats.prefill_seconds += seconds
        self.cache.keep(slot, chunk.length)
        if counted:
            self._prefill_credit -= seconds
        self._store_blocks(slot, [chunk])

    def _store_blocks(self, slot: int, chunks: list[Chunk]) -> None:
        """Keep the blocks of ``chunks`` (held by the row in ``slot``) in the prefix cache."""
        store_blocks(self.prefix_cache, chunks, functools.partial(self.cache.block, slot),
                     getattr(self.target, "dtype", None))

    def _budget(self, live: list[tuple[int, StepPlan]], chunk_tokens: int = 0) -> list[tuple[int, StepPlan]]:
        """Cut the drafts of rows whose K policy allows it to the set with the most expected
        tokens per second (``batching.budget``); ``chunk_tokens``: a prompt chunk the step feeds too."""
        cut = [(i, p) for i, p in live if self.active[i].decoder.budgeted and p.draft.tokens]
        if not cut:
            return live
        survivals = [self.active[i].decoder.k_policy.survival(p.draft.token_kinds(), p.draft.confidence)  # type: ignore[union-attr]
                     for i, p in cut]
        fixed_tokens = sum(len(p.tokens) for _, p in live) - sum(len(p.draft.tokens) for _, p in cut) + chunk_tokens
        keep = dict(zip((i for i, _ in cut), choose_drafts(survivals, fixed_tokens, float(len(live)), self.cost)))
        return [(i, p.cut(keep[i]) if i in keep else p) for i, p in live]
