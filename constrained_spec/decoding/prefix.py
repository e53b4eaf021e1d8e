"""Prompt chunks at fixed absolute boundaries, and the prefix cache of their blocks.

A prompt (all its tokens but the last, which opens the first step) is cut into *chunks* at fixed
absolute positions: every ``PREFILL_CHUNK`` tokens from its start and, where the request names
one (``prefix_len``: an extraction template, a server's system prompt), the end of its shared
prefix. A chunk is computed by kernel calls of its own, over its own rows and the keys before
them (``models.invariant``: prompt rows keep the stock kernels, which are not invariant to how
many rows share a call, so a chunk's bits depend on where the cuts are; the cuts are fixed). On
a batch-invariant model (native precision, GPUs):

- a request alone feeds every chunk in its first forward (one prompt segment each, no extra
  forward); the batch engine feeds a long prompt's chunks one per step between the other rows'
  decode steps (``batching.engine``). Both give each position the same keys, bit for bit;
- a chunk's keys depend only on the tokens up to its end and the cuts before it, so a chunk
  that ends at a fixed cut is kept as a *block* keyed by exactly those (``Chunk.key``), and any
  later prompt that starts with the same chunks reuses them, bit for bit: several schemas over
  one document (with the document first in the prompt), a conversation growing turn by turn, a
  server's system prompt. ``prefix_len`` is not needed for reuse; it adds a cut where a
  shared part shorter than a chunk ends.

A model that is not batch-invariant (float32 on the CPU: its linear layers see a forward's rows
at once) feeds each chunk but the last in a forward of its own, which makes its blocks exact too.

Blocks are keyed by their tokens (a dict lookup compares them, so two prompts never share keys
by a hash collision) and evicted least recently used beyond ``max_bytes``; one cache serves one
model (``prefix_cache_for``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Default bound on a cache's tensors (SmolLM2-135M in float32: 46 KiB per cached token, so
#: about 5,700 tokens of blocks).
DEFAULT_MAX_BYTES = 256 * 2**20
#: Shorter shared prefixes are not worth a cut of their own.
MIN_PREFIX = 16
#: Tokens per prompt chunk: what a long prompt holds the batch for, at most, in one step (its
#: cost on a CPU: see docs/performance.md).
PREFILL_CHUNK = 256

BlockKey = tuple[tuple[int, ...], tuple[int, ...]]
Block = tuple[list[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class Chunk:
    """Prompt positions ``start .. end - 1``, computed together; ``key``: its block's key (the
    tokens up to ``end`` and every cut up to it) when ``end`` is a fixed cut, else None (the
    prompt's tail, which ends wherever the prompt does)."""

    start: int
    end: int
    key: BlockKey | None

    @property
    def length(self) -> int:
        """Tokens in the chunk."""
        return self.end - self.start


def prompt_chunks(tokens: list[int], prefix_len: int | None = None, size: int | None = None) -> list[Chunk]:
    """The chunks of ``tokens`` (a prompt without its last token; see the module docstring):
    cuts every ``size`` tokens (None: ``PREFILL_CHUNK``; 0: none, the prompt in one piece but
    for its shared prefix)."""
    n = len(tokens)
    size = PREFILL_CHUNK if size is None else size  # read at call time: tests shrink it
    fixed = set(range(size, n + 1, size)) if size else set()
    if prefix_len is not None and MIN_PREFIX <= prefix_len < n:
        fixed.add(prefix_len)
    ends = sorted(fixed | ({n} if n else set()))
    chunks, start = [], 0
    for i, end in enumerate(ends):
        key = (tuple(tokens[:end]), tuple(ends[: i + 1])) if end in fixed else None
        chunks.append(Chunk(start, end, key))
        start = end
    return chunks


class PrefixCache:
    """LRU map from a block's key to its keys and values (one ``[kv_heads, length, head_dim]``
    pair per layer, in the model's dtype)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Any, Block] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def get(self, key: Any) -> Block | None:
        """The keys and values of block ``key``, marked recently used; None if absent."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store a block's keys and values (copies), evicting the least recently used beyond the bound."""
        if key in self._entries:
            return
        keys = [k.detach().clone() for k in keys]
        values = [v.detach().clone() for v in values]
        size = sum(t.numel() * t.element_size() for t in keys + values)
        if size > self.max_bytes:
            return
        self._entries[key] = (keys, values)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (old_k, old_v) = self._entries.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old_k + old_v)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.bytes = 0


def prefix_cache_for(model: Any) -> PrefixCache:
    """The prefix cache shared by every request on ``model`` in this process (made on first use)."""
    cache = getattr(model, "_constrained_spec_prefix_cache", None)
    if cache is None:
        cache = PrefixCache()
        model._constrained_spec_prefix_cache = cache
    return cache


def shared_prefix_length(full: list[int], prefix_only: list[int]) -> int:
    """How many leading tokens of ``full`` a shared text prefix covers, given the prompt encoded
    with only that prefix as its content: their common leading tokens, less the last one (a
    token at the seam can merge with the text after it)."""
    n = 0
    for a, b in zip(full, prefix_only):
        if a != b:
            break
        n += 1
    return max(0, n - 1)


def load_blocks(cache: Any, chunks: list[Chunk], store: PrefixCache | None, device: torch.device) -> int:
    """Copy the leading chunks that ``store`` holds into ``cache`` (a request's, empty), in
    order, stopping at the first it lacks. Returns how many were copied."""
    loaded = 0
    for chunk in chunks:
        entry = store.get(chunk.key) if store is not None and chunk.key is not None else None
        if entry is None:
            break
        for layer, (k, v) in enumerate(zip(*entry)):
            cache.update(k[None].to(device), v[None].to(device), layer)
        loaded += 1
    return loaded


def store_blocks(store: PrefixCache | None, chunks: list[Chunk],
                 layers: Callable[[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]],
                 dtype: torch.dtype | None) -> None:
    """Keep the cacheable ``chunks`` in ``store``; ``layers(start, end)`` gives their positions'
    keys and values per layer (``[kv_heads, length, head_dim]``), kept as the cache holds them but
    for a cache's float64 copies of float32 keys, kept in ``dtype`` (back to float32 exactly)."""
    if store is None:
        return

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.dtype == torch.float64 else t

    for chunk in chunks:
        if chunk.key is not None and chunk.key not in store:
            keys, values = layers(chunk.start, chunk.end)
            store.put(chunk.key, [kept(k) for k in keys], [kept(v) for v in values])


@torch.no_grad()
def prefill_alone(target: Any, cache: Any, tokens: list[int], chunks: list[Chunk]) -> None:
    """Feed each of ``chunks`` into ``cache`` in a forward of its own (a model that is not
    batch-invariant: see the module docstring)."""
    device = next(target.parameters()).device
    for chunk in chunks:
        target.base_model(input_ids=torch.tensor([tokens[chunk.start : chunk.end]], device=device), cache=cache,
                          use_cache=True)
