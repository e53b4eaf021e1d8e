"""Constraint backends behind one interface, and the public ``compile_constraint``.

- outlines-core (``constraint.Constraint``): an ``Index`` with integer states; rollback is
  assignment; one compiled object serves every request.
- llguidance (``GuidanceConstraint``): a matcher that consumes and rolls back tokens. To give
  it the same integer-state interface, each request gets its own trie of the token paths it
  has visited (a state is a trie node); moving the matcher between nodes is a rollback to the
  common ancestor plus the tokens down to the target. Masks, finality and forced text are
  cached per node. llguidance compiles far more real-world schemas, in about a millisecond,
  and enforces keywords outlines-core ignores (``minimum``, most formats); in strict mode it
  refuses what it cannot enforce, in lenient mode it names what it relaxed.

The decoder and the drafters only use: ``initial_state``, ``allowed_mask``, ``next_state``,
``allows``, ``is_final``, ``is_done``, ``walk``, ``forced_bytes``, ``eos_token_id``, ``vocab``,
``memo`` and ``for_request()``.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Literal

import numpy as np
import torch

from .constraint import (
    DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS, Constraint, TokenVocabulary, allowed_bytes, compile_regex, keyword_path,
    load_schema, map_subschemas, schema_to_regex, vocabulary_of,
)
from .errors import InvalidRegexError, InvalidSchemaError, UnsupportedSchemaFeatureError

Backend = Literal["auto", "outlines-core", "llguidance"]
BACKENDS = ("auto", "outlines-core", "llguidance")
#: What ``backend="auto"`` means. llguidance: on a sample of JSONSchemaBench it compiled
#: ~97% of schemas strictly (outlines-core ~63%), in ~3 ms at the median (outlines-core
#: ~140 ms, with 5-10 s timeouts), enforced keywords outlines-core ignores, and accepted every
#: valid instance (outlines-core rejected over a third); decoding speed is the same. See the
#: README's "Constraint backends".
AUTO_BACKEND = "llguidance"
#: Masks kept per request (oldest dropped first): one is vocab-size bytes (48 KiB here), and a
#: long generation visits thousands of trie nodes, few of them twice.
_MAX_CACHED_MASKS = 512


class GuidanceConstraint:
    """An llguidance grammar with the integer-state interface of ``Constraint`` (one per request)."""

    def __init__(self, grammar: str, lltokenizer: Any, vocab: TokenVocabulary, pattern: str,
                 warnings: list[str] | None = None) -> None:
        from llguidance import LLMatcher

        self.grammar = grammar
        self.lltokenizer = lltokenizer
        self.vocab = vocab
        self.pattern = pattern
        self.warnings = list(warnings or [])
        self.eos_token_id = vocab.eos_token_id
        self.initial_state = 0
        self.memo: dict[str, dict] = {}
        self._matcher = LLMatcher(lltokenizer, grammar, limits=parser_limits())
        if self._matcher.is_error():
            raise InvalidSchemaError(f"Invalid grammar: llguidance says {self._matcher.get_error()}")
        # The trie: node -> parent, token, depth; (node, token) -> child; the matcher sits at _at.
        self._parent = [-1]
        self._token = [-1]
        self._depth = [0]
        self._child: dict[tuple[int, int], int] = {}
        self._rejected: set[tuple[int, int]] = set()
        self._at = 0
        self._masks: dict[int, torch.Tensor] = {}
        self._final: dict[int, bool] = {}
        self._done: dict[int, bool] = {}
        self._ff: dict[int, bytes] = {}
        self._bits = torch.zeros((lltokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def for_request(self) -> "GuidanceConstraint":
        """A fresh matcher and trie over the same compiled grammar."""
        return GuidanceConstraint(self.grammar, self.lltokenizer, self.vocab, self.pattern, self.warnings)

    # -- moving the matcher ------------------------------------------------------------------
    def _goto(self, node: int) -> None:
        if node == self._at:
            return
        a, b = self._at, node
        down: list[int] = []
        while self._depth[a] > self._depth[b]:
            a = self._parent[a]
        while self._depth[b] > self._depth[a]:
            down.append(self._token[b])
            b = self._parent[b]
        while a != b:
            a = self._parent[a]
            down.append(self._token[b])
            b = self._parent[b]
        up = self._depth[self._at] - self._depth[a]
        if up:
            self._matcher.rollback(up)
        if down:
            self._matcher.consume_tokens(down[::-1])
        self._at = node

    # -- the interface -------------------------------------------------------------------------
    def next_state(self, state: int, token: int) -> int | None:
        """The node after ``token``, or None when it is not allowed (EOS: None too)."""
        if token == self.eos_token_id:
            return None
        key = (state, token)
        child = self._child.get(key)
        if child is not None:
            return child
        if key in self._rejected:
            return None
        mask = self._masks.get(state)
        if mask is not None and (token >= mask.shape[0] or not bool(mask[token])):
            self._rejected.add(key)
            return None
        self._goto(state)
        if self._matcher.try_consume_tokens([token]) != 1:
            self._rejected.add(key)
            return None
        child = len(self._parent)
        self._parent.append(state)
        self._token.append(token)
        self._depth.append(self._depth[state] + 1)
        self._child[key] = child
        self._at = child
        return child

    def allows(self, state: int, token: int) -> bool:
        """Whether ``token`` is allowed in ``state`` (EOS only in final states)."""
        if token == self.eos_token_id:
            return self.is_final(state)
        return self.next_state(state, token) is not None

    def allowed_mask(self, state: int) -> torch.Tensor:
        """Boolean mask ``[vocab.size]`` of the allowed tokens (cached per node)."""
        mask = self._masks.get(state)
        if mask is None:
            self._goto(state)
            # Written in place into the request's preallocated bitmask (no bytes object per step).
            self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
            mask = torch.from_numpy(bits[: self.vocab.size].astype(bool))
            if self.eos_token_id < mask.shape[0] and not self.is_final(state):
                mask[self.eos_token_id] = False  # our invariant: EOS only where the text is complete
            if len(self._masks) >= _MAX_CACHED_MASKS:  # nodes behind the output are not revisited
                del self._masks[next(iter(self._masks))]
            self._masks[state] = mask
        return mask

    def is_final(self, state: int) -> bool:
        """Whether the text so far is a complete member of the language."""
        hit = self._final.get(state)
        if hit is None:
            self._goto(state)
            hit = self._final[state] = bool(self._matcher.is_accepting())
        return hit

    def is_done(self, state: int) -> bool:
        """Final with nothing but EOS allowed."""
        hit = self._done.get(state)
        if hit is None:
            if not self.is_final(state):
                hit = False
            else:
                self._goto(state)
                mask = self.allowed_mask(state)
                hit = bool(self._matcher.is_stopped()) or (int(mask.sum()) == 1 and bool(mask[self.eos_token_id]))
            self._done[state] = hit
        return hit

    # Only next_state differs between the backends; the walk over it is the same code.
    walk = Constraint.walk

    def allowed_bytes(self, state: int) -> dict[int, int]:
        """Single bytes allowed next from ``state`` and the node after each (cached)."""
        return allowed_bytes(self, state)

    def forced_bytes(self, state: int, limit: int = 256) -> bytes:
        """The bytes every continuation from ``state`` starts with (llguidance's fast-forward)."""
        hit = self._ff.get(state)
        if hit is None:
            self._goto(state)
            hit = self._ff[state] = bytes(self._matcher.compute_ff_bytes())[:limit]
        return hit


# --------------------------------------------------------------------------------------------
# Compilation
# --------------------------------------------------------------------------------------------

_LLTOKENIZERS: dict[int, Any] = {}
#: llguidance's default lexer fuel per mask step (200k) runs out inside long bounded patterns
#: (``^(\\S+\\s+){0,99}\\S+$`` with ``maxLength: 5000``) and then silently disallows valid
#: bytes, narrowing the language. 100 times more keeps such strings (measured: a 100-character
#: answer needs 20M); it is a cap, spent only by the rare pattern that needs it.
PARSER_LIMITS = {"step_lexer_fuel": 20_000_000, "initial_lexer_fuel": 50_000_000}


def parser_limits() -> Any:
    """The llguidance parser limits every matcher here is built with."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)
_GUIDANCE_CACHE: dict[tuple[str, str], GuidanceConstraint] = {}
_LOCK = threading.Lock()


def _lltokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    key = id(tokenizer)
    if key not in _LLTOKENIZERS:
        _LLTOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer)
    return _LLTOKENIZERS[key]


def _guidance_json_options(whitespace: str, lenient: bool) -> dict[str, Any]:
    ws = JSON_LAYOUTS.get(whitespace, whitespace)
    if ws is None:  # canonical: json.dumps style
        return {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": lenient}
    if ws == "":
        return {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False, "lenient": lenient}
    return {"item_separator": ",", "key_separator": ":", "whitespace_pattern": ws, "lenient": lenient}


_REFUSALS = (
    (re.compile(r"Unimplemented keys: \[\s*\"?([A-Za-z$]+)"), None),
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"Unknown format"), "format"),
    (re.compile(r"patternPropert"), "patternProperties"),
    (re.compile(r"min/maxProperties"), "minProperties"),
)


def _refused_keyword(message: str) -> str | None:
    """The schema keyword an llguidance error message is about, when it names one."""
    for pattern, keyword in _REFUSALS:
        m = pattern.search(message)
        if m:
            return keyword or m.group(1)
    return None


def _compile_guidance(grammar: str, tokenizer: Any, vocab: TokenVocabulary, pattern: str, *, kind: str,
                      lenient: bool, schema: Any = None) -> GuidanceConstraint:
    from llguidance import LLMatcher

    key = (vocab.fingerprint, pattern)
    with _LOCK:
        hit = _GUIDANCE_CACHE.get(key)
    if hit is not None:
        return hit
    lltok = _lltokenizer(tokenizer)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=parser_limits())
    if is_error:
        msg = messages[0] if messages else "unknown error"
        keyword = _refused_keyword(msg)
        if keyword is not None and kind == "json":
            raise UnsupportedSchemaFeatureError(keyword, keyword_path(schema, keyword) or "",
                                                f"llguidance (strict mode): {msg.splitlines()[0]}. lenient=True relaxes it.")
        if kind == "regex":
            raise InvalidRegexError(f"Invalid regex {pattern[:200]!r}: llguidance says {msg}")
        raise InvalidSchemaError(f"Invalid schema: llguidance says {msg}")
    constraint = GuidanceConstraint(grammar, lltok, vocab, pattern, messages)
    probe = constraint.for_request()
    if not probe.is_final(probe.initial_state) and not bool(probe.allowed_mask(probe.initial_state).any()):
        what = f"regex {pattern[:200]!r}" if kind == "regex" else "schema"
        error = InvalidRegexError if kind == "regex" else InvalidSchemaError
        raise error(f"Invalid {what}: it matches nothing (no token can start a valid output).")
    with _LOCK:
        _GUIDANCE_CACHE.setdefault(key, constraint)
        return _GUIDANCE_CACHE[key]


def compile_constraint(
    spec: Any,
    tokenizer: Any,
    *,
    kind: Literal["json", "regex"] = "json",
    backend: Backend = "auto",
    lenient: bool = False,
    whitespace: str = DEFAULT_JSON_WHITESPACE,
    timeout_s: float | None = None,
) -> Constraint | GuidanceConstraint:
    """Compile a JSON schema (dict, JSON text, path, pydantic class) or a regex over a tokenizer.

    Compiled once per (vocabulary fingerprint, pattern) and cached. Raises
    ``InvalidSchemaError``, ``UnsupportedSchemaFeatureError`` (naming the keyword),
    ``InvalidRegexError``, or ``TimeoutError`` when compiling takes longer than ``timeout_s``
    (the work then runs in a worker process that is killed, so nothing is left running).
    Call ``for_request()`` on the result to get a per-request cursor.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: expected one of {list(BACKENDS)}, got {backend!r}.")
    if kind not in ("json", "regex"):
        raise ValueError(f"Invalid kind: expected 'json' or 'regex', got {kind!r}.")
    backend = AUTO_BACKEND if backend == "auto" else backend
    if timeout_s is not None:
        _check_in_time(spec, tokenizer, kind=kind, backend=backend, lenient=lenient, whitespace=whitespace,
                       timeout_s=timeout_s)
    vocab = vocabulary_of(tokenizer)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {spec!r}.")
        if backend == "llguidance":
            from llguidance import LLMatcher

            return _compile_guidance(LLMatcher.grammar_from_regex(spec), tokenizer, vocab, spec, kind="regex",
                                     lenient=lenient)
        return compile_regex(spec, vocab)
    schema, _ = load_schema(spec)
    if backend == "llguidance":
        try:
            return _compile_guidance_json(schema, tokenizer, vocab, whitespace, relax=False)
        except UnsupportedSchemaFeatureError:
            if not lenient:
                raise
        # lenient: strict where it can be; otherwise relax, and name what was relaxed
        return _compile_guidance_json(schema, tokenizer, vocab, whitespace, relax=True)
    return compile_regex(schema_to_regex(schema, whitespace), vocab)


def _compile_guidance_json(schema: dict, tokenizer: Any, vocab: TokenVocabulary, whitespace: str, *,
                           relax: bool) -> GuidanceConstraint:
    from llguidance import LLMatcher

    options = _guidance_json_options(whitespace, relax)
    dropped: list[str] = []
    if relax:
        options["coerce_one_of"] = True  # oneOf enforced as anyOf; exclusivity checked on the output
        schema, dropped = _without_unsupported_property_counts(schema)
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
    pattern = "json:" + json.dumps(schema, sort_keys=True) + json.dumps(options, sort_keys=True)
    constraint = _compile_guidance(grammar, tokenizer, vocab, pattern, kind="json", lenient=relax, schema=schema)
    if relax and keyword_path(schema, "oneOf") is not None and not any("oneOf" in w for w in constraint.warnings):
        constraint.warnings.append("oneOf enforced as anyOf")
    for path in dropped:
        note = f"min/maxProperties not enforced at {path or '/'}"
        if note not in constraint.warnings:
            constraint.warnings.append(note)
    return constraint


def _without_unsupported_property_counts(schema: Any) -> tuple[Any, list[str]]:
    """The schema without ``minProperties`` / ``maxProperties`` where some listed property is optional.

    llguidance's lenient mode mis-handles them there (``minProperties: 1`` then demands a property
    outside ``properties``, rejecting valid objects), so they are dropped: the language widens,
    the output is still validated against the original schema, and the paths are reported.
    """
    dropped: list[str] = []

    def drop(node: dict, path: str) -> dict:
        props = node.get("properties")
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if not (isinstance(props, dict) and any(k not in required for k in props)):
            return node
        if "minProperties" in node or "maxProperties" in node:
            dropped.append(path)
        return {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}

    return map_subschemas(schema, drop), dropped



def _compile_in_worker(conn: Any, spec: Any, tokenizer: Any, options: dict[str, Any]) -> None:
    try:
        compile_constraint(spec, tokenizer, **options)
        conn.send(None)
    except Exception as e:  # sent back and re-raised in the caller
        conn.send(e)


def _check_in_time(spec: Any, tokenizer: Any, *, timeout_s: float, **options: Any) -> None:
    """Compile once in a worker process; kill it and raise ``TimeoutError`` past ``timeout_s``.

    The compiled result stays in the worker; what this proves is that compiling finishes in
    time, so the caller's own compile (in process, then cached) is safe to run. The worker is
    spawned, not forked: a fork could inherit Rust thread pools in a locked state.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_compile_in_worker, args=(child, spec, tokenizer, options), daemon=True)
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
