"""JSON layouts: where a constraint allows whitespace between JSON tokens.

"canonical" is Python's ``json.dumps`` style, ``{"a": 1, "b": [1, 2]}``: one fixed layout, so the
grammar drafter can draft every key, quote, colon and comma, and the one the embedded model
writes best (measured: the compact layout made it extract wrong values). "flexible" allows one
optional space at each structural point; "compact" none. Any other string is used as the
whitespace regex at every structural point.
"""

from __future__ import annotations

#: Layout name -> whitespace regex (None: canonical separators ", " and ": ").
JSON_LAYOUTS: dict[str, str | None] = {"canonical": None, "compact": "", "flexible": r"[ ]?"}
DEFAULT_JSON_WHITESPACE = "canonical"


def whitespace_regex(whitespace: str) -> str | None:
    """The whitespace regex of a layout name or a custom regex (None: canonical)."""
    return JSON_LAYOUTS.get(whitespace, whitespace)
