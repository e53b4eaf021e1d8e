"""Bounds on what a constraint may cost, checked before anything is compiled.

A constraint is untrusted input on a server: a pattern's counted repetitions cost the automaton
builders time and memory in proportion to their expanded size (a million-fold ``a{1000000}`` takes
seconds and gigabytes), and a schema nested thousands of objects deep overflows the recursion of
every JSON and JSON-schema library on the way (docs/constraints.md, "Limits", has the costs). So each is measured first, by a walk that never
recurses, and refused with an error naming the limit and the value:

- a schema's nesting depth, its number of JSON values and its size in bytes;
- a regex's size, its largest counted repetition ``{m,n}``, and its *expanded* size: the
  pattern's length with every counted repetition written out (``(ab){3}`` counts as 6), which is
  what the automaton builders pay for; a schema's ``pattern`` keywords are checked the same way.

The defaults refuse none of the JSONSchemaBench schemas and keep the compile of any pattern they
let through to a fraction of a second (docs/constraints.md, "Limits"). The backends' own
bounds (llguidance's grammar size and lexer states, the compile deadline) stay behind these.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import InvalidOptionError, InvalidRegexError, InvalidSchemaError


@dataclass(frozen=True)
class ConstraintLimits:
    """What a schema or pattern may cost (see the module docstring); every field must be >= 1.

    Attributes:
        max_schema_depth: how deeply the schema's JSON may nest (objects and arrays).
        max_schema_values: how many JSON values (objects, arrays, scalars) the schema may hold.
        max_schema_bytes: the schema's size as JSON text.
        max_regex_bytes: a pattern's length in bytes (UTF-8).
        max_repeat: the largest count of one counted repetition, ``{m}`` / ``{m,n}``.
        max_regex_expanded: the pattern's size with counted repetitions expanded.
    """

    max_schema_depth: int = 64
    max_schema_values: int = 100_000
    max_schema_bytes: int = 2 << 20
    max_regex_bytes: int = 64 << 10
    max_repeat: int = 10_000
    max_regex_expanded: int = 20_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOptionError(f"Invalid {f.name}: expected an integer >= 1, got {value!r}.")

    def with_(self, **changes: int) -> "ConstraintLimits":
        """A copy with some limits changed."""
        return replace(self, **changes)


DEFAULT_LIMITS = ConstraintLimits()


# --------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------

def json_depth_and_values(value: Any, stop_depth: int | None = None) -> tuple[int, int]:
    """The nesting depth (a scalar is 1) and the number of JSON values of ``value``, walked with
    an explicit stack; the walk stops early once ``stop_depth`` is passed."""
    depth = values = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, d = stack.pop()
        values += 1
        if d > depth:
            depth = d
            if stop_depth is not None and depth > stop_depth:
                break
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, d + 1) for v in node)
    return depth, values


def check_schema_limits(schema: Any, limits: ConstraintLimits = DEFAULT_LIMITS, text_bytes: int | None = None) -> None:
    """Raise ``InvalidSchemaError`` naming the limit when ``schema`` (a parsed JSON value) is too
    deep, holds too many values, or is too large (``text_bytes``: its JSON text's size, if
    known), or when one of its regexes (``pattern``, ``patternProperties``) is over the regex
    limits."""
    if text_bytes is not None:
        check_schema_bytes(text_bytes, limits)
    depth, values = json_depth_and_values(schema, stop_depth=limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise InvalidSchemaError(f"Invalid schema: it nests deeper than the limit of {limits.max_schema_depth} levels "
                                 "(max_schema_depth).")
    if values > limits.max_schema_values:
        raise InvalidSchemaError(f"Invalid schema: {values} JSON values is over the limit of "
                                 f"{limits.max_schema_values} (max_schema_values).")
    for where, pattern in _schema_patterns(schema):
        try:
            check_regex_limits(pattern, limits)
        except InvalidRegexError as e:
            raise InvalidSchemaError(f"Invalid schema at {where}: {e}") from None


def check_schema_bytes(text_bytes: int, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """Raise ``InvalidSchemaError`` when a schema's JSON text of ``text_bytes`` is over the limit."""
    if text_bytes > limits.max_schema_bytes:
        raise InvalidSchemaError(f"Invalid schema: {text_bytes} bytes is over the limit of {limits.max_schema_bytes} "
                                 "bytes (max_schema_bytes).")


def _schema_patterns(schema: Any) -> list[tuple[str, str]]:
    """Every regex of a schema with its JSON pointer (``pattern`` values, ``patternProperties``
    names), found without recursion; data keywords are not entered."""
    from .schema import DATA_KEYWORDS

    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in DATA_KEYWORDS:
                continue
            if key == "pattern" and isinstance(value, str):
                found.append((f"{path}/pattern", value))
            elif key == "patternProperties" and isinstance(value, dict):
                found.extend((f"{path}/patternProperties", name) for name in value)
            stack.append((value, f"{path}/{key}"))
    return found


# --------------------------------------------------------------------------------------------
# Regexes
# --------------------------------------------------------------------------------------------

def check_regex_limits(pattern: str, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """Raise ``InvalidRegexError`` naming the limit when ``pattern`` is too long, has a counted
    repetition over ``max_repeat``, or expands past ``max_regex_expanded``."""
    size = len(pattern.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_regex_bytes:
        raise InvalidRegexError(f"Invalid regex: {size} bytes is over the limit of {limits.max_regex_bytes} bytes "
                                "(max_regex_bytes).")
    largest, expanded = regex_cost(pattern)
    if largest > limits.max_repeat:
        raise InvalidRegexError(f"Invalid regex {pattern[:80]!r}: a repetition count of {largest} is over the limit "
                                f"of {limits.max_repeat} (max_repeat).")
    if expanded > limits.max_regex_expanded:
        raise InvalidRegexError(f"Invalid regex {pattern[:80]!r}: written out, its counted repetitions come to "
                                f"{expanded} units, over the limit of {limits.max_regex_expanded} "
                                "(max_regex_expanded); nested counts multiply.")


def _count(pattern: str, i: int) -> tuple[int, int] | None:
    """``(largest count, end index)`` when ``pattern[i]`` opens a counted repetition ``{m}``,
    ``{m,}`` or ``{m,n}``; None when the brace is a literal."""
    j = pattern.find("}", i)
    if j < 0:
        return None
    body = pattern[i + 1 : j].replace(" ", "")
    lo, sep, hi = body.partition(",")
    if not lo.isdigit() and not (sep and not lo):  # "{,n}" is a count in some dialects
        return None
    if hi and not hi.isdigit():
        return None
    # Digits of a huge count are not turned into an int (a DoS of its own): 10 digits is enough.
    numbers = [int(x[:10]) for x in (lo, hi) if x]
    return max(numbers, default=0), j + 1


def regex_cost(pattern: str) -> tuple[int, int]:
    """``(largest repetition count, expanded size)`` of a pattern, by one left-to-right scan.

    The expanded size counts one unit per literal, class or escape, a group as the sum of its
    branches, and multiplies a counted repetition's operand by its largest count (``{m,}`` by
    ``m + 1``); ``*``, ``+`` and ``?`` add nothing, as an automaton builds them as loops. It is a
    measure of cost, not a parser: a pattern it reads wrongly is still checked by the backend.
    """
    largest = 0
    # One frame per open group: [units so far, units of the last operand].
    stack: list[list[int]] = [[0, 0]]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        if c == "(":
            stack.append([0, 0])
            i = _group_body_start(pattern, i + 1)
        elif c == ")":
            if len(stack) > 1:
                inner = stack.pop()[0]
                stack[-1][0] += inner
                stack[-1][1] = inner
            i += 1
        elif c == "|":
            frame[1] = 0
            i += 1
        elif c in "*+?":
            i += 1
        elif c == "{" and (counted := _count(pattern, i)) is not None:
            count, i = counted
            largest = max(largest, count)
            _repeat_last_operand(frame, count, open_ended=pattern[i - 2] == ",")
            if i < n and pattern[i] in "?+":  # lazy / possessive
                i += 1
        else:  # one unit: an escape, a class, or a literal (a brace that is no count among them)
            i = i + 2 if c == "\\" else _class_end(pattern, i) if c == "[" else i + 1
            frame[0] += 1
            frame[1] = 1
    while len(stack) > 1:  # an unclosed group: the backend will refuse it; count what is there
        inner = stack.pop()[0]
        stack[-1][0] += inner
    return largest, stack[0][0]


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at ``i`` (a leading ']' or '^]' is a literal)."""
    n = len(pattern)
    j = i + 1
    if j < n and pattern[j] == "^":
        j += 1
    if j < n and pattern[j] == "]":
        j += 1
    while j < n and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group_body_start(pattern: str, i: int) -> int:
    """Where the body of the group opened just before ``i`` starts: past a head such as ``?:``,
    ``?P<name>``, ``?i`` or a lookaround's."""
    if not pattern.startswith("?", i):
        return i
    n = len(pattern)
    j = i + 1
    while j < n and pattern[j] not in ":)" and not (pattern[j] == ">" and pattern[i:i + 2] in ("?P", "?<")):
        j += 1
    return j + 1 if j < n and pattern[j] in ":>" else j


def _repeat_last_operand(frame: list[int], count: int, *, open_ended: bool) -> None:
    """Count the group's last operand ``count`` times (``{m,}``: ``m + 1``, m copies and a loop)."""
    # The operand was counted once already; the rest of its copies come on top.
    extra = frame[1] * (max(count, 1) - 1) if count else 0
    if open_ended:
        extra = frame[1] * count
    frame[0] += extra
    frame[1] += extra
