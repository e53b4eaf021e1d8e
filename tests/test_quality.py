"""Field accuracy against expected values, and the bench's reference rows (plumbing, no model)."""

from __future__ import annotations

import json

import pytest

from constrained_spec.bench.single import DEFAULT_PROMPTS, load_prompts
from constrained_spec.bench.quality import field_accuracy

EXPECTED = {"name": "Maria Gonzalez", "age": 34, "tags": ["a", "b"], "paid": True, "total": 1249.5}


@pytest.mark.parametrize("value, right", [
    (EXPECTED, 5),
    ({"name": "  maria   GONZALEZ ", "age": 34.0, "tags": ["b", "a"], "paid": True, "total": 1249.50}, 5),
    ({"name": "Maria", "age": 34, "tags": ["a"], "paid": 1, "total": 1249.5}, 2),  # partial name, list, 1 is not True
    ({"name": "Maria Gonzalez"}, 1),  # missing fields are wrong
    (None, 0),  # unparseable output
    ({"name": "The Maria Gonzalez", "age": "34", "tags": ["a", "b"], "paid": True, "total": 1249.5}, 4),
])
def test_field_accuracy(value, right):
    assert field_accuracy(value, EXPECTED) == (right, 5)


def test_every_bench_prompt_has_expected_values_within_its_schema():
    import jsonschema

    for item in load_prompts(DEFAULT_PROMPTS):
        expected = item["expected"]
        assert set(expected) == set(item["schema"]["properties"]), item["id"]
        jsonschema.validate(expected, item["schema"])
