"""The C library's allocator controls (glibc's ``mallopt`` and ``malloc_trim``), where there are
any: freed memory kept for reuse while a long prompt is read, and handed back once rows end.

``keep_freed_memory``: glibc's allocator told to serve large tensors from its heap and to keep
``RuntimeConfig.heap_keep_mb`` MiB of freed memory rather than hand it back to the system.

Why: a long prompt's pass allocates and frees tensors of tens of MiB, layer after layer (its
MLP activations, for one). By default glibc serves blocks that large from fresh pages (``mmap``
above its threshold, and the heap's top trimmed back to the system past a small margin), so each
tensor's pages were faulted in one by one, zeroed by the kernel: a share of a long prompt's pass
that docs/extraction.md ("Long documents") measures. With the threshold raised and freed memory
kept, the next tensor reuses the last one's pages. The cost: the process stays up to
``heap_keep_mb`` MiB larger after a long prompt than it would be (each allocator arena keeps at
most that much at its top), until ``trim_heap`` hands it back.

One choice per process, made at the first load (``load_model``); elsewhere than glibc on Linux
nothing is changed. ``CONSTRAINED_SPEC_HEAP_KEEP_MB=0`` leaves the allocator's settings alone.

``trim_heap``: what the batch engine calls when a shelf of rows is freed (``batching.cache``), so
a finished long row's memory leaves the process; the server caps the allocator's arenas with
``libc_function("mallopt")`` (``serving.worker``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

from .. import config

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap rather than from their own mapping: a long prompt's
#: largest activations, not a model's weights (which are mapped from their files or loaded once).
MMAP_THRESHOLD_MB = 128

_SETTLED: list[int] = []  # the keep size the process settled on, once it did


def keep_freed_memory(keep_mb: int) -> bool:
    """Tell glibc's allocator to keep ``keep_mb`` MiB of freed memory for reuse, once per process
    (later calls change nothing); False where nothing was changed (``keep_mb`` 0, not glibc, or
    an earlier call settled it)."""
    config.RuntimeConfig(heap_keep_mb=keep_mb)  # checked as every setting is (RuntimeConfigError)
    if _SETTLED:
        return False
    _SETTLED.append(keep_mb)
    mallopt = _glibc_mallopt()
    if keep_mb == 0 or mallopt is None:
        return False
    # Setting either turns off glibc's own threshold that grows with the blocks freed, so both.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MB << 20) and mallopt(_M_TRIM_THRESHOLD, keep_mb << 20))


def libc_function(name: str) -> Any:
    """A function of the C library, or None where there is none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand freed heap memory back to the operating system now (``malloc_trim``): what the
    allocator keeps (above, and below its mmap threshold in any case) would stay in the process
    after a long row's KV buffers are freed. A no-op where there is no ``malloc_trim``."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _glibc_mallopt() -> Any:
    """glibc's ``mallopt``, or None where the C library is not glibc (musl has a ``mallopt``
    that does nothing)."""
    if not sys.platform.startswith("linux") or libc_function("gnu_get_libc_version") is None:
        return None
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
