"""The batch engine's mechanism: pack the rows' new tokens, run one target forward, unpack.

The step runner owns the row cache and knows nothing of who should run: it is handed the rows'
plans and the prompt chunks the scheduler (``batching.scheduler``) chose, lays them into one
sequence with each row at its own positions (``batching.packing``), runs the forward and
returns each row's logits ``[k+1, V]`` as its single-request forward would give them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..decoding.decoder import StepPlan
from ..models.output_rows import forward_logits, supports_subsets
from ..decoding.prefix import Chunk, PrefixCache
from ..models.invariant import cache_dtype
from .cache import RowCache
from .packing import PACKED_PREFIX, PackedRows, install_packed_attention, pack_rows


@dataclass
class StepOutput:
    """What one batched forward gives back.

    Attributes:
        logits: per slot of a row that planned, its logits ``[k+1, V]`` (rows nobody reads zero).
        hidden: the forward's ``hidden_states`` where a row's drafter reads them, else None.
        starts: per slot, the first absolute position the step fed.
        packing: where each row's tokens sit in the packed sequence (``packing.starts``).
        seconds: the forward's wall-clock time.
    """

    logits: dict[int, torch.Tensor]
    hidden: Sequence[torch.Tensor] | None
    starts: list[int]
    packing: PackedRows
    seconds: float


class StepRunner:
    """Runs a batch's steps on ``target``: one packed forward over every row's new tokens.

    Args:
        target: the causal LM (see ``BatchEngine``).
        max_batch: the rows the cache holds at most.
    """

    def __init__(self, target: Any, max_batch: int) -> None:
        self.target = target
        self.device = next(target.parameters()).device
        cfg = target.config
        context = getattr(cfg, "max_position_embeddings", None) or 4096
        self.invariant = bool(getattr(target, "batch_invariant", False))
        self.cache = RowCache(cfg.num_hidden_layers, max_batch, context,
                              dtype=cache_dtype(target) if self.invariant else None)
        install_packed_attention(target)
        self._subsets = supports_subsets(target)
        self._additive_mask = cfg._attn_implementation == PACKED_PREFIX + "eager"
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        #: Numbers one cached position holds, and their size where the cache keeps the keys' own dtype.
        self._values_per_position = 2 * cfg.num_hidden_layers * kv_heads * head_dim
        self._element_size = next(target.parameters()).element_size()
        #: Forwards run for batched steps (prompt chunks included).
        self.batch_forwards = 0
        #: Tokens fed by each batched step (rows plus kept drafts), for figures and tests.
        self.step_tokens: list[int] = []
        #: Prompt-chunk tokens fed by each batched step (at most ``PREFILL_CHUNK``), for figures and tests.
        self.step_chunk_tokens: list[int] = []

    def kv_bytes(self, rows: list[int]) -> int:
        """Bytes the row cache holds at most for rows of these positions (slots and capacity as
        ``RowCache`` allocates them)."""
        return self.cache.footprint_bytes(rows, self._values_per_position, self._element_size)

    def block_reader(self, slot: int) -> Callable[[int, int], Any]:
        """Reads the keys and values of positions ``start..end-1`` of the row in ``slot``."""
        return functools.partial(self.cache.block, slot)

    def catch_up(self, rows: Sequence[Any], prefix_cache: PrefixCache | None) -> None:
        """Copy into each prefilling row (``rows[slot].decoder``) the chunks it has yet to feed
        that the prefix cache holds: cached before it joined, or fed since by another row
        (requests that share a template and joined together)."""
        if prefix_cache is None:
            return
        for slot, req in enumerate(rows):
            dec = req.decoder
            while dec.prompt_chunks and dec.prompt_chunks[0].key in prefix_cache:
                chunk = dec.prompt_chunks.pop(0)
                keys, values = prefix_cache.get(chunk.key)  # type: ignore[misc]
                self.cache.append(slot, keys, values)
                dec.stats.prefix_cached_tokens = chunk.end

    @torch.no_grad()
    def run(self, rows: int, live: list[tuple[int, StepPlan]], feeding: dict[int, tuple[Chunk, list[int]]],
            reads: dict[int, tuple[int, ...]]) -> StepOutput:
        """One forward over ``rows`` rows: the planned rows' ``live`` (slot, plan), the prompt
        chunks ``feeding`` (slot: (chunk, its tokens)); ``reads``: per live slot, the
        ``hidden_states`` its drafter reads (empty: none)."""
        packing = self._pack(rows, live, feeding)
        fed = {i: p.tokens for i, p in live} | {i: tokens for i, (_, tokens) in feeding.items()}
        ids = torch.tensor([t for i in sorted(fed) for t in fed[i]], dtype=torch.long)
        needed = [packing.starts[i] + r for i, p in live for r in p.rows]  # packed indices whose logits are read
        with_features = any(reads.values())
        starts = [int(n) for n in self.cache.lengths[:rows]]  # each row's first fed position
        began_at = time.perf_counter()
        out, computed = self._forward(rows, ids, packing, needed, [s for _, p in live for s in p.row_subsets()],
                                      with_features)
        seconds = time.perf_counter() - began_at
        self.batch_forwards += 1
        return StepOutput(self._unpack(live, computed), out.hidden_states if with_features else None, starts,
                          packing, seconds)

    def _pack(self, rows: int, live: list[tuple[int, StepPlan]], feeding: dict[int, Any]) -> PackedRows:
        """Reserve room for what each row feeds and lay the rows out in one sequence."""
        counts, prompts = [0] * rows, [0] * rows
        for i, p in live:
            counts[i], prompts[i] = len(p.tokens) - p.first, p.first
        for i, (chunk, _) in feeding.items():
            prompts[i] = chunk.length
        widest = max(counts)
        for i in range(rows):  # room for what each row feeds, up to its grid's width (``packing._grid``)
            self.cache.reserve_row(i, int(self.cache.lengths[i]) + prompts[i] + (widest if counts[i] else 0))
        packing = pack_rows(self.cache.lengths, counts, prompts, additive=self._additive_mask, parts=self.cache.parts())
        self.step_tokens.append(packing.tokens)
        self.step_chunk_tokens.append(sum(chunk.length for chunk, _ in feeding.values()))
        return packing

    def _forward(self, rows: int, ids: torch.Tensor, packing: PackedRows, needed: list[int],
                 subsets: list[torch.Tensor | None], with_features: bool) -> tuple[Any, torch.Tensor | None]:
        """The packed forward; the logits ``[len(needed), V]`` of the packed positions ``needed``
        (None when no row reads any)."""
        self.cache.active = rows
        self.cache.packing = packing.to(self.device)
        # The grids carry their own masks; any 4D mask keeps transformers from building one (a
        # step that only feeds prompt chunks has no grid).
        grids = self.cache.packing.grids
        mask = grids[0].mask if grids else torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        inputs = dict(input_ids=ids[None].to(self.device), position_ids=self.cache.packing.positions[None],
                      attention_mask=mask, cache=self.cache, use_cache=True, packing=self.cache.packing)
        if self.invariant and packing.prompts:  # joining requests' prompt rows keep the stock kernels
            inputs["prompt_rows"] = [(seg.start, seg.length) for seg in packing.prompts]
        if with_features:  # rows whose drafter is a learned head read the target's features
            inputs["output_hidden_states"] = True
        try:
            if needed:  # small states over their allowed ids only (models.output_rows)
                return forward_logits(self.target, needed, subsets, self._subsets, **inputs)
            # Every row is in a single-token state, or feeds a chunk: only the keys are needed.
            return self.target.base_model(**inputs), None
        finally:
            self.cache.packing = None

    def _unpack(self, live: list[tuple[int, StepPlan]], computed: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """Each live row's logits ``[k+1, V]``: ``computed`` lists each row's read positions in
        turn, so its logits are the next ``len(plan.rows)``."""
        vocab = computed.shape[-1] if computed is not None else int(self.target.config.vocab_size)
        dtype = computed.dtype if computed is not None else torch.float32
        out, read = {}, 0
        for i, p in live:
            out[i] = p.full_logits(computed[read : read + len(p.rows)] if computed is not None else None, vocab, dtype)
            read += len(p.rows)
        return out
