"""Freed memory kept for reuse (``models.heap``): with it, a loop of large tensors, as a long
prompt's pass makes, reuses the heap's pages rather than mapping fresh ones every time; without
it (``0``) glibc's settings stay as they were; one choice per process. Each case runs in a fresh
process, as the setting is the process's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from constrained_spec.config import RuntimeConfigError
from constrained_spec.models import heap

pytestmark = pytest.mark.skipif(heap._glibc_mallopt() is None, reason="glibc's allocator only")

_ALLOCATOR = textwrap.dedent("""
    import ctypes, sys, torch
    from constrained_spec.models import heap

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    torch.set_num_threads(1)
    applied = heap.keep_freed_memory(int(sys.argv[1]))
    again = heap.keep_freed_memory(int(sys.argv[1]))
    x = torch.ones(4096, 2560)  # 40 MiB, as a 4,096-token prompt's activations
    mapped_live, arenas = [], []
    for _ in range(6):
        a = x * 2.0; b = a + x
        mapped_live.append(mallinfo2().hblkhd)  # bytes in blocks with their own mapping, now
        del a, b
        arenas.append(mallinfo2().arena)  # bytes the heap holds from the system
    freed = mallinfo2().fordblks  # freed bytes the process kept
    print(applied, again, min(mapped_live), arenas[1], arenas[-1], freed)
""")

_MIB = 1 << 20


def _allocator(keep_mb: int) -> tuple[bool, bool, int, int, int, int]:
    out = subprocess.run([sys.executable, "-c", _ALLOCATOR, str(keep_mb)], capture_output=True, text=True, check=True)
    applied, again, *sizes = out.stdout.split()
    mapped_live, arena_early, arena_late, freed = (int(size) for size in sizes)
    return applied == "True", again == "True", mapped_live, arena_early, arena_late, freed


@pytest.mark.skipif(heap.libc_function("mallinfo2") is None, reason="glibc 2.33 or later (mallinfo2)")
def test_kept_memory_is_reused_rather_than_mapped_afresh():
    # The allocator's own accounting, not page-fault counts: the kernel adds faults of its own
    # (NUMA balancing, huge pages) on shared machines, which made a fault-count test flaky.
    applied, again, mapped_live, arena_early, arena_late, freed = _allocator(256)
    untouched, _, default_mapped_live, _, _, default_freed = _allocator(0)
    assert applied and not again and not untouched
    # By default glibc gives blocks above 32 MiB mappings of their own, each freed back to the
    # system: every pass's two 40 MiB tensors are fresh pages, and nothing is kept.
    assert default_mapped_live >= 80 * _MIB, default_mapped_live
    assert default_freed < 40 * _MIB, default_freed
    # Kept: they come from the heap, which stops growing after the first pass (later passes reuse
    # its pages) and still holds both once they are freed.
    assert mapped_live < 40 * _MIB, mapped_live
    assert arena_late == arena_early, (arena_early, arena_late)
    assert freed >= 80 * _MIB, freed


def test_a_bad_size_is_refused_by_name():
    with pytest.raises(RuntimeConfigError, match="heap_keep_mb=-5"):
        heap.keep_freed_memory(-5)
