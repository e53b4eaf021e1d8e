"""Schemas as the standard writes them: what was refused or unchecked before, each case by name
(the suite-wide figures are in ``test_schema_suite``)."""

from __future__ import annotations

import pytest

from constrained_spec import (
    InvalidSchemaError, OutputValidationError, UnsupportedSchemaFeatureError, compile_constraint, load_schema,
    validate_json_output,
)
from tests.schema_suite import byte_vocabulary


def _compile(schema, **options):
    return compile_constraint(schema, byte_vocabulary(), **options)


@pytest.mark.parametrize("keyword", ["maxLength", "minLength", "maxItems", "minItems", "maxProperties",
                                     "minProperties", "maxContains", "minContains"])
def test_counts_written_as_floats_are_the_same_schema(keyword: str) -> None:
    loaded = load_schema({keyword: 2.0})
    assert loaded.schema[keyword] == 2 and isinstance(loaded.schema[keyword], int)
    if keyword not in ("maxContains", "minContains"):  # without "contains" they are annotations
        _compile({keyword: 2.0})


def test_a_float_count_with_a_fraction_is_still_invalid() -> None:
    with pytest.raises(InvalidSchemaError, match="Invalid schema at /maxLength"):
        load_schema({"maxLength": 2.5})


def test_unicode_property_classes_compile_and_are_checked() -> None:
    schema = {"type": "string", "pattern": "^\\p{Letter}+$"}
    compiled = _compile(schema)
    matcher = compiled.matcher()
    states = matcher.walk(matcher.initial_state, list('"héllo"'.encode()))
    assert len(states) == len('"héllo"'.encode()) + 1 and matcher.is_final(states[-1])
    assert validate_json_output('"héllo"', schema) == "héllo"
    with pytest.raises(OutputValidationError, match="does not match"):
        validate_json_output('"h1"', schema)
    validate_json_output('{"é": 1}', {"patternProperties": {"^\\p{Letter}$": {"type": "integer"}}})
    with pytest.raises(OutputValidationError):
        validate_json_output('{"é": "x"}', {"patternProperties": {"^\\p{Letter}$": {"type": "integer"}}})


def test_boolean_root_schemas() -> None:
    assert load_schema(True).schema == {}
    _compile(True)
    with pytest.raises(InvalidSchemaError, match="Unsatisfiable schema: `false`.*lenient=True does not change"):
        load_schema(False)
    with pytest.raises(InvalidSchemaError, match="Unsatisfiable schema"):
        _compile({"allOf": [True, False]})


@pytest.mark.parametrize("schema, keyword", [
    ({"minimum": -18446744073709551615}, "minimum"),
    ({"properties": {"n": {"type": "integer", "maximum": -(2**63)}}}, "maximum"),
    ({"type": "integer", "multipleOf": 0.123456789}, "multipleOf"),
])
@pytest.mark.parametrize("lenient", [False, True])
def test_bounds_the_grammar_cannot_hold_are_named(schema: dict, keyword: str, lenient: bool) -> None:
    with pytest.raises(UnsupportedSchemaFeatureError) as caught:
        _compile(schema, lenient=lenient)
    assert caught.value.keyword == keyword
    assert "lenient=True does not relax it" in str(caught.value) and not caught.value.relaxable


def test_integers_past_64_bits_compile() -> None:
    _compile({"type": "integer", "maximum": 2**70})
    _compile({"const": 2**70, "default": 2**80})
    with pytest.raises(OutputValidationError):
        validate_json_output(str(2**70 + 1), {"type": "integer", "maximum": 2**70})


def test_every_refusal_is_an_invalid_schema_error_that_says_which_and_what_lenient_does() -> None:
    assert issubclass(UnsupportedSchemaFeatureError, InvalidSchemaError)
    with pytest.raises(UnsupportedSchemaFeatureError, match="the schema is valid.*lenient=True would compile it") as caught:
        _compile({"type": "array", "uniqueItems": True})
    assert caught.value.relaxable  # what the message says, as a field
    _compile({"type": "array", "uniqueItems": True}, lenient=True)
    with pytest.raises(InvalidSchemaError, match="breaks the JSON Schema standard; lenient=True does not change"):
        load_schema({"type": "strnig"})


@pytest.mark.parametrize("lenient", [False, True])
def test_overlapping_pattern_properties_say_what_mode_refused_them(lenient: bool) -> None:
    schema = {"patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}}}
    with pytest.raises(UnsupportedSchemaFeatureError) as caught:
        _compile(schema, lenient=lenient)
    message = str(caught.value)
    assert "lenient mode" in message and "does not relax it either" in message
    assert "(strict mode)" not in message and "relaxes it." not in message
    assert not caught.value.relaxable


def test_remote_references_are_named_not_fetched() -> None:
    with pytest.raises(UnsupportedSchemaFeatureError, match="remote address") as caught:
        _compile({"properties": {"a": {"$ref": "http://example.com/a.json"}}})
    assert (caught.value.keyword, caught.value.path) == ("$ref", "/properties/a") and not caught.value.relaxable


@pytest.mark.parametrize("fmt, good, bad", [
    ("date", "2020-02-29", "2021-02-29"),
    ("date", "2020-02-29", "\u0662\u0660\u0662\u0660-02-29"),  # digits of another script are not RFC 3339's
    ("date-time", "1998-12-31T23:59:60Z", "1998-12-31T22:59:60Z"),
    ("time", "15:59:60-08:00", "15:58:60-08:00"),
    ("hostname", "example.com", "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 63 + ".com"),
    ("hostname", "xn--ihqwcrb4cv8a8dqg056pqjye", "xn--hello-txk"),
    ("email", "joe.bloggs@example.com", "joe.bloggs@"),
    ("uuid", "2eb8aa08-aa98-11ea-b4aa-73b441d16380", "2eb8aa08-aa98-11ea-b4aa-73b441d1638"),
    ("ipv4", "192.168.0.1", "256.1.1.1"),
])
def test_formats_are_checked_after_decoding(fmt: str, good: str, bad: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert validate_json_output(f'"{good}"', schema) == good
    with pytest.raises(OutputValidationError, match=f"is not a '{fmt}'"):
        validate_json_output(f'"{bad}"', schema)


def test_a_format_the_grammar_lets_through_is_caught() -> None:
    """The grammar of ``date`` allows the 29th of February in any year: the check refuses it,
    so the pipeline never returns it."""
    compiled = _compile({"type": "string", "format": "date"})
    matcher = compiled.matcher()
    states = matcher.walk(matcher.initial_state, list(b'"2021-02-29"'))
    assert len(states) == len(b'"2021-02-29"') + 1 and matcher.is_final(states[-1])
    with pytest.raises(OutputValidationError):
        validate_json_output('"2021-02-29"', {"type": "string", "format": "date"})
