"""The outlines-core backend: a schema becomes a regex, the regex an ``Index`` with integer states.

States are the index's own integers, the same for every request, so per-state caches (masks,
drafters' forced text) live with the compiled constraint and serve all requests; a matcher is
just a history of states, and rollback is assignment. outlines-core ignores many validation
keywords, so those are refused up front (``check_schema_support``) rather than letting outputs
break them; compiled indexes are also cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import threading
from typing import Any

import torch
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from ..errors import InvalidRegexError, UnsupportedSchemaFeatureError
from ..storage import cache_dir
from .base import CompiledConstraint, Matcher, State
from .layout import DEFAULT_JSON_WHITESPACE, whitespace_regex
from .schema import iter_subschemas
from .vocabulary import TokenVocabulary

BACKEND = "outlines-core"
#: Masks kept per compiled constraint, shared by its requests (oldest dropped first): one is
#: vocab-size bytes (48 KiB on SmolLM2), so 1,024 of them is 48 MiB; a long-running server
#: would otherwise grow them without bound on a large schema.
MAX_SHARED_MASKS = 1024
#: Bytes per index transition in the estimate of an index's size (a token id and a state in a
#: Rust hash map, with its overhead).
TRANSITION_BYTES = 24

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
_WS_MARK = "\ue000"  # a private-use character standing for "whitespace goes here"


def check_schema_support(schema: Any) -> None:
    """Raise ``UnsupportedSchemaFeatureError`` for the first keyword outlines-core cannot enforce."""
    for path, node in iter_subschemas(schema):
        for kw in _UNENFORCED_KEYWORDS:
            if kw in node:
                raise UnsupportedSchemaFeatureError(kw, path)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in _SUPPORTED_FORMATS:
            raise UnsupportedSchemaFeatureError(
                "format", path, f"Format {fmt!r} is not one of {sorted(_SUPPORTED_FORMATS)}."
            )
        if node.get("additionalProperties") is False and "properties" not in node:
            raise UnsupportedSchemaFeatureError(
                "additionalProperties", path, "'additionalProperties: false' needs 'properties' beside it."
            )


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


def schema_to_regex(schema: dict, whitespace: str = DEFAULT_JSON_WHITESPACE) -> str:
    """The regex of the JSON texts that the schema allows, in the given layout (see ``layout``)."""
    check_schema_support(schema)
    ws = whitespace_regex(whitespace)
    try:
        if ws is None:
            return _canonical_layout(build_regex_from_schema(json.dumps(schema), _WS_MARK))
        return build_regex_from_schema(json.dumps(schema), ws)
    except Exception as e:  # outlines-core raises ValueError with a free-form message
        msg = str(e).split("\n")[0]
        if re.search(r"Format (\S+) is not supported", msg):
            raise UnsupportedSchemaFeatureError("format", "", msg) from None
        raise UnsupportedSchemaFeatureError("(structure)", "", f"outlines-core says: {msg}") from None


def _to_outlines(vocab: TokenVocabulary) -> Vocabulary:
    """The outlines-core ``Vocabulary`` (bytes -> ids; EOS given separately)."""
    grouped: dict[bytes, list[int]] = {}
    for tid, b in vocab.token_bytes.items():
        if tid != vocab.eos_token_id:
            grouped.setdefault(b, []).append(tid)
    return Vocabulary(vocab.eos_token_id, grouped)


def build_index(pattern: str, vocab: TokenVocabulary, *, disk_cache: bool = True) -> Index:
    """The outlines-core ``Index`` of ``pattern`` over ``vocab``, from the disk cache when there.

    Raises ``InvalidRegexError`` when the pattern does not compile or no token sequence matches it.
    """
    digest = hashlib.sha256(f"{vocab.fingerprint}\0{pattern}".encode()).hexdigest()[:40]
    path = cache_dir() / "index" / f"{digest}.pkl"
    if disk_cache and path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:
            pass  # a stale or truncated file is rebuilt below
    try:
        index = Index(pattern, _to_outlines(vocab))
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
    if disk_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(pickle.dumps(index))
            os.replace(tmp, path)
        except OSError:
            pass  # the disk cache is an optimization only
    return index


class OutlinesCompiled(CompiledConstraint):
    """An outlines-core index. Its per-state caches (masks, done flags) are pure functions of
    the state, so every matcher shares them."""

    backend = BACKEND

    def __init__(self, index: Index, vocab: TokenVocabulary, kind: str, pattern: str) -> None:
        super().__init__(vocab, kind, pattern)
        self.index = index
        self.initial_state: int = index.get_initial_state()
        self.final_states = frozenset(index.get_final_states())
        self.masks: dict[int, torch.Tensor] = {}
        self.done: dict[int, bool] = {}
        self._index_bytes = TRANSITION_BYTES * sum(len(t) for t in index.get_transitions().values())

    @property
    def nbytes(self) -> int:
        """The index's transitions and the masks cached so far."""
        return self._index_bytes + len(self.masks) * self.vocab.size + super().nbytes

    def matcher(self) -> "OutlinesMatcher":
        """A fresh matcher (a history of states) over this index."""
        return OutlinesMatcher(self)


class OutlinesMatcher(Matcher):
    """A request's history of outlines-core states; lookups go to the shared, cached index."""

    compiled: OutlinesCompiled

    def __init__(self, compiled: OutlinesCompiled) -> None:
        self.initial_state = compiled.initial_state
        super().__init__(compiled)
        self._index = compiled.index
        self._memo: dict[str, dict] = {}

    @property
    def memo(self) -> dict[str, dict]:
        """This request's (drafters learn from its verdicts; a seeded request must not depend on
        what earlier requests learned)."""
        return self._memo

    def next_state(self, state: State, token: int) -> State | None:
        """The state after ``token``, or None when it is not allowed (EOS: None too)."""
        if token == self.eos_token_id:
            return None
        return self._index.get_next_state(state, token)

    def allowed_mask(self, state: State) -> torch.Tensor:
        """Boolean mask of shape ``[vocab.size]`` (cached per state, shared by all matchers)."""
        mask = self.compiled.masks.get(state)
        if mask is None:
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)
            allowed = self._index.get_allowed_tokens(state)
            if allowed:
                mask[torch.tensor(allowed, dtype=torch.long)] = True
            masks = self.compiled.masks
            if len(masks) >= MAX_SHARED_MASKS:
                masks.pop(next(iter(masks)), None)  # another request's thread may have dropped it
            masks[state] = mask
        return mask

    def is_final(self, state: State) -> bool:
        """Whether the text so far is a complete member of the language."""
        return state in self.compiled.final_states

    def is_done(self, state: State) -> bool:
        """Final with nothing but EOS allowed."""
        done = self.compiled.done.get(state)
        if done is None:
            done = self.is_final(state) and self._index.get_allowed_tokens(state) == [self.eos_token_id]
            self.compiled.done[state] = done
        return done


def compile_outlines(pattern: str, vocab: TokenVocabulary, kind: str, *, disk_cache: bool = True) -> OutlinesCompiled:
    """Compile a regex (a JSON schema's, or the user's) into an ``OutlinesCompiled``."""
    return OutlinesCompiled(build_index(pattern, vocab, disk_cache=disk_cache), vocab, kind, pattern)
