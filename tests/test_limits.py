"""Bounds checked before compile: each refused with the error type of its input and a message
naming the limit and the value; real-world schemas pass; the compiled-constraint cache is
bounded by bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from constrained_spec import InvalidRegexError, InvalidSchemaError
from constrained_spec.constraint import (ConstraintLimits, TokenVocabulary, cache_bytes, clear_cache,
                                         compile_constraint, load_schema, set_cache_bytes)
from constrained_spec.constraint.cache import ByteBoundedLRU
from constrained_spec.constraint.limits import check_regex_limits, check_schema_limits, regex_cost
from constrained_spec.errors import InvalidOptionError

VOCAB = TokenVocabulary.build({1: b"a", 2: b"b", 3: b"{", 4: b"}", 5: b'"', 6: b":", 7: b" ", 8: b",", 9: b"1"}, 0,
                              size=10)
BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"


@pytest.mark.parametrize("pattern, largest, expanded", [
    ("abc", 0, 3),
    ("(ab){3}", 3, 6),
    ("(?:ab|cd){10}", 10, 40),
    ("[a-z]{2,5}x", 5, 6),
    ("a{3,}", 3, 4),
    (r"\d{3}-\d{4}", 4, 8),
    ("(a{1000}){1000}", 1000, 1_000_000),  # nested counts multiply
    ("[]{]{4}", 4, 4),  # a brace inside a class is a literal
    ("x{a}", 0, 4),  # not a count
    ("(?P<n>ab){2}", 2, 4),
])
def test_regex_cost(pattern, largest, expanded):
    assert regex_cost(pattern) == (largest, expanded)


@pytest.mark.parametrize("pattern, limit", [
    ("a{1000000}", "max_repeat"),
    ("(a{1000}){1000}", "max_regex_expanded"),
    ("(ab{100}){300}", "max_regex_expanded"),
    ("a" * (65 << 10), "max_regex_bytes"),
])
def test_a_costly_regex_is_refused_before_compile_naming_the_limit(pattern, limit):
    with pytest.raises(InvalidRegexError, match=limit):
        compile_constraint(pattern, VOCAB, kind="regex")


def test_limits_are_configurable_and_checked():
    check_regex_limits("a{50000}", ConstraintLimits(max_repeat=100_000, max_regex_expanded=100_000))
    with pytest.raises(InvalidRegexError, match="max_repeat"):
        check_regex_limits("a{50}", ConstraintLimits(max_repeat=10))
    with pytest.raises(InvalidOptionError, match="max_repeat"):
        ConstraintLimits(max_repeat=0)
    with pytest.raises(InvalidOptionError, match="limits"):
        compile_constraint("a", VOCAB, kind="regex", limits={"max_repeat": 5})


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_deep_schema_is_refused_as_dict_text_and_file(tmp_path):
    deep = _nested(5000)
    with pytest.raises(InvalidSchemaError, match="max_schema_depth"):
        load_schema(deep)
    text = '{"items": ' * 5000 + "{}" + "}" * 5000  # past the JSON parser's own recursion limit
    with pytest.raises(InvalidSchemaError, match="max_schema_depth"):
        compile_constraint(text, VOCAB)
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(InvalidSchemaError, match="max_schema_depth"):
        load_schema(path)
    load_schema(_nested(30))  # deeper than any of the 9,557 JSONSchemaBench schemas (28)


def test_schema_size_values_and_patterns_are_bounded():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(60_000)}}
    with pytest.raises(InvalidSchemaError, match="max_schema_values"):
        load_schema(wide)
    with pytest.raises(InvalidSchemaError, match="max_schema_bytes"):
        load_schema({"type": "string", "description": "x" * (3 << 20)})
    with pytest.raises(InvalidSchemaError, match=r"/properties/a/pattern.*max_repeat"):
        compile_constraint({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{100000}$"}}}, VOCAB)
    with pytest.raises(InvalidSchemaError, match="patternProperties.*max_regex_expanded"):
        load_schema({"type": "object", "patternProperties": {"(a{200}){200}": {"type": "integer"}}})
    # a pattern inside data (an enum value, a default) is not a regex of the schema
    load_schema({"type": "string", "enum": ["a{1000000}"], "default": {"pattern": "a{1000000}"}})


@pytest.mark.skipif(not BENCH.is_dir(), reason="JSONSchemaBench data not present")
def test_no_real_world_schema_is_refused():
    refused, seen = [], 0
    for path in sorted(BENCH.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            schema = json.loads(line)["schema"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            seen += 1
            try:
                check_schema_limits(schema, text_bytes=len(json.dumps(schema)))
            except InvalidSchemaError as e:
                refused.append((path.name, str(e)))
    assert seen > 9000 and refused == []


def test_byte_bounded_lru_drops_least_recent_by_size():
    sizes = {"a": 40, "b": 40, "c": 40, "big": 500}
    lru: ByteBoundedLRU[str] = ByteBoundedLRU(100, lambda v: sizes[v])
    lru.put(1, "a")
    lru.put(2, "b")
    assert lru.get(1) == "a"  # 1 is now the most recent
    lru.put(3, "c")  # 120 bytes: 2 goes
    assert lru.get(2) is None and lru.get(1) == "a" and lru.get(3) == "c" and lru.nbytes == 80
    lru.put(4, "big")  # alone over the bound: kept, everything else dropped
    assert len(lru) == 1 and lru.get(4) == "big"
    sizes["big"] = 50  # values may shrink or grow: sizes are read again
    lru.resize(10)
    assert len(lru) == 1


def test_the_compile_cache_is_bounded_by_bytes():
    clear_cache()
    held, bound = cache_bytes()
    try:
        set_cache_bytes(8 * 1024)  # room for a few small compiled regexes (about 1 KiB each)
        for i in range(40):
            compile_constraint(f"a{{{i + 1}}}b", VOCAB, kind="regex")
        held_now, _ = cache_bytes()
        assert held_now <= 8 * 1024
        first = compile_constraint("a{40}b", VOCAB, kind="regex")
        assert compile_constraint("a{40}b", VOCAB, kind="regex") is first  # the latest are kept
        with pytest.raises(InvalidOptionError):
            set_cache_bytes(-1)
    finally:
        set_cache_bytes(bound)
        clear_cache()
