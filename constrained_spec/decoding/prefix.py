"""Prefix caching: the KV of a prompt's shared leading part, computed once and reused by every
request that starts with the same tokens.

A request may name how many of its prompt tokens are shared with other requests
(``prefix_len``: the extraction template before the document, a server's system prompt). Those
tokens are always fed in their own forward, first, whether or not a cache is used; the rest of
the prompt rides in the first verify pass as before. A cached prefix is therefore the very
tensor a cold run computes for it (the same kernels on the same inputs), so outputs are
identical with and without the cache. A request that names no shared prefix is fed in one
pass, as before: fixed block boundaries for every prompt were measured to cost a cold
91-token prompt 85 ms here (two extra forwards of ~40 ms each), 17% of a single request's
speed, and the prompt rows' stock kernels are not invariant to how a prompt is split.

Entries are keyed by the prefix's tokens (a dict lookup compares them, so two prompts never
share keys by a hash collision), evicted least recently used beyond ``max_bytes``; one cache
serves one model (``prefix_cache_for``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

#: Default bound on a cache's tensors (SmolLM2-135M in float32: 46 KiB per cached token).
DEFAULT_MAX_BYTES = 256 * 2**20
#: Shorter shared prefixes are not worth a forward of their own.
MIN_PREFIX = 16


class PrefixCache:
    """LRU map from a shared prompt prefix's tokens to its keys and values (one
    ``[kv_heads, length, head_dim]`` pair per layer)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prefix: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The keys and values of ``prefix``, marked recently used; None if absent."""
        entry = self._entries.get(prefix)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(prefix)
        self.hits += 1
        return entry

    def put(self, prefix: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store ``prefix``'s keys and values (copies), evicting the least recently used beyond the bound."""
        if prefix in self._entries:
            return
        keys = [k.detach().clone() for k in keys]
        values = [v.detach().clone() for v in values]
        size = sum(t.numel() * t.element_size() for t in keys + values)
        if size > self.max_bytes:
            return
        self._entries[prefix] = (keys, values)
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


@torch.no_grad()
def prefill_prefix(target: Any, cache: Any, tokens: list[int], prefix_len: int | None, store: PrefixCache | None,
                   batch_invariant: bool) -> tuple[int, bool]:
    """Feed ``tokens[:prefix_len]`` into ``cache`` (a request's, empty) in a forward of its
    own, or copy it from ``store``. Returns (tokens fed, whether they came from the store); the
    caller feeds the rest. Nothing is fed when there is no shared prefix worth one."""
    if prefix_len is None or prefix_len < MIN_PREFIX or prefix_len >= len(tokens):
        return 0, False
    key = tuple(tokens[:prefix_len])
    device = next(target.parameters()).device
    entry = store.get(key) if store is not None else None
    if entry is not None:
        for layer, (k, v) in enumerate(zip(*entry)):
            cache.update(k[None].to(device), v[None].to(device), layer)
        return prefix_len, True
    extra = {"prompt_rows": prefix_len} if batch_invariant else {}
    target.base_model(input_ids=torch.tensor([list(key)], device=device), cache=cache, use_cache=True, **extra)
    if store is not None:  # in the model's dtype (a request's cache may hold float64 copies)
        dtype = getattr(target, "dtype", None)
        store.put(key, [layer.keys[0].to(dtype or layer.keys.dtype) for layer in cache.layers],
                  [layer.values[0].to(dtype or layer.values.dtype) for layer in cache.layers])
    return prefix_len, False
