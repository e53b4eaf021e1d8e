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


@pytest.mark.parametrize("required", [[], ["a"], ["b"], ["c"], ["a", "b"], ["a", "c"], ["b", "c"], ["a", "b", "c"]])
def test_canonical_layout_for_every_mix_of_optional_properties(required):
    """Every allowed subset of keys is accepted in json.dumps layout and refused compact (a
    required property before an optional one kept its space only after this was fixed)."""
    import itertools
    import re

    from constrained_spec.constraint import schema_to_regex

    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, "required": required,
              "additionalProperties": False}
    regex = schema_to_regex(schema)
    for n in range(4):
        for keys in itertools.combinations("abc", n):
            value = {k: 1 for k in keys}
            assert bool(re.fullmatch(regex, json.dumps(value))) == (set(required) <= set(keys)), (regex, value)
            if n > 1:
                assert not re.fullmatch(regex, json.dumps(value, separators=(",", ":")))
