"""The OpenAI-compatible HTTP app: ``create_app(model, ...)`` -> a FastAPI application.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /metrics``. Every generation runs on one ``BatchEngine`` in its own thread
(``serving.worker``): requests decode together, each speculating, and join and leave between steps.

Fail closed: a request is answered 200 only with output that satisfies the constraint it asked
for (or with ``finish_reason: "length"`` and ``constrained_spec.valid: false`` when the token limit
came first). Anything the server cannot enforce is a 400 naming it (``serving.protocol``); an
output that fails the final validation is withheld (500), never sent as valid.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import regex
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..api import chat_prefix_length, encode_chat, encode_text, prepare_request, resolve_draft, validate_json_output
from ..constraint import CompiledConstraint, ConstraintLimits, JsonSchema, compile_constraint, load_schema
from ..constraint.schema import close_objects
from ..constraint.validator import compiled_pattern
from ..constraint.cache import ByteBoundedLRU
from ..batching import BatchEngine
from ..decoding import DecodeStats, SpecOptions
from ..errors import ConstrainedSpecError, DeadEndError, InvalidOptionError, InvalidPromptError, OutputValidationError
from ..models import ModelHandle, resolve_model
from .metrics import ServerMetrics
from .protocol import FREE_TEXT, MAX_BODY_BYTES, ApiError, ConstraintSpec, Parsed, parse_body
from .worker import EngineWorker, Job, QueueFull

#: A body over the limit is still read (and dropped) up to this many bytes, so the client, which
#: sends its whole body before it reads the reply, gets the 413 instead of a reset connection.
MAX_DRAINED_BYTES = 64 << 20


@dataclass
class ServerConfig:
    """How the server runs. ``max_queue``: requests that may wait for a slot beyond the
    ``max_batch`` decoding; more are answered 429. ``request_timeout``: seconds a request may
    take in all. ``compile_timeout``: seconds a constraint may take to compile (after the
    ``limits`` have refused what would be expensive)."""

    max_batch: int = 16
    max_queue: int = 64
    request_timeout: float = 120.0
    compile_timeout: float = 10.0
    max_tokens_default: int = 512
    api_key: str | None = None
    #: Bytes of compiled constraints kept (least recently used dropped first).
    constraint_cache_bytes: int = 64 << 20
    #: What a request's schema or pattern may cost (``constraint.limits``), checked before compiling.
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    #: Bytes the engine's KV cache may hold (None: half the machine's memory); a request
    #: waits for room, and one that could never fit is a 400.
    kv_memory: int | None = None


@dataclass(frozen=True)
class _Compiled:
    compiled: CompiledConstraint
    schema: JsonSchema | None
    checker: regex.Pattern[str] | None
    #: The schema's JSON text size, counted twice (its dict and the validator built from it).
    schema_bytes: int = 0

    def nbytes(self) -> int:
        """About what this entry holds (read on every insertion into the cache: no walk here)."""
        return self.compiled.nbytes + self.schema_bytes


def create_app(model: Any = None, *, draft: Any = None, options: SpecOptions | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``model`` (a ``ModelHandle``, id or path; None: the embedded default).
    ``draft``: what "auto" drafts with besides the model-free drafters: None or False
    (nothing), True (the model's shipped head), a head directory, or a draft model (same
    tokenizer, checked now).
    ``options``: the defaults of every request (a request's own fields override them)."""
    handle: ModelHandle = resolve_model(model)
    base = options or SpecOptions()
    # The draft model or head every request's "auto" drafts with (None: none; True: the shipped head).
    draft_source = resolve_draft(draft, handle, SpecOptions(drafter="hybrid"))
    cfg = config or ServerConfig()
    state: dict[str, Any] = {}

    def make_engine() -> BatchEngine:
        return BatchEngine(handle.model, max_batch=cfg.max_batch, precision=handle.precision, profile=base.profile,
                           prefix_cache=base.prefix_cache, kv_memory=cfg.kv_memory)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker = EngineWorker(make_engine, capacity=cfg.max_batch + cfg.max_queue)
        state["worker"] = worker
        yield
        await asyncio.to_thread(worker.stop, cfg.request_timeout)

    app = FastAPI(title="constrained-spec", lifespan=lifespan)
    metrics = ServerMetrics(queue_depth=lambda: state["worker"].waiting if "worker" in state else 0,
                            decoding=lambda: len(state["worker"].engine.active) if "worker" in state else 0,
                            kv_bytes=lambda: state["worker"].engine.cache.allocated_bytes if "worker" in state else 0,
                            prefix_bytes=lambda: (state["worker"].engine.prefix_cache.bytes
                                                  if "worker" in state and state["worker"].engine.prefix_cache else 0))
    compiled_cache: ByteBoundedLRU[_Compiled] = ByteBoundedLRU(cfg.constraint_cache_bytes, _Compiled.nbytes)
    model_ids = {handle.name, "default"}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    if cfg.api_key:
        app.add_middleware(_ApiKeyGuard, key=cfg.api_key)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        worker = state.get("worker")
        return {"status": "ok", "model": handle.name,
                "decoding": len(worker.engine.active) if worker else 0, "waiting": worker.waiting if worker else 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": handle.name, "object": "model", "created": 0,
                                            "owned_by": "constrained-spec", "precision": handle.precision}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def compile_for(spec: ConstraintSpec) -> _Compiled:
        key = spec.cache_key
        hit = compiled_cache.get(key)
        if hit is not None:
            return hit
        try:
            entry = await asyncio.wait_for(asyncio.to_thread(_compile, spec, handle, base, cfg.limits),
                                           cfg.compile_timeout)
        except asyncio.TimeoutError:
            raise ApiError(400, f"The constraint did not compile within {cfg.compile_timeout:g} s.", param=spec.param,
                           code="compile_timeout") from None
        except ConstrainedSpecError as e:
            raise ApiError(400, str(e), param=spec.param, code="invalid_constraint") from None
        return compiled_cache.put(key, entry)

    async def start(request: Request, parsed: Parsed) -> tuple[Job, _Compiled, int]:
        if parsed.model is not None and parsed.model not in model_ids:
            raise ApiError(404, f"The model '{parsed.model}' is not served here; this server serves "
                                f"'{handle.name}' (GET /v1/models).", param="model", code="model_not_found")
        entry = await compile_for(parsed.constraint)
        try:
            ids = encode_chat(handle, parsed.messages) if parsed.messages is not None else encode_text(handle, parsed.prompt or "")
        except InvalidPromptError as e:
            raise ApiError(400, str(e), param="messages" if parsed.messages is not None else "prompt",
                           code="context_length_exceeded") from None
        room = (handle.context_length or 1 << 30) - len(ids)
        wanted = parsed.max_tokens or cfg.max_tokens_default
        if parsed.max_tokens is not None and parsed.max_tokens > room:
            raise ApiError(400, f"max_tokens {parsed.max_tokens} and the prompt's {len(ids)} tokens do not fit the "
                                f"model's context of {handle.context_length} tokens.", param="max_tokens",
                           code="context_length_exceeded")
        try:
            opts = SpecOptions.build(base, temperature=parsed.temperature, seed=parsed.seed,
                                     max_new_tokens=min(wanted, room), lenient=parsed.constraint.lenient,
                                     **parsed.speculative)
        except InvalidOptionError as e:
            raise ApiError(400, str(e), param="speculative", code="invalid_value") from None
        task = "json" if parsed.constraint.kind == "json" else "text"
        uses_draft = draft_source if opts.drafter_kind in ("model", "head", "hybrid") else None
        try:
            # Conversations opening with the same system turns share their keys (prefix cache).
            shared = chat_prefix_length(handle, parsed.messages, ids) if parsed.messages is not None else None
            parts = prepare_request(handle, uses_draft, entry.compiled, parsed.source_text, opts, task, prompt_ids=ids,
                                    prefix_len=shared)
        except InvalidOptionError as e:  # drafter "model" on a server without a draft model
            raise ApiError(400, str(e), param="speculative.drafter", code="invalid_value") from None
        engine = state["worker"].engine
        needs = engine.kv_bytes_alone(len(ids), opts.max_new_tokens)
        if needs > engine.kv_memory:  # it could never join: say so now rather than queue it
            raise ApiError(400, f"The request needs {needs / 2**20:.0f} MiB of KV cache ({len(ids)} prompt tokens and "
                                f"up to {opts.max_new_tokens} new ones), more than this server's --kv-memory of "
                                f"{engine.kv_memory / 2**20:.0f} MiB; lower max_tokens or shorten the prompt.",
                           param="max_tokens", code="kv_memory_exceeded")
        job = Job(parts, opts, asyncio.get_running_loop())
        try:
            state["worker"].submit(job)
        except QueueFull:
            raise ApiError(429, "The server is at capacity; retry shortly.", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return job, entry, len(ids)

    async def generate(request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        parsed = parse_body(await _read_body(request), kind)  # type: ignore[arg-type]
        job, entry, prompt_tokens = await start(request, parsed)
        run = _Run(job, entry, parsed, handle, prompt_tokens, kind, t0)
        endpoint = request.url.path
        if parsed.stream:
            from sse_starlette.sse import EventSourceResponse

            async def events() -> AsyncIterator[str]:
                status = "200"
                try:
                    async for chunk in run.stream(cfg.request_timeout):
                        yield json.dumps(chunk)
                    yield "[DONE]"
                except ApiError as e:
                    status = str(e.status)
                    yield json.dumps(e.body())
                finally:
                    if not run.ended:
                        state["worker"].cancel(job)
                        status = "499"
                    metrics.requests.labels(endpoint, status).inc()
                    run.record(metrics)

            return EventSourceResponse(events(), ping=15)
        try:
            body = await run.complete(cfg.request_timeout, request)
        finally:
            if not run.ended:
                state["worker"].cancel(job)
        if body is None:  # the client went away
            metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        metrics.requests.labels(endpoint, "200").inc()
        run.record(metrics)
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    return app


async def _read_body(request: Request) -> bytes:
    """The request's body, or a 413 when it is over ``MAX_BODY_BYTES`` (declared or sent). The
    excess is read and dropped up to ``MAX_DRAINED_BYTES`` rather than left unread: a client
    writes its whole body before it reads the reply, and a server that closed on it would reset
    the connection under it, so it would never see the 413."""
    declared = request.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > MAX_BODY_BYTES
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if over or size > MAX_BODY_BYTES:
            over = True
            chunks.clear()
            if size > MAX_DRAINED_BYTES:
                break  # past what is worth reading: the connection closes after the reply
            continue
        chunks.append(chunk)
    if over:
        sent = int(declared) if declared.isdigit() else size
        raise ApiError(413, f"Request body of {sent} bytes is over the limit of {MAX_BODY_BYTES} bytes.",
                       code="body_too_large", headers={"Connection": "close"})
    return b"".join(chunks)


class _ApiKeyGuard:
    """Every route but ``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise). A plain
    ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from the
    handlers, and a request whose client went away must be cancelled."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _compile(spec: ConstraintSpec, handle: ModelHandle, base: SpecOptions, limits: ConstraintLimits) -> _Compiled:
    """Compile a request's constraint (the backend refuses one that matches nothing, the limits
    one that would cost too much) and the final check of its output."""
    schema = load_schema(spec.source, limits=limits) if spec.kind == "json" else None
    if schema is not None and spec.closed:
        schema = schema._replace(schema=close_objects(schema.schema))
    compiled = compile_constraint(schema if schema is not None else spec.source, handle.tokenizer, kind=spec.kind,
                                  backend=base.backend, lenient=spec.lenient, whitespace=base.whitespace,
                                  limits=limits)
    checker = None
    if spec.kind == "regex" and spec is not FREE_TEXT:
        try:
            checker = compiled_pattern(spec.source)
        except regex.error:  # a pattern in the backend's syntax only: the matcher alone enforces it
            checker = None
    return _Compiled(compiled, schema, checker, 2 * len(json.dumps(schema.schema)) if schema is not None else 0)


class _Run:
    """One request's events turned into an OpenAI response (whole, or as stream chunks)."""

    def __init__(self, job: Job, entry: _Compiled, parsed: Parsed, handle: ModelHandle, prompt_tokens: int,
                 kind: str, t0: float) -> None:
        self.job, self.entry, self.parsed, self.handle = job, entry, parsed, handle
        self.prompt_tokens = prompt_tokens
        self.kind = kind
        self.t0 = t0
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.ids: list[int] = []
        self.text = ""
        self.first_token: float | None = None
        self.ended = False
        self.stats: DecodeStats | None = None
        #: Set when the request ends: the reply's finish_reason and whether the text is valid.
        self.finish_reason = "length"
        self.valid = False
        #: Why it ended early: "repetition" or "stop sequence '...'"; None otherwise.
        self.stopped: str | None = None
        #: Text the final decode added after the last streamed delta.
        self.tail = ""

    # -- events ---------------------------------------------------------------------------------
    async def _events(self, timeout: float) -> AsyncIterator[str]:
        """Yield text deltas as tokens arrive; on the end, set ``finish`` fields. Raises ApiError."""
        deadline = self.t0 + timeout
        tok = self.handle.tokenizer
        while True:
            left = deadline - time.perf_counter()
            try:
                kind, payload = await asyncio.wait_for(self.job.events.get(), max(left, 0.001))
            except asyncio.TimeoutError:
                raise ApiError(504, f"The request took longer than the server's timeout of {timeout:g} s.",
                               type="timeout_error", code="timeout") from None
            if kind == "tokens":
                if self.first_token is None:
                    self.first_token = time.perf_counter() - self.t0
                self.ids += payload
                text = tok.decode(self.ids, skip_special_tokens=False)
                if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                    continue
                delta = text[len(self.text):]
                for stop in self.parsed.stop:
                    at = text.find(stop, max(0, len(self.text) - len(stop)))
                    if at >= 0:
                        delta = text[len(self.text):at]
                        self.text = text[:at]
                        self.stopped = f"stop sequence {stop!r}"
                        break
                else:
                    self.text = text
                if delta:
                    yield delta
                if self.stopped is not None:  # the caller cancels the engine's row (not ended)
                    self.finish_reason, self.valid = "stop", True
                    return
                continue
            self.ended = True
            if kind == "error":
                raise self._generation_error(payload)
            self._finish(payload)
            return

    def _generation_error(self, error: BaseException) -> ApiError:
        """A grammar's dead end is the request's constraint (no token of this vocabulary can go
        on), so a 400 naming it; anything else failed on our side."""
        if isinstance(error, DeadEndError):
            return ApiError(400, f"The constraint cannot be completed: {error}", param=self.parsed.constraint.param,
                            code="constraint_dead_end")
        return ApiError(500, f"Generation failed: {error}", type="server_error", code="generation_failed")

    def _finish(self, req: Any) -> None:
        if req is None:  # cancelled before it reached the engine
            raise ApiError(499, "The request was cancelled.", code="cancelled")
        dec = req.decoder
        self.stats = dec.stats
        tok = self.handle.tokenizer
        if req.error is not None:
            raise self._generation_error(req.error)
        full = tok.decode(dec.output, skip_special_tokens=False)
        self.tail = full[len(self.text):]
        self.text = full
        self.stopped = "repetition" if dec.repetition is not None else None
        if dec.repetition is not None or not dec.finished:
            self.finish_reason, self.valid = "length", False
            return
        self.finish_reason, self.valid = "stop", True
        try:
            if self.entry.schema is not None:
                validate_json_output(full, self.entry.schema)
            elif self.entry.checker is not None and not self.entry.checker.fullmatch(full):
                raise OutputValidationError(full, "does not fully match the pattern")
        except OutputValidationError as e:
            raise ApiError(500, f"The output failed the final validation and is withheld: {e}", type="server_error",
                           code="output_invalid") from None

    # -- responses ------------------------------------------------------------------------------
    async def complete(self, timeout: float, request: Request) -> dict[str, Any] | None:
        """The whole response, or None when the client disconnected first."""
        async def drain() -> None:
            async for _ in self._events(timeout):
                pass

        task = asyncio.ensure_future(drain())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return None
        task.result()
        return self._body(self.text)

    async def stream(self, timeout: float) -> AsyncIterator[dict[str, Any]]:
        """OpenAI stream chunks: the role, content deltas, then the finish (and usage if asked)."""
        first = {"role": "assistant", "content": ""} if self.kind == "chat" else None
        if first is not None:
            yield self._chunk(first, None)
        async for delta in self._events(timeout):
            yield self._chunk({"content": delta} if self.kind == "chat" else delta, None)
        last = self._chunk({"content": self.tail} if self.kind == "chat" else self.tail, self.finish_reason)
        last["constrained_spec"] = self._extension()
        yield last
        if self.parsed.include_usage:
            usage = self._chunk({} if self.kind == "chat" else "", None)
            usage["choices"] = []
            usage["usage"] = self._usage()
            yield usage

    def _chunk(self, delta: Any, finish: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.handle.name, "choices": [choice]}

    def _body(self, text: str) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.handle.name, "choices": [choice],
                "usage": self._usage(), "constrained_spec": self._extension()}

    def _usage(self) -> dict[str, int]:
        n = self.stats.output_tokens if self.stats else len(self.ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def _extension(self) -> dict[str, Any]:
        """Our figures, in the documented ``constrained_spec`` field of every response."""
        s = self.stats
        ext: dict[str, Any] = {"valid": self.valid, "constraint": self.parsed.constraint.kind
                               if self.parsed.constraint is not FREE_TEXT else None,
                               "stopped": self.stopped}
        if s is not None:
            kinds = {k: r for k, r in s.per_kind.items() if k != "target" and r["drafted"]}
            ext.update({"drafter": s.drafter, "backend": s.backend, "target_forwards": s.target_forwards,
                        "forwards_per_token": round(s.forwards_per_token, 4),
                        "acceptance_rate": round(s.acceptance_rate, 4),
                        "acceptance_by_kind": {k: round(r["accepted"] / r["drafted"], 4) for k, r in kinds.items()},
                        "k_mean": round(sum(s.ks) / len(s.ks), 2) if s.ks else 0.0,
                        "prefix_cached_tokens": s.prefix_cached_tokens,
                        "relaxed": list(s.relaxed)})
        return ext

    def record(self, metrics: ServerMetrics) -> None:
        """Fold this request into the metrics."""
        if self.stats is not None:
            metrics.add_decode(self.stats)
        tokens = self.stats.output_tokens if self.stats else len(self.ids)
        metrics.add_timing(time.perf_counter() - self.t0, self.first_token, tokens)
