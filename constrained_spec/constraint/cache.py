"""``ByteBoundedLRU``: a least-recently-used map bounded by the bytes its values hold, not by count.

Compiled constraints differ in size by orders of magnitude (a regex's grammar is a few bytes, an
outlines-core index of a large schema tens of MB, and its per-state masks grow as requests use
it), so a bound by count (the 256 entries kept before) bounds nothing. ``functools.lru_cache``
and ``cachetools`` weigh an entry once, on insertion; values here grow afterwards, so the sizes
are read again on every insertion (``size_of`` must be cheap).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class ByteBoundedLRU(Generic[V]):
    """A thread-safe LRU map whose values' ``size_of`` sum stays at most ``max_bytes`` (the newest
    entry is kept even when it alone is larger: the caller compiled it and is about to use it)."""

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        """The value, marked most recently used; None when absent."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
            return hit

    def put(self, key: Hashable, value: V) -> V:
        """Insert ``value`` unless another thread put one first; returns the one kept. Drops the
        least recently used entries until the total fits."""
        with self._lock:
            kept = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            self._trim()
            return kept

    def _trim(self) -> None:
        total = sum(self._size_of(v) for v in self._items.values())
        while total > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            total -= self._size_of(old)

    def resize(self, max_bytes: int) -> None:
        """Change the bound (dropping entries now if they no longer fit)."""
        with self._lock:
            self.max_bytes = max_bytes
            self._trim()

    @property
    def nbytes(self) -> int:
        """The bytes the values hold now."""
        with self._lock:
            return sum(self._size_of(v) for v in self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
