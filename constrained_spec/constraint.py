"""The one compiled constraint: a token-level automaton over the target tokenizer's vocabulary.

A JSON schema (dict, JSON text or file path), a pydantic model class, or a regex is compiled
once with outlines-core into an ``Index`` whose states are integers, so a cursor is just an
``int`` and rollback is assignment. The draft and the verifier walk the same ``Constraint``.

Compiled indexes are cached in memory and on disk, keyed by a fingerprint of the vocabulary
and the regex; allowed-token masks are cached per state as boolean tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from .errors import InvalidRegexError, InvalidSchemaError, UnsupportedSchemaFeatureError

#: JSON layouts. "canonical" is Python's ``json.dumps`` style, ``{"a": 1, "b": [1, 2]}``: one
#: fixed layout, so the grammar drafter can draft every key, quote, colon and comma, and the
#: one the embedded model writes best (measured: the compact layout made it extract wrong
#: values). "flexible" allows one optional space at each structural point; "compact" none.
#: Any other string is used as the whitespace regex at every structural point.
JSON_LAYOUTS = {"canonical": None, "compact": "", "flexible": r"[ ]?"}
DEFAULT_JSON_WHITESPACE = "canonical"
_WS_MARK = "\ue000"  # a private-use character standing for "whitespace goes here"

# Validation keywords outlines-core ignores (its regex would accept instances that break
# them). Refusing them up front is the honest choice; the output is also re-validated.
_UNENFORCED_KEYWORDS = (
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains",
    "minProperties", "maxProperties", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies",
    "not", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems",
    "$dynamicRef", "$recursiveRef",
)
_SUPPORTED_FORMATS = frozenset({"date-time", "date", "time", "uuid", "email", "uri"})
# Keywords whose value is a sub-schema, a list of them, or a map of them.
_SUBSCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
_SUBSCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAP = ("properties", "$defs", "definitions")


# --------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class TokenVocabulary:
    """The exact bytes of every ordinary token of a tokenizer, and its EOS id.

    Special and added tokens (chat markers and the like) are left out, so the constraint never
    allows them; only ``eos_token_id`` is kept, and only in final states.
    """

    token_bytes: Mapping[int, bytes]
    eos_token_id: int
    #: One past the largest token id; logits may be wider (padding rows), never narrower.
    size: int
    fingerprint: str = field(default="", compare=False)

    @staticmethod
    def build(token_bytes: Mapping[int, bytes], eos_token_id: int, size: int | None = None) -> "TokenVocabulary":
        """A vocabulary from explicit token bytes (tests and custom tokenizers use this)."""
        size = size if size is not None else max([eos_token_id, *token_bytes]) + 1
        h = hashlib.sha256(f"eos={eos_token_id};size={size};".encode())
        for tid in sorted(token_bytes):
            h.update(tid.to_bytes(4, "little") + len(token_bytes[tid]).to_bytes(2, "little") + token_bytes[tid])
        return TokenVocabulary(dict(token_bytes), eos_token_id, size, h.hexdigest()[:32])

    @staticmethod
    def from_tokenizer(tokenizer: Any) -> "TokenVocabulary":
        """Read token bytes from a Hugging Face tokenizer (byte-level BPE, SentencePiece or plain)."""
        eos = tokenizer.eos_token_id
        if eos is None:
            raise InvalidSchemaError(
                "Invalid tokenizer: expected an eos_token_id, got None. Set tokenizer.eos_token first."
            )
        vocab: dict[str, int] = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        byte_decoder = _byte_level_decoder()
        byte_level = any("Ġ" in t for t in vocab) and all(
            all(ch in byte_decoder for ch in t) for t in list(vocab)[:2000] if vocab[t] not in special
        )
        token_bytes: dict[int, bytes] = {}
        for tok, tid in vocab.items():
            if tid in special:
                continue
            if byte_level:
                try:
                    token_bytes[tid] = bytes(byte_decoder[ch] for ch in tok)
                except KeyError:
                    continue
            else:
                m = _SPM_BYTE.match(tok)
                if m:
                    token_bytes[tid] = bytes([int(m.group(1), 16)])
                else:
                    token_bytes[tid] = tok.replace("▁", " ").encode("utf-8")
        token_bytes = {t: b for t, b in token_bytes.items() if b}
        size = max(len(tokenizer), max(vocab.values()) + 1)
        return TokenVocabulary.build(token_bytes, eos, size)

    def to_outlines(self) -> Vocabulary:
        """The outlines-core ``Vocabulary`` (bytes -> ids; EOS given separately)."""
        grouped: dict[bytes, list[int]] = {}
        for tid, b in self.token_bytes.items():
            if tid != self.eos_token_id:
                grouped.setdefault(b, []).append(tid)
        return Vocabulary(self.eos_token_id, grouped)


_VOCAB_CACHE: dict[int, TokenVocabulary] = {}


def vocabulary_of(tokenizer: Any) -> TokenVocabulary:
    """``TokenVocabulary.from_tokenizer``, memoized per tokenizer object."""
    key = id(tokenizer)
    vocab = _VOCAB_CACHE.get(key)
    if vocab is None:
        vocab = _VOCAB_CACHE[key] = TokenVocabulary.from_tokenizer(tokenizer)
    return vocab


# --------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------


def load_schema(schema: Any) -> tuple[dict, type | None]:
    """Normalize a schema given as a dict, JSON text, file path or pydantic class.

    Returns ``(schema_dict, pydantic_class_or_None)``. Raises ``InvalidSchemaError`` when the
    input is not a valid JSON schema.
    """
    model_cls = None
    if isinstance(schema, type):
        try:
            from pydantic import BaseModel
        except ImportError:  # pragma: no cover - pydantic is a dependency
            BaseModel = None  # type: ignore[assignment]
        if BaseModel is None or not issubclass(schema, BaseModel):
            raise InvalidSchemaError(
                f"Invalid schema: expected a pydantic model class, a dict, JSON text or a file path, got class {schema.__name__}."
            )
        model_cls = schema
        schema = schema.model_json_schema()
    elif isinstance(schema, os.PathLike) or (
        isinstance(schema, str) and not schema.lstrip().startswith(("{", "[")) and schema.strip()
    ):
        path = Path(schema)
        if not path.is_file():
            raise InvalidSchemaError(f"Invalid schema: expected JSON text or an existing file, got {str(schema)!r} (no such file).")
        try:
            schema = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"Invalid schema: {path} is not JSON ({e}).") from None
    elif isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"Invalid schema: the JSON text does not parse ({e}).") from None
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise InvalidSchemaError(f"Invalid schema: expected a JSON object, got {type(schema).__name__}.")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise InvalidSchemaError(f"Invalid schema at {where}: {e.message}") from None
    if _REF_OVERRIDES_SIBLINGS.search(str(schema.get("$schema", ""))):
        schema = _without_ref_siblings(schema)
    return schema, model_cls


#: Drafts in which ``$ref`` replaces its object: "all other properties in a $ref object MUST be
#: ignored" (draft-07 8.3). The grammar engines intersect the siblings instead (2019-09 rules),
#: which would forbid values the draft allows (``{"type": "string", "$ref": "#/obj"}``).
_REF_OVERRIDES_SIBLINGS = re.compile(r"draft-0[3-7]\b")
_KEPT_BESIDE_REF = frozenset({"$ref", "definitions", "$defs", "$schema", "$id", "id", "title", "description",
                              "$comment"})


def _without_ref_siblings(schema: Any) -> Any:
    """The schema with the keywords a draft-03..07 ``$ref`` overrides removed (definitions kept)."""

    def drop(node: dict, path: str) -> dict:
        if not isinstance(node.get("$ref"), str):
            return node
        return {k: v for k, v in node.items() if k in _KEPT_BESIDE_REF}

    return map_subschemas(schema, drop)


def map_subschemas(schema: Any, fix: Callable[[dict, str], dict], path: str = "") -> Any:
    """A copy of ``schema`` with ``fix(node, json_pointer)`` applied to every subschema, outside in.

    Data keywords (``enum``, ``const``, ``default``, ``examples``) are left alone, and in maps
    of names to subschemas (``properties``, ``$defs``...) a name is never taken for a keyword.
    """
    if isinstance(schema, list):
        return [map_subschemas(v, fix, f"{path}/{i}") for i, v in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in fix(schema, path).items():
        if key in ("enum", "const", "default", "examples"):
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_subschemas(sub, fix, f"{path}/{key}/{name}") for name, sub in value.items()}
        else:
            out[key] = map_subschemas(value, fix, f"{path}/{key}")
    return out


#: Keywords whose value maps names to subschemas.
SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependencies", "dependentSchemas")


def check_schema_support(schema: Any, path: str = "") -> None:
    """Raise ``UnsupportedSchemaFeatureError`` for the first keyword the backend cannot enforce."""
    if not isinstance(schema, dict):
        return
    for kw in _UNENFORCED_KEYWORDS:
        if kw in schema:
            raise UnsupportedSchemaFeatureError(kw, path)
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _SUPPORTED_FORMATS:
        raise UnsupportedSchemaFeatureError(
            "format", path, f"Format {fmt!r} is not one of {sorted(_SUPPORTED_FORMATS)}."
        )
    if schema.get("additionalProperties") is False and "properties" not in schema:
        raise UnsupportedSchemaFeatureError(
            "additionalProperties", path, "'additionalProperties: false' needs 'properties' beside it."
        )
    for kw in _SUBSCHEMA_ONE:
        if isinstance(schema.get(kw), dict):
            check_schema_support(schema[kw], f"{path}/{kw}")
    for kw in _SUBSCHEMA_LIST:
        if isinstance(schema.get(kw), list):
            for i, sub in enumerate(schema[kw]):
                check_schema_support(sub, f"{path}/{kw}/{i}")
    for kw in _SUBSCHEMA_MAP:
        if isinstance(schema.get(kw), dict):
            for name, sub in schema[kw].items():
                check_schema_support(sub, f"{path}/{kw}/{name}")


def _canonical_layout(regex: str) -> str:
    """Put exactly one space after ':' and ',' and none elsewhere, where outlines-core put a marker.

    Optional properties put the comma inside an optional group, ``("a": 1<m>,)?<m>"b"``: the
    space goes inside the group with its comma, or it would stay behind when the group is skipped.
    A required property before an optional one, ``"a": 1<m>,(<m>"b": 2<m>,)?<m>"c"``, keeps the
    space right after its comma, before the group opens.
    """
    m = re.escape(_WS_MARK)
    regex = regex.replace(f"{_WS_MARK}:{_WS_MARK}", ": ").replace(f"{_WS_MARK},{_WS_MARK}", ", ")
    regex = re.sub(f",((?:\\)[?*]?)*\\(*){m}", r", \1", regex)
    return regex.replace(f",{_WS_MARK}", ", ").replace(_WS_MARK, "")


def keyword_path(schema: Any, keyword: str, path: str = "") -> str | None:
    """JSON pointer of the first sub-schema that uses ``keyword`` (walking like ``check_schema_support``)."""
    if not isinstance(schema, dict):
        return None
    if keyword in schema:
        return path or "/"
    subs: list[tuple[str, Any]] = []
    for kw in _SUBSCHEMA_ONE:
        if isinstance(schema.get(kw), dict):
            subs.append((f"{path}/{kw}", schema[kw]))
    for kw in _SUBSCHEMA_LIST:
        if isinstance(schema.get(kw), list):
            subs += [(f"{path}/{kw}/{i}", sub) for i, sub in enumerate(schema[kw])]
    for kw in _SUBSCHEMA_MAP:
        if isinstance(schema.get(kw), dict):
            subs += [(f"{path}/{kw}/{name}", sub) for name, sub in schema[kw].items()]
    for kw in ("not", "if", "then", "else", "contains", "propertyNames"):
        if isinstance(schema.get(kw), dict):
            subs.append((f"{path}/{kw}", schema[kw]))
    for sub_path, sub in subs:
        found = keyword_path(sub, keyword, sub_path)
        if found is not None:
            return found
    return None


def schema_to_regex(schema: dict, whitespace: str = DEFAULT_JSON_WHITESPACE) -> str:
    """The regex of the JSON texts that the schema allows, in the given layout (see ``JSON_LAYOUTS``)."""
    check_schema_support(schema)
    ws = JSON_LAYOUTS.get(whitespace, whitespace)
    try:
        if ws is None:
            return _canonical_layout(build_regex_from_schema(json.dumps(schema), _WS_MARK))
        return build_regex_from_schema(json.dumps(schema), ws)
    except Exception as e:  # outlines-core raises ValueError with a free-form message
        msg = str(e).split("\n")[0]
        m = re.search(r"Format (\S+) is not supported", msg)
        if m:
            raise UnsupportedSchemaFeatureError("format", "", msg) from None
        raise UnsupportedSchemaFeatureError("(structure)", "", f"outlines-core says: {msg}") from None


# --------------------------------------------------------------------------------------------
# The compiled constraint
# --------------------------------------------------------------------------------------------


class Constraint:
    """A compiled token automaton. States are ints; every method leaves the automaton unchanged.

    One object serves every request and both the drafter and the verifier: each walks its
    own integer state through ``next_state``.
    """

    def __init__(self, index: Index, vocab: TokenVocabulary, pattern: str) -> None:
        self.index = index
        self.vocab = vocab
        self.pattern = pattern
        self.eos_token_id = vocab.eos_token_id
        self.initial_state: int = index.get_initial_state()
        self._final = frozenset(index.get_final_states())
        self._masks: dict[int, torch.Tensor] = {}
        self._done: dict[int, bool] = {}
        #: Per-state caches that drafters keep with the compiled constraint, so they outlive a
        #: request (forced text, learned tokenizations). Keyed by the drafter's own names.
        self.memo: dict[str, dict] = {}

    def allowed_mask(self, state: int) -> torch.Tensor:
        """Boolean mask of shape ``[vocab.size]``: True where the token is allowed (cached per state)."""
        mask = self._masks.get(state)
        if mask is None:
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)
            allowed = self.index.get_allowed_tokens(state)
            if allowed:
                mask[torch.tensor(allowed, dtype=torch.long)] = True
            self._masks[state] = mask
        return mask

    def next_state(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None when the token is not allowed (EOS: None too)."""
        if token == self.eos_token_id:
            return None
        return self.index.get_next_state(state, token)

    def allows(self, state: int, token: int) -> bool:
        """Whether ``token`` is allowed in ``state`` (EOS only in final states)."""
        if token == self.eos_token_id:
            return state in self._final
        return self.index.get_next_state(state, token) is not None

    def is_final(self, state: int) -> bool:
        """Whether the text so far is a complete member of the language."""
        return state in self._final

    def is_done(self, state: int) -> bool:
        """Final with nothing but EOS allowed: generation ends here without another forward."""
        done = self._done.get(state)
        if done is None:
            done = state in self._final and self.index.get_allowed_tokens(state) == [self.eos_token_id]
            self._done[state] = done
        return done

    def walk(self, state: int, tokens: list[int]) -> list[int]:
        """States along ``tokens`` from ``state``: ``[s_0, s_1, ...]``, cut before the first rejected token."""
        states = [state]
        for t in tokens:
            nxt = self.next_state(states[-1], t)
            if nxt is None:
                break
            states.append(nxt)
        return states

    def for_request(self) -> "Constraint":
        """The cursor for one request: states are plain ints here, so the shared object itself."""
        return self

    def allowed_bytes(self, state: int) -> dict[int, int]:
        """Single bytes allowed next from ``state`` and the state after each (cached)."""
        return allowed_bytes(self, state)

    def forced_bytes(self, state: int, limit: int = 256) -> bytes:
        """The bytes every continuation from ``state`` starts with: single-byte steps while
        exactly one byte is allowed and the state is not final."""
        out = bytearray()
        while len(out) < limit and not self.is_final(state):
            options = self.allowed_bytes(state)
            if len(options) != 1:
                break
            byte, state = next(iter(options.items()))
            out.append(byte)
        return bytes(out)


def allowed_bytes(constraint: Any, state: int) -> dict[int, int]:
    """Single bytes allowed from ``state`` -> the state after each, read off the allowed mask
    at the single-byte tokens (byte-level vocabularies have one per byte). Cached in ``memo``."""
    cache = constraint.memo.setdefault("allowed_bytes", {})
    hit = cache.get(state)
    if hit is None:
        if "byte_tokens" not in constraint.memo:
            table: dict[int, int] = {}
            for tid, b in constraint.vocab.token_bytes.items():
                if len(b) == 1 and tid != constraint.eos_token_id:
                    table.setdefault(b[0], tid)
            constraint.memo["byte_tokens"] = (torch.tensor(list(table.keys()), dtype=torch.long),
                                              torch.tensor(list(table.values()), dtype=torch.long))
        byte_ids, token_ids = constraint.memo["byte_tokens"]
        mask = constraint.allowed_mask(state)
        hit = {}
        for b, t in zip(byte_ids[mask[token_ids]].tolist(), token_ids[mask[token_ids]].tolist()):
            nxt = constraint.next_state(state, t)
            if nxt is not None:
                hit[b] = nxt
        cache[state] = hit
    return hit


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to -inf in place. ``logits``: ``[..., V_model]``, ``mask``: ``[..., V_vocab]``.

    ``V_model`` may exceed ``V_vocab`` (embedding padding); those rows are always disallowed.
    """
    n = mask.shape[-1]
    logits[..., :n].masked_fill_(~mask, float("-inf"))
    if logits.shape[-1] > n:
        logits[..., n:] = float("-inf")
    return logits


# --------------------------------------------------------------------------------------------
# Compilation with a two-level cache
# --------------------------------------------------------------------------------------------

_MEMORY_CACHE: dict[tuple[str, str], Constraint] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where compiled indexes and model weights are cached (``$CONSTRAINED_SPEC_CACHE``)."""
    root = os.environ.get("CONSTRAINED_SPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "constrained_spec"
    )
    return Path(root)


def compile_regex(pattern: str, vocab: TokenVocabulary, *, use_disk_cache: bool = True) -> Constraint:
    """Compile ``pattern`` over ``vocab`` once; later calls get the same ``Constraint``.

    Raises ``InvalidRegexError`` when the pattern does not compile or no token sequence matches it.
    """
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {pattern!r}.")
    key = (vocab.fingerprint, pattern)
    with _LOCK:
        hit = _MEMORY_CACHE.get(key)
    if hit is not None:
        return hit
    digest = hashlib.sha256(f"{vocab.fingerprint}\0{pattern}".encode()).hexdigest()[:40]
    path = cache_dir() / "index" / f"{digest}.pkl"
    index = None
    if use_disk_cache and path.is_file():
        try:
            index = pickle.loads(path.read_bytes())
        except Exception:
            index = None  # a stale or truncated file is rebuilt below
    if index is None:
        try:
            index = Index(pattern, vocab.to_outlines())
        except Exception as e:
            msg = str(e).split("\n")[0]
            if "incompatible with the regex" in msg or "no transitions" in msg.lower():
                raise InvalidRegexError(
                    f"Invalid regex {pattern[:200]!r}: no sequence of tokens of this vocabulary can match it "
                    f"(the pattern matches nothing, or needs characters no token has). outlines-core: {msg}"
                ) from None
            raise InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it does not compile ({msg}).") from None
        if not index.get_final_states():
            raise InvalidRegexError(f"Invalid regex {pattern[:200]!r}: it matches nothing.")
        if use_disk_cache:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(pickle.dumps(index))
                os.replace(tmp, path)
            except OSError:
                pass  # the disk cache is an optimization only
    constraint = Constraint(index, vocab, pattern)
    with _LOCK:
        _MEMORY_CACHE.setdefault(key, constraint)
        return _MEMORY_CACHE[key]
