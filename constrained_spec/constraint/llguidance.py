"""The llguidance backend: a grammar compiled once, a matcher with rollback per request.

llguidance compiles far more real-world schemas than outlines-core, in about a millisecond,
and enforces keywords outlines-core ignores (``minimum``, most formats); in strict mode it
refuses what it cannot enforce, in lenient mode it names what it relaxed.

To give its stateful ``LLMatcher`` the integer-state lookahead of the ``Matcher`` interface,
each request keeps a trie of the token paths it has visited (a state is a trie node); moving the
``LLMatcher`` between nodes is a rollback to the common ancestor plus the tokens down to the
target. Masks, finality and forced text are cached per node, for this request only.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidRegexError, InvalidSchemaError, UnsupportedSchemaFeatureError
from .base import CompiledConstraint, Matcher, State
from .ecma_regex import with_ecma_patterns
from .layout import whitespace_regex
from .schema import iter_subschemas, keyword_path, map_subschemas
from .vocabulary import TokenVocabulary

BACKEND = "llguidance"
#: Masks kept per request (oldest dropped first): one is vocab-size bytes (48 KiB here), and a
#: long generation visits thousands of trie nodes, few of them twice; a step reads the masks of
#: its draft path (at most K_max + 1) and of the state it starts from. 128 (6 MiB) rather than
#: 512: 16 rows of 24 MiB each churned the server's heap (seen in the soak's memory).
MAX_CACHED_MASKS = 128
#: Matcher snapshots kept besides the root's: one at each of the last committed states (the
#: cursor after ``advance``), from which drafts and verifier masks are reached by consuming
#: forward; a state behind them (a rollback of the cursor) is replayed from an older one or the
#: root. A copy is cheap and small, where one per explored trie node grew a long generation's
#: process by hundreds of MiB.
MAX_SNAPSHOTS = 8
#: llguidance's default lexer fuel per mask step (200k) runs out inside long bounded patterns
#: (``^(\\S+\\s+){0,99}\\S+$`` with ``maxLength: 5000``) and then silently disallows valid
#: bytes, narrowing the language. 100 times more keeps such strings; it is a cap, spent only by
#: the rare pattern that needs it.
PARSER_LIMITS = {"step_lexer_fuel": 20_000_000, "initial_lexer_fuel": 50_000_000}


def parser_limits() -> Any:
    """The llguidance parser limits every matcher here is built with."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


class _VocabularyTokens:
    """A ``TokenVocabulary`` as llguidance's ``TokenizerWrapper`` expects a tokenizer: token bytes by
    id (ids without bytes become special placeholders) and a greedy longest-match encoder."""

    bos_token_id = None

    def __init__(self, vocab: TokenVocabulary) -> None:
        self.eos_token_id = vocab.eos_token_id
        self.tokens = [vocab.token_bytes.get(i) or f"<[{i}]>".encode() for i in range(vocab.size)]
        self.special_token_ids = [i for i in range(vocab.size) if i not in vocab.token_bytes or i == vocab.eos_token_id]
        self._by_length = sorted(((b, t) for t, b in vocab.token_bytes.items() if t != vocab.eos_token_id),
                                 key=lambda bt: -len(bt[0]))

    def __call__(self, text: bytes | str) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        out: list[int] = []
        while data:
            match = next(((b, t) for b, t in self._by_length if data.startswith(b)), None)
            if match is None:
                break  # no token has this byte: the rest cannot be tokenized
            out.append(match[1])
            data = data[len(match[0]):]
        return out


#: llguidance tokenizers of hand-built vocabularies, by fingerprint.
_LLTOKENIZERS: dict[Any, Any] = {}
#: llguidance tokenizers of Hugging Face tokenizers, per tokenizer object (``tables.per_object``).
_HF_LLTOKENIZERS: dict[int, tuple[Callable[[], Any], Any]] = {}
#: What llguidance's token table is built by, so part of its stored key.
LLGUIDANCE_LIBRARIES = ("llguidance", "transformers", "tokenizers")


def lltokenizer(tokenizer: Any, vocab: TokenVocabulary) -> Any:
    """The llguidance tokenizer of a Hugging Face tokenizer (memoized per object; its token table
    kept on disk: ``stored_lltokenizer``) or of a hand-built vocabulary (memoized)."""
    import llguidance

    from .tables import per_object

    if tokenizer is not vocab:
        return per_object(_HF_LLTOKENIZERS, tokenizer, lambda: stored_lltokenizer(tokenizer))
    hit = _LLTOKENIZERS.get(vocab.fingerprint)
    if hit is None:
        hit = _LLTOKENIZERS[vocab.fingerprint] = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_VocabularyTokens(vocab)))
    return hit


class _StoredTokens:
    """llguidance's token table of a Hugging Face tokenizer, as ``TokenizerWrapper`` takes it: the
    bytes of every id (special ones as llguidance names them), the special ids and EOS; text is
    tokenized by the tokenizer itself, as ``llguidance.hf`` does (no special tokens added)."""

    bos_token_id = None

    def __init__(self, tokenizer: Any, tokens: list[bytes], special: list[int], eos: int) -> None:
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        # llguidance hands over valid UTF-8 only (it tokenizes a broken tail by itself).
        return self._tokenizer.encode(text.decode("utf-8"), add_special_tokens=False)


def stored_lltokenizer(tokenizer: Any) -> Any:
    """``llguidance.hf.from_tokenizer(tokenizer)``, its token table read from the disk cache
    (``constraint.tables``) when there, else built and stored.

    llguidance's tokenizer cannot be pickled, and ``from_tokenizer`` serializes the whole
    tokenizer, copies and parses it again before deriving its table, seconds on a large
    vocabulary. From the stored table, through ``TokenizerWrapper``, only its token trie and
    mask slices are built, which only llguidance can make (docs/json-output.md has the
    figures). Both give the same tokenizer: the same bytes and special flag for every id, the
    same EOS and the same tokenization (``tests/test_vocabulary_tables.py``).
    """
    import llguidance
    import llguidance.hf

    from .tables import library_versions, memoized_digest, pack_bytes, pack_ints, read_tables, unpack_bytes, \
        unpack_ints, write_tables

    digest = memoized_digest(tokenizer)
    if digest is None:
        return llguidance.hf.from_tokenizer(tokenizer)
    key = f"{digest};{library_versions(*LLGUIDANCE_LIBRARIES)}"
    sections = read_tables("llguidance", key)
    if sections is not None:
        try:
            tokens = unpack_bytes(sections["lengths"], sections["bytes"])
            eos = unpack_ints(sections["eos"])
            stored = _StoredTokens(tokenizer, tokens, unpack_ints(sections["special"]), eos[0])
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(stored), eos_token=eos)
        except (ValueError, KeyError, IndexError):
            pass  # sections that do not fit together: rebuilt below
    built = llguidance.hf.from_tokenizer(tokenizer)
    ids = range(built.vocab_size)
    lengths, blob = pack_bytes([built.decode_bytes([i]) for i in ids])
    write_tables("llguidance", key, {"lengths": lengths, "bytes": blob, "eos": pack_ints(built.eos_tokens),
                                     "special": pack_ints([i for i in ids if built.is_special_token(i)])})
    return built


class GuidanceCompiled(CompiledConstraint):
    """A validated llguidance grammar over one tokenizer; each matcher gets its own ``LLMatcher``."""

    backend = BACKEND

    def __init__(self, grammar: str, lltok: Any, vocab: TokenVocabulary, kind: str, pattern: str,
                 warnings: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(vocab, kind, pattern, warnings)
        self.grammar = grammar
        self.lltokenizer = lltok

    @property
    def nbytes(self) -> int:
        """The grammar text and the key: llguidance keeps nothing else per constraint (each
        matcher builds its own lexer and drops it with the request; the tokenizer is shared)."""
        return len(self.grammar) + super().nbytes

    def matcher(self) -> "GuidanceMatcher":
        """A fresh ``LLMatcher`` and token trie for one request."""
        return GuidanceMatcher(self)


class GuidanceMatcher(Matcher):
    """One request's ``LLMatcher`` behind integer states (nodes of its token trie)."""

    compiled: GuidanceCompiled

    def __init__(self, compiled: GuidanceCompiled) -> None:
        from llguidance import LLMatcher

        super().__init__(compiled)
        self._matcher = LLMatcher(compiled.lltokenizer, compiled.grammar, limits=parser_limits())
        if self._matcher.is_error():
            raise InvalidSchemaError(f"Invalid grammar: llguidance says {self._matcher.get_error()}")
        # The trie: node -> parent, token, depth; (node, token) -> child; the LLMatcher sits at _at.
        self._parent = [-1]
        self._token = [-1]
        self._depth = [0]
        self._child: dict[tuple[int, int], int] = {}
        self._rejected: set[tuple[int, int]] = set()
        self._at = 0
        self._snapshots: dict[int, Any] = {0: self._matcher.deep_copy()}
        self._masks: dict[int, torch.Tensor] = {}
        self._final: dict[int, bool] = {}
        self._done: dict[int, bool] = {}
        self._ff: dict[int, bytes] = {}
        self._memo: dict[str, dict] = {}
        # Masks are written in place into this preallocated bitmask (no bytes object per step).
        self._bits = torch.zeros((compiled.lltokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    @property
    def memo(self) -> dict[str, dict]:
        """This request's: trie nodes mean nothing to another matcher."""
        return self._memo

    def _goto(self, node: int) -> None:
        """Move the ``LLMatcher`` to ``node``: from ``_at`` when ``node`` lies below it, else from
        the snapshot of its nearest ancestor that has one (``advance`` takes one at each
        committed state; the root's is kept), consuming down.

        Never by ``LLMatcher.rollback``: in llguidance 1.9.1 a mask computed inside a nested
        object's key, then rolled back past the object and followed by another token, left the
        matcher in a state a fresh replay of the same tokens does not reach (its masks allowed
        '":' inside an array and refused '",'): greedy speculative output then departed from
        target-only output (``tests/test_backends.py`` replays the case). Consuming forward from
        a copy is what target-only decoding does, and a copy costs microseconds.
        """
        if node == self._at:
            return
        down: list[int] = []
        b = node
        while b != self._at and b not in self._snapshots:
            down.append(self._token[b])
            b = self._parent[b]
        if b != self._at:
            self._matcher = self._snapshots[b].deep_copy()
        if down:
            self._matcher.consume_tokens(down[::-1])
        self._at = node

    def next_state(self, state: State, token: int) -> State | None:
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

    def advance(self, tokens: Sequence[int]) -> State:
        """Commit ``tokens`` (see ``Matcher.advance``) and snapshot the new cursor state: every
        draft and verifier mask of the next step is reached from it by consuming forward."""
        state = super().advance(tokens)
        if state not in self._snapshots:
            self._goto(state)
            if len(self._snapshots) > MAX_SNAPSHOTS:  # the oldest after the root's
                del self._snapshots[next(k for k in self._snapshots if k != 0)]
            self._snapshots[state] = self._matcher.deep_copy()
        return state

    def allowed_mask(self, state: State) -> torch.Tensor:
        """Boolean mask ``[vocab.size]`` of the allowed tokens (cached per node)."""
        mask = self._masks.get(state)
        if mask is None:
            self._goto(state)
            self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
            mask = torch.from_numpy(bits[: self.vocab.size].astype(bool))
            if self.eos_token_id < mask.shape[0] and not self.is_final(state):
                mask[self.eos_token_id] = False  # our invariant: EOS only where the text is complete
            if len(self._masks) >= MAX_CACHED_MASKS:  # nodes behind the output are not revisited
                del self._masks[next(iter(self._masks))]
            self._masks[state] = mask
        return mask

    def is_final(self, state: State) -> bool:
        """Whether the text so far is a complete member of the language."""
        hit = self._final.get(state)
        if hit is None:
            self._goto(state)
            hit = self._final[state] = bool(self._matcher.is_accepting())
        return hit

    def is_done(self, state: State) -> bool:
        """Final with nothing but EOS allowed."""
        hit = self._done.get(state)
        if hit is None:
            if not self.is_final(state):
                hit = False
            else:
                mask = self.allowed_mask(state)
                self._goto(state)
                hit = bool(self._matcher.is_stopped()) or (int(mask.sum()) == 1 and bool(mask[self.eos_token_id]))
            self._done[state] = hit
        return hit

    def forced_bytes(self, state: State, limit: int = 256) -> bytes:
        """The bytes every continuation from ``state`` starts with (llguidance's fast-forward)."""
        hit = self._ff.get(state)
        if hit is None:
            self._goto(state)
            hit = self._ff[state] = bytes(self._matcher.compute_ff_bytes())
        return hit[:limit]


# --------------------------------------------------------------------------------------------
# Compilation
# --------------------------------------------------------------------------------------------

# NOTE: llguidance (1.9.1) reports why it refuses a grammar as text only: its
# ``validate_grammar_with_warnings`` returns ``(is_error, [message])``, with no error type or code.
# So its messages are read here (``_REFUSALS``) and in ``_schema_refusal``, and nowhere else; what
# the rest of the module decides on is the structured error built from them (``relaxable`` on
# ``UnsupportedSchemaFeatureError`` says whether lenient mode relaxes the keyword).
#: llguidance's refusal messages -> the keyword they name (None: the message's first group).
_REFUSALS = (
    (re.compile(r"Unimplemented keys: \[\s*\"?([A-Za-z$]+)"), None),
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"Unknown format"), "format"),
    (re.compile(r"patternPropert"), "patternProperties"),
    (re.compile(r"min/maxProperties"), "minProperties"),
    (re.compile(r"Value for '([A-Za-z]+)' has too many digits"), None),
)


def _refused_keyword(message: str) -> str | None:
    """The schema keyword an llguidance error message is about, when it names one."""
    for pattern, keyword in _REFUSALS:
        m = pattern.search(message)
        if m:
            return keyword or m.group(1)
    return None


def json_options(whitespace: str, lenient: bool) -> dict[str, Any]:
    """llguidance's JSON compile options for a layout (see ``layout``)."""
    ws = whitespace_regex(whitespace)
    if ws is None:  # canonical: json.dumps style
        return {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": lenient}
    if ws == "":
        return {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False, "lenient": lenient}
    return {"item_separator": ",", "key_separator": ":", "whitespace_pattern": ws, "lenient": lenient}


def _validated(grammar: str, lltok: Any, kind: str, pattern: str, *, schema: Any = None,
               relaxed: bool = False) -> list[str]:
    """llguidance's warnings on ``grammar``, or the refusal (naming a refused keyword) as our
    error. ``lltok`` None checks the grammar alone: everything but what the vocabulary decides."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=parser_limits())
    if is_error:
        msg = messages[0] if messages else "unknown error"
        if kind == "regex":
            raise _regex_refusal(msg, pattern)
        raise _schema_refusal(msg, schema, relaxed)
    return messages


def _regex_refusal(msg: str, pattern: str) -> InvalidRegexError:
    """The error for llguidance's refusal ``msg`` of a pattern: its parser's own line (e.g.
    "error: unclosed group") when it could not parse it, else the whole message."""
    parse_error = re.search(r"^error: (.*)$", msg, re.M) if "regex parse error" in msg else None
    if parse_error:
        return InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it does not compile ({parse_error.group(1)}).")
    return InvalidRegexError(f"Invalid regex {pattern[:200]!r}: llguidance says {msg}")


def _compile_grammar(grammar: str, lltok: Any, vocab: TokenVocabulary, kind: str, pattern: str, *,
                     schema: Any = None, relaxed: bool = False) -> GuidanceCompiled:
    """Validate ``grammar`` (naming a refused keyword) and check that some output is possible."""
    messages = _validated(grammar, lltok, kind, pattern, schema=schema, relaxed=relaxed)
    compiled = GuidanceCompiled(grammar, lltok, vocab, kind, pattern, messages)
    probe = compiled.matcher()
    if not probe.is_final(probe.initial_state) and not _can_start(probe):
        if kind == "regex":
            raise InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it matches nothing (no token can start a "
                                    "valid output).")
        raise InvalidSchemaError("Unsatisfiable schema: no token of this vocabulary can start a valid output, so "
                                 "nothing can be generated (lenient=True does not change that).")
    return compiled


def _schema_refusal(msg: str, schema: Any, relaxed: bool) -> InvalidSchemaError:
    """The error for llguidance's refusal ``msg`` of ``schema``: a valid schema's unsupported
    keyword, a schema no value satisfies, or an invalid one; each says what lenient mode does."""
    first = msg.splitlines()[0]
    mode = "lenient" if relaxed else "strict"
    if "Unsatisfiable schema" in msg:
        return InvalidSchemaError(f"Unsatisfiable schema: it is valid, but no value satisfies it (llguidance: {first}), "
                                  "so nothing can be generated (lenient=True does not change that).")
    if _REMOTE.search(msg):
        where = _remote_reference(schema)
        return UnsupportedSchemaFeatureError(
            where[0], where[1], f"It refers to a schema by a remote address, which is never fetched ({first}); put "
            "the referenced schema under $defs and refer to it as '#/$defs/...'.", lenient="lenient=True does not change that.")
    bound = _RANGE.search(msg)
    if bound:
        keyword, path = _bound_at(schema, {float(v) for v in _SOME.findall(bound.group(0))})
        return UnsupportedSchemaFeatureError(
            keyword, path, f"llguidance cannot build the grammar of a number range with this bound ({first}).",
            lenient="lenient=True does not relax it either: write a bound nearer zero, or none, and check it after "
                    "generation.")
    keyword = _refused_keyword(msg)
    if keyword is not None:
        return UnsupportedSchemaFeatureError(keyword, keyword_path(schema, keyword) or "", f"llguidance ({mode} mode): {first}.",
                                             lenient=_LENIENT_WOULD if not relaxed else "lenient=True does not relax it either.",
                                             relaxable=not relaxed)
    return InvalidSchemaError(f"Invalid schema: llguidance says {msg}")


#: What a strict refusal says (``relaxable``) when a lenient compile of the same schema succeeds.
_LENIENT_WOULD = ("lenient=True would compile it and enforce this keyword only after decoding (an output that breaks "
                  "it is an OutputValidationError).")
_REMOTE = re.compile(r"is not present in a registry|does not fetch resources")


def _remote_reference(schema: Any) -> tuple[str, str]:
    """The keyword and path of the first reference to a schema outside this document."""
    for path, node in iter_subschemas(schema):
        for keyword in ("$ref", "$dynamicRef", "$schema"):
            target = node.get(keyword)
            if isinstance(target, str) and not target.startswith("#") and (keyword != "$schema" or not _STANDARD_META.match(target)):
                return keyword, path
    return "$ref", ""


_RANGE = re.compile(r"Failed to generate regex for (?:float|integer) range: .*")
_SOME = re.compile(r"Some\(([-+0-9.eE]+)\)")


def _bound_at(schema: Any, values: set[float]) -> tuple[str, str]:
    """The first bound keyword (and its path) whose value is among ``values``."""
    for path, node in iter_subschemas(schema):
        for keyword in _LOWER_BOUNDS + _UPPER_BOUNDS:
            value = node.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) in values:
                return keyword, path
    return "minimum", ""


_STANDARD_META = re.compile(r"https?://json-schema\.org/")


#: At most this many allowed tokens are tried one by one when checking that an output can start.
_PROBED_TOKENS = 256


def _can_start(probe: GuidanceMatcher) -> bool:
    """Whether some token can start an output. llguidance's mask may allow a token that its
    matcher then refuses to consume (a character whose UTF-8 bytes no token sequence of the
    vocabulary spells, e.g. U+40000 on SmolLM2), so a small mask is tried token by token."""
    allowed = probe.allowed_mask(probe.initial_state).nonzero().flatten().tolist()
    if len(allowed) > _PROBED_TOKENS:
        return True
    return any(probe.next_state(probe.initial_state, t) is not None for t in allowed)


def compile_regex_guidance(pattern: str, tokenizer: Any, vocab: TokenVocabulary) -> GuidanceCompiled:
    """Compile a regex with llguidance."""
    from llguidance import LLMatcher

    return _compile_grammar(LLMatcher.grammar_from_regex(pattern), lltokenizer(tokenizer, vocab), vocab,
                            "regex", pattern)


def check_regex_guidance(pattern: str) -> None:
    """``compile_regex_guidance``'s refusals that need no tokenizer (a pattern llguidance cannot
    parse), answered before any model loads; whether a token can start a match is the compile's."""
    from llguidance import LLMatcher

    _validated(LLMatcher.grammar_from_regex(pattern), None, "regex", pattern)


def compile_json_guidance(schema: dict, tokenizer: Any, vocab: TokenVocabulary, whitespace: str, *,
                          lenient: bool) -> GuidanceCompiled:
    """Compile a schema with llguidance: strictly; with ``lenient``, strictly where it can be and
    otherwise with the unenforceable keywords relaxed and named in ``warnings``."""
    return _strict_then_lenient(lambda relax: _compile_json(schema, tokenizer, vocab, whitespace, relax=relax),
                                lenient)


def check_json_guidance(schema: dict, whitespace: str, *, lenient: bool) -> None:
    """``compile_json_guidance``'s refusals that need no tokenizer (an unsupported keyword, a
    schema no value satisfies, one llguidance cannot read), answered before any model loads;
    whether a token of the vocabulary can start an output is the compile's."""
    def check(relax: bool) -> None:
        grammar, pattern, used, _ = _json_grammar(schema, whitespace, relax)
        _validated(grammar, None, "json", pattern, schema=used, relaxed=relax)

    _strict_then_lenient(check, lenient)


def _strict_then_lenient(attempt: Callable[[bool], Any], lenient: bool) -> Any:
    """``attempt(relax=False)``; on a refused keyword, with ``lenient`` ``attempt(relax=True)``,
    else the strict refusal, which says lenient mode would help only where a relaxed attempt
    succeeds."""
    try:
        return attempt(False)
    except UnsupportedSchemaFeatureError as strict_error:
        if lenient:
            return attempt(True)
        if strict_error.relaxable:
            try:  # the refusal says lenient=True would compile it: only where that is true
                attempt(True)
            except InvalidSchemaError as lenient_error:
                raise lenient_error from None
        raise


def _json_grammar(schema: dict, whitespace: str, relax: bool) -> tuple[str, str, dict, list[str]]:
    """(llguidance grammar, its cache text, the schema it was built from, the paths whose
    property counts were dropped) of ``schema`` in a layout, strict or relaxed."""
    from llguidance import LLMatcher

    options = json_options(whitespace, relax)
    dropped: list[str] = []
    if relax:
        options["coerce_one_of"] = True  # oneOf enforced as anyOf; exclusivity checked on the output
        schema, dropped = _without_unsupported_property_counts(schema)
    # As JSON text: llguidance reads integers past 64 bits from text (as floats; the bounds are
    # widened first so that no valid value is lost), where a dict of Python ints is refused.
    # Patterns as ECMA-262 reads them (llguidance reads Rust's dialect: \\S took U+FEFF).
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(_widened_bounds(with_ecma_patterns(schema))),
                                                 defaults=options)
    pattern = "json:" + json.dumps(schema, sort_keys=True) + json.dumps(options, sort_keys=True)
    return grammar, pattern, schema, dropped


def _compile_json(schema: dict, tokenizer: Any, vocab: TokenVocabulary, whitespace: str, *,
                  relax: bool) -> GuidanceCompiled:
    grammar, pattern, schema, dropped = _json_grammar(schema, whitespace, relax)
    compiled = _compile_grammar(grammar, lltokenizer(tokenizer, vocab), vocab, "json", pattern, schema=schema,
                                relaxed=relax)
    notes = list(compiled.warnings)  # llguidance's own warnings name what it relaxed
    if relax and keyword_path(schema, "oneOf") is not None and not any("oneOf" in w for w in notes):
        notes.append("oneOf enforced as anyOf")
    notes += [f"min/maxProperties not enforced at {path or '/'}" for path in dropped]
    compiled.warnings = tuple(dict.fromkeys(notes))  # still private: not yet in the cache
    return compiled


#: Integers whose float is exact; past them a bound is rounded outward for llguidance.
_EXACT_FLOAT_INT = 2**53
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")


def _widened_bounds(schema: Any) -> Any:
    """``schema`` with numeric bounds past 2**53 as floats rounded outward: llguidance reads
    numbers as 64-bit floats, and rounding to nearest could refuse a valid value next to the
    bound; the output check after decoding enforces the exact bound."""
    import math

    def widen(node: dict, _path: str) -> dict:
        out = dict(node)
        for keyword in _LOWER_BOUNDS + _UPPER_BOUNDS:
            value = node.get(keyword)
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _EXACT_FLOAT_INT:
                near = float(value)
                if keyword in _LOWER_BOUNDS and near > value:
                    near = math.nextafter(near, -math.inf)
                elif keyword in _UPPER_BOUNDS and near < value:
                    near = math.nextafter(near, math.inf)
                out[keyword] = near
        return out

    return map_subschemas(schema, widen)


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
