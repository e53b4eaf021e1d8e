"""Long documents in the batch engine: the harness of ``constrained-spec bench long-prompt``
(figures in docs/extraction.md, "Long prompts").

Three measurements on the embedded model, each side by side with the behaviour before chunked
prefill where it can still be selected (``prefill_chunk=0``: a prompt fed in one step):

- memory: the process's resident memory before, at its peak during and after one extraction
  request over a long document (sampled every 50 ms), and the engine's KV bytes;
- stalls: that request alone, then again with four short extraction requests arriving one second
  after it, the engine stepping them all (as the server's worker does): each one's seconds from
  its arrival to its end;
- reuse: three different schemas extracted from one long document, one after another, with the
  document first in the prompt: each one's seconds, the second and third reading the document's
  blocks from the prefix cache (against the same three with the cache off).

With ``through_server``, the first two again through ``constrained-spec serve`` (defaults, a
child process): its resident memory idle, at its peak and after; the long request alone, against
the same request in process; then the same request again (its document's blocks now in the
prefix cache, so its row is long at once) with four short ones arriving a second after it.

The document is the package's 64 people documents joined (and repeated) to the asked length:
real sentences, though a repeated list; every output is checked against its schema.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

DATA = Path(__file__).resolve().parent.parent / "data"
#: The reuse measurement's template: the document first, so every schema shares its blocks.
DOCUMENT_FIRST_TEMPLATE = "Document:\n{text}\n\nExtract the following fields from the document and answer with JSON.\n\nFields:\n{fields}"


class Contact(BaseModel):
    """The second schema of the reuse measurement."""

    name: str
    city: str


class Job(BaseModel):
    """The third schema of the reuse measurement."""

    occupation: str
    age: int


def long_document(tokenizer: Any, tokens: int) -> str:
    """The shipped people documents joined, repeated as needed, cut to about ``tokens`` tokens."""
    texts = [json.loads(line)["text"] for line in (DATA / "people.jsonl").read_text().splitlines() if line.strip()]
    parts: list[str] = []
    while len(tokenizer(" ".join(parts))["input_ids"]) < tokens:
        parts.extend(texts)
    ids = tokenizer(" ".join(parts))["input_ids"][:tokens]
    return tokenizer.decode(ids)


def _rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory (Linux; default: this one's)."""
    import os

    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakMemory:
    """The peak resident memory of process ``pid`` (default: this one) while the ``with`` block
    runs (sampled every 50 ms)."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid

    def __enter__(self) -> "_PeakMemory":
        self.peak = _rss_mib(self.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss_mib(self.pid))

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib(self.pid))


@dataclass
class LongPromptRow:
    """One prefill mode's figures."""

    mode: str
    prompt_tokens: int = 0
    rss_idle_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    kv_peak_mib: float = 0.0
    long_alone_s: float = 0.0
    long_with_short_s: float = 0.0
    short_s: list[float] = field(default_factory=list)
    reuse_s: list[float] = field(default_factory=list)
    reuse_first_token_s: list[float] = field(default_factory=list)
    reuse_tokens: list[int] = field(default_factory=list)
    valid: int = 0
    #: Outputs the repetition guard stopped (a clear error to the caller, as ``extract`` raises).
    stopped: int = 0
    outputs: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The row as plain values (for ``--json``)."""
        return {k: (round(v, 2) if isinstance(v, float) else [round(x, 2) for x in v] if isinstance(v, list) else v)
                for k, v in self.__dict__.items()}

    @property
    def growth_mib(self) -> float:
        """Resident memory the long request added at its peak."""
        return self.rss_peak_mib - self.rss_idle_mib


def _submit(engine: Any, handle: Any, schema: type[BaseModel], prompt: str,
            on_tokens: Callable[[list[int]], None] | None = None) -> Any:
    """Queue one extraction request as ``extract`` and the server do (default options, greedy)."""
    from ..api import prepare_request, submit_request
    from ..constraint import compile_constraint
    from ..decoding import SpecOptions

    opts = SpecOptions(max_new_tokens=96)
    parts = prepare_request(handle, None, compile_constraint(schema, handle.tokenizer), prompt, opts, "json")
    req = submit_request(engine, parts, opts, on_tokens=on_tokens)
    req.schema = schema  # type: ignore[attr-defined]
    return req


def _valid(handle: Any, req: Any) -> bool:
    try:
        req.schema.model_validate_json(handle.tokenizer.decode(req.result.tokens))
        return req.error is None
    except ValueError:
        return False


def run_long_prompt_bench(tokens: int = 3900, short: int = 4, arrival: float = 1.0,
                          progress: Callable[[str], None] = lambda _m: None) -> list[LongPromptRow]:
    """The three measurements (module docstring) with chunked prefill and without."""
    from ..batching import BatchEngine
    from ..decoding import PrefixCache
    from ..models.loading import load_model
    from .batch import Person
    from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE, describe_fields

    handle = load_model()
    doc = long_document(handle.tokenizer, tokens)
    shorts = [json.loads(line)["text"] for line in (DATA / "people.jsonl").read_text().splitlines()[:short]]
    long_prompt = DEFAULT_PROMPT_TEMPLATE.format(fields=describe_fields(Person.model_json_schema()), text=doc)
    rows = []
    for mode, chunk in (("chunked prefill (now)", None), ("one-step prefill (before)", 0)):
        row = LongPromptRow(mode)
        row.prompt_tokens = len(handle.tokenizer(long_prompt)["input_ids"])
        engine = BatchEngine(handle.model, max_batch=16, precision=handle.precision, prefix_cache=PrefixCache(),
                             prefill_chunk=chunk)
        progress(f"{mode}: the long request alone")
        alone = _long_alone(engine, handle, row, long_prompt)
        progress(f"{mode}: the long request with {short} short ones arriving {arrival:g} s after it")
        with_short = _long_with_short(engine, handle, row, long_prompt, shorts, arrival)
        progress(f"{mode}: three schemas over one document" + (" (prefix cache on)" if chunk is None else " (cache off)"))
        engine = BatchEngine(handle.model, max_batch=16, precision=handle.precision,
                             prefix_cache=PrefixCache() if chunk is None else False, prefill_chunk=chunk)
        reused = _schemas_over_one_document(engine, handle, row, doc)
        outcomes = [alone, *with_short, *reused]
        row.outputs = len(outcomes)
        row.valid = sum(_valid(handle, r) for r in outcomes)
        row.stopped = sum(r.decoder.repetition is not None for r in outcomes)
        rows.append(row)
    return rows


def _long_alone(engine: Any, handle: Any, row: LongPromptRow, long_prompt: str) -> Any:
    """1. The long request alone on a fresh ``engine``, with memory: the request."""
    from .batch import Person

    row.rss_idle_mib = _rss_mib()
    with _PeakMemory() as peak:
        t0 = time.perf_counter()
        req = _submit(engine, handle, Person, long_prompt)
        while engine.busy:
            engine.step()
            row.kv_peak_mib = max(row.kv_peak_mib, engine.cache.allocated_bytes / 2**20)
        row.long_alone_s = time.perf_counter() - t0
    row.rss_peak_mib, row.rss_after_mib = peak.peak, _rss_mib()
    return req


def _long_with_short(engine: Any, handle: Any, row: LongPromptRow, long_prompt: str, shorts: list[str],
                     arrival: float) -> list[Any]:
    """2. The long request with short ones arriving ``arrival`` seconds after it, on step 1's
    ``engine`` with a cold prefix cache: every request."""
    from ..decoding import PrefixCache
    from .batch import Person
    from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE, describe_fields

    person_fields = describe_fields(Person.model_json_schema())
    engine.prefix_cache = PrefixCache()  # the server's default cache, but cold: nothing from the run alone
    t0 = time.perf_counter()
    long_req = _submit(engine, handle, Person, long_prompt)
    pending = list(shorts)
    ends: dict[Any, float] = {}
    short_reqs: list[Any] = []
    while engine.busy or pending:
        if pending and time.perf_counter() - t0 >= arrival:
            short_reqs = [_submit(engine, handle, Person, DEFAULT_PROMPT_TEMPLATE.format(fields=person_fields, text=t))
                          for t in pending]
            pending = []
        if not engine.busy:
            time.sleep(0.01)
            continue
        for done in engine.step():
            ends[done] = time.perf_counter() - t0
    row.long_with_short_s = ends[long_req]
    row.short_s = [ends[r] - arrival for r in short_reqs]
    return [long_req, *short_reqs]


def _schemas_over_one_document(engine: Any, handle: Any, row: LongPromptRow, doc: str) -> list[Any]:
    """3. Three schemas over one document, the document first, on a fresh ``engine``: every request."""
    from .batch import Person
    from ..pipelines.extract import describe_fields

    reqs = []
    for schema in (Person, Contact, Job):
        prompt = DOCUMENT_FIRST_TEMPLATE.format(fields=describe_fields(schema.model_json_schema()), text=doc)
        first: list[float] = []
        t0 = time.perf_counter()
        req = _submit(engine, handle, schema, prompt,
                      on_tokens=lambda _t, first=first, t0=t0: first or first.append(time.perf_counter() - t0))
        list(engine.run())
        row.reuse_s.append(time.perf_counter() - t0)
        row.reuse_first_token_s.append(first[0] if first else row.reuse_s[-1])
        row.reuse_tokens.append(len(req.result.tokens))
        reqs.append(req)
    return reqs


@dataclass
class ServerRow:
    """The long request through ``constrained-spec serve``."""

    rss_idle_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_after_mib: float = 0.0
    long_alone_s: float = 0.0
    long_cached_with_short_s: float = 0.0
    short_s: list[float] = field(default_factory=list)
    valid: int = 0
    #: Outputs the repetition guard stopped.
    stopped: int = 0
    outputs: int = 0
    errors: list[str] = field(default_factory=list)

    as_dict = LongPromptRow.as_dict

    @property
    def growth_mib(self) -> float:
        """Resident memory the long requests added at their peak."""
        return self.rss_peak_mib - self.rss_idle_mib


def run_long_prompt_server(tokens: int = 3900, short: int = 4, arrival: float = 1.0,
                           progress: Callable[[str], None] = lambda _m: None) -> ServerRow:
    """The long request, alone and with short ones beside it, through a ``serve`` child process."""
    from ..models.loading import load_model
    from .batch import Person
    from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE, describe_fields
    from .serve import _request, server_process

    tokenizer = load_model().tokenizer
    doc = long_document(tokenizer, tokens)
    person_fields = describe_fields(Person.model_json_schema())
    shorts = [json.loads(line)["text"] for line in (DATA / "people.jsonl").read_text().splitlines()[:short]]
    row = ServerRow()

    def body(text: str) -> dict[str, Any]:
        return {"model": "default", "temperature": 0, "max_tokens": 96, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": DEFAULT_PROMPT_TEMPLATE.format(fields=person_fields, text=text)}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}}}

    with server_process(16, 64) as (url, proc):
        # The first request of a fresh server builds its caches: a short one first, as in use.
        _request(url, body(shorts[0]), None)
        time.sleep(1.0)
        row.rss_idle_mib = _rss_mib(proc.pid)
        outcomes = []
        with _PeakMemory(proc.pid) as peak:
            progress("through the server: the long request alone")
            outcomes.append(_request(url, body(doc), None))
            row.long_alone_s = outcomes[-1].seconds
            progress(f"through the server: the long request again (document cached), {short} short ones {arrival:g} s after it")
            results: dict[int, Any] = {}

            def send(i: int, text: str) -> None:
                results[i] = _request(url, body(text), None)

            threads = [threading.Thread(target=send, args=(0, doc))]
            threads[0].start()
            time.sleep(arrival)
            threads += [threading.Thread(target=send, args=(i + 1, t)) for i, t in enumerate(shorts)]
            for t in threads[1:]:
                t.start()
            for t in threads:
                t.join()
            row.long_cached_with_short_s = results[0].seconds
            row.short_s = [results[i + 1].seconds for i in range(len(shorts))]
            outcomes += [results[i] for i in sorted(results)]
        row.rss_peak_mib = peak.peak
        time.sleep(1.0)
        row.rss_after_mib = _rss_mib(proc.pid)
    row.outputs = len(outcomes)
    row.valid = sum(o.valid for o in outcomes)
    row.stopped = sum(o.stopped == "repetition" for o in outcomes)
    row.errors = [o.error for o in outcomes if o.error]
    return row
