"""The soak: minutes of mixed valid and hostile traffic from concurrent clients against one server.

``constrained-spec soak --minutes 10 --clients 16`` starts ``constrained-spec serve`` in a child
process (or uses ``--server URL``, then memory is read only with ``--pid``), and each client
sends, until the time or the request budget is spent, a valid request (``hostile.VALID``) or a
hostile one (``hostile.HOSTILE``), drawn from its own seeded generator. Every answer goes
through ``hostile.check_answer``. Reported: requests by kind and status, problems (must be 0:
no 5xx, no reset, every valid answer valid), the server's resident memory after the warm-up
and at the end (flat: within 10%), and whether it is healthy afterwards.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .hostile import HOSTILE, VALID, check_answer, healthy, send
from .serve import server_process


def resident_mib(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: dict[str, int] = field(default_factory=lambda: {"valid": 0, "hostile": 0})
    statuses: dict[str, int] = field(default_factory=dict)
    valid_ok: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, kind: str, name: str, status: int, problem: str | None) -> None:
        with self.lock:
            self.sent[kind] += 1
            key = f"{status // 100}xx" if status else "no answer"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if problem is None and kind == "valid" and 200 <= status < 300:
                self.valid_ok += 1
            if problem is not None or (kind == "hostile" and not 400 <= status < 500) or \
                    (kind == "valid" and status != 200):
                self.problems.append(f"{kind} {name!r}: {problem or f'status {status}'}")


#: Seconds between samples of the server's memory (and progress lines).
SAMPLE_SECONDS = 5.0


def run_soak(*, minutes: float = 10.0, clients: int = 16, url: str | None = None, pid: int | None = None,
             hostile_share: float = 0.5, max_requests: int = 100_000, warmup_minutes: float = 1.0,
             max_batch: int = 16, seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Soak a server (``url``, or one started here) for ``minutes`` with ``clients`` threads;
    returns the report (see the module docstring)."""
    tally = _Tally()
    memory: list[tuple[float, float]] = []
    with (_started(max_batch, 4 * clients) if url is None else _given(url, pid)) as (base, proc_pid):
        start = time.monotonic()
        deadline = start + 60 * minutes
        warm_at = start + 60 * min(warmup_minutes, minutes / 2)
        budget = [max_requests]
        stop = threading.Event()
        start_rss = resident_mib(proc_pid) if proc_pid else None
        sampler = threading.Thread(target=_sample, args=(stop, start, proc_pid, memory, tally, progress), daemon=True)
        sampler.start()
        threads = [threading.Thread(target=_client, args=(base, tally, budget, deadline, random.Random(seed * 1000 + i),
                                                          hostile_share))
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        seconds = time.monotonic() - start
        end_rss = resident_mib(proc_pid) if proc_pid else None
        ok = healthy(base)
    return _soak_report(tally, [m for t, m in memory if t >= warm_at - start], seconds=seconds, clients=clients,
                        start_rss=start_rss, end_rss=end_rss, healthy_after=ok)


def _client(base: str, tally: _Tally, budget: list[int], deadline: float, rng: random.Random,
            hostile_share: float) -> None:
    """One client: hostile or valid requests drawn by ``rng`` until the deadline or the budget ends."""
    names = sorted(HOSTILE)
    while time.monotonic() < deadline:
        with tally.lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        if rng.random() < hostile_share:
            name = rng.choice(names)
            request: Any = HOSTILE[name]
            kind = "hostile"
        else:
            j = rng.randrange(len(VALID))
            name, request, kind = f"valid[{j}]", VALID[j], "valid"
        answer = send(base, request, timeout=300)
        tally.add(kind, name, answer.status, check_answer(request, answer))


def _sample(stop: threading.Event, start: float, proc_pid: int | None, memory: list[tuple[float, float]],
            tally: _Tally, progress: Callable[[str], None] | None) -> None:
    """Every ``SAMPLE_SECONDS`` until ``stop``: the server's resident memory into ``memory``, and progress."""
    while not stop.wait(SAMPLE_SECONDS):
        rss = resident_mib(proc_pid) if proc_pid else None
        if rss is not None:
            memory.append((time.monotonic() - start, rss))
        if progress:
            with tally.lock:
                done = sum(tally.sent.values())
                bad = len(tally.problems)
            progress(f"{time.monotonic() - start:5.0f} s: {done} requests, {bad} problems"
                     + (f", server {rss:.0f} MiB" if rss is not None else ""))


def _soak_report(tally: _Tally, warm: list[float], *, seconds: float, clients: int, start_rss: float | None,
                 end_rss: float | None, healthy_after: bool) -> dict[str, Any]:
    """The report, from the counts and the memory samples taken after the warm-up (``warm``)."""
    warm_rss = warm[0] if warm else None
    peak_after = max(warm) if warm else None
    growth = (end_rss / warm_rss - 1) if end_rss and warm_rss else None
    return {
        "minutes": round(seconds / 60, 2), "clients": clients, "requests": dict(tally.sent),
        "statuses": dict(sorted(tally.statuses.items())),
        "valid_answers_valid": f"{tally.valid_ok}/{tally.sent['valid']}",
        "problems": len(tally.problems), "first_problems": tally.problems[:10],
        "server_errors": tally.statuses.get("5xx", 0), "no_answer": tally.statuses.get("no answer", 0),
        "rss_start_mib": _r(start_rss), "rss_after_warmup_mib": _r(warm_rss), "rss_peak_after_warmup_mib": _r(peak_after),
        "rss_end_mib": _r(end_rss), "rss_growth_after_warmup": None if growth is None else round(growth, 4),
        "healthy_after": healthy_after,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


@contextmanager
def _given(url: str, pid: int | None) -> Iterator[tuple[str, int | None]]:
    yield url.rstrip("/"), pid


@contextmanager
def _started(max_batch: int, max_queue: int) -> Iterator[tuple[str, int]]:
    with server_process(max_batch, max_queue) as (url, proc):
        yield url, proc.pid
