"""The server load test: concurrent clients on the extraction documents, speculation on and off.

``constrained-spec bench serve 1,8,32`` starts ``constrained-spec serve`` in a process of its own
(or uses ``--server URL``), then for each concurrency level runs that many client threads, each
sending streamed chat requests (the ``Person`` schema of the batch sweep, greedy) until the
documents are used up, once with ``speculative.drafter = "none"`` and once with the default, in
the same run. Per level and drafter: requests/s, output tokens/s, time to first token and time
per output token after it (p50 / p99), errors (must be 0) and valid outputs (must be all).
Standard library HTTP only, so the clients cost little next to the server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .batch import DEFAULT_DOCUMENTS, Person, load_documents
from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE, describe_fields


@dataclass
class _Outcome:
    ok: bool = False
    valid: bool = False
    tokens: int = 0
    ttft: float | None = None
    seconds: float = 0.0
    error: str | None = None
    #: The server's ``stopped`` figure (``"repetition"``: the repetition guard ended it).
    stopped: str | None = None


@dataclass
class _Level:
    outcomes: list[_Outcome] = field(default_factory=list)
    seconds: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(max_batch: int, max_queue: int, extra: list[str] | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """``constrained-spec serve`` in a child process on a free port; yields its URL and process."""
    port = _free_port()
    cmd = [sys.executable, "-m", "constrained_spec.cli", "serve", "--port", str(port), "--max-batch", str(max_batch),
           "--max-queue", str(max_queue), *(extra or [])]
    env = {k: v for k, v in os.environ.items() if k != "CONSTRAINED_SPEC_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("the server did not start within 180 s") from None
                time.sleep(0.3)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def local_server(max_batch: int, max_queue: int, extra: list[str] | None = None) -> Iterator[str]:
    """``constrained-spec serve`` in a child process on a free port; yields its URL."""
    with server_process(max_batch, max_queue, extra) as (url, _):
        yield url


def _request(url: str, body: dict[str, Any], api_key: str | None) -> _Outcome:
    out = _Outcome()
    t0 = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    text, finish, tokens = "", None, 0
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                out.stopped = (chunk.get("constrained_spec") or {}).get("stopped") or out.stopped
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                    text += piece
                    finish = choice.get("finish_reason") or finish
    except Exception as e:  # counted, not raised: the load test reports errors
        out.error = f"{type(e).__name__}: {e}"
        out.seconds = time.perf_counter() - t0
        return out
    out.seconds = time.perf_counter() - t0
    out.ok, out.tokens = True, tokens
    try:
        Person.model_validate_json(text)
        out.valid = finish == "stop"
    except ValueError:
        out.valid = False
    return out


def _run_level(url: str, prompts: list[str], clients: int, drafter: str, max_tokens: int,
               api_key: str | None = None) -> _Level:
    level = _Level()
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    schema = Person.model_json_schema()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                _, prompt = todo.pop(0)
            body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                    "speculative": {"drafter": drafter},
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema, "strict": True}}}
            outcome = _request(url, body, api_key)
            with lock:
                level.outcomes.append(outcome)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.seconds = time.perf_counter() - start
    return level


def _q(values: list[float], q: float) -> float | None:
    return round(float(np.quantile(values, q)), 3) if values else None


def _row(clients: int, drafter: str, level: _Level) -> dict[str, Any]:
    done = [o for o in level.outcomes if o.ok]
    tokens = sum(o.tokens for o in done)
    ttft = [o.ttft for o in done if o.ttft is not None]
    per_token = [(o.seconds - o.ttft) / (o.tokens - 1) for o in done if o.ttft is not None and o.tokens > 1]
    return {
        "clients": clients,
        "speculation": "off" if drafter == "none" else "on",
        "requests": len(level.outcomes),
        "seconds": round(level.seconds, 2),
        "requests_per_second": round(len(done) / level.seconds, 2) if level.seconds else None,
        "output_tokens_per_second": round(tokens / level.seconds, 1) if level.seconds else None,
        "ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99),
        "per_token_p50_ms": _q([1000 * x for x in per_token], 0.5),
        "per_token_p99_ms": _q([1000 * x for x in per_token], 0.99),
        "errors": len(level.outcomes) - len(done),
        "valid": f"{sum(o.valid for o in done)}/{len(level.outcomes)}",
        "first_error": next((o.error for o in level.outcomes if o.error), None),
    }


def run_serve_bench(levels: list[int], *, url: str | None = None, documents: Path | str = DEFAULT_DOCUMENTS,
                    limit: int | None = None, max_tokens: int = 128, max_batch: int = 16,
                    api_key: str | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load-test a server (``url``, or one started here with ``max_batch`` rows) at each
    concurrency level, speculation off and on; returns the report (one row per level and drafter)."""
    docs = load_documents(documents, limit)
    fields = describe_fields(Person.model_json_schema())
    prompts = [DEFAULT_PROMPT_TEMPLATE.format(text=d["text"], fields=fields, schema="") for d in docs]
    rows = []
    with (local_server(max_batch, max(levels)) if url is None else given_server(url)) as base:
        _run_level(base, prompts[:2], 2, "auto", max_tokens, api_key)  # warm-up: kernels, compile
        for clients in levels:
            for drafter in ("none", "auto"):
                row = _row(clients, drafter, _run_level(base, prompts, clients, drafter, max_tokens, api_key))
                rows.append(row)
                if progress:
                    progress(f"{clients} clients, speculation {row['speculation']}: "
                             f"{row['output_tokens_per_second']} tok/s, {row['errors']} errors")
    return {"documents": len(docs), "max_tokens": max_tokens, "max_batch": max_batch, "rows": rows}


@contextmanager
def given_server(url: str) -> Iterator[str]:
    """A server already running at ``url``, in the shape of ``local_server``."""
    yield url.rstrip("/")
