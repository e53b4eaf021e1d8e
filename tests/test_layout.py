"""The canonical JSON layout: json.dumps text of valid values matches the outlines-core regex."""

from __future__ import annotations

import json
import re

import pytest

from constrained_spec.constraint import schema_to_regex

OPTIONAL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}}
NESTED = {"type": "object", "properties": {
    "items": {"type": "array", "items": OPTIONAL},
    "meta": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["y"]},
}, "required": ["items"]}


@pytest.mark.parametrize("schema, values", [
    (OPTIONAL, [{}, {"a": 1}, {"b": "x"}, {"c": True}, {"a": 1, "c": False}, {"a": 1, "b": "x", "c": True}, {"b": "x", "c": True}]),
    (NESTED, [{"items": []}, {"items": [{}, {"a": 2, "c": True}], "meta": {"y": 1}}, {"items": [{"b": "q"}], "meta": {"x": 0, "y": 3}}]),
])
def test_canonical_layout_accepts_every_subset_of_optional_properties(schema, values):
    regex = schema_to_regex(schema)
    for value in values:
        assert re.fullmatch(regex, json.dumps(value)), json.dumps(value)
    compact = json.dumps(values[-1], separators=(",", ":"))  # one layout only: the compact one is out
    assert not re.fullmatch(regex, compact)
