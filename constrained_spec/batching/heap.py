"""The C library's allocator controls (glibc's ``malloc_trim`` and ``mallopt``), where there are any."""

from __future__ import annotations

from typing import Any


def libc_function(name: str) -> Any:
    """A function of the C library, or None where there is none."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand freed heap memory back to the operating system: glibc keeps freed blocks below its
    mmap threshold, which grows to 32 MB as large blocks are freed, so a long row's KV buffers
    would stay in the process otherwise. A no-op where there is no ``malloc_trim``."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
