"""JSON schemas: loading and normalizing, and the one walker over sub-schemas.

Every other place that looks inside a schema (backend support checks, keyword paths in error
messages, rewrites) goes through ``iter_subschemas`` or ``map_subschemas``, so they agree on
what a sub-schema is and on its JSON pointer.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from ..errors import InvalidSchemaError

#: Keywords whose value is data, never a sub-schema.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
#: Keywords whose value maps names to sub-schemas (a name is never taken for a keyword).
SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependencies", "dependentSchemas")


class JsonSchema(NamedTuple):
    """A loaded, checked schema: the dict and, when it came from one, the pydantic class."""

    schema: dict
    model_cls: type | None = None


def load_schema(spec: Any, *, limits: Any = None) -> JsonSchema:
    """Normalize a schema given as a dict, JSON text, file path or pydantic class (or an
    already loaded ``JsonSchema``, returned as is).

    Raises ``InvalidSchemaError`` when the input is not a valid JSON schema, or is over
    ``limits`` (a ``ConstraintLimits``; default: ``constraint.limits.DEFAULT_LIMITS``), checked
    before anything recurses into it. For draft-03..07 schemas, keywords beside a ``$ref`` are
    dropped, as those drafts say. Warns ``UnknownSchemaKeywordWarning`` for a keyword no draft
    knows that lies close to one that constrains values (``constraint.keywords``: most likely
    misspelled, and ignored).
    """
    from .limits import DEFAULT_LIMITS, check_schema_bytes, check_schema_limits

    limits = limits or DEFAULT_LIMITS
    if isinstance(spec, JsonSchema):
        return spec
    schema, model_cls = _schema_value(spec, limits)
    if schema is True:  # the schema every value satisfies, as the standard writes it
        schema = {}
    if schema is False:
        raise InvalidSchemaError("Unsatisfiable schema: `false` is a valid schema that no value satisfies, so nothing "
                                 "can be generated (lenient=True does not change that).")
    if not isinstance(schema, dict):
        raise InvalidSchemaError(f"Invalid schema: expected a JSON object or a boolean, got {type(schema).__name__}.")
    check_schema_limits(schema, limits)  # before anything below recurses into it
    try:
        check_schema_bytes(len(json.dumps(schema)), limits)
    except (TypeError, ValueError) as e:
        raise InvalidSchemaError(f"Invalid schema: it is not JSON data ({e}).") from None
    import jsonschema

    from .validator import check_schema

    try:
        check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise InvalidSchemaError(f"Invalid schema at {where}: {e.message} (the schema breaks the JSON Schema "
                                 "standard; lenient=True does not change that).") from None
    from .keywords import warn_unknown_keywords

    warn_unknown_keywords(schema, stacklevel=3)  # a misspelled keyword is ignored by the standard: say so
    if _REF_OVERRIDES_SIBLINGS.search(str(schema.get("$schema", ""))):
        schema = _without_ref_siblings(schema)
    if any(isinstance(node.get(k), float) for _, node in iter_subschemas(schema) for k in COUNT_KEYWORDS):
        schema = map_subschemas(schema, _integral_counts)  # copied only where a count needs it
    return JsonSchema(schema, model_cls)


def _schema_value(spec: Any, limits: Any) -> tuple[Any, type | None]:
    """(the schema as a JSON value, the pydantic class it came from or None): a class's schema,
    a file's or a text's parsed JSON (each within ``limits``), or ``spec`` as it is."""
    model_cls = None
    schema = spec
    if isinstance(schema, type):
        from pydantic import BaseModel

        if not issubclass(schema, BaseModel):
            raise InvalidSchemaError(
                f"Invalid schema: expected a pydantic model class, a dict, JSON text or a file path, got class {schema.__name__}."
            )
        model_cls = schema
        schema = pydantic_schema(schema)
    elif isinstance(schema, os.PathLike) or (
        isinstance(schema, str) and not schema.lstrip().startswith(("{", "[")) and schema.strip()
    ):
        path = Path(schema)
        if not path.is_file():
            raise InvalidSchemaError(f"Invalid schema: expected JSON text or an existing file, got {str(schema)!r} (no such file).")
        if path.stat().st_size > limits.max_schema_bytes:
            raise InvalidSchemaError(f"Invalid schema: {path} has {path.stat().st_size} bytes, over the limit of "
                                     f"{limits.max_schema_bytes} bytes (max_schema_bytes).")
        schema = _parse(path.read_text(), f"{path} is not JSON", limits)
    elif isinstance(schema, str):
        schema = _parse(schema, "the JSON text does not parse", limits)
    return schema, model_cls


#: Keywords whose value is a count. The standard allows any number with a zero fractional part
#: ("2.0"); the grammar engines want an integer.
COUNT_KEYWORDS = frozenset({"maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties",
                            "maxContains", "minContains"})


def _integral_counts(node: dict, _path: str) -> dict:
    """``node`` with counts written as integral floats (``2.0``) made integers: the same schema."""
    if not any(isinstance(node.get(k), float) for k in COUNT_KEYWORDS):
        return node
    return {k: int(v) if k in COUNT_KEYWORDS and isinstance(v, float) else v for k, v in node.items()}


def pydantic_schema(model_cls: Any) -> dict:
    """The JSON schema a pydantic class is decoded under: ``model_json_schema()`` with its
    objects closed (``close_objects``).

    Why: pydantic leaves ``additionalProperties`` out for its default ``extra="ignore"``, which
    by JSON Schema allows any other key, yet validation then drops those keys. Generating them
    only spends tokens, and a model given the freedom can run away inside them: extracting
    ``name`` and ``city`` from a long document, the embedded model wrote ``"country_code_2"``,
    ``"country_code_3"``, ... until the token limit failed the request. OpenAI's structured
    outputs and outlines emit the declared properties only, too. A model that wants other keys
    says so (``extra="allow"``: pydantic writes ``additionalProperties: true``, kept as is;
    ``extra="forbid"`` writes false)."""
    return close_objects(model_cls.model_json_schema())


#: Keywords under which closing an object could refuse what the schema allows:
#: ``additionalProperties`` sees its own object's ``properties`` only, so in
#: ``{"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": ...}}]}`` a closed Base would
#: refuse every object with ``extra``.
_COMBINING = ("not", "if", "then", "else", "dependentSchemas", "dependencies", "unevaluatedProperties", "$dynamicRef")
#: Keywords that each bring a schema of their own to the same object.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref")
_OBJECT_KEYWORDS = ("properties", "patternProperties", "additionalProperties")


def _combines(node: dict) -> bool:
    """Whether ``node`` joins object schemas so that closing one could refuse what another allows."""
    if any(k in node for k in _COMBINING):
        return True
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return True
    applied = [k for k in _APPLICATORS if k in node]
    return len(applied) > 1 or bool(applied and any(k in node for k in _OBJECT_KEYWORDS))


def closed_schema(loaded: JsonSchema, closed: bool = True) -> JsonSchema:
    """``loaded`` with its objects closed to their declared keys (``close_objects``) where
    ``closed``, else as it is: the schema a request decodes with (``SpecOptions.closed``)."""
    return loaded._replace(schema=close_objects(loaded.schema)) if closed else loaded


def close_objects(schema: dict) -> dict:
    """A copy of ``schema`` in which every object that lists its ``properties`` and says nothing
    of others (no ``additionalProperties``), and requires no key it does not declare, takes none
    (``false``): the declared keys only, as
    pydantic classes and a server's ``strict: true`` schemas are decoded. Every output under the
    copy is valid under ``schema``; a schema that joins object schemas (``_combines``: an
    ``allOf`` of several, a ``$ref`` beside ``properties``, ``if``/``then``, ...) is returned as
    written, since closing a part could refuse what the whole allows. Call it on a schema
    already checked against the limits (it recurses)."""
    if any(_combines(node) for _, node in iter_subschemas(schema)):
        return schema

    def close(node: dict, _path: str) -> dict:
        declared = node.get("properties")
        required = node.get("required")
        # An object that requires a key it does not declare, or more keys than it declares, is
        # left open: closed, nothing would satisfy it.
        names_all = not isinstance(required, list) or all(
            name in declared or _matches_a_pattern(name, node.get("patternProperties")) for name in required)
        room = "patternProperties" in node or not isinstance(node.get("minProperties"), int) \
            or node["minProperties"] <= len(declared or {})
        if isinstance(declared, dict) and "additionalProperties" not in node and names_all and room:
            return {**node, "additionalProperties": False}
        return node

    return map_subschemas(schema, close)


def _matches_a_pattern(name: Any, patterns: Any) -> bool:
    """Whether the key ``name`` matches one of ``patternProperties``' patterns (as ECMA-262 reads them)."""
    if not isinstance(patterns, dict) or not isinstance(name, str):
        return False
    from .validator import schema_pattern

    return any(schema_pattern(p).search(name) for p in patterns)


def _parse(text: str, what: str, limits: Any) -> Any:
    """JSON text -> value; a text over the size limit, or nested past the parser's recursion,
    is an ``InvalidSchemaError`` naming the limit, not a ``RecursionError``."""
    from .limits import check_schema_bytes

    check_schema_bytes(len(text.encode("utf-8", errors="surrogatepass")), limits)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidSchemaError(f"Invalid schema: {what} ({e}).") from None
    except RecursionError:
        raise InvalidSchemaError(f"Invalid schema: it nests deeper than the limit of {limits.max_schema_depth} "
                                 "levels (max_schema_depth).") from None


#: Drafts in which ``$ref`` replaces its object: "all other properties in a $ref object MUST be
#: ignored" (draft-07 8.3). The grammar engines intersect the siblings instead (2019-09 rules),
#: which would forbid values the draft allows (``{"type": "string", "$ref": "#/obj"}``).
_REF_OVERRIDES_SIBLINGS = re.compile(r"draft-0[3-7]\b")
_KEPT_BESIDE_REF = frozenset({"$ref", "definitions", "$defs", "$schema", "$id", "id", "title", "description",
                              "$comment"})


def _without_ref_siblings(schema: Any) -> Any:
    """The schema with the keywords a draft-03..07 ``$ref`` overrides removed (definitions kept)."""

    def drop(node: dict, path: str) -> dict:
        if not isinstance(node.get("$ref"), str):
            return node
        return {k: v for k, v in node.items() if k in _KEPT_BESIDE_REF}

    return map_subschemas(schema, drop)


def _children(node: dict, path: str) -> Iterator[tuple[str, Any]]:
    """The values below one schema node that may hold sub-schemas, with their pointers."""
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield f"{path}/{key}/{name}", sub
        else:
            yield f"{path}/{key}", value


def iter_subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every sub-schema (``path``, node), outside in, depth first, the root first.

    Data keywords (``enum``, ``const``, ``default``, ``examples``) are not entered, and in maps
    of names to sub-schemas (``properties``, ``$defs``...) a name is never taken for a keyword.
    """
    if isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from iter_subschemas(value, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    yield path, schema
    for sub_path, value in _children(schema, path):
        yield from iter_subschemas(value, sub_path)


def map_subschemas(schema: Any, fix: Callable[[dict, str], dict], path: str = "") -> Any:
    """A copy of ``schema`` with ``fix(node, json_pointer)`` applied to every sub-schema, outside in
    (the same nodes and pointers as ``iter_subschemas``)."""
    if isinstance(schema, list):
        return [map_subschemas(v, fix, f"{path}/{i}") for i, v in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    node = fix(schema, path)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_subschemas(sub, fix, f"{path}/{key}/{name}") for name, sub in value.items()}
        else:
            out[key] = map_subschemas(value, fix, f"{path}/{key}")
    return out


def keyword_path(schema: Any, keyword: str) -> str | None:
    """JSON pointer of the first sub-schema that uses ``keyword`` ("/" for the root), or None."""
    for path, node in iter_subschemas(schema):
        if keyword in node:
            return path or "/"
    return None
