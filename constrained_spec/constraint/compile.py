"""``compile_constraint``: the one front door from a schema or pattern to a cached ``CompiledConstraint``.

One LRU-bounded cache and one lock for every backend, keyed by (backend, vocabulary fingerprint, kind, the
normalized schema or pattern, layout, lenient). A compile that must finish within ``timeout_s``:
llguidance bounds its own work (grammar size, lexer states, lexer fuel: ``PARSER_LIMITS`` and
its defaults; the pathological schemas and patterns we tried compile in milliseconds once the
tokenizer's tables are built, ~0.4 s for the first compile on a tokenizer), so
it compiles once, in process, in a thread the caller stops waiting for at the deadline;
outlines-core has no such limits (its DFA construction can explode), so it is checked first in
a spawned worker process that is killed on time-out, and nothing is left running.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Literal

from ..errors import InvalidOptionError, InvalidRegexError
from .base import CompiledConstraint
from .layout import DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS
from .llguidance import compile_json_guidance, compile_regex_guidance
from .outlines_core import compile_outlines, schema_to_regex
from .schema import JsonSchema, load_schema
from .vocabulary import vocabulary_of

Backend = Literal["auto", "outlines-core", "llguidance"]
Kind = Literal["json", "regex"]
BACKENDS: tuple[str, ...] = ("auto", "outlines-core", "llguidance")
#: What ``backend="auto"`` means. llguidance: on the whole JSONSchemaBench corpus it compiles 99%
#: of schemas (lenient; outlines-core about half on a sample), in ~5 ms at the median, enforces
#: keywords outlines-core ignores, and accepted every valid instance; decoding speed is the same.
#: See the README's "Constraint backends".
AUTO_BACKEND = "llguidance"

#: Compiled constraints kept, least recently used dropped first (a server sees many schemas).
CACHE_ENTRIES = 256
_CACHE: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
_LOCK = threading.Lock()


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

    Raises:
        InvalidSchemaError, UnsupportedSchemaFeatureError (naming the keyword and its path),
        InvalidRegexError, InvalidOptionError, TimeoutError.
    """
    backend = resolve_backend(backend)
    if kind not in ("json", "regex"):
        raise InvalidOptionError(f"Invalid kind: expected 'json' or 'regex', got {kind!r}.")
    if not isinstance(whitespace, str):
        raise InvalidOptionError(f"Invalid whitespace: expected one of {sorted(JSON_LAYOUTS)} or a regex, got {whitespace!r}.")
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {spec!r}.")
        source: Any = spec
        key_text = spec
    else:
        source = load_schema(spec)
        key_text = json.dumps(source.schema, sort_keys=True)
    vocab = vocabulary_of(tokenizer)
    key = (backend, vocab.fingerprint, kind, key_text, whitespace if kind == "json" else "", lenient)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    options = dict(kind=kind, backend=backend, lenient=lenient, whitespace=whitespace)
    if timeout_s is not None and backend == "llguidance":
        compiled = _compile_bounded(source, tokenizer, vocab, timeout_s, options)
    else:
        if timeout_s is not None:
            _check_in_time(source, tokenizer, timeout_s=timeout_s, **options)
        compiled = _compile(source, tokenizer, vocab, **options)
    with _LOCK:
        compiled = _CACHE.setdefault(key, compiled)
        _CACHE.move_to_end(key)
        while len(_CACHE) > CACHE_ENTRIES:
            _CACHE.popitem(last=False)
        return compiled


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
    with _LOCK:
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
