"""A valid instance is rejected only if no serialization of its value is in the constraint's language;
and the llguidance fixes that keep valid values in the language (lexer fuel, relaxed min/maxProperties)."""

from __future__ import annotations

import json

import pytest

from constrained_spec import UnsupportedSchemaFeatureError
from constrained_spec.constraint import compile_constraint
from constrained_spec.bench.coverage import _accepts
from constrained_spec.bench.instances import byte_matcher, serialization_in_language

PAIR = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"],
        "additionalProperties": False}


def _language(schema, tokenizer, lenient=False):
    compiled = compile_constraint(schema, tokenizer, backend="llguidance", lenient=lenient)
    return compiled, byte_matcher(compiled.grammar)


def test_key_order_and_number_spelling_do_not_count_as_rejections(smol_tokenizer):
    compiled, matcher = _language(PAIR, smol_tokenizer)
    value = {"b": 1e-06, "a": 3}  # keys out of the constraint's order, a float json writes as 1e-06
    found = serialization_in_language(matcher, value)
    assert found is not None and json.loads(found) == value
    assert found.startswith('{"a": 3, "b": ')
    assert _accepts(compiled, smol_tokenizer(found, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("value", [{"a": 3}, {"a": 3, "b": 1, "c": 2}, {"a": "3", "b": 1}, [3, 1]])
def test_values_outside_the_schema_are_not_found(smol_tokenizer, value):
    _, matcher = _language(PAIR, smol_tokenizer)
    assert serialization_in_language(matcher, value) is None


def test_search_backtracks_across_nested_key_orders(smol_tokenizer):
    inner = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
    schema = {"type": "array", "items": inner}
    _, matcher = _language(schema, smol_tokenizer)
    value = [{"y": 1, "x": 2}, {"x": 3, "y": 4}, {"y": 5, "x": 6}]
    assert json.loads(serialization_in_language(matcher, value)) == value


def test_long_bounded_pattern_keeps_valid_strings(smol_tokenizer):
    """llguidance's default lexer fuel silently disallowed the space after the first word here."""
    schema = {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": r"^$|(^(?:\S+\s+){0,99}\S+$)"}
    text = json.dumps("The answer to this question varies depending on cultural and personal perspectives.")
    compiled = compile_constraint(schema, smol_tokenizer, backend="llguidance")
    assert _accepts(compiled, smol_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_lenient_drops_min_properties_it_cannot_enforce_and_names_it(smol_tokenizer):
    """llguidance's lenient minProperties with optional properties demanded an extra, unlisted key."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "minProperties": 1}
    with pytest.raises(UnsupportedSchemaFeatureError):
        compile_constraint(schema, smol_tokenizer, backend="llguidance")
    compiled, matcher = _language(schema, smol_tokenizer, lenient=True)
    assert any("min/maxProperties not enforced at /" in w for w in compiled.warnings)
    for value in ({"a": 1}, {"b": True}, {"a": 1, "b": False}):
        assert serialization_in_language(matcher, value) is not None


def test_draft_07_ref_replaces_its_siblings(smol_tokenizer):
    """Draft-07: "all other properties in a $ref object MUST be ignored"; the engines would
    intersect them (a string that is also an object: nothing)."""
    from constrained_spec.constraint import load_schema

    raw = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
           "properties": {"sensor": {"type": "string", "$ref": "#/definitions/reading"}},
           "definitions": {"reading": {"type": "object", "properties": {"v": {"type": "number"}}, "required": ["v"]}}}
    schema, _ = load_schema(raw)
    assert schema["properties"]["sensor"] == {"$ref": "#/definitions/reading"}
    compiled, matcher = _language(schema, smol_tokenizer)
    assert serialization_in_language(matcher, {"sensor": {"v": 1.5}}) == '{"sensor": {"v": 1.5}}'
    later, _ = load_schema({**raw, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    assert later["properties"]["sensor"]["type"] == "string"  # 2019-09 on: siblings apply


def test_layout_follows_properties_merged_through_all_of(smol_tokenizer):
    from constrained_spec.bench.coverage import _ordered_like

    schema = {"allOf": [{"$ref": "#/definitions/base"}, {"properties": {"z": {"type": "integer"}}}],
              "definitions": {"base": {"properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}}}
    assert list(_ordered_like({"z": 1, "a": 2, "b": 3, "extra": 4}, schema)) == ["b", "a", "z", "extra"]
