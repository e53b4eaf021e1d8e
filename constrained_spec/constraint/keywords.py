"""Schema keywords no draft knows, reported: a misspelled keyword is otherwise ignored.

JSON Schema ignores a keyword it does not know (it is an annotation), so
``{"type": "string", "maxLenght": 3}`` compiles, decodes and validates as if the bound were not
there. ``warn_unknown_keywords`` (called by ``load_schema``) issues one
``UnknownSchemaKeywordWarning`` per unknown keyword that lies close to a known keyword that
constrains values, naming it, its JSON pointer and the keyword meant (difflib's closest match).

Why only those: in the JSONSchemaBench schemas a third hold keywords no draft knows, most of them
meant (vendor extensions such as ``javaType``, ``self``, ``links``, ``propertyOrder``, ``_format``
kept off on purpose; docs/json-output.md has the survey), and a warning for each would teach
users to silence the category, and then the typo goes unseen too. A name one or two edits from a
keyword (``maxLenght``, ``additonalProperties``, ``minlength``, ``item``) is almost always a
mistake, and it costs a constraint only where the keyword meant constrains values: a misspelled
``description`` loses nothing. Names starting ``x-`` (vendor extensions), ``_`` (a keyword kept off)
or ``@`` (JSON-LD) never warn.

Only keyword positions are read: the names inside ``properties``, ``$defs`` and the other maps of
names to sub-schemas are names, not keywords, and the values of ``enum``, ``const``, ``default``
and ``examples`` are data. The value of an unknown keyword is not entered.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Iterator


class UnknownSchemaKeywordWarning(UserWarning):
    """A schema holds a keyword that no JSON Schema draft defines and that lies close to one
    that constrains values (most likely misspelled): it is ignored, as the standard says, so the constraint
    and the check after decoding both act as if it were not there.

    Attributes:
        keyword: the unknown keyword, e.g. ``"maxLenght"``.
        path: JSON pointer of the sub-schema holding it ("/" for the root).
        suggestion: the known keyword it is closest to, e.g. ``"maxLength"``.
    """

    def __init__(self, keyword: str, path: str, suggestion: str) -> None:
        self.keyword = keyword
        self.path = path or "/"
        self.suggestion = suggestion
        super().__init__(
            f"Unknown schema keyword {keyword!r} at {self.path}: no JSON Schema draft defines it, so it is ignored "
            f"(nothing enforces it while decoding or after). Did you mean {suggestion!r}? (A keyword of your own "
            "that is meant: name it 'x-...', or filter UnknownSchemaKeywordWarning.)"
        )


#: Keywords whose value is one sub-schema (draft-03's ``extends`` may be a list too).
_SCHEMA_VALUED = frozenset({
    "additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties", "contentSchema", "extends",
})
#: Keywords whose value is a list of sub-schemas.
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
#: Keywords whose value maps names to sub-schemas (``dependencies``: or to lists of names).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})

#: Every keyword of JSON Schema draft-03 to 2020-12 (core, applicator, validation, meta-data,
#: format, content, unevaluated), and the annotations OpenAPI and pydantic write beside them.
KNOWN_KEYWORDS: frozenset[str] = _SCHEMA_VALUED | _SCHEMA_LISTS | _SCHEMA_MAPS | frozenset({
    # core
    "$schema", "$id", "id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor", "$vocabulary", "$comment",
    # validation
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired",
    # draft-03
    "divisibleBy", "disallow",
    # meta-data, format, content
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples", "format",
    "contentEncoding", "contentMediaType",
    # OpenAPI's and pydantic's annotations
    "discriminator", "nullable", "example", "externalDocs", "xml",
})
#: Known keywords that constrain nothing (annotations, identifiers, containers of definitions): a
#: name close to one of them is not reported, since ignoring it loses no constraint.
ANNOTATIONS: frozenset[str] = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "$comment", "$defs",
    "definitions", "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "contentEncoding", "contentMediaType", "discriminator", "nullable", "example", "externalDocs", "xml",
})
#: The keywords an unknown one is compared with; by their lower case too (``anyof`` is ``anyOf``).
_CONSTRAINING = sorted(KNOWN_KEYWORDS - ANNOTATIONS)
_CONSTRAINING_BY_LOWER_CASE = {k.lower(): k for k in _CONSTRAINING}
#: How close (difflib's ratio) an unknown keyword must be to a constraining one to be reported:
#: above 0.8, where `form` (a form generator's) and `tsType` met `format` and `type`.
CLOSE_MATCH = 0.82
#: Prefixes of names that are meant: vendor extensions, keywords kept off, JSON-LD terms.
_MEANT_PREFIXES = ("x-", "_", "@")


def unknown_keywords(schema: Any) -> Iterator[tuple[str, str, str]]:
    """Every (keyword, JSON pointer of its sub-schema, the known keyword it is closest to) of
    ``schema`` whose keyword no draft knows (``x-``, ``_`` and ``@`` names aside) and that lies
    within ``CLOSE_MATCH`` of a known keyword that constrains values. Walks keyword positions only, without recursion (a schema may be deep)."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        children: list[tuple[str, Any]] = []
        for key, value in node.items():
            if key in _SCHEMA_VALUED:
                items = enumerate(value) if isinstance(value, list) else None
                children += [(f"{path}/{key}/{i}", v) for i, v in items] if items is not None else [(f"{path}/{key}", value)]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                children += [(f"{path}/{key}/{i}", v) for i, v in enumerate(value)]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                children += [(f"{path}/{key}/{_escaped(name)}", v) for name, v in value.items()]
            elif key not in KNOWN_KEYWORDS and not key.startswith(_MEANT_PREFIXES):
                meant = _CONSTRAINING_BY_LOWER_CASE.get(key.lower())
                close = [meant] if meant else difflib.get_close_matches(key, _CONSTRAINING, n=1, cutoff=CLOSE_MATCH)
                if close:
                    yield key, path or "/", close[0]
        stack.extend(reversed(children))  # depth first, in the schema's order


def _escaped(name: str) -> str:
    """``name`` as one JSON pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def warn_unknown_keywords(schema: Any, *, stacklevel: int = 2) -> None:
    """Warn (``UnknownSchemaKeywordWarning``) for each unknown keyword of ``schema`` that lies
    close to a known one (``unknown_keywords``)."""
    for keyword, path, suggestion in unknown_keywords(schema):
        warnings.warn(UnknownSchemaKeywordWarning(keyword, path, suggestion), stacklevel=stacklevel + 1)
