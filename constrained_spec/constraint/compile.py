"""``compile_constraint``: the one front door from a schema or pattern to a cached ``CompiledConstraint``.

Every schema and pattern is first measured against ``ConstraintLimits`` (``constraint.limits``:
depth, size, repetition counts), so what would cost seconds and gigabytes is refused before any
backend sees it. One cache bounded by bytes (``set_cache_bytes``, default 256 MiB, or
``$CONSTRAINED_SPEC_CONSTRAINT_CACHE_MB``) for every backend, keyed by (backend, vocabulary fingerprint, kind, the
normalized schema or pattern, layout, lenient). A compile that must finish within ``timeout_s``:
llguidance bounds its own work (grammar size, lexer states, lexer fuel: ``PARSER_LIMITS`` and
its defaults; the pathological schemas and patterns we tried compile in milliseconds once the
tokenizer's tables are built), so it compiles once, in process, in a thread the caller stops waiting for at the deadline;
outlines-core has no such limits (its DFA construction can explode), so it is checked first in
a spawned worker process that is killed on time-out, and nothing is left running.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Literal

from .. import config
from ..errors import InvalidOptionError, InvalidRegexError
from .base import CompiledConstraint
from .cache import ByteBoundedLRU
from .layout import DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS, whitespace_regex
from .limits import DEFAULT_LIMITS, ConstraintLimits, check_regex_limits, check_schema_limits
from .llguidance import compile_json_guidance, compile_regex_guidance
from .outlines_core import compile_outlines, schema_to_regex
from .schema import JsonSchema, load_schema
from .vocabulary import vocabulary_of

Backend = Literal["auto", "outlines-core", "llguidance"]
Kind = Literal["json", "regex"]
BACKENDS: tuple[str, ...] = ("auto", "outlines-core", "llguidance")
#: What ``backend="auto"`` means. llguidance: on real-world schemas it compiles far more of them
#: than outlines-core, faster, enforces keywords outlines-core ignores, and accepted every valid
#: instance; decoding speed is the same (docs/constraints.md holds the coverage table).
AUTO_BACKEND = "llguidance"

#: Bytes of compiled constraints kept, least recently used dropped first (a server sees many
#: schemas): ``$CONSTRAINED_SPEC_CONSTRAINT_CACHE_MB`` (``RuntimeConfig``), read once at import.
CACHE_BYTES_ENV = config.variable("constraint_cache_mb")


def _cache_bytes_from_env() -> int:
    return int(config.read("constraint_cache_mb") * (1 << 20))


_CACHE: ByteBoundedLRU[CompiledConstraint] = ByteBoundedLRU(_cache_bytes_from_env(), lambda c: c.nbytes)


def set_cache_bytes(max_bytes: int) -> None:
    """Bound the compiled-constraint cache to ``max_bytes`` (0 keeps only the latest entry)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise InvalidOptionError(f"Invalid cache size: expected an integer number of bytes >= 0, got {max_bytes!r}.")
    _CACHE.resize(max_bytes)


def cache_bytes() -> tuple[int, int]:
    """(bytes held now, the bound) of the compiled-constraint cache."""
    return _CACHE.nbytes, _CACHE.max_bytes


def resolve_backend(backend: str) -> str:
    """The concrete backend name; raises ``InvalidOptionError`` for an unknown one."""
    if backend not in BACKENDS:
        raise InvalidOptionError(f"Invalid backend: expected one of {list(BACKENDS)}, got {backend!r}.")
    return AUTO_BACKEND if backend == "auto" else backend


def compile_constraint(
    spec: Any,
    tokenizer: Any,
    *,
    kind: Kind = "json",
    backend: Backend = "auto",
    lenient: bool = False,
    whitespace: str = DEFAULT_JSON_WHITESPACE,
    timeout_s: float | None = None,
    limits: ConstraintLimits | None = None,
) -> CompiledConstraint:
    """Compile a JSON schema (dict, JSON text, path, pydantic class, or a loaded ``JsonSchema``) or
    a regex over a tokenizer (a Hugging Face tokenizer or a ``TokenVocabulary``).

    Compiled once per (backend, vocabulary, schema or pattern, options) and cached; the result is
    immutable and shared, so get a per-request matcher with ``compiled.matcher()``.

    Args:
        kind: "json" (``spec`` is a schema) or "regex" (``spec`` is a pattern).
        backend: "auto" (llguidance), "llguidance" or "outlines-core".
        lenient: llguidance only: relax keywords it cannot enforce instead of refusing them,
            and name them in ``compiled.warnings``.
        whitespace: the JSON layout, see ``constrained_spec.constraint.layout``.
        timeout_s: raise ``TimeoutError`` if compiling takes longer.
        limits: what the schema or pattern may cost (``ConstraintLimits``; the defaults refuse no
            real-world schema we have), checked before compiling.

    Raises:
        InvalidSchemaError: the schema is invalid or over a limit.
        UnsupportedSchemaFeatureError: a keyword the backend cannot enforce, named with its path.
        InvalidRegexError: the pattern does not compile, matches nothing or is over a limit.
        InvalidOptionError: a bad backend or option.
        TimeoutError: compiling took longer than ``timeout_s``.
    """
    backend = resolve_backend(backend)
    if kind not in ("json", "regex"):
        raise InvalidOptionError(f"Invalid kind: expected 'json' or 'regex', got {kind!r}.")
    if not isinstance(whitespace, str):
        raise InvalidOptionError(f"Invalid whitespace: expected one of {sorted(JSON_LAYOUTS)} or a regex, got {whitespace!r}.")
    limits = limits or DEFAULT_LIMITS
    if not isinstance(limits, ConstraintLimits):
        raise InvalidOptionError(f"Invalid limits: expected a ConstraintLimits, got {type(limits).__name__}.")
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {spec!r}.")
        check_regex_limits(spec, limits)
        source: Any = spec
        key_text = spec
    else:
        ws = whitespace_regex(whitespace)
        if ws:
            check_regex_limits(ws, limits)
        source = load_schema(spec, limits=limits)  # checks the limits of what it loads
        key_text = json.dumps(source.schema, sort_keys=True)
        if isinstance(spec, JsonSchema):  # loaded elsewhere, maybe under other limits
            check_schema_limits(source.schema, limits, text_bytes=len(key_text))
    vocab = vocabulary_of(tokenizer)
    key = (backend, vocab.fingerprint, kind, key_text, whitespace if kind == "json" else "", lenient)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    options = dict(kind=kind, backend=backend, lenient=lenient, whitespace=whitespace)
    if timeout_s is not None and backend == "llguidance":
        compiled = _compile_bounded(source, tokenizer, vocab, timeout_s, options)
    else:
        if timeout_s is not None:
            _check_in_time(source, tokenizer, timeout_s=timeout_s, **options)
        compiled = _compile(source, tokenizer, vocab, **options)
    return _CACHE.put(key, compiled)


def _compile(source: Any, tokenizer: Any, vocab: Any, *, kind: str, backend: str, lenient: bool,
             whitespace: str) -> CompiledConstraint:
    if kind == "regex":
        if backend == "llguidance":
            return compile_regex_guidance(source, tokenizer, vocab)
        return compile_outlines(source, vocab, "regex")
    schema = source.schema if isinstance(source, JsonSchema) else source
    if backend == "llguidance":
        return compile_json_guidance(schema, tokenizer, vocab, whitespace, lenient=lenient)
    return compile_outlines(schema_to_regex(schema, whitespace), vocab, "json")


def clear_cache() -> None:
    """Forget every compiled constraint (the outlines-core disk cache stays)."""
    _CACHE.clear()


def _compile_bounded(source: Any, tokenizer: Any, vocab: Any, timeout_s: float,
                     options: dict[str, Any]) -> CompiledConstraint:
    """Compile in a daemon thread and wait at most ``timeout_s`` (the backend's limits end the
    thread's work soon after; nothing is spawned)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(_try(_compile, source, tokenizer, vocab, **options)),
                              daemon=True, name="constrained-spec-compile")
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise TimeoutError(f"Compiling the constraint took longer than {timeout_s:g} s.")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _try(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # handed to the waiting caller
        return e


def _compile_in_worker(conn: Any, source: Any, tokenizer: Any, options: dict[str, Any]) -> None:
    try:
        _compile(source, tokenizer, vocabulary_of(tokenizer), **options)
        conn.send(None)
    except Exception as e:  # sent back and re-raised in the caller
        conn.send(e)


def _check_in_time(source: Any, tokenizer: Any, *, timeout_s: float, **options: Any) -> None:
    """Compile once in a worker process; kill it and raise ``TimeoutError`` past ``timeout_s``.

    The compiled result stays in the worker; what this proves is that compiling finishes in
    time, so the caller's own compile (in process, then cached) is safe to run. The worker is
    spawned, not forked: a fork could inherit Rust thread pools in a locked state.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_compile_in_worker, args=(child, source, tokenizer, options), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"Compiling the constraint took longer than {timeout_s:g} s; the worker was stopped.")
        err = parent.recv()
        if err is not None:
            raise err
    finally:
        proc.kill()
        proc.join()
        parent.close()
        child.close()
