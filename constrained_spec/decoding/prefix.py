"""Prefix caching: the KV of a prompt's leading blocks, computed once and reused by every request
that starts with the same tokens.

Exact by construction. A prompt's tokens before its last one are fed in fixed blocks of
``BLOCK`` tokens (block ``i`` is tokens ``i*BLOCK .. (i+1)*BLOCK - 1``, each block its own
forward over the blocks before it), whether or not a cache is used; what is left (fewer than
``BLOCK`` tokens) rides in the first verify pass as before. A cached block is therefore the very
tensor a cold run computes for it (the same kernels on the same inputs and the same earlier
blocks), so outputs are identical with and without the cache, and identical between a request
run alone and one in the batch engine. The price of the fixed boundaries: a cold prompt of n
tokens takes ``n // BLOCK`` extra forwards (each ~15 ms of dispatch here).

Entries are keyed by the whole token prefix up to the block's end (a dict lookup compares the
tokens, so two prompts never share a block by a hash collision) and evicted least recently used
beyond ``max_bytes``. One cache serves one model (``prefix_cache_for``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

#: Tokens per cached block: small enough that prompts sharing a template share most of it,
#: large enough that a cold prompt does not pay many extra forwards.
BLOCK = 32
#: Default bound on a cache's tensors (SmolLM2-135M in float32: 1.5 MB per block, ~170 blocks).
DEFAULT_MAX_BYTES = 256 * 2**20


class PrefixCache:
    """LRU map from a prompt's first ``(i + 1) * BLOCK`` tokens to block ``i``'s keys and values
    (one ``[heads, BLOCK, head_dim]`` pair per layer)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, prefix: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The block ending ``prefix``, marked recently used; None if absent."""
        block = self._blocks.get(prefix)
        if block is None:
            self.misses += 1
            return None
        self._blocks.move_to_end(prefix)
        self.hits += 1
        return block

    def put(self, prefix: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store the block ending ``prefix`` (copies), evicting the least recently used beyond the bound."""
        if prefix in self._blocks:
            return
        keys = [k.detach().clone() for k in keys]
        values = [v.detach().clone() for v in values]
        size = sum(t.numel() * t.element_size() for t in keys + values)
        if size > self.max_bytes:
            return
        self._blocks[prefix] = (keys, values)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (old_k, old_v) = self._blocks.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old_k + old_v)

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.bytes = 0


def prefix_cache_for(model: Any) -> PrefixCache:
    """The prefix cache shared by every request on ``model`` in this process (made on first use)."""
    cache = getattr(model, "_constrained_spec_prefix_cache", None)
    if cache is None:
        cache = PrefixCache()
        model._constrained_spec_prefix_cache = cache
    return cache


@torch.no_grad()
def prefill_blocks(target: Any, cache: Any, tokens: list[int], store: PrefixCache | None,
                   batch_invariant: bool) -> int:
    """Feed ``tokens``' whole blocks into ``cache`` (a ``DynamicCache``, empty), from ``store``
    where it has them, computing the rest block by block (and storing them). Returns how many
    tokens were fed; the caller feeds the rest (fewer than ``BLOCK``)."""
    device = next(target.parameters()).device
    blocks = len(tokens) // BLOCK
    reused = 0
    if store is not None:
        hit_k: list[list[torch.Tensor]] = []
        hit_v: list[list[torch.Tensor]] = []
        for i in range(blocks):
            block = store.get(tuple(tokens[: (i + 1) * BLOCK]))
            if block is None:
                break
            hit_k.append(block[0])
            hit_v.append(block[1])
        reused = len(hit_k)
        for layer in range(len(hit_k[0]) if hit_k else 0):
            cache.update(torch.cat([b[layer] for b in hit_k], dim=1)[None].to(device),
                         torch.cat([b[layer] for b in hit_v], dim=1)[None].to(device), layer)
    extra = {"prompt_rows": BLOCK} if batch_invariant else {}
    for i in range(reused, blocks):
        ids = torch.tensor([tokens[i * BLOCK : (i + 1) * BLOCK]], device=device)
        target.base_model(input_ids=ids, cache=cache, use_cache=True, **extra)
        if store is not None:
            store.put(tuple(tokens[: (i + 1) * BLOCK]),
                      [layer.keys[0, :, -BLOCK:] for layer in cache.layers],
                      [layer.values[0, :, -BLOCK:] for layer in cache.layers])
    return blocks * BLOCK
