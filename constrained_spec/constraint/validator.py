"""The one JSON Schema validator, of schemas before compiling and of outputs after decoding.

jsonschema's validators, with two changes that make them agree with what the constraint does:

- Patterns (``pattern``, ``patternProperties`` and the ``regex`` format that the meta-schema
  checks patterns with) run on the ``regex`` package, which knows Unicode property classes
  (``\\p{Letter}``) as llguidance does; Python's ``re`` refuses them, so a valid schema was
  refused and its outputs could not be checked.
- ``format`` is an assertion, checked by ``constraint.formats`` (jsonschema's checks, corrected
  where they disagree with the standard). The constraint enforces formats while decoding, with a
  grammar that is looser than the standard for some of them (a 30th of February, a leap second
  at the wrong minute, a hostname over 255 bytes), so the check after decoding is what makes
  sure no output that breaks a format is ever returned. docs/constraints.md lists which formats
  the grammar enforces and which only this check does.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterator

import jsonschema
import regex
from jsonschema.exceptions import ValidationError


@lru_cache(maxsize=1024)
def compiled_pattern(pattern: str) -> regex.Pattern:
    """``pattern`` compiled by the ``regex`` package (cached: schemas repeat their patterns)."""
    return regex.compile(pattern)


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not compiled_pattern(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if compiled_pattern(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _is_regex(text: object) -> bool:
    if isinstance(text, str):
        compiled_pattern(text)
    return True


@lru_cache(maxsize=None)
def _schema_format_checker(base: jsonschema.FormatChecker) -> jsonschema.FormatChecker:
    """The meta-schema's format checks, its ``regex`` (a schema's patterns) compiled by the
    ``regex`` package that ``output_validator`` then runs them on."""
    from .formats import with_checks

    return with_checks(base, {"regex": _is_regex}, raises=regex.error)


@lru_cache(maxsize=1)
def _output_format_checker() -> jsonschema.FormatChecker:
    from .formats import format_checker

    return format_checker()


@lru_cache(maxsize=None)
def _validator_class(cls: type) -> type:
    return jsonschema.validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})


def check_schema(schema: dict) -> None:
    """Raise ``jsonschema.SchemaError`` where ``schema`` breaks its draft's meta-schema."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema, format_checker=_schema_format_checker(cls.FORMAT_CHECKER))


def output_validator(schema: dict) -> Any:
    """A validator of instances under ``schema``: its draft's rules, ``regex`` patterns, and
    every format ``constraint.formats`` knows asserted."""
    return _validator_class(jsonschema.validators.validator_for(schema))(schema, format_checker=_output_format_checker())
