"""outlines-core's schema regexes never accept an instance the schema forbids: where its regex
would (a keyword ignored or misread), the backend refuses the schema, naming the keyword.

outlines-core 0.2.14 builds a sub-schema's regex from the first of ``properties``, ``allOf``,
``anyOf``, ``oneOf``, ``prefixItems``, ``enum``, ``const``, ``$ref``, ``type`` it finds and
ignores the rest; it writes ``allOf`` as a concatenation and ``oneOf`` as ``anyOf``; it drops a
property whose value needs a fifth nested ``$ref``; and it puts a ``pattern`` between quotes as
it is. Checked by refusal (keyword and path) with a control that compiles, and by brute force:
for small schemas, either the backend refuses or each of a handful of valid and invalid JSON
texts is accepted iff jsonschema says valid. Texts are in the backend's layout (``json.dumps``
separators, the schema's property order); the vocabulary has one token per byte.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from outlines_core.json_schema import build_regex_from_schema

from constrained_spec import UnsupportedSchemaFeatureError
from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.constraint.outlines_core import build_index
from constrained_spec.constraint.outlines_core_schema import _WS_MARK, _canonical_layout, schema_to_regex

BYTES = TokenVocabulary.build({b + 1: bytes([b]) for b in range(256)}, 0)
LIST = {"$defs": {"L": {"type": "array", "items": {"type": "integer"}}}}
NODE = {"type": "object", "properties": {"v": {"type": "integer"},
                                         "next": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}}}


@pytest.mark.parametrize("schema, keyword, path", [
    ({**LIST, "$ref": "#/$defs/L", "maxItems": 1}, "maxItems", "/"),
    ({**LIST, "$ref": "#/$defs/L", "minItems": 2}, "minItems", "/"),
    ({**LIST, "$ref": "#/$defs/L", "items": False}, "items", "/"),
    ({"allOf": [{}, {"const": 1}]}, "allOf", "/"),
    ({"type": "object", "required": ["a"]}, "required", "/"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "required", "/"),
    ({"type": "string", "maxLength": 3, "pattern": "^a+$"}, "pattern", "/"),
    ({"type": "string", "pattern": "^[a-z@.]+$", "format": "email"}, "format", "/"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "string"}, "type", "/"),
    ({"type": "array", "items": {"type": "integer"}, "properties": {"a": {"type": "integer"}}}, "type", "/"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "anyOf", "/"),
    ({"type": "integer", "enum": [1, "a"]}, "type", "/"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/"),
    ({"prefixItems": [{"type": "integer"}], "minItems": 2}, "minItems", "/"),
    ({"type": "array", "maxItems": 0, "minItems": 1}, "minItems", "/"),
    ({"type": "string", "pattern": 'a"b'}, "pattern", "/"),
    ({"type": "object", "properties": {'a"b': {"type": "integer"}}}, "properties", '/properties/a"b'),
    ({"$defs": {"N": {**NODE, "required": ["v", "next"]}}, "$ref": "#/$defs/N"}, "$ref", "/$defs/N/properties/next"),
    ({"const": {"a.b": 1}}, "const", "/"),
])
def test_a_keyword_outlines_core_would_get_wrong_is_refused_by_name(schema, keyword, path):
    with pytest.raises(UnsupportedSchemaFeatureError) as err:
        compile_constraint(schema, BYTES, backend="outlines-core")
    assert (err.value.keyword, err.value.path) == (keyword, path)


@pytest.mark.parametrize("schema", [
    {**LIST, "$ref": "#/$defs/L", "description": "annotations beside $ref are fine"},
    {"$defs": {"L": {"type": "array", "items": {"type": "integer"}, "maxItems": 1}}, "$ref": "#/$defs/L"},
    {"allOf": [{"const": 1}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "string", "pattern": "^[a-z]+@[a-z]+$"},
    {"type": "string", "maxLength": 3},
    {"anyOf": [{"type": "integer"}, {"type": "number"}], "type": "number"},
    {"type": "string", "enum": ["a", "b"]},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
               {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]},
    {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1, "maxItems": 1, "items": False},
    {"$defs": {"N": {**NODE, "required": ["v"]}}, "$ref": "#/$defs/N"},
    {"type": "array", "items": {"type": "string"}, "additionalItems": False, "maxItems": 2},
])
def test_the_controls_compile(schema):
    compile_constraint(schema, BYTES, backend="outlines-core")


#: (schema, JSON texts: valid and invalid ones, each in the layout the backend writes)
CASES = [
    ({"type": "number"}, ["1.1", "3.14", "-0.5e+3", "1", "1.", "01", '"1"']),
    ({**LIST, "$ref": "#/$defs/L", "maxItems": 1}, ["[1]", "[1, 2]", "[]"]),
    ({**LIST, "$ref": "#/$defs/L"}, ["[1]", "[1, 2]", '["a"]']),
    ({"allOf": [{}, {"const": 1}]}, ["1", "21", '"x"', '1"x"']),
    ({"allOf": [{"const": 1}]}, ["1", "21"]),
    ({"type": "object", "required": ["a"]}, ["{}", '{"a": 1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, ['{"a": 1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]},
     ['{"b": "x"}', '{"a": 1, "b": "x"}', '{"a": 1}', "{}"]),
    ({"type": "string", "maxLength": 3, "pattern": "^a+$"}, ['"aa"', '"bbb"', '"aaaa"']),
    ({"type": "string", "pattern": "^[^@]+@[^@]+$"}, ['"a@b"', '"a@b@c"', '"a\\u0040b@c"', '"@b"']),
    ({"type": "string", "pattern": "^a|b$"}, ['"a"', '"b"', '"c"', '"a"b"']),
    ({"type": "string", "pattern": "^.{2}$"}, ['"ab"', '"a\\nb"', '"\\n\\n"', '"abc"']),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["1", "1.5"]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"', "1.5"]),
    ({"type": "integer", "enum": [1, "a"]}, ["1", '"a"']),
    ({"prefixItems": [{"type": "integer"}], "minItems": 2}, ["[1]", "[1, 2]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, ["[1]", "[1, 2]"]),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "string"}, ["1", '"a"']),
    ({"type": "array", "maxItems": 0, "minItems": 1}, ["[]"]),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, ["[]", "[true]", "[true, false]",
                                                                                     "[true, true, true]"]),
    ({"type": "array", "items": {"type": "integer"}, "properties": {"a": {"type": "integer"}}}, ["[1]", '{"a": 1}']),
    ({"$defs": {"N": {**NODE, "required": ["v", "next"]}}, "$ref": "#/$defs/N"},
     ['{"v": 1, "next": null}', '{"v": 1, "next": {"v": 2, "next": null}}', '{"v": 1}']),
    ({"$defs": {"N": {**NODE, "required": ["v"]}}, "$ref": "#/$defs/N"},
     ['{"v": 1}', '{"v": 1, "next": null}', '{"next": null}']),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"]},  # {} as a value: a bare alternation
     ['{"a": 1}', '{"a": [true]}', '{"a": {"b": [1, 2]}}', "null", "[1]"]),
    ({"const": {"a.b": 1}}, ['{"a.b": 1}', '{"aXb": 1}']),
]


#: Schemas whose unchecked regex writes any JSON value: indexing it over every byte takes minutes.
SLOW_UNCHECKED = [{"allOf": [{}, {"const": 1}]}, {"type": "object", "required": ["a"]},
                  {"type": "object", "properties": {"a": {}}, "required": ["a"]}]


def _accepts(step, is_final, initial: int, text: str) -> bool:
    state = initial
    for b in text.encode():
        state = step(state, b + 1)
        if state is None:
            return False
    return is_final(state)


def _valid(schema: dict, text: str) -> bool:
    """Whether ``text`` is JSON and its value valid under ``schema`` (formats asserted)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


@pytest.mark.parametrize("schema, texts", CASES, ids=[json.dumps(c[0])[:60] for c in CASES])
def test_refused_or_accepts_exactly_the_valid_instances(schema, texts):
    try:
        m = compile_constraint(schema, BYTES, backend="outlines-core").matcher()
    except UnsupportedSchemaFeatureError:
        return
    for text in texts:
        assert _accepts(m.next_state, m.is_final, m.initial_state, text) == _valid(schema, text), text


def test_most_cases_compile_and_unchecked_regexes_fail_the_same_test():
    """The brute-force test above has power: without ``check_schema_support`` (outlines-core's
    regex indexed as it is) some case accepts an invalid instance; and with it, most cases
    compile, so they are tested rather than refused."""
    compiled = wrong = 0
    for schema, texts in CASES:
        try:
            compile_constraint(schema, BYTES, backend="outlines-core")
            compiled += 1
        except UnsupportedSchemaFeatureError:
            pass
        if schema in SLOW_UNCHECKED:
            continue
        try:
            regex = _canonical_layout(build_regex_from_schema(json.dumps(schema), _WS_MARK))
            index = build_index(regex, BYTES, disk_cache=False)
        except Exception:  # noqa: BLE001 - outlines-core refuses it itself
            continue
        finals = index.get_final_states()
        wrong += any(_accepts(index.get_next_state, finals.__contains__, index.get_initial_state(), text)
                     and not _valid(schema, text) for text in texts)
    assert compiled >= 9 and wrong >= 9


def test_a_pattern_left_to_match_escaped_characters_is_refused(monkeypatch):
    """The check behind the pattern rewrite is a proof over every byte, not a trust in the
    rewrite: without it, ``[^@]`` matches a quote and the schema is refused."""
    from constrained_spec.constraint import outlines_core_schema

    monkeypatch.setattr(outlines_core_schema, "_json_safe", lambda body: body)
    with pytest.raises(UnsupportedSchemaFeatureError, match="still matches") as err:
        compile_constraint({"type": "string", "pattern": "^[^@]+$", "title": "unsafe"}, BYTES, backend="outlines-core")
    assert err.value.keyword == "pattern"


def test_a_uri_cannot_write_a_second_property_in_a_compact_layout():
    """outlines-core's ``uri`` regex lets a path hold quotes: compact, ``{"u":"http://h/a","v":"x"}``
    reads as two properties, though the schema allows one. The backend writes formats JSON-safe."""
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}, "required": ["u"],
              "additionalProperties": False}
    bad, good = '{"u":"http://localhost/a","v":"x"}', '{"u":"http://localhost/a"}'
    m = compile_constraint(schema, BYTES, backend="outlines-core", whitespace="compact").matcher()
    assert _accepts(m.next_state, m.is_final, m.initial_state, good)
    assert not _accepts(m.next_state, m.is_final, m.initial_state, bad) and not _valid(schema, bad)
    raw = build_index(build_regex_from_schema(json.dumps(schema), ""), BYTES, disk_cache=False)
    finals = raw.get_final_states()
    assert _accepts(raw.get_next_state, finals.__contains__, raw.get_initial_state(), bad)  # the negative control


@pytest.mark.parametrize("whitespace, marker", [("canonical", 0), ("compact", 0), ("flexible", 0), (r"[ \t]*", None)])
def test_a_schema_regex_names_its_end_marker_where_the_layout_proves_it(whitespace, marker):
    """No JSON text of the named layouts holds a NUL, so NUL ends every schema's regex without a
    probe; a custom whitespace regex is probed like any pattern (and still compiles exactly)."""
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}
    assert schema_to_regex(schema, whitespace).end_marker == marker
    m = compile_constraint(schema, BYTES, backend="outlines-core", whitespace=whitespace).matcher()
    text = '{"n": 1.5}' if whitespace != "compact" else '{"n":1.5}'
    assert _accepts(m.next_state, m.is_final, m.initial_state, text)
