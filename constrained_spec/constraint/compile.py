"""``compile_constraint``: the one front door from a schema or pattern to a cached ``CompiledConstraint``.

Every schema and pattern is first measured against ``ConstraintLimits`` (``constraint.limits``:
depth, size, repetition counts), so what would cost seconds and gigabytes is refused before any
backend sees it. One cache bounded by bytes (``set_cache_bytes``, default 256 MiB, or
``$CONSTRAINED_SPEC_CONSTRAINT_CACHE_MB``) for every backend and every caller, keyed by (backend,
vocabulary fingerprint, kind, the normalized schema or pattern, layout, lenient); the server's
request-level entries (``compile_checked``: the constraint and the check of its output, keyed by
the request's own schema or pattern) live in the same cache under the same bound.

A compile that must finish within ``timeout_s``:
llguidance bounds its own work (grammar size, lexer states, lexer fuel: ``PARSER_LIMITS`` and
its defaults; the pathological schemas and patterns we tried compile in milliseconds once the
tokenizer's tables are built), so it compiles once, in process, in a thread the caller stops waiting for at the deadline;
outlines-core has no such limits (its DFA construction can explode), so it is checked first in
a spawned worker process that is killed on time-out, and nothing is left running.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import regex

from .. import config
from ..errors import InvalidOptionError, InvalidRegexError
from .base import CompiledConstraint
from .cache import ByteBoundedLRU
from .layout import DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS, whitespace_regex
from .limits import DEFAULT_LIMITS, ConstraintLimits, check_regex_limits, check_schema_limits
from .llguidance import check_json_guidance, check_regex_guidance, compile_json_guidance, compile_regex_guidance
from .outlines_core import compile_outlines
from .outlines_core_schema import schema_to_regex
from .schema import JsonSchema, close_objects, load_schema
from .validator import compiled_pattern
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


@dataclass(frozen=True)
class CheckedConstraint:
    """A compiled constraint and the check of its output after decoding (``compile_checked``).

    Attributes:
        compiled: the constraint to decode with.
        schema: the schema outputs are validated against (JSON only; closed when asked).
        checker: the pattern outputs must fully match (regex only; None when the pattern is in
            the backend's syntax only, or no check was asked for).
        schema_bytes: the schema's JSON text size, counted twice (its dict and the validator
            built from it).
    """

    compiled: CompiledConstraint
    schema: JsonSchema | None
    checker: regex.Pattern[str] | None
    schema_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """About what this entry holds (read on every insertion into the cache: no walk here). The
        compiled constraint may also be cached alone; counting it twice keeps the bound safe."""
        return self.compiled.nbytes + self.schema_bytes


#: The one cache of compiled constraints, for every backend and every caller (the server included).
_CACHE: ByteBoundedLRU[CompiledConstraint | CheckedConstraint] = ByteBoundedLRU(
    _cache_bytes_from_env(), lambda entry: entry.nbytes)


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
    limits = _checked_options(kind, whitespace, limits)
    source, key_text = _load_source(spec, kind, whitespace, limits)
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


def check_constraint(
    spec: Any,
    *,
    kind: Kind = "json",
    backend: Backend = "auto",
    lenient: bool = False,
    whitespace: str = DEFAULT_JSON_WHITESPACE,
    limits: ConstraintLimits | None = None,
) -> None:
    """Every refusal ``compile_constraint`` can make without a tokenizer, made now: so a bad
    option, an invalid, over-limit, unsupported or unsatisfiable schema, or a pattern that does
    not parse is answered before a model loads (the model is needed only for its vocabulary).
    What only the vocabulary decides (whether any of its tokens can start an output) stays with
    the compile. Arguments and errors as in ``compile_constraint``."""
    backend = resolve_backend(backend)
    limits = _checked_options(kind, whitespace, limits)
    source, key_text = _load_source(spec, kind, whitespace, limits)
    key = (backend, kind, key_text, whitespace if kind == "json" else "", lenient)
    if _PASSED.get(key) is not None:  # a request loop checks its schema once, not per request
        return
    if kind == "json":
        schema = source.schema if isinstance(source, JsonSchema) else source
        if backend == "llguidance":
            check_json_guidance(schema, whitespace, lenient=lenient)
        else:
            schema_to_regex(schema, whitespace)  # outlines-core's refusals are made here, tokenizer-free
    elif backend == "llguidance":
        check_regex_guidance(source)
    _PASSED.put(key, len(key_text))


#: Schemas and patterns ``check_constraint`` passed, each weighed by its text's length (4 MiB of
#: text kept, the least recent dropped first).
_PASSED: ByteBoundedLRU[int] = ByteBoundedLRU(4 << 20, lambda length: length)


def _checked_options(kind: str, whitespace: Any, limits: Any) -> ConstraintLimits:
    """Refuse a bad ``kind``, ``whitespace`` or ``limits``; the limits to apply."""
    if kind not in ("json", "regex"):
        raise InvalidOptionError(f"Invalid kind: expected 'json' or 'regex', got {kind!r}.")
    if not isinstance(whitespace, str):
        raise InvalidOptionError(f"Invalid whitespace: expected one of {sorted(JSON_LAYOUTS)} or a regex, got {whitespace!r}.")
    limits = limits or DEFAULT_LIMITS
    if not isinstance(limits, ConstraintLimits):
        raise InvalidOptionError(f"Invalid limits: expected a ConstraintLimits, got {type(limits).__name__}.")
    return limits


def _load_source(spec: Any, kind: str, whitespace: str, limits: ConstraintLimits) -> tuple[Any, str]:
    """(what the backend compiles, its text in the cache key): the pattern, or the loaded
    schema, each checked against ``limits``."""
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {spec!r}.")
        check_regex_limits(spec, limits)
        return spec, spec
    ws = whitespace_regex(whitespace)
    if ws:
        check_regex_limits(ws, limits)
    source = load_schema(spec, limits=limits)  # checks the limits of what it loads
    key_text = json.dumps(source.schema, sort_keys=True)
    if isinstance(spec, JsonSchema):  # loaded elsewhere, maybe under other limits
        check_schema_limits(source.schema, limits, text_bytes=len(key_text))
    return source, key_text


def compile_checked(
    spec: Any,
    tokenizer: Any,
    *,
    kind: Kind = "json",
    closed: bool = False,
    check_output: bool = True,
    backend: Backend = "auto",
    lenient: bool = False,
    whitespace: str = DEFAULT_JSON_WHITESPACE,
    limits: ConstraintLimits | None = None,
) -> CheckedConstraint:
    """A request's constraint as a server takes it: compiled, with the check of its output.

    Cached in the one cache under the request's own ``spec`` (a schema as JSON data, or a
    pattern), so a repeated request neither loads its schema again nor compiles it again.

    Args:
        closed: objects that leave ``additionalProperties`` out take their declared keys only
            (``constraint.schema.close_objects``).
        check_output: False where every text passes (a pattern that matches anything): no checker.
        The others as in ``compile_constraint``.

    Raises:
        The errors of ``compile_constraint``.
    """
    backend = resolve_backend(backend)
    vocab = vocabulary_of(tokenizer)
    key = ("checked", backend, vocab.fingerprint, kind, json.dumps(spec, sort_keys=True), closed, check_output,
           lenient, whitespace if kind == "json" else "")
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    schema = load_schema(spec, limits=limits) if kind == "json" else None
    if schema is not None and closed:
        schema = schema._replace(schema=close_objects(schema.schema))
    compiled = compile_constraint(schema if schema is not None else spec, tokenizer, kind=kind, backend=backend,
                                  lenient=lenient, whitespace=whitespace, limits=limits)
    checker = _output_pattern(spec) if kind == "regex" and check_output else None
    schema_bytes = 2 * len(json.dumps(schema.schema)) if schema is not None else 0
    return _CACHE.put(key, CheckedConstraint(compiled, schema, checker, schema_bytes))


def _output_pattern(pattern: str) -> regex.Pattern[str] | None:
    """``pattern`` compiled to check outputs; None for a pattern in the backend's syntax only
    (the matcher alone enforces it)."""
    try:
        return compiled_pattern(pattern)
    except regex.error:
        return None


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
