"""JSON layouts: where a constraint allows whitespace between JSON tokens.

"canonical" is Python's ``json.dumps`` style, ``{"a": 1, "b": [1, 2]}``: one fixed layout, so the
grammar drafter can draft every key, quote, colon and comma, and the one the embedded model
writes best (measured: the compact layout made it extract wrong values). "flexible" allows one
optional space at each structural point; "compact" none. "indented" lets the model write either
one line with spaces or pretty-printed JSON: at each structural point nothing, one space, or a
newline and at most ``MAX_INDENT`` spaces, so whitespace is bounded per position (the model
cannot run away in it, as it can under free whitespace) while a model that indents is not forced
into a layout it never writes (the validity counts per layout are in docs/json-output.md).
Any other string is used as the whitespace regex at every structural point.

Each structural point takes one match of the regex, never a repetition of it, on both backends
(tests/test_layout_choice.py), so a regex's bound is the cap per position.
"""

from __future__ import annotations

#: The most spaces after a newline in the "indented" layout: 10 levels of two-space indentation
#: (llama.cpp's own JSON grammar caps it at 20 too).
MAX_INDENT = 20

#: Layout name -> whitespace regex (None: canonical separators ", " and ": ").
JSON_LAYOUTS: dict[str, str | None] = {
    "canonical": None,
    "compact": "",
    "flexible": r"[ ]?",
    "indented": rf"(?:[ ]|\n[ ]{{0,{MAX_INDENT}}})?",
}
DEFAULT_JSON_WHITESPACE = "canonical"


def whitespace_regex(whitespace: str) -> str | None:
    """The whitespace regex of a layout name or a custom regex (None: canonical)."""
    return JSON_LAYOUTS.get(whitespace, whitespace)
