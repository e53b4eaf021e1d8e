"""Threads that share the machine: how many threads torch's ops use, chosen from what the other
processes on our cores are doing.

Each op of a forward is a parallel region over torch's threads, and a region ends when its
slowest thread does. With another process busy on one of two cores, one of our two threads gets
that core in scheduler slices, every region waits for it, and the waiting thread spins: a
request took several times as long as alone, where one thread costs little (a forward of a
small model is bound by memory traffic and small ops more than by arithmetic; the figures are
in docs/performance.md, "Sharing the machine").

So ``ThreadGovernor`` samples, every ``interval`` seconds, the busy time of the cores this process
may run on (``/proc/stat``) less this process's own CPU time, and gives torch the cores the others
leave free (at least one, at most the thread count torch started with). Forwards give the same
bits at any thread count (the int4 kernel computes each output alone, attention parallelizes
over heads, the float64 reductions round to float32; tested), so changing it mid-request changes
speed only. That includes the dense matmul of prompt rows where it runs in blocks
(``models.dense_blocks``: each block on one thread, ``dense_threads()`` blocks), so a prompt pass
sheds threads too. Elsewhere (a float32 prompt matmul, or oneDNN without its packed linear)
oneDNN and MKL split a matmul's reduction by the thread count for some shapes, so a prompt's
keys, and with them the output, would change with the load the governor saw: those matmuls run
at ``dense_threads()``, one count for the life of the process, whatever the governor chose. A
request's output never depends on the machine's load (tested).

``RuntimeConfig.threads`` (``CONSTRAINED_SPEC_THREADS``): "auto" (the default) as above; a number
fixes the thread count (an operator who pins processes to cores); "off" leaves torch's setting
alone. One choice per process: the first load's (``request_threads``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch

from .. import config

#: Seconds between two samples of the machine's load (a sample reads /proc/stat, a few microseconds).
INTERVAL = 0.25
#: A sample older than this many intervals describes the past, not now (the process was idle:
#: between requests, or while a benchmark's reference ran): it is only a new baseline.
STALE_INTERVALS = 4
#: Free cores are rounded up from this fraction: 1.4 free cores (a neighbour busy three fifths
#: of the time) still gives 1 thread, 1.7 gives 2.
ROUND_UP_FROM = 0.65


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def busy_seconds(cpus: set[int], path: str = "/proc/stat") -> float | None:
    """CPU seconds the machine's ``cpus`` have spent busy (user, nice, system, irq, softirq)
    since boot, from ``/proc/stat``; None where it cannot be read."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
            total += user + nice + system + irq + softirq
    return total / tick


def own_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Sets torch's thread count to the cores other processes leave free (module docstring).

    ``busy`` and ``own``: the two clocks (injectable for tests); ``set_threads``: what applies a
    count (``torch.set_num_threads``); ``cpus``: the cores this process may use (its affinity)."""

    def __init__(self, max_threads: int | None = None, *, interval: float = INTERVAL,
                 busy: Callable[[], float | None] | None = None, own: Callable[[], float] = own_seconds,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic, cpus: set[int] | None = None) -> None:
        cpus = cpus if cpus is not None else _cpus()
        self.cores = len(cpus)
        self.max_threads = max(1, max_threads or torch.get_num_threads())
        self.threads = self.max_threads
        self.interval = interval
        self._busy = busy or (lambda: busy_seconds(cpus))
        self._own, self._set, self._clock = own, set_threads, clock
        self._last: tuple[float, float, float] | None = None
        self._lock = threading.Lock()
        #: Other processes' busy cores over the last interval (None before two samples).
        self.others: float | None = None

    def reset(self) -> None:
        """Forget the last sample and go back to ``max_threads``."""
        with self._lock:
            self._last, self.others = None, None
            if self.threads != self.max_threads:
                self._set(self.max_threads)
                self.threads = self.max_threads

    def update(self) -> int:
        """Sample the load when ``interval`` has passed and adjust the thread count; returns it.
        After an idle gap (``STALE_INTERVALS``) the sample is only a new baseline: a neighbour
        busy during the gap (a benchmark's reference row) must not cost the next request its
        threads; one busy now is seen an interval later."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        with self._lock:
            busy = self._busy()
            if busy is None:  # nothing to read: keep the count
                return self.threads
            own = self._own()
            stale = self._last is not None and now - self._last[0] > STALE_INTERVALS * self.interval
            if self._last is not None and now > self._last[0] and not stale:
                t0, busy0, own0 = self._last
                self.others = max(0.0, ((busy - busy0) - (own - own0)) / (now - t0))
                free = self.cores - self.others
                want = max(1, min(self.max_threads, int(free + 1 - ROUND_UP_FROM)))
                if want != self.threads:
                    self._set(want)
                    self.threads = want
            self._last = (now, busy, own)
        return self.threads


class _Fixed:
    """A fixed thread count (``RuntimeConfig.threads=N``), or none at all ("off")."""

    def __init__(self, threads: int | None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = threads or torch.get_num_threads()

    def update(self) -> int:
        return self.threads


_GOVERNOR: ThreadGovernor | _Fixed | None = None
_ASKED: list[str | int] = []  # the first load's RuntimeConfig.threads, until the governor is made


def request_threads(threads: str | int) -> None:
    """Ask for the governor of ``RuntimeConfig.threads`` ``threads`` ("auto", "off" or a count);
    a no-op once one was asked for or made. ``load_model`` asks; ``thread_governor`` makes it."""
    config.RuntimeConfig(threads=threads)  # checked as every setting is (RuntimeConfigError)
    if _GOVERNOR is None and not _ASKED:
        _ASKED.append(threads)


def thread_governor() -> ThreadGovernor | _Fixed:
    """The process's governor, made on first use from what the first load asked for
    (``request_threads``) or, before any load, from the environment (``config.read``)."""
    global _GOVERNOR
    if _GOVERNOR is None:
        value = _ASKED.pop() if _ASKED else config.read("threads")
        _GOVERNOR = ThreadGovernor() if value == "auto" else _Fixed(None if value == "off" else value)
    return _GOVERNOR


def dense_threads() -> int:
    """The governor's most threads (the count torch started with, or the fixed one), never the
    load-dependent current count: the blocks of a dense prompt matmul, or the count one that is
    not in blocks runs at (module docstring)."""
    governor = thread_governor()
    return governor.max_threads if isinstance(governor, ThreadGovernor) else governor.threads


class at_dense_threads:
    """Run the block at ``dense_threads()`` and restore the count after (a few microseconds)."""

    def __enter__(self) -> None:
        self._saved = torch.get_num_threads()
        want = dense_threads()
        if want != self._saved:
            torch.set_num_threads(want)

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self._saved:
            torch.set_num_threads(self._saved)
