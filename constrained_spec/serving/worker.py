"""The engine thread: one ``BatchEngine`` stepping in a thread of its own, fed from the event loop.

The server's handlers run on asyncio; the engine's forwards are blocking torch calls. So the
engine lives in one thread that owns it entirely: handlers put submissions and cancellations in
its inbox, and it sends each request's tokens and its end back to the handler's event loop
(``call_soon_threadsafe``), so a slow or streaming client never holds up a step and nothing but
the engine thread touches the engine.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..api import RequestParts, submit_request
from ..batching import BatchEngine, Request
from ..decoding import SpecOptions
from ..models.heap import libc_function


class QueueFull(Exception):
    """The engine has as many requests as it may hold (decoding plus waiting)."""


@dataclass(eq=False)
class Job:
    """One request on its way through the engine. ``events`` receives ``("tokens", ids)`` per
    step that emitted any and finally ``("done", request)`` or ``("error", exception)``."""

    parts: RequestParts
    options: SpecOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None
    cancelled: bool = False

    def post(self, kind: str, payload: Any) -> None:
        """From the engine thread: hand an event to the handler's loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class EngineWorker:
    """Runs a ``BatchEngine`` (from ``make_engine``) in a daemon thread. ``capacity``: the most
    jobs held at once (rows decoding plus requests waiting for a slot); ``submit`` raises
    ``QueueFull`` beyond it."""

    def __init__(self, make_engine: Callable[[], BatchEngine], *, capacity: int) -> None:
        self._make_engine = make_engine
        self.engine = make_engine()
        self.capacity = capacity
        self._inbox: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self._held = 0
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._thread = threading.Thread(target=self._run, name="constrained-spec-engine", daemon=True)
        self._stopping = False
        self._trim = MemoryTrim()
        self._thread.start()

    @property
    def held(self) -> int:
        """Jobs submitted and not yet ended."""
        return self._held

    @property
    def waiting(self) -> int:
        """Jobs held but not decoding (queue depth)."""
        return max(0, self._held - len(self.engine.active))

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the engine; ``QueueFull`` when ``capacity`` jobs are held."""
        with self._lock:
            if self._held >= self.capacity or self._stopping:
                raise QueueFull
            self._held += 1
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (a client that went away); its slot is freed at the next step."""
        job.cancelled = True
        self._inbox.put(("cancel", job))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the thread end after the ones held, and wait for it."""
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while True:
            busy = self.engine.busy
            if stop and not busy:
                return
            try:
                kind, job = self._inbox.get(block=not busy)
            except queue.Empty:
                kind, job = "", None
            while kind:
                if kind == "submit":
                    self._start(job)  # type: ignore[arg-type]
                elif kind == "cancel" and job is not None and job.request is not None and not job.request.done:
                    self.engine.cancel(job.request)
                elif kind == "stop":
                    stop = True
                try:
                    kind, job = self._inbox.get_nowait()
                except queue.Empty:
                    kind = ""
            if self.engine.busy:
                try:
                    for req in self.engine.step():
                        self._end(self._jobs.pop(req.id), ("done", req))
                        self._trim.maybe()
                except Exception as e:  # a bug in a step: fail every job held rather than hang them
                    for j in list(self._jobs.values()):
                        self._end(j, ("error", e))
                    self._jobs.clear()
                    self.engine = self._make_engine()

    def _start(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, ("done", None))
            return
        try:
            req = submit_request(self.engine, job.parts, job.options, on_tokens=lambda ids: job.post("tokens", ids))
        except Exception as e:
            self._end(job, ("error", e))
            return
        job.request = req
        self._jobs[req.id] = job

    def _end(self, job: Job, event: tuple[str, Any]) -> None:
        with self._lock:
            self._held -= 1
        if job.request is not None:  # also when a broken step ended it: the callback closes over the job
            job.request.on_tokens = None
        job.post(*event)


class MemoryTrim:
    """Hands freed heap memory back to the system now and then (glibc's ``malloc_trim``).

    Each step allocates attention grids, masks and logits of a new shape; glibc keeps the freed
    blocks, fragmented, so the resident size crept up with the traffic (measured: a 10-minute
    soak at 16 clients went from 1,364 MiB after the first minute to 1,819 MiB, while the same
    requests one by one stayed flat). A trim after a request ends, at most every
    ``interval_s``, costs a few milliseconds. A no-op where the C library has no ``malloc_trim``.
    """

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0
        self._trim = libc_function("malloc_trim")

    def maybe(self) -> None:
        """Trim if the last trim is older than ``interval_s``."""
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.interval_s:
            self._last = now
            self._trim(0)


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``) before the server starts its threads:
    by default each thread that allocates gets an arena of its own (up to 8 per core), and the
    server's threads (HTTP, engine, compiles) each kept fragments of their own. Returns whether
    it took effect (False where the C library has no ``mallopt``)."""
    mallopt = libc_function("mallopt")
    return bool(mallopt(-8, arenas)) if mallopt is not None else False  # -8: M_ARENA_MAX

