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
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..api import chat_prefix_length, encode_chat, encode_text, prepare_request, resolve_draft, validate_json_output
from ..constraint import CheckedConstraint, ConstraintLimits, compile_checked, set_cache_bytes
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
    #: Bytes of compiled constraints kept (least recently used dropped first): the bound of the
    #: process's one compiled-constraint cache (``constraint.set_cache_bytes``), set by ``create_app``.
    constraint_cache_bytes: int = 64 << 20
    #: What a request's schema or pattern may cost (``constraint.limits``), checked before compiling.
    limits: ConstraintLimits = field(default_factory=ConstraintLimits)
    #: Bytes the engine's KV cache may hold (None: half the machine's memory); a request
    #: waits for room, and one that could never fit is a 400.
    kv_memory: int | None = None


def create_app(model: Any = None, *, draft: Any = None, options: SpecOptions | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``model`` (a ``ModelHandle``, id or path; None: the embedded default).
    ``draft``: what "auto" drafts with besides the model-free drafters: None or False
    (nothing), True (the model's shipped head), a head directory, or a draft model (same
    tokenizer, checked now).
    ``options``: the defaults of every request (a request's own fields override them).

    Side effect: bounds the process's compiled-constraint cache to ``config.constraint_cache_bytes``."""
    handle: ModelHandle = resolve_model(model)
    base = options or SpecOptions()
    # The draft model or head every request's "auto" drafts with (None: none; True: the shipped head).
    server = _Server(handle, base, resolve_draft(draft, handle, SpecOptions(drafter="hybrid")), config or ServerConfig())
    set_cache_bytes(server.cfg.constraint_cache_bytes)
    app = FastAPI(title="constrained-spec", lifespan=server.lifespan)
    _add_error_handler(app, server.metrics)
    if server.cfg.api_key:
        app.add_middleware(_ApiKeyGuard, key=server.cfg.api_key)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    return app


def _add_error_handler(app: FastAPI, metrics: ServerMetrics) -> None:
    """An ``ApiError`` becomes its JSON error body and status, counted in the metrics."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _add_info_routes(app: FastAPI, server: _Server) -> None:
    """``GET /health``, ``GET /v1/models`` and ``GET /metrics``."""
    handle = server.handle

    @app.get("/health")
    async def health() -> dict[str, Any]:
        worker = server.worker
        return {"status": "ok", "model": handle.name,
                "decoding": len(worker.engine.active) if worker else 0, "waiting": worker.waiting if worker else 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0,
                                            "owned_by": "constrained-spec", "precision": handle.precision,
                                            "description": handle.name}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)


def _add_generation_routes(app: FastAPI, server: _Server) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completion")


class _Server:
    """What the routes share: the model, the request defaults, the config, the metrics and the
    engine's worker (started and stopped by ``lifespan``)."""

    def __init__(self, handle: ModelHandle, base: SpecOptions, draft_source: Any, cfg: ServerConfig) -> None:
        self.handle, self.base, self.draft_source, self.cfg = handle, base, draft_source, cfg
        #: What ``/v1/models`` lists and replies name; a request's ``model`` may also be the
        #: handle's display name or "default".
        self.model_id = model_id(handle)
        self.model_ids = {self.model_id, handle.name, "default"}
        #: The engine's thread; None until the app starts.
        self.worker: EngineWorker | None = None
        self.metrics = ServerMetrics(queue_depth=lambda: self.worker.waiting if self.worker else 0,
                                     decoding=lambda: len(self.worker.engine.active) if self.worker else 0,
                                     kv_bytes=lambda: self.worker.engine.cache.allocated_bytes if self.worker else 0,
                                     prefix_bytes=lambda: (self.worker.engine.prefix_cache.bytes
                                                           if self.worker and self.worker.engine.prefix_cache else 0))

    def make_engine(self) -> BatchEngine:
        handle, cfg, base = self.handle, self.cfg, self.base
        return BatchEngine(handle.model, max_batch=cfg.max_batch, precision=handle.precision, profile=base.profile,
                           prefix_cache=base.prefix_cache, kv_memory=cfg.kv_memory)

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        worker = EngineWorker(self.make_engine, capacity=self.cfg.max_batch + self.cfg.max_queue)
        self.worker = worker
        yield
        await asyncio.to_thread(worker.stop, self.cfg.request_timeout)

    async def compile_for(self, spec: ConstraintSpec) -> CheckedConstraint:
        """The request's constraint from the one cache, compiled within ``compile_timeout`` on a miss."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(_compile, spec, self.handle, self.base, self.cfg.limits),
                                          self.cfg.compile_timeout)
        except asyncio.TimeoutError:
            raise ApiError(400, f"The constraint did not compile within {self.cfg.compile_timeout:g} s.",
                           param=spec.param, code="compile_timeout") from None
        except ConstrainedSpecError as e:
            raise ApiError(400, in_server_terms(str(e), spec), param=spec.param, code="invalid_constraint") from None

    async def start(self, request: Request, parsed: Parsed) -> tuple[Job, CheckedConstraint, int]:
        """Check the request, compile its constraint, encode its prompt and queue it on the engine."""
        handle, cfg = self.handle, self.cfg
        if parsed.model is not None and parsed.model not in self.model_ids:
            raise ApiError(404, f"The model '{parsed.model}' is not served here; this server serves "
                                f"'{self.model_id}' (GET /v1/models; 'default' names it too).", param="model",
                           code="model_not_found")
        entry = await self.compile_for(parsed.constraint)
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
        opts = self.request_options(parsed, max_new_tokens=min(wanted, room))
        task = "json" if parsed.constraint.kind == "json" else "text"
        uses_draft = self.draft_source if opts.drafter_kind in ("model", "head", "hybrid") else None
        try:
            # Conversations opening with the same system turns share their keys (prefix cache).
            shared = chat_prefix_length(handle, parsed.messages, ids) if parsed.messages is not None else None
            parts = prepare_request(handle, uses_draft, entry.compiled, parsed.source_text, opts, task, prompt_ids=ids,
                                    prefix_len=shared)
        except InvalidOptionError as e:  # drafter "model" on a server without a draft model
            raise ApiError(400, str(e), param="speculative.drafter", code="invalid_value") from None
        self.check_kv_room(len(ids), opts.max_new_tokens)
        job = Job(parts, opts, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            raise ApiError(429, "The server is at capacity; retry shortly.", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return job, entry, len(ids)

    def request_options(self, parsed: Parsed, *, max_new_tokens: int) -> SpecOptions:
        """The server's defaults with the request's own fields over them (a bad one is a 400)."""
        try:
            return SpecOptions.build(self.base, temperature=parsed.temperature, seed=parsed.seed,
                                     max_new_tokens=max_new_tokens, lenient=parsed.constraint.lenient,
                                     **parsed.speculative)
        except InvalidOptionError as e:
            raise ApiError(400, str(e), param="speculative", code="invalid_value") from None

    def check_kv_room(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A 400 now for a request that could never join the engine (rather than queue it)."""
        engine = self.worker.engine
        needs = engine.kv_bytes_alone(prompt_tokens, max_new_tokens)
        if needs > engine.kv_memory:
            raise ApiError(400, f"The request needs {needs / 2**20:.0f} MiB of KV cache ({prompt_tokens} prompt tokens and "
                                f"up to {max_new_tokens} new ones), more than this server's --kv-memory of "
                                f"{engine.kv_memory / 2**20:.0f} MiB; lower max_tokens or shorten the prompt.",
                           param="max_tokens", code="kv_memory_exceeded")

    async def generate(self, request: Request, kind: str) -> Response:
        """One completion request, answered whole or streamed."""
        t0 = time.perf_counter()
        parsed = parse_body(await _read_body(request), kind)  # type: ignore[arg-type]
        job, entry, prompt_tokens = await self.start(request, parsed)
        run = _Run(job, entry, parsed, self.handle, prompt_tokens, kind, t0, self.model_id)
        if parsed.stream:
            return self.streamed(run, request.url.path)
        try:
            body = await run.complete(self.cfg.request_timeout, request)
        finally:
            if not run.ended:
                self.worker.cancel(job)
        if body is None:  # the client went away
            self.metrics.requests.labels(request.url.path, "499").inc()
            return Response(status_code=499)
        self.metrics.requests.labels(request.url.path, "200").inc()
        run.record(self.metrics)
        return JSONResponse(body)

    def streamed(self, run: _Run, endpoint: str) -> Response:
        """The run as server-sent events: its chunks, then ``[DONE]`` (or the error's body)."""
        from sse_starlette.sse import EventSourceResponse

        async def events() -> AsyncIterator[str]:
            status = "200"
            try:
                async for chunk in run.stream(self.cfg.request_timeout):
                    yield json.dumps(chunk)
                yield "[DONE]"
            except ApiError as e:
                status = str(e.status)
                yield json.dumps(e.body())
            finally:
                if not run.ended:
                    self.worker.cancel(run.job)
                    status = "499"
                self.metrics.requests.labels(endpoint, status).inc()
                run.record(self.metrics)

        return EventSourceResponse(events(), ping=15)


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


def model_id(handle: ModelHandle) -> str:
    """The model's short, stable id: its display name without the parenthesised precision and
    kernels ("SmolLM2-135M-Instruct (native Q4_1)" -> "SmolLM2-135M-Instruct"), a local folder's
    or file's last component rather than its whole path; "default" when that leaves nothing."""
    base = handle.name.split(" (", 1)[0].strip()
    if os.sep in base and os.path.exists(base):  # a path on this machine: its name, not where it lies
        base = os.path.basename(base.rstrip(os.sep))
    return base or "default"


#: How a request asks for what Python calls ``lenient=True`` (``protocol._constraint`` maps it).
_STRICT_FALSE = '"strict": false'


def in_server_terms(message: str, spec: ConstraintSpec) -> str:
    """A refusal of ``spec``'s constraint said in this server's fields rather than Python's: the
    constraint package names the option ``lenient=True``, which a request asks for with
    ``"strict": false`` in ``response_format.json_schema`` (``structured_outputs.json`` has no
    such switch), and where Python raises ``OutputValidationError`` the server withholds the
    output with a 500 ``output_invalid``."""
    if spec.param == "response_format.json_schema.schema":
        would = f"{_STRICT_FALSE} in response_format.json_schema would compile it"
    else:
        would = f"Sending the schema as response_format.json_schema with {_STRICT_FALSE} would compile it"
    message = message.replace("lenient=True would compile it", would)
    message = message.replace("(an output that breaks it is an OutputValidationError)",
                              "(an output that breaks it is withheld with a 500, code output_invalid)")
    return message.replace("lenient=True", _STRICT_FALSE)


def _compile(spec: ConstraintSpec, handle: ModelHandle, base: SpecOptions, limits: ConstraintLimits) -> CheckedConstraint:
    """A request's constraint (the backend refuses one that matches nothing, the limits one that
    would cost too much) and the final check of its output, from the one compiled-constraint cache."""
    return compile_checked(spec.source, handle.tokenizer, kind=spec.kind, closed=spec.closed,
                           check_output=spec is not FREE_TEXT, backend=base.backend, lenient=spec.lenient,
                           whitespace=base.whitespace, limits=limits)


class _Run:
    """One request's events turned into an OpenAI response (whole, or as stream chunks)."""

    def __init__(self, job: Job, entry: CheckedConstraint, parsed: Parsed, handle: ModelHandle, prompt_tokens: int,
                 kind: str, t0: float, model: str) -> None:
        self.job, self.entry, self.parsed, self.handle = job, entry, parsed, handle
        #: The model's id in replies: what ``/v1/models`` lists (``model_id``).
        self.model = model
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
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _body(self, text: str) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
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
