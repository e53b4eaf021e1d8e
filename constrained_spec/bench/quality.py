"""Field accuracy of extracted values against expected ones (the bench's quality column).

A field counts as right when its value equals the expected one after light normalization:
strings compared case-insensitively with whitespace collapsed and a leading "the " dropped,
numbers by value, lists as sets of normalized items. A missing field is wrong. This measures
whether a precision or a drafter changes what the model extracts, not the model's quality in
general: six prompts and 27 fields are a smoke test, not a benchmark.
"""

from __future__ import annotations

import re
from typing import Any


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        text = re.sub(r"\s+", " ", value).strip().casefold()
        return text[4:] if text.startswith("the ") else text
    if isinstance(value, bool) or value is None:
        return ("literal", value)  # kept apart from numbers: True == 1.0 in Python
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        return frozenset(repr(_norm(v)) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, repr(_norm(v))) for k, v in value.items()))
    return value


def field_accuracy(value: Any, expected: dict[str, Any]) -> tuple[int, int]:
    """``(right, total)`` over the expected top-level fields of one extracted object."""
    got = value if isinstance(value, dict) else {}
    right = sum(1 for k, v in expected.items() if k in got and _norm(got[k]) == _norm(v))
    return right, len(expected)
