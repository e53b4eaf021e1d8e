"""The one JSON Schema validator, of schemas before compiling and of outputs after decoding.

jsonschema's validators, with three changes that make them agree with what the constraint does:

- Patterns (``pattern``, ``patternProperties``, the ``additionalProperties`` they exempt names
  from, and the ``regex`` format that the meta-schema checks patterns with) run on the ``regex``
  package, which knows Unicode property classes (``\\p{Letter}``) as llguidance does; Python's
  ``re`` refuses them, so a valid schema was refused and its outputs could not be checked. They
  run as ECMA-262 reads them (``constraint.ecma_regex``: ``\\s``, ``\\d``, ``\\w``, ``$``), the
  same rewrite the backends decode with, so both sides agree on what a pattern matches.
- ``format`` is an assertion, checked by ``constraint.formats`` (jsonschema's checks, corrected
  where they disagree with the standard). The constraint enforces formats while decoding, with a
  grammar that is looser than the standard for some of them (a 30th of February, a leap second
  at the wrong minute, a hostname over 255 bytes), so the check after decoding is what makes
  sure no output that breaks a format is ever returned. docs/constraints.md lists which formats
  the grammar enforces and which only this check does.
- ``dependencies`` (draft-07 and before) is checked under 2019-09 and 2020-12 too
  (``_dependencies``): lenient mode relaxes every keyword llguidance cannot enforce, on the
  promise that this check enforces it, and a schema without ``$schema`` is read as 2020-12.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterator

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

from .ecma_regex import ecma_python_pattern


@lru_cache(maxsize=1024)
def compiled_pattern(pattern: str) -> regex.Pattern:
    """``pattern`` compiled by the ``regex`` package as it is (cached): a ``generate_regex``
    pattern, in llguidance's dialect. A schema's pattern goes through ``schema_pattern``."""
    return regex.compile(pattern)


@lru_cache(maxsize=1024)
def schema_pattern(pattern: str) -> regex.Pattern:
    """A schema's ``pattern`` (ECMA-262) compiled by the ``regex`` package to match what ECMA-262
    matches (``ecma_regex.ecma_python_pattern``; cached: schemas repeat their patterns)."""
    return regex.compile(ecma_python_pattern(pattern))


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not schema_pattern(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if schema_pattern(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any, schema: dict) -> Iterator[ValidationError]:
    """jsonschema's ``additionalProperties``, with the names ``patternProperties`` covers found by
    ``schema_pattern``: jsonschema's own runs Python's ``re``, which reads ``\\d`` as Unicode
    digits and raises on ``\\p{Letter}``."""
    if not validator.is_type(instance, "object"):
        return
    declared = schema.get("properties", {})
    patterns = [schema_pattern(p) for p in schema.get("patternProperties", {})]
    extras = [k for k in instance if k not in declared and not any(p.search(k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for name in extras:
            yield from validator.descend(instance[name], additional, path=name)
    elif not additional and extras:
        names = ", ".join(repr(k) for k in sorted(extras))
        if "patternProperties" in schema:
            patterns_text = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            yield ValidationError(f"{names} {'does' if len(extras) == 1 else 'do'} not match any of the regexes: "
                                  f"{patterns_text}")
        else:
            yield ValidationError(f"Additional properties are not allowed ({names} "
                                  f"{'was' if len(extras) == 1 else 'were'} unexpected)")


def _is_regex(text: object) -> bool:
    if isinstance(text, str):
        schema_pattern(text)
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


def _dependencies(validator: Any, dependencies: dict, instance: Any, schema: dict) -> Iterator[ValidationError]:
    """draft-04..07's ``dependencies``, for the drafts that split it (2019-09 on: an array is now
    ``dependentRequired``, a schema ``dependentSchemas``). Their validators ignore it as an
    unknown keyword, yet a schema that leaves ``$schema`` out is read as 2020-12, and lenient
    mode relaxes it while decoding (llguidance names it as a keyword it cannot enforce): it was
    enforced nowhere."""
    if not validator.is_type(instance, "object") or not isinstance(dependencies, dict):
        return
    for name, dependency in dependencies.items():
        if name not in instance:
            continue
        if isinstance(dependency, list):
            for required in dependency:
                if required not in instance:
                    yield ValidationError(f"{required!r} is a dependency of {name!r}")
        else:
            yield from validator.descend(instance, dependency, schema_path=name)


@lru_cache(maxsize=None)
def _validator_class(cls: type) -> type:
    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties,
                "additionalProperties": _additional_properties}
    if "dependencies" not in cls.VALIDATORS and "dependentRequired" in cls.VALIDATORS:
        keywords["dependencies"] = _dependencies
    return jsonschema.validators.extend(cls, keywords)


def check_schema(schema: dict) -> None:
    """Raise ``jsonschema.SchemaError`` where ``schema`` breaks its draft's meta-schema."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema, format_checker=_schema_format_checker(cls.FORMAT_CHECKER))


def output_validator(schema: dict) -> Any:
    """A validator of instances under ``schema``: its draft's rules, ``regex`` patterns, and
    every format ``constraint.formats`` knows asserted."""
    return _validator_class(jsonschema.validators.validator_for(schema))(schema, format_checker=_output_format_checker())
