"""What a schema means, the same while decoding and after it: ECMA-262 patterns, every keyword
lenient mode relaxes checked after decoding, and unknown (misspelled) keywords reported.

No model: the constraints are compiled over a vocabulary of one token per byte
(``tests.schema_suite.byte_vocabulary``), so tokenization cannot hide a language difference.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from constrained_spec.constraint import compile_constraint, load_schema
from constrained_spec.constraint.validator import output_validator
from tests.schema_suite import Case, byte_vocabulary, run_case

D2020 = "https://json-schema.org/draft/2020-12/schema"


def constraint_allows(schema: dict, value: Any, backend: str) -> bool:
    """Whether the compiled constraint allows ``value`` written as ``json.dumps`` writes it
    (characters as they are, not ``\\u`` escapes), byte by byte."""
    matcher = compile_constraint(schema, byte_vocabulary(), backend=backend).matcher()
    state = matcher.initial_state
    for byte in json.dumps(value, ensure_ascii=False).encode():
        state = matcher.next_state(state, byte)
        if state is None:
            return False
    return matcher.is_final(state)


def valid_after_decoding(schema: dict, value: Any) -> bool:
    """Whether the check after decoding passes ``value``."""
    return output_validator(load_schema(schema).schema).is_valid(value)


# ------------------------------------------------------------------------------------------
# 1. Patterns mean what ECMA-262 says
# ------------------------------------------------------------------------------------------

#: ECMA-262's \s: WhiteSpace (TAB, VT, FF, ZWNBSP, every Space_Separator) and LineTerminator.
ECMA_SPACES = "\t\n\v\f\r \u00a0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
#: Whitespace to Python or Rust, but not to ECMA-262 (NEL, the separators Python's \s adds).
NOT_ECMA_SPACES = "\x85\x1c\x1d\x1e\x1f\u180e"


@pytest.mark.parametrize("backend", ["llguidance", "outlines-core"])
@pytest.mark.parametrize("pattern, value, valid", [
    (r"^\S+$", "a\ufeffb", False),  # U+FEFF is ECMA-262 whitespace
    (r"^\S+$", "ab", True),
    (r"^[\S]+$", "a\ufeffb", False),
    (r"^\s$", "\ufeff", True),
    (r"^\s$", "\x85", False),  # NEL: whitespace to Rust and Python, not to ECMA-262
    (r"^[^\s]$", "\x85", True),
    (r"^\d+$", "\u0663", False),  # ARABIC-INDIC DIGIT THREE
    (r"^\D$", "\u0663", True),
    (r"^[^\d]$", "\u0663", True),
    (r"^\w+$", "\u00e9", False),  # é
    (r"^\W$", "\u00e9", True),
    (r"^[\w-]+$", "a-\u00e9", False),
    (r"^a\\?s$", "as", True),  # an escaped backslash, then a plain 's'
    (r"^a\\?s$", "a ", False),
])
def test_pattern_classes_are_ecma_262_while_decoding_and_after(backend, pattern, value, valid):
    schema = {"type": "string", "pattern": pattern}
    assert valid_after_decoding(schema, value) is valid
    assert constraint_allows(schema, value, backend) is valid


@pytest.mark.parametrize("char", list(ECMA_SPACES))
def test_every_ecma_space_is_s_and_not_S(char):
    assert valid_after_decoding({"type": "string", "pattern": r"^\s$"}, char)
    assert not valid_after_decoding({"type": "string", "pattern": r"^\S$"}, char)


@pytest.mark.parametrize("char", list(NOT_ECMA_SPACES))
def test_no_other_character_is_s(char):
    assert not valid_after_decoding({"type": "string", "pattern": r"^\s$"}, char)
    assert valid_after_decoding({"type": "string", "pattern": r"^\S$"}, char)


def test_dollar_does_not_match_before_a_trailing_newline():
    """ECMA-262's ``$`` is the end of the text; Python's also matches before a final newline."""
    assert not valid_after_decoding({"type": "string", "pattern": "^abc$"}, "abc\n")
    assert valid_after_decoding({"type": "string", "pattern": "^abc$"}, "abc")


def test_pattern_properties_are_ecma_262_after_decoding():
    schema = {"type": "object", "patternProperties": {r"^\d+$": {"type": "integer"}}, "additionalProperties": False}
    assert valid_after_decoding(schema, {"42": 1})
    assert not valid_after_decoding(schema, {"\u09ea\u09e8": 1})  # BENGALI DIGITS FOUR, TWO: additional
    assert not valid_after_decoding(schema, {"42": "x"})


def test_unicode_property_in_pattern_properties_beside_additional_properties():
    """jsonschema's own ``additionalProperties`` ran the patterns on Python's ``re``, which
    refuses ``\\p{...}``: the check after decoding raised ``re.error`` instead of answering."""
    schema = {"type": "object", "patternProperties": {r"\p{Letter}cole": True}, "additionalProperties": False}
    assert valid_after_decoding(schema, {"l'\u00e9cole": 1})
    assert not valid_after_decoding(schema, {"L'\u00c9COLE": 1})


# The JSON-Schema-Test-Suite's tests/draft2020-12/optional/ecmascript-regex.json (MIT), its
# groups on character classes, anchors and escapes, with its long sentences cut to the word
# the pattern looks at. ``\a`` (an invalid pattern) is left out: it is about the meta-schema.
LETTER_FR, LETTER_ASCII, LETTER_UP = "l'\u00e9cole", "l'ecole", "L'\u00c9COLE"
ECMASCRIPT_REGEX = [
    ("$ does not match trailing newline", {"type": "string", "pattern": "^abc$"},
     [("abc\n", False), ("abc", True)]),
    ("\\t is a tab", {"type": "string", "pattern": "^\\t$"}, [("\\t", False), ("\t", True)]),
    ("\\cC", {"type": "string", "pattern": "^\\cC$"}, [("\\cC", False), ("\x03", True)]),
    ("\\cc", {"type": "string", "pattern": "^\\cc$"}, [("\\cc", False), ("\x03", True)]),
    ("\\d", {"type": "string", "pattern": "^\\d$"}, [("0", True), ("\u07c0", False)]),
    ("\\D", {"type": "string", "pattern": "^\\D$"}, [("0", False), ("\u07c0", True)]),
    ("\\w", {"type": "string", "pattern": "^\\w$"}, [("a", True), ("\u00e9", False)]),
    ("\\W", {"type": "string", "pattern": "^\\W$"}, [("a", False), ("\u00e9", True)]),
    ("\\s", {"type": "string", "pattern": "^\\s$"},
     [(c, True) for c in " \t\v\f\u00a0\ufeff\n\u2029\u2003"] + [("\x01", False), ("\u2013", False)]),
    ("\\S", {"type": "string", "pattern": "^\\S$"},
     [(c, False) for c in " \t\v\f\u00a0\ufeff\n\u2029\u2003"] + [("\x01", True), ("\u2013", True)]),
    ("\\p{Letter}", {"pattern": "\\p{Letter}cole"}, [(LETTER_ASCII, True), (LETTER_FR, True), (LETTER_UP, False)]),
    ("\\w is ASCII", {"pattern": "\\wcole"}, [(LETTER_ASCII, True), (LETTER_FR, False), (LETTER_UP, False)]),
    ("[a-z]", {"pattern": "[a-z]cole"}, [(LETTER_FR, False), (LETTER_ASCII, True)]),
    ("\\d+", {"pattern": "^\\d+$"}, [("42", True), ("-%#", False), ("\u09ea\u09e8", False)]),
    ("\\p{digit}", {"pattern": "^\\p{digit}+$"}, [("42", True), ("-%#", False), ("\u09ea\u09e8", True)]),
    *[(f"patternProperties {p}", {"type": "object", "patternProperties": {p: True}, "additionalProperties": False},
       [({k: "x"}, v) for k, v in tests]) for p, tests in [
        ("\\p{Letter}cole", [(LETTER_ASCII, True), (LETTER_FR, True), (LETTER_UP, False)]),
        ("\\wcole", [(LETTER_ASCII, True), (LETTER_FR, False), (LETTER_UP, False)]),
        ("[a-z]cole", [(LETTER_FR, False), (LETTER_ASCII, True)]),
        ("^\\d+$", [("42", True), ("-%#", False), ("\u09ea\u09e8", False)]),
        ("^\\p{digit}+$", [("42", True), ("-%#", False), ("\u09ea\u09e8", True)]),
    ]],
]


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "lenient"])
def test_ecmascript_regex_suite_on_the_default_backend(lenient):
    """Every group compiles, no invalid instance is returned, no valid one refused."""
    problems = []
    for name, schema, tests in ECMASCRIPT_REGEX:
        case = Case("ecmascript-regex.json", name, {"$schema": D2020, **schema},
                    [{"description": repr(data), "data": data, "valid": valid} for data, valid in tests])
        outcome = run_case(case, backend="llguidance", lenient=lenient)
        if not outcome.compiled:
            problems.append(f"{name}: refused ({outcome.refusal})")
        problems += [f"{name}: {kind} {label}" for kind in ("false_accepts", "false_rejects", "undetermined")
                     for label in getattr(outcome, kind)]
    assert not problems, problems


def test_ecmascript_regex_suite_after_decoding():
    """The check after decoding alone gives the suite's verdict on every instance."""
    wrong = [(name, data) for name, schema, tests in ECMASCRIPT_REGEX for data, valid in tests
             if valid_after_decoding(schema, data) is not valid]
    assert not wrong, wrong


# ------------------------------------------------------------------------------------------
# 2. A keyword relaxed in lenient mode is checked after decoding
# ------------------------------------------------------------------------------------------

#: For every keyword that can fail an instance: a schema using it and an instance it fails.
VIOLATIONS: dict[str, tuple[dict, Any]] = {
    "type": ({"type": "string"}, 1),
    "enum": ({"enum": [1, 2]}, 3),
    "const": ({"const": 1}, 2),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 1),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "x"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, 3),
    "not": ({"not": {"type": "string"}}, "x"),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 2}}, "a"),
    "then": ({"if": {"type": "string"}, "then": {"minLength": 2}}, "a"),
    "else": ({"if": {"type": "string"}, "then": {}, "else": {"type": "integer"}}, 1.5),
    "$ref": ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, "x"),
    "$dynamicRef": ({"$dynamicAnchor": "n", "type": "object", "properties": {"a": {"$dynamicRef": "#n"}}}, {"a": 1}),
    "$recursiveRef": ({"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": True,
                       "type": "object", "properties": {"a": {"$recursiveRef": "#"}}}, {"a": 1}),
    "minLength": ({"type": "string", "minLength": 2}, "a"),
    "maxLength": ({"type": "string", "maxLength": 1}, "ab"),
    "pattern": ({"type": "string", "pattern": "^a"}, "b"),
    "format": ({"type": "string", "format": "idn-email"}, "no at sign"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, 0.7),
    "minimum": ({"type": "number", "minimum": 2}, 1),
    "maximum": ({"type": "number", "maximum": 2}, 3),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 2}, 2),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 2}, 2),
    "minItems": ({"type": "array", "minItems": 2}, [1]),
    "maxItems": ({"type": "array", "maxItems": 1}, [1, 2]),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, [1, 1]),
    "items": ({"type": "array", "items": {"type": "integer"}}, ["x"]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}]}, ["x"]),
    "contains": ({"type": "array", "contains": {"const": 1}}, [2]),
    "minContains": ({"type": "array", "contains": {"const": 1}, "minContains": 2}, [1, 2]),
    "maxContains": ({"type": "array", "contains": {"const": 1}, "maxContains": 1}, [1, 1]),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{}], "unevaluatedItems": False}, [1, 2]),
    "required": ({"type": "object", "required": ["a"]}, {}),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "x"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, {"ab": "x"}),
    "additionalProperties": ({"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                             {"a": 1, "b": 2}),
    "minProperties": ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, {}),
    "maxProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, {"a": 1, "b": 2}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, {"a": 1}),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
                              {"a": 1, "b": 2}),
}


def test_violations_cover_every_keyword_that_can_fail_an_instance():
    from constrained_spec.constraint.outlines_core_schema import _ASSERTIONS

    assert set(_ASSERTIONS) - set(VIOLATIONS) == set()


def _relaxed_by_lenient_mode(schema: dict) -> bool:
    """Whether strict mode refuses ``schema`` with a keyword that lenient mode relaxes."""
    from constrained_spec.errors import UnsupportedSchemaFeatureError

    try:
        compile_constraint(schema, byte_vocabulary(), lenient=False)
    except UnsupportedSchemaFeatureError as e:
        return e.relaxable
    return False


@pytest.mark.parametrize("keyword", sorted(VIOLATIONS))
def test_a_keyword_lenient_mode_relaxes_is_checked_after_decoding(keyword):
    """Lenient mode may let the constraint allow an instance that breaks a keyword only because
    the check after decoding refuses it; a keyword lenient mode relaxes and that check ignores
    (``dependencies`` under 2020-12) would return invalid values without a word."""
    schema, instance = VIOLATIONS[keyword]
    assert keyword in json.dumps(schema)
    assert not valid_after_decoding(schema, instance), f"{keyword}: {instance!r} passes the check after decoding"
    if _relaxed_by_lenient_mode(schema):
        compiled = compile_constraint(schema, byte_vocabulary(), lenient=True)
        assert compiled.warnings  # it says what it relaxed


# The JSON-Schema-Test-Suite's tests/draft7/dependencies.json (MIT): no ``$schema``, so read as
# 2020-12 here, where lenient mode relaxes ``dependencies``.
DEPENDENCIES_SUITE = [
    ({"dependencies": {"bar": ["foo"]}},
     [({}, True), ({"foo": 1}, True), ({"foo": 1, "bar": 2}, True), ({"bar": 2}, False), (["bar"], True),
      ("foobar", True), (12, True)]),
    ({"dependencies": {"bar": []}}, [({}, True), ({"bar": 2}, True)]),
    ({"dependencies": {"quux": ["foo", "bar"]}},
     [({}, True), ({"foo": 1, "bar": 2}, True), ({"foo": 1, "bar": 2, "quux": 3}, True), ({"foo": 1, "quux": 2}, False),
      ({"bar": 1, "quux": 2}, False), ({"quux": 1}, False)]),
    ({"dependencies": {"bar": {"properties": {"foo": {"type": "integer"}, "bar": {"type": "integer"}}}}},
     [({"foo": 1, "bar": 2}, True), ({"foo": "quux"}, True), ({"foo": "quux", "bar": 2}, False),
      ({"foo": 2, "bar": "quux"}, False), ({"foo": "quux", "bar": "quux"}, False)]),
    ({"dependencies": {"foo": True, "bar": False}},
     [({"foo": 1}, True), ({"bar": 2}, False), ({"foo": 1, "bar": 2}, False), ({}, True)]),
    ({"dependencies": {"foo\nbar": ["foo\rbar"], "foo\tbar": {"minProperties": 4}, "foo'bar": {"required": ['foo"bar']},
                       'foo"bar': ["foo'bar"]}},
     [({"foo\nbar": 1, "foo\rbar": 2}, True), ({"foo\tbar": 1, "a": 2, "b": 3, "c": 4}, True),
      ({"foo'bar": 1, 'foo"bar': 2}, True), ({"foo\nbar": 1, "foo": 2}, False), ({"foo\tbar": 1, "a": 2}, False),
      ({"foo'bar": 1}, False), ({'foo"bar': 2}, False)]),
]


def test_dependencies_suite_in_lenient_mode():
    """Every group compiles in lenient mode, and none of its invalid instances is returned."""
    problems = []
    for i, (schema, tests) in enumerate(DEPENDENCIES_SUITE):
        case = Case("draft7/dependencies.json", f"group {i}", schema,
                    [{"description": repr(data), "data": data, "valid": valid} for data, valid in tests])
        outcome = run_case(case, backend="llguidance", lenient=True)
        assert outcome.compiled, outcome.refusal
        problems += [f"{i}: {kind} {label}" for kind in ("false_accepts", "false_rejects", "undetermined")
                     for label in getattr(outcome, kind)]
    assert not problems, problems


# ------------------------------------------------------------------------------------------
# 3. A misspelled keyword is reported
# ------------------------------------------------------------------------------------------

def _unknown_keyword_warnings(schema: Any) -> list:
    import warnings

    from constrained_spec.constraint.keywords import UnknownSchemaKeywordWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_schema(schema)
    return [w.message for w in caught if issubclass(w.category, UnknownSchemaKeywordWarning)]


def test_a_misspelled_keyword_warns_with_its_path_and_the_keyword_meant():
    found = _unknown_keyword_warnings({"type": "object", "properties": {"code": {"type": "string", "maxLenght": 3}}})
    assert len(found) == 1
    assert (found[0].keyword, found[0].path, found[0].suggestion) == ("maxLenght", "/properties/code", "maxLength")
    text = str(found[0])
    assert "'maxLenght'" in text and "/properties/code" in text and "Did you mean 'maxLength'?" in text


@pytest.mark.parametrize("schema, expected", [
    ({"type": "object", "additonalProperties": False}, [("additonalProperties", "/", "additionalProperties")]),
    ({"type": "string", "minlength": 1}, [("minlength", "/", "minLength")]),
    ({"type": "array", "item": {"type": "integer"}}, [("item", "/", "items")]),
    ({"anyOf": [{"type": "string", "pattren": "^a"}]}, [("pattren", "/anyOf/0", "pattern")]),
    ({"$defs": {"a/b": {"type": "integer", "maximun": 3}}}, [("maximun", "/$defs/a~1b", "maximum")]),
])
def test_misspelled_keywords_anywhere_are_found(schema, expected):
    assert [(w.keyword, w.path, w.suggestion) for w in _unknown_keyword_warnings(schema)] == expected


@pytest.mark.parametrize("schema", [
    # names in maps of names to sub-schemas are not keywords
    {"type": "object", "properties": {"maxLenght": {"type": "integer"}, "itmes": {}},
     "patternProperties": {"requried": {}}, "$defs": {"minimun": {}}, "definitions": {"typ": {}},
     "dependentSchemas": {"patern": {}}, "dependencies": {"enumm": ["typ"]}},
    # data is not keywords
    {"enum": [{"maxLenght": 1}], "const": {"minLenght": 2}, "default": {"patern": 1},
     "examples": [{"requried": []}]},
    # meant names: vendor extensions, keywords kept off, JSON-LD, annotations, far from any keyword
    {"type": "string", "x-maxLenght": 3, "_format": "date", "@type": "Thing", "javaType": "String", "self": {},
     "links": [], "propertyOrder": 1, "decription": "a typo, but of an annotation: no constraint lost"},
    # the value of an unknown keyword is not entered
    {"type": "object", "x-meta": {"maxLenght": 1}, "tsType": {"requried": True}},
    # every known keyword
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/s", "$comment": "c",
     "title": "t", "description": "d", "deprecated": False, "readOnly": False, "writeOnly": False,
     "type": "string", "contentMediaType": "text/plain", "contentEncoding": "base64", "format": "email",
     "minLength": 1, "maxLength": 9, "pattern": "^a"},
])
def test_names_data_and_meant_keywords_do_not_warn(schema):
    assert _unknown_keyword_warnings(schema) == []


def test_pydantic_schemas_do_not_warn():
    from enum import Enum
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9, description="left", examples=[9])

    class Dog(BaseModel):
        kind: Literal["dog"]
        tags: set[str] = Field(default_factory=set, min_length=0, max_length=4, deprecated=True)

    class Owner(BaseModel):
        name: str = Field(pattern=r"^\S+$", min_length=1, max_length=20, title="Name", json_schema_extra={"x-ui": 1})
        pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]
        color: Optional[Color] = None
        ratio: float = Field(default=0.5, multiple_of=0.25, gt=0, lt=1)
        pets: list[Union[Cat, Dog]] = Field(default_factory=list, min_length=0)
        extra: dict[str, int] = {}
        friend: Optional["Owner"] = None

    assert _unknown_keyword_warnings(Owner) == []
    assert _unknown_keyword_warnings(Owner.model_json_schema(mode="serialization")) == []


def _bench_sample(n: int) -> list[dict]:
    """``n`` JSONSchemaBench schemas, the same every run, spread over its subsets."""
    from pathlib import Path

    files = sorted(Path("/work/shared/data/jsonschemabench").glob("*.jsonl"))
    if not files:
        pytest.skip("the JSONSchemaBench data is not here")
    lines = [line for f in files for line in f.read_text().splitlines() if line.strip()]
    step = max(1, len(lines) // n)
    return [json.loads(line)["schema"] for line in lines[::step][:n]]


def test_bench_schemas_warn_only_for_misspellings():
    """On 200 JSONSchemaBench schemas, what warns is a misspelling of a constraining keyword
    (the survey of all of them is in docs/constraints.md)."""
    from constrained_spec.constraint.keywords import unknown_keywords

    found = {(k, s) for schema in _bench_sample(200) for k, _, s in unknown_keywords(schema)}
    assert found == {("additinalProperties", "additionalProperties"), ("exclusiveMinimumm", "exclusiveMinimum"),
                     ("item", "items"), ("type:", "type")}
