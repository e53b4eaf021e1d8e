"""serve, fuzz and soak: the OpenAI-compatible server and the traffic that tests it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import InvalidOptionError
from .common import app, DrafterOpt, DraftOpt, DtypeOpt, err, _model_arg, ModelOpt, PrecisionOpt, ProfileOpt, _report, _run_guarded


@app.command("fuzz")
def fuzz_cmd(
    server: Optional[str] = typer.Option(None, "--server", help="A running server's URL (default: start one here)."),
    examples: int = typer.Option(1000, "--examples", help="Random requests to send."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Make the requests reproducible."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CONSTRAINED_SPEC_API_KEY"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Random requests against the server (hypothesis; needs the 'fuzz' extra): every answer must
    be a 2xx with a valid body or a 4xx with an error body, never a 5xx; exits 1 on a problem."""
    def go() -> None:
        from ..bench.hostile import run_fuzz
        from ..bench.serve import given_server, local_server

        if examples < 1:
            raise InvalidOptionError(f"Invalid --examples: expected at least 1, got {examples}.")
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            raise InvalidOptionError("fuzz needs hypothesis: pip install 'constrained_spec[fuzz]'") from None
        with (local_server(4, 16) if server is None else given_server(server)) as url:
            report = run_fuzz(url, examples=examples, seed=seed, api_key=api_key, progress=err.print)
        _report(report, json_out)
        if report["problems"] or not report["healthy_after"]:
            raise typer.Exit(1)

    _run_guarded(go)


@app.command("soak")
def soak_cmd(
    minutes: float = typer.Option(10.0, "--minutes", help="How long to send traffic."),
    clients: int = typer.Option(16, "--clients", help="Concurrent clients."),
    server: Optional[str] = typer.Option(None, "--server", help="A running server's URL (default: start one here)."),
    pid: Optional[int] = typer.Option(None, "--pid", help="With --server: its process id, to read its memory."),
    hostile_share: float = typer.Option(0.5, "--hostile-share", help="Share of hostile requests (0..1)."),
    max_requests: int = typer.Option(100_000, "--max-requests", help="Stop after this many requests."),
    seed: int = typer.Option(0, "--seed"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Mixed valid and hostile traffic for minutes (bench.soak): reports 5xx (must be 0),
    valid answers, and the server's memory after warm-up and at the end; exits 1 on a problem."""
    def go() -> None:
        from ..bench.soak import run_soak

        if minutes <= 0 or clients < 1 or not 0 <= hostile_share <= 1 or max_requests < 1:
            raise InvalidOptionError("Invalid soak options: --minutes > 0, --clients >= 1, --hostile-share in 0..1, "
                                     "--max-requests >= 1.")
        report = run_soak(minutes=minutes, clients=clients, url=server, pid=pid, hostile_share=hostile_share,
                          max_requests=max_requests, seed=seed, progress=err.print)
        _report(report, json_out)
        if report["problems"] or not report["healthy_after"]:
            raise typer.Exit(1)

    _run_guarded(go)



@app.command("serve")
def serve_cmd(
    model: Optional[str] = ModelOpt,
    precision: Optional[str] = PrecisionOpt,
    dtype: Optional[str] = DtypeOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CONSTRAINED_SPEC_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health (or set $CONSTRAINED_SPEC_API_KEY)."),
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded at once (one target forward per step for all)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a slot; beyond it: 429 with Retry-After."),
    request_timeout: float = typer.Option(120.0, "--request-timeout", help="Seconds a request may take in all (504 past it)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="On SIGTERM: seconds to finish the requests in flight."),
    constraint_cache_mb: float = typer.Option(64.0, "--constraint-cache-mb", help="MiB of compiled constraints kept (least recently used dropped)."),
    kv_memory_mb: Optional[float] = typer.Option(None, "--kv-memory", help="MiB the KV cache may hold (default: half the machine's memory); a request waits for room, one that could never fit is a 400."),
    draft: Optional[str] = DraftOpt,
    drafter: str = DrafterOpt,
    profile: Optional[str] = ProfileOpt,
) -> None:
    """An OpenAI-compatible server for constrained generation that fails closed (needs the
    'server' extra: pip install 'constrained_spec\\[server]').

    Example: constrained-spec serve --port 8000, then with the openai client:
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(...)
    """
    def go() -> None:
        try:
            import uvicorn

            from ..serving import ServerConfig, create_app
        except ImportError as e:
            raise InvalidOptionError(f"serve needs the server extra ({e.name} is missing): "
                                     "pip install 'constrained_spec[server]'") from None
        from ..decoding import SpecOptions
        from ..models import resolve_model
        from ..serving.worker import limit_malloc_arenas

        limit_malloc_arenas()  # before any thread: see serving.worker

        for name, value in (("--max-batch", max_batch), ("--max-queue", max_queue), ("--port", port),
                            ("--constraint-cache-mb", constraint_cache_mb), ("--kv-memory", kv_memory_mb or 1)):
            if value < (0 if name in ("--max-queue", "--constraint-cache-mb") else 1):
                raise InvalidOptionError(f"Invalid {name}: {value}.")
        options = SpecOptions(drafter=drafter, profile=profile)  # type: ignore[arg-type]
        handle = resolve_model(_model_arg(model, dtype, precision))
        config = ServerConfig(max_batch=max_batch, max_queue=max_queue, request_timeout=request_timeout,
                              api_key=api_key or None, constraint_cache_bytes=int(constraint_cache_mb * (1 << 20)),
                              kv_memory=int(kv_memory_mb * (1 << 20)) if kv_memory_mb else None)
        err.print(f"serving {handle.name} ({handle.precision}) on http://{host}:{port}/v1"
                  f"{' (API key required)' if api_key else ''}")
        uvicorn.run(create_app(handle, draft=draft, options=options, config=config), host=host, port=port,
                    log_level="warning",
                    timeout_graceful_shutdown=shutdown_timeout)

    _run_guarded(go)
