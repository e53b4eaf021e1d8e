"""The batch engine's policy: who joins, whose prompt chunk a step feeds, whether and how long each row drafts.

The scheduler decides and never touches a tensor: admission against the KV memory bound, the
turns of prompt chunks beside the decoding rows, whether a step's rows draft at all (the draft
gate, ``batching.drafting``: before any row proposes, from the measured forward and host costs
and recent drafts' acceptance estimates, with probes on a bounded schedule while it is off),
and the step budget that cuts the drafts drawn to the set with the most expected tokens per
second (``batching.budget``). Both leave alone the rows whose K is fixed or whose seeded
sampling must not depend on the batch (``SpeculativeDecoder.budgeted``). The step runner
(``batching.runner``) carries out what it decides; ``batching.engine`` composes the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..decoding import prefix
from ..decoding.decoder import SpeculativeDecoder, StepPlan
from ..decoding.prefix import Chunk, PrefixCache
from .budget import BatchCost, choose_drafts
from .drafting import DraftGate

if TYPE_CHECKING:
    from .engine import Request

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


def row_positions(dec: SpeculativeDecoder) -> int:
    """Positions a request's row may come to hold: its prompt, its token limit and a step's drafts."""
    return len(dec.prompt_ids) + dec.max_new_tokens + DRAFT_MARGIN


class Scheduler:
    """Admission, KV memory accounting, prefill turns and the draft budget of a batch engine.

    Args:
        max_batch: the most rows decoded at once.
        kv_memory: bytes the row cache may hold (see ``BatchEngine``).
        kv_bytes: the bytes the row cache holds at most for rows of the given positions.
        cost: the batched forward's cost model (``batching.budget``), shared with the draft gate.
        prefix_cache: where prompt blocks are shared (a block two rows start with is fed once).
        prefill_chunk: tokens per prompt chunk (None: ``PREFILL_CHUNK``).
    """

    def __init__(self, *, max_batch: int, kv_memory: int, kv_bytes: Callable[[list[int]], int], cost: BatchCost,
                 prefix_cache: PrefixCache | None, prefill_chunk: int | None) -> None:
        self.max_batch = max_batch
        self.kv_memory = kv_memory
        self.kv_bytes = kv_bytes
        self.cost = cost
        #: Whether a step's cuttable rows draft at all (``batching.drafting``).
        self.gate = DraftGate(cost)
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.waiting: list[Request] = []
        self.active: list[Request] = []  # active[i] is the row cache's row i
        # Seconds of steps the prefilling rows are owed (their share of the steps) less those
        # their chunks took (``prefill_turn``).
        self.prefill_credit = 0.0

    # -- admission and KV memory ----------------------------------------------------------------
    def kv_bytes_alone(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The KV bytes a request of this size needs with no other row (what ``submit`` checks
        against ``kv_memory``)."""
        return self.kv_bytes([prompt_tokens + max_new_tokens + DRAFT_MARGIN])

    def fits(self, req: Request) -> bool:
        """Whether ``req`` may join now: the cache sized for every row's limit stays within
        ``kv_memory`` (an engine with no row admits what passed ``submit``)."""
        if not self.active:
            return True
        rows = [row_positions(r.decoder) for r in self.active] + [row_positions(req.decoder)]
        return self.kv_bytes(rows) <= self.kv_memory

    def next_to_admit(self) -> Request | None:
        """The first waiting request, taken off the queue, if a slot is free and it fits."""
        if self.waiting and len(self.active) < self.max_batch and self.fits(self.waiting[0]):
            return self.waiting.pop(0)
        return None

    # -- prefill turns --------------------------------------------------------------------------
    @property
    def chunk_budget(self) -> int:
        """Prompt-chunk tokens a step may feed."""
        return prefix.PREFILL_CHUNK if self.prefill_chunk is None else max(self.prefill_chunk, 1)

    def prompt_left(self, slot: int) -> int:
        """Prompt tokens the row in ``slot`` has yet to feed."""
        dec = self.active[slot].decoder
        return len(dec.prompt_ids) - dec.prompt_chunks[0].start if dec.prompt_chunks else 0

    def prefill_turn(self) -> dict[int, Chunk]:
        """The prompt chunks this step feeds, by slot: the next chunk of prefilling rows, the
        row with the least prompt left first (a short request is not held behind a document),
        as many as fit in one chunk's tokens (one at least), a block that several rows start
        with fed by one of them while the others wait to copy it. A long prompt (more than a
        chunk left) is fed every step while no row decodes; else only once the steps' share
        owed to the long prompts (their number over the rows', of each step's time) has caught
        up with the time their chunks took: a chunk costs what hundreds of decode tokens cost,
        so fed every step it would slow every decoding row's step that much. A short prompt's
        chunk (a template's prefix) is not held back: its last chunk would ride with its first
        draft anyway."""
        waiting = [i for i, r in enumerate(self.active) if r.decoder.prompt_chunks and r.error is None]
        if not waiting:
            self.prefill_credit = 0.0
            return {}
        if len(waiting) == len(self.active):
            self.prefill_credit = 0.0  # nobody else to be fair to
        budget = self.chunk_budget
        turn: dict[int, Chunk] = {}
        for i in sorted(waiting, key=lambda i: (self.prompt_left(i), self.active[i].id)):
            chunk = self.active[i].decoder.prompt_chunks[0]
            if self.prefill_credit < 0 and self.prompt_left(i) > budget:
                continue  # a long prompt waits for its share of the steps
            if (self.prefix_cache is not None and chunk.key is not None
                    and any(c.key == chunk.key for c in turn.values())):
                continue  # another row feeds this very block now: copy it next step (``catch_up``)
            if turn and sum(c.length for c in turn.values()) + chunk.length > budget:
                break
            turn[i] = chunk
        return turn

    def long_prompts(self) -> list[int]:
        """The slots with more than a chunk of prompt left (asked before a step's chunks are booked)."""
        return [i for i in range(len(self.active)) if self.prompt_left(i) > self.chunk_budget]

    def book_prefill(self, long: list[int], chunk_seconds: dict[int, float], seconds: float) -> None:
        """Book a step's prompt chunks against the long prompts' share of the steps: the seconds
        their chunks took (``chunk_seconds``, by slot) spent, their share of this step's
        ``seconds`` earned (never more than one step's)."""
        for slot, spent in chunk_seconds.items():
            if slot in long:
                self.prefill_credit -= spent
        if long:
            self.prefill_credit = min(self.prefill_credit + len(long) / len(self.active) * seconds, seconds)

    # -- drafting and the draft budget ---------------------------------------------------------
    def gated(self, slot: int) -> bool:
        """Whether the draft gate decides for the row in ``slot``: one the budget may cut
        (``SpeculativeDecoder.budgeted``) with a drafter to call."""
        dec = self.active[slot].decoder
        return dec.budgeted and dec.drafter is not None

    def drafting_pays(self, rows: int, gated: int, fixed_tokens: int) -> bool:
        """Whether this step's ``gated`` rows (budgeted rows with a drafter, of ``rows`` planning
        rows) draft at all (``DraftGate.decide``); asked before any of them proposes.
        ``fixed_tokens``: what the step feeds whatever they draft."""
        return self.gate.decide(rows, gated, fixed_tokens)

    def budget(self, live: list[tuple[int, StepPlan]], chunk_tokens: int = 0,
               drafted: bool = True) -> list[tuple[int, StepPlan]]:
        """Cut the drafts of rows whose K policy allows it to the set with the most expected
        tokens per second (``batching.budget``); ``chunk_tokens``: a prompt chunk the step feeds
        too; ``drafted``: whether the gated rows drafted this step (their survivals, drawn or
        not, then teach the draft gate what drafting is worth)."""
        gated = [(i, p) for i, p in live if self.gated(i)]
        if drafted and gated:
            self.gate.observe([(self.active[i].decoder.k_policy.survival,  # type: ignore[attr-defined]
                                p.draft.token_kinds(), p.draft.confidence) for i, p in gated])
        cut = [(i, p) for i, p in gated if p.draft.tokens]
        if not cut:
            return live
        survivals = [self.active[i].decoder.k_policy.survival(p.draft.token_kinds(), p.draft.confidence)  # type: ignore[attr-defined]
                     for i, p in cut]
        fixed_tokens = sum(len(p.tokens) for _, p in live) - sum(len(p.draft.tokens) for _, p in cut) + chunk_tokens
        # The rows' host work is the step's whatever is kept: it lowers the rate a draft must beat.
        host = self.gate.host.plain * len(live) + (self.gate.host.draft * len(gated) if drafted else 0.0)
        keep = dict(zip((i for i, _ in cut), choose_drafts(survivals, fixed_tokens, float(len(live)), self.cost, host)))
        return [(i, p.cut(keep[i]) if i in keep else p) for i, p in live]
