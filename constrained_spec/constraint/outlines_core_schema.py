"""A JSON schema for outlines-core: refused by keyword and path where its regex would be wrong,
rewritten where a correct form exists, then written as a regex (``schema_to_regex``) that the
backend (``constraint.outlines_core``) builds its index from.

outlines-core ignores many validation keywords and misreads some, so where its regex could accept
an instance the schema forbids, the schema is refused up front (``check_schema_support``, naming
the keyword and its path: a keyword it ignores, siblings of the keyword it builds the regex from,
``allOf`` of several, a ``oneOf`` whose branches could overlap, references nested past its depth)
or rewritten into one it writes correctly (``_for_outlines``: ``{}`` as one group, patterns
grouped and made JSON-safe, formats as those patterns). What a pattern can match is proven on an
index over every byte (``_escaped_byte``), not assumed.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Iterator

import outlines_core.json_schema as json_regexes
from outlines_core.json_schema import build_regex_from_schema

from ..errors import InvalidRegexError, UnsupportedSchemaFeatureError
from .ecma_regex import ecma_pattern
from .layout import DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS, whitespace_regex
from .outlines_core import BYTE_VOCAB, build_index, scan_regex, skip_class, skip_escape
from .schema import iter_subschemas, map_subschemas

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


#: JSON Schema keywords that can fail an instance -> the instance type they apply to (None: any).
_ASSERTIONS: dict[str, str | None] = {
    **dict.fromkeys(("type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
                     "$dynamicRef", "$recursiveRef")),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), "number"),
    # additionalItems is left out: it acts only beside an array-form items, which outlines-core refuses.
    **dict.fromkeys(("minItems", "maxItems", "uniqueItems", "items", "prefixItems", "contains",
                     "minContains", "maxContains", "unevaluatedItems"), "array"),
    **dict.fromkeys(("required", "properties", "patternProperties", "additionalProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                     "unevaluatedProperties"), "object"),
}
#: Keywords whose value ``true`` or ``{}`` fails nothing.
_NO_OP_WHEN_EMPTY = frozenset({"additionalProperties", "items", "unevaluatedItems", "unevaluatedProperties",
                               "propertyNames"})
_ALL_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
#: The keywords outlines-core dispatches a sub-schema on, in its order: the first one present
#: decides the whole regex of the sub-schema, and every other keyword beside it is ignored.
_DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")
#: How many ``$ref`` outlines-core follows inside one another (its default ``max_recursion_depth``).
_MAX_REF_DEPTH = 3
#: Bytes that a JSON string holds only escaped: a pattern that matches them, put between quotes
#: as outlines-core does, would write escapes whose decoded value the pattern never saw.
_ESCAPED_BYTES = frozenset(b'"\\' + bytes(range(0x20)))


def check_schema_support(schema: Any) -> None:
    """Raise ``UnsupportedSchemaFeatureError`` for the first keyword outlines-core cannot enforce:
    a keyword it ignores, or one it reads so that its regex would accept an instance the schema
    forbids (``_check_node`` lists them)."""
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
    for path, node in iter_subschemas(schema):
        _check_node(schema, path, node)
    _check_ref_depth(schema)


def _branch(node: dict) -> tuple[str, frozenset[str]]:
    """(the keyword outlines-core builds ``node``'s regex from, the keywords that regex honors);
    ("", ...) for ``{}`` (any value) and for a node it refuses."""
    key = next((k for k in _DISPATCH if k in node), "")
    if key == "properties":  # it writes the listed properties only, so additionalProperties always holds
        return key, frozenset({"properties", "required", "additionalProperties"})
    if key != "type":
        return key, frozenset({key} if key else ())
    honored = {"type"}
    for t in _declared_types(node) or ():
        if t == "string":
            if "minLength" in node or "maxLength" in node:
                honored |= {"minLength", "maxLength"}
            elif "pattern" in node:
                honored.add("pattern")
            elif "format" in node:
                honored.add("format")
        elif t == "array":
            honored |= {"minItems", "maxItems", "items"}
        elif t == "object":
            honored.add("additionalProperties")
    return key, frozenset(honored)


def _declared_types(node: dict) -> frozenset[str] | None:
    """The types ``node``'s ``type`` keyword allows (None when it has none)."""
    t = node.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(x for x in t if isinstance(x, str))
    return None


def _json_type(value: Any) -> str:
    """The JSON Schema type of a JSON value (an integral number is "integer")."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "object")


def _resolve(root: Any, ref: Any) -> Any:
    """The target of a local ``$ref``, read as outlines-core reads it (pointer parts split on '/',
    not unescaped); None where it would fail (it then refuses the schema itself)."""
    if not isinstance(ref, str):
        return None
    parts = ref.split("#")
    if len(parts) == 2 and parts[0] and parts[0] != (root.get("$id") if isinstance(root, dict) else None):
        return None
    if len(parts) > 2:
        return None
    node = root
    for part in (p for p in parts[-1].split("/") if p):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _output_types(root: Any, node: Any, seen: frozenset[int] = frozenset()) -> frozenset[str]:
    """The JSON types of the values outlines-core's regex of ``node`` can write (a superset)."""
    if not isinstance(node, dict) or id(node) in seen:
        return _ALL_TYPES
    seen = seen | {id(node)}
    key, _ = _branch(node)
    if key == "properties":
        return frozenset({"object"})
    if key == "prefixItems":
        return frozenset({"array"})
    if key in ("enum", "const"):
        values = node["enum"] if key == "enum" and isinstance(node["enum"], list) else [node.get("const")]
        return frozenset(_json_type(v) for v in values)
    if key in ("allOf", "anyOf", "oneOf") and isinstance(node[key], list):
        out: frozenset[str] = frozenset()
        for sub in node[key]:
            out |= _output_types(root, sub, seen)
        return out
    if key == "$ref":
        return _output_types(root, _resolve(root, node["$ref"]), seen)
    if key == "type":
        return _declared_types(node) or _ALL_TYPES
    return _ALL_TYPES


def _allows(declared: frozenset[str], written: str) -> bool:
    """Whether a value of type ``written`` satisfies ``type: declared`` (an integer is a number)."""
    return written in declared or (written == "integer" and "number" in declared)


def _check_node(root: Any, path: str, node: dict) -> None:
    """Refuse what outlines-core's regex of ``node`` would get wrong: a keyword it ignores beside
    the one it builds the regex from (the first of ``_DISPATCH`` present) where it could fail a
    value that regex writes, and the keywords it reads wrongly."""
    key, honored = _branch(node)
    if key in ("enum", "const"):
        _check_values(root, path, node, key)
        return  # every value was checked against the whole node
    written = _output_types(root, node)
    for kw, value in node.items():
        applies = _ASSERTIONS.get(kw, "-")
        if kw in honored or applies == "-" or (kw in _NO_OP_WHEN_EMPTY and value in (True, {})):
            continue
        if kw == "required" and value == []:
            continue
        if key == "prefixItems" and _within_prefix_items(node, kw):
            continue
        if kw == "type":
            declared = _declared_types(node) or _ALL_TYPES
            if all(_allows(declared, t) for t in written):
                continue
        elif applies is not None and not any(_allows(frozenset({applies}), t) for t in written):
            continue  # it only constrains values of a type this regex never writes
        raise UnsupportedSchemaFeatureError(
            kw, path, f"outlines-core builds this sub-schema from {key!r} alone and ignores {kw!r} beside it."
            if key else f"outlines-core ignores {kw!r} here."
        )
    if key == "properties":
        _check_properties(path, node)
    elif key == "allOf" and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
        raise UnsupportedSchemaFeatureError("allOf", path, "outlines-core writes one value of each sub-schema one "
                                            "after the other (a concatenation), not a value of all of them.")
    elif key == "oneOf" and isinstance(node["oneOf"], list):
        _check_one_of(root, path, node["oneOf"])
    elif key == "type":
        _check_typed(path, node)


def _within_prefix_items(node: dict, kw: str) -> bool:
    """Whether ``kw`` holds for every array outlines-core writes for ``prefixItems`` (exactly one
    item per entry, nothing after them)."""
    n = len(node["prefixItems"]) if isinstance(node["prefixItems"], list) else -1
    if kw in ("items", "additionalItems", "unevaluatedItems"):
        return True  # they constrain items past the prefix, and there are none
    if kw == "minItems":
        return isinstance(node[kw], int) and node[kw] <= n
    if kw == "maxItems":
        return isinstance(node[kw], int) and node[kw] >= n
    return False


def _check_values(root: Any, path: str, node: dict, key: str) -> None:
    """outlines-core writes exactly the ``enum``/``const`` values and ignores every other keyword:
    each value must then be valid under the whole node."""
    import jsonschema

    values = node[key] if key == "enum" else [node[key]]
    cls = jsonschema.validators.validator_for(root) if isinstance(root, dict) else jsonschema.Draft202012Validator
    validator = cls(root, format_checker=cls.FORMAT_CHECKER).evolve(schema=node)
    for value in values if isinstance(values, list) else []:
        key_text = next((k for k in _object_keys(value) if any(ch in _REGEX_META or ord(ch) in _ESCAPED_BYTES
                                                               for ch in k)), None)
        if key_text is not None:
            raise UnsupportedSchemaFeatureError(
                key, path, f"outlines-core writes the key {key_text!r} of this {key} value into its regex as it "
                "is, where it is not literal text (a regex character, a quote, a backslash or a control character).")
        error = next(iter(validator.iter_errors(value)), None)
        if error is not None:
            kw = str(error.validator)
            raise UnsupportedSchemaFeatureError(
                kw, path, f"outlines-core writes the {key} value {json.dumps(value)[:80]} as it is and ignores "
                f"{kw!r}, which that value breaks ({error.message[:120]})."
            )


#: Characters the Rust ``regex`` syntax gives a meaning (its ``is_meta_character``).
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _object_keys(value: Any) -> Iterator[str]:
    """Every key of every object inside a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _object_keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _object_keys(v)


def _check_properties(path: str, node: dict) -> None:
    """outlines-core writes exactly the listed properties, names unescaped: every required one
    must be listed, and no name may need an escape."""
    props = node["properties"] if isinstance(node["properties"], dict) else {}
    required = node.get("required", [])
    missing = [r for r in required if r not in props] if isinstance(required, list) else []
    if missing:
        raise UnsupportedSchemaFeatureError(
            "required", path, f"outlines-core writes only the properties listed in 'properties', and {missing[0]!r} "
            "is required without being listed there.")
    for name in props:
        if any(ord(ch) in _ESCAPED_BYTES for ch in name):
            raise UnsupportedSchemaFeatureError(
                "properties", f"{path}/properties/{name}", "outlines-core writes a property name between quotes "
                "without escaping it, and this name holds a quote, a backslash or a control character.")


def _check_typed(path: str, node: dict) -> None:
    """Counts outlines-core reads only as non-negative integers, and ``pattern``."""
    types = _declared_types(node) or frozenset()
    counts = ("minLength", "maxLength") * ("string" in types) + ("minItems", "maxItems") * ("array" in types)
    for kw in counts:
        if kw in node and (isinstance(node[kw], bool) or not isinstance(node[kw], int) or node[kw] < 0):
            raise UnsupportedSchemaFeatureError(kw, path, "outlines-core reads only a non-negative integer here.")
    if "array" in types and node.get("maxItems") == 0 and node.get("minItems", 0) > 0:
        raise UnsupportedSchemaFeatureError("minItems", path, "with 'maxItems: 0' outlines-core writes [] "
                                            "whatever 'minItems' says.")
    if "string" in types and "pattern" in node and "minLength" not in node and "maxLength" not in node:
        _check_pattern(path, node["pattern"])
    elif "string" in types and node.get("format") in _FORMAT_REGEXES and "minLength" not in node and \
            "maxLength" not in node and _format_pattern(node["format"]) is None:
        raise UnsupportedSchemaFeatureError("format", path, "outlines-core's regex of this format matches "
                                            "characters a JSON string holds only escaped.")


def _pattern_body(pattern: str) -> str | None:
    """The regex outlines-core should match a whole JSON string's text against for ``pattern``.

    Without a leading ``^`` and a trailing ``$`` (JSON Schema patterns search; a whole match is
    one of the texts they find), its classes as ECMA-262 reads them (``ecma_pattern``), and with
    every character it matches intersected with the characters a JSON string holds unescaped
    (``_json_safe``). None where that cannot be done: an end assertion left inside, the verbose
    flag, or syntax this reader does not follow.
    """
    pattern = ecma_pattern(pattern)  # as ECMA-262 reads it: outlines-core reads Rust's dialect
    body = pattern[1:] if pattern.startswith("^") else pattern
    scan = scan_regex(body)
    if scan.end_anchors and scan.end_anchors[-1][1] == len(body) and body.endswith("$"):
        body = body[:-1]
        scan = scan_regex(body)
    if not scan.ok or scan.end_anchors or scan.verbose:
        return None
    return _json_safe(body)


#: The characters a JSON string holds as they are (not a quote, a backslash or a control character).
_UNESCAPED = r'[^"\\\x00-\x1F]'
_ASSERTION_ESCAPES = frozenset("bBAz<>")


def _json_safe(body: str) -> str | None:
    """``body`` with each of its character matchers (a literal, an escape, a class, ``.``)
    intersected with ``_UNESCAPED``, so it matches exactly its texts that need no escape in a JSON
    string: the text outlines-core writes between quotes is then the string's value. None where
    the syntax is not followed."""
    out, i, n = [], 0, len(body)
    while i < n:
        c = body[i]
        if c == "\\":
            j = skip_escape(body, i)
            if j > n:
                return None
            esc = body[i:j]
            out.append(esc if body[i + 1] in _ASSERTION_ESCAPES else f"[{esc}&&{_UNESCAPED}]")
            i = j
        elif c == "[":
            j = skip_class(body, i)
            if j > n:
                return None
            out.append(f"[{body[i:j]}&&{_UNESCAPED}]")
            i = j
        elif c == ".":
            out.append(r'[^\n"\\\x00-\x1F]')
            i += 1
        elif c == "(" and body.startswith("?", i + 1):
            j = i + 2  # copy a group's head: (?:  (?flags)  (?flags:  (?P<name>  (?<name>
            while j < n and body[j] not in ":)>":
                j += 1
            if j >= n:
                return None
            out.append(body[i:j + 1])
            i = j + 1
        elif c == "{":
            j = body.find("}", i)
            if j < 0 or not re.fullmatch(r"\{\d+(,\d*)?\}", body[i:j + 1]):
                return None
            out.append(body[i:j + 1])
            i = j + 1
        else:
            # Structure (()|*+?^) as it is; a literal a JSON string would escape matches nothing.
            out.append(r"[^\s\S]" if c not in "()|*+?^" and ord(c) in _ESCAPED_BYTES else c)
            i += 1
    return "".join(out)


#: outlines-core's regex of each format it knows (a JSON string, quotes included).
_FORMAT_REGEXES = {"date-time": json_regexes.DATE_TIME, "date": json_regexes.DATE, "time": json_regexes.TIME,
                   "uuid": json_regexes.UUID, "email": json_regexes.EMAIL, "uri": json_regexes.URI}


@functools.lru_cache(maxsize=None)
def _format_pattern(fmt: str) -> str | None:
    """outlines-core's regex of ``fmt`` between its quotes, made JSON-safe (``_json_safe``): its own
    regexes let ``uri`` hold raw quotes (in a compact layout ``"http://a/b","x":"y"`` wrote a
    second property into one URI), ``email`` raw quotes and control characters, and ``time``'s
    fraction needs a backslash. None if it cannot be made safe (proven by ``_escaped_byte``)."""
    safe = _json_safe(_FORMAT_REGEXES[fmt][1:-1])
    return None if safe is None or _escaped_byte(safe) else safe


def _escaped_byte(body: str) -> str:
    """The first character that a JSON string holds only escaped and ``body`` can match, "" if
    none: proven on the exact index of ``"(?:body)"`` over every byte, where the only quotes
    are the opening one (from the start) and the closing one (into a final state that allows
    nothing more). Raises what ``build_index`` raises."""
    index = build_index(f'"(?:{body})"', BYTE_VOCAB, disk_cache=False)
    quote, start, eos = ord('"') + 1, index.get_initial_state(), BYTE_VOCAB.eos_token_id
    for state, edges in index.index.get_transitions().items():
        for token, target in edges.items():
            if not 0 < token <= 256 or token - 1 not in _ESCAPED_BYTES or target in index.past_end:
                continue
            closing = target in index.final_states and index.get_allowed_tokens(target) == [eos]
            if token != quote or not (state == start or closing):
                return chr(token - 1)
    return ""


def _check_pattern(path: str, pattern: Any) -> None:
    """A ``pattern`` goes between the quotes of a JSON string as it is (``_grouped_pattern``
    writes ``_pattern_body``'s regex there): check that this regex is readable, indexes, and
    matches no character JSON writes escaped (proven over every byte, not assumed)."""
    body = _pattern_body(pattern) if isinstance(pattern, str) else None
    if body is None:
        raise UnsupportedSchemaFeatureError("pattern", path, "outlines-core can enforce a pattern only without "
                                            "'$' or '\\z' before its end and without the verbose flag (?x).")
    try:
        escaped = _escaped_byte(body)
    except (InvalidRegexError, UnsupportedSchemaFeatureError) as e:
        raise UnsupportedSchemaFeatureError("pattern", path, f"outlines-core cannot index it: {e}") from None
    if escaped:
        raise UnsupportedSchemaFeatureError(
            "pattern", path, f"its regex for outlines-core still matches {escaped!r}, which a JSON string holds "
            "only escaped.")


def _check_one_of(root: Any, path: str, branches: list) -> None:
    """outlines-core writes ``oneOf`` as ``anyOf``: right only where no value is valid under two
    branches, proven here by their types, their constant values, or a required property whose
    constant values differ (a discriminator)."""
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            if not _disjoint(root, a, b):
                raise UnsupportedSchemaFeatureError(
                    "oneOf", path, "outlines-core allows a value of any branch, also one valid under two of them, "
                    "which oneOf forbids; branches count as exclusive here when their types differ, their "
                    "const/enum values differ, or a property both require has differing const/enum values.")


def _follow(root: Any, node: Any, depth: int = 0) -> Any:
    """``node`` with ``$ref`` chains and one-branch ``allOf`` followed (what it asserts, for ``_disjoint``)."""
    while isinstance(node, dict) and depth < 32:
        depth += 1
        if isinstance(node.get("$ref"), str) and not any(k in node for k in _DISPATCH[:7]):
            node = _resolve(root, node["$ref"])
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1 and not any(
                k in node for k in _DISPATCH if k != "allOf"):
            node = node["allOf"][0]
        else:
            break
    return node


def _asserted_types(node: dict) -> frozenset[str] | None:
    """The types a value valid under ``node`` can have, by its const/enum values or else its ``type``."""
    values = _const_values(node)
    if values is not None:
        return frozenset(_json_type(v) for v in values)
    return _declared_types(node)


def _const_values(node: Any) -> list | None:
    """The only values ``node`` allows, by ``const`` or ``enum`` (None when it has neither)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _canonical_value(value: Any) -> str:
    """A key equal for JSON-equal values (1 and 1.0 alike, true and 1 not)."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _values_disjoint(a: list | None, b: list | None) -> bool:
    """Whether two value lists are known and share no JSON-equal value."""
    return a is not None and b is not None and not ({_canonical_value(v) for v in a} & {_canonical_value(v) for v in b})


def _disjoint(root: Any, a: Any, b: Any) -> bool:
    """Whether no value is valid under both ``a`` and ``b`` (a sufficient test)."""
    a, b = _follow(root, a), _follow(root, b)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _asserted_types(a), _asserted_types(b)
    if ta is not None and tb is not None and not any(_allows(tb, t) for t in ta) and not any(_allows(ta, t) for t in tb):
        return True
    if _values_disjoint(_const_values(a), _const_values(b)):
        return True
    pa, pb = a.get("properties"), b.get("properties")
    ra, rb = a.get("required"), b.get("required")
    if not all(isinstance(x, dict) for x in (pa, pb)) or not all(isinstance(x, list) for x in (ra, rb)):
        return False
    return any(_values_disjoint(_const_values(_follow(root, pa[k])), _const_values(_follow(root, pb[k])))
               for k in set(ra) & set(rb) if k in pa and k in pb)


class _RefLimit(Exception):
    """outlines-core's recursion-limit error, which a ``properties`` entry swallows."""


class _Refused(Exception):
    """Any other error of outlines-core's parser: it refuses the schema itself."""


def _check_ref_depth(root: Any) -> None:
    """Walk the schema as outlines-core's parser does, counting nested ``$ref`` as it does: past
    ``_MAX_REF_DEPTH`` it fails the innermost reference, and the nearest ``properties`` drops that
    property from the object it writes. Refuse where the dropped property is required."""
    try:
        _RefWalk(root).walk(root, "")
    except (_RefLimit, _Refused):
        pass  # outlines-core refuses the schema itself


class _RefWalk:
    """``_check_ref_depth``'s walk: how deep in references it is now, and what each node did."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.depth = 0
        # (node, depth on entry) -> (what it raised, depth on exit): outlines-core expands a
        # reference again at every use; the walk needs each (node, depth) once.
        self.memo: dict[tuple[int, int], tuple[type[Exception] | None, int]] = {}

    def walk(self, node: Any, path: str) -> None:
        key = (id(node), self.depth)
        if key in self.memo:
            raised, self.depth = self.memo[key]
            if raised is not None:
                raise raised
            return
        try:
            self.expand(node, path)
        except (_RefLimit, _Refused) as e:
            self.memo[key] = (type(e), self.depth)
            raise
        self.memo[key] = (None, self.depth)

    def expand(self, node: Any, path: str) -> None:
        """Walk into ``node`` as outlines-core builds its regex: from the keyword it dispatches on."""
        if not isinstance(node, dict):
            raise _Refused
        key, _ = _branch(node)
        if not node:
            return
        if key == "properties":
            self.properties(node, path)
        elif key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if not isinstance(node[key], list):
                raise _Refused
            for i, sub in enumerate(node[key]):
                self.walk(sub, f"{path}/{key}/{i}")
        elif key == "$ref":
            self.reference(node["$ref"])
        elif key == "type":
            types = _declared_types(node) or frozenset()
            if "array" in types and node.get("maxItems") != 0 and "items" in node:
                self.walk(node["items"], f"{path}/items")
            ap = node.get("additionalProperties")
            if "object" in types and ap not in (None, True):
                self.walk(ap, f"{path}/additionalProperties")
        elif key == "":
            raise _Refused

    def properties(self, node: dict, path: str) -> None:
        """Each property's value; one past the reference limit is dropped, refused if required."""
        if not isinstance(node["properties"], dict):
            raise _Refused
        required = node.get("required") if isinstance(node.get("required"), list) else []
        for name, sub in node["properties"].items():
            try:
                self.walk(sub, f"{path}/properties/{name}")
            except _RefLimit:
                if name in required:
                    raise UnsupportedSchemaFeatureError(
                        "$ref", f"{path}/properties/{name}", f"outlines-core follows at most "
                        f"{_MAX_REF_DEPTH + 1} nested references and then leaves out the property whose value "
                        "needs one more, yet this property is required.") from None

    def reference(self, ref: str) -> None:
        """The target of ``ref``, one reference deeper."""
        if self.depth > _MAX_REF_DEPTH:
            raise _RefLimit
        target = _resolve(self.root, ref)
        if target is None:
            raise _Refused
        self.depth += 1
        # outlines-core returns early, without counting the reference back out, for one
        # that names the schema's $id.
        named = "#" in ref and not ref.startswith("#")
        try:
            self.walk(target, "/" + ref.split("#")[-1].strip("/"))
        finally:
            self.depth -= 0 if named else 1


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


#: ``{}`` as outlines-core should read it: the same values, as one group. It writes ``{}`` as a
#: bare alternation, ``(true|false)|(null)|...``, which splits whatever it is written into (a
#: property's value, a ``prefixItems`` entry) instead of standing for one value.
_ANY_VALUE = {"type": ["boolean", "null", "number", "integer", "string", "array", "object"]}


def _for_outlines(node: dict, path: str) -> dict:
    """``node`` rewritten into what outlines-core writes correctly: ``{}`` as ``_ANY_VALUE``, its
    ``pattern`` grouped (``_grouped_pattern``), its ``format`` as that pattern (``_format_pattern``)."""
    if not node:
        return _ANY_VALUE
    node = _grouped_pattern(node, path)
    fmt = node.get("format")
    if fmt in _FORMAT_REGEXES and "string" in (_declared_types(node) or ()) and not any(
            k in node for k in ("pattern", "minLength", "maxLength")):
        node = {**{k: v for k, v in node.items() if k != "format"}, "pattern": f"^(?:{_format_pattern(fmt)})$"}
    return node


def _grouped_pattern(node: dict, _path: str) -> dict:
    """``node`` with its ``pattern`` written ``^(?:body)$`` (``_pattern_body``): outlines-core strips
    that ``^`` and ``$`` and puts the rest between quotes as it is, where a bare ``a|b`` would mean
    ``"a`` or ``b"``."""
    pattern = node.get("pattern")
    body = _pattern_body(pattern) if isinstance(pattern, str) else None
    return node if body is None else {**node, "pattern": f"^(?:{body})$"}


class JsonRegex(str):
    """A schema's regex from ``schema_to_regex``, with the end marker (a byte) that its
    construction proves free, or None (``build_index`` then proves one itself)."""

    end_marker: int | None = None


#: The named layouts' whitespace regexes: spaces and newlines only, so none matches a NUL byte.
_NUL_FREE_WHITESPACE = tuple(JSON_LAYOUTS.values())


def schema_to_regex(schema: dict, whitespace: str = DEFAULT_JSON_WHITESPACE) -> JsonRegex:
    """The regex of the JSON texts that the schema allows, in the given layout (see ``layout``).

    Its ``end_marker`` is NUL for the named layouts: no text of the regex holds a NUL byte (JSON
    strings hold control characters only escaped: outlines-core's string regex, and the
    patterns, formats and names that ``check_schema_support`` and ``_for_outlines`` let through,
    never match one), so NUL never follows a complete text, and ``build_index`` need not prove it.
    """
    check_schema_support(schema)
    schema = map_subschemas(schema, _for_outlines)
    ws = whitespace_regex(whitespace)
    try:
        if ws is None:
            regex = JsonRegex(_canonical_layout(build_regex_from_schema(json.dumps(schema), _WS_MARK)))
        else:
            regex = JsonRegex(build_regex_from_schema(json.dumps(schema), ws))
        regex.end_marker = 0 if ws in _NUL_FREE_WHITESPACE else None
        return regex
    except Exception as e:  # outlines-core raises ValueError with a free-form message
        msg = str(e).split("\n")[0]
        if re.search(r"Format (\S+) is not supported", msg):
            raise UnsupportedSchemaFeatureError("format", "", msg) from None
        raise UnsupportedSchemaFeatureError("(structure)", "", f"outlines-core says: {msg}") from None
