"""A JSON Schema pattern as ECMA-262 reads it, written for the engines that run it here.

JSON Schema's ``pattern`` and ``patternProperties`` are ECMA-262 regular expressions, but
every engine here reads another dialect: llguidance and outlines-core read Rust's ``regex``,
the check after decoding runs the ``regex`` package (Python's dialect). Where the dialects
disagree on a pattern, the same schema meant three things (the JSON-Schema-Test-Suite's
``optional/ecmascript-regex.json`` lists the cases):

- ``\\s``/``\\S``: ECMA-262's whitespace is WhiteSpace and LineTerminator (``ECMA_WHITESPACE``),
  so U+FEFF is one and U+0085 is not; Rust and Python use Unicode's White_Space, which says the
  opposite of both (Python adds U+001C-U+001F). ``\\S`` let U+FEFF through everywhere.
- ``\\d``/``\\D`` and ``\\w``/``\\W``: ASCII in ECMA-262 (``[0-9]``, ``[A-Za-z0-9_]``), Unicode
  in Rust and Python (``\\d`` took Arabic-Indic digits, ``\\w`` took ``é``).
- ``\\cX`` (a control character): ECMA-262 only; the others refuse it.
- ``$``: the end of the text in ECMA-262 and Rust; Python's also matches before a final newline.

So a pattern is rewritten once into explicit code-point sets that every engine reads alike
(``ecma_pattern``; ``ecma_python_pattern`` adds the ``$`` of Python), and all of them run the
rewritten pattern. Escapes stay escapes: in ``\\\\s`` the backslash is escaped and ``s`` is a
letter. Everything else is left as written (Unicode property classes, ``\\p{Letter}``, read the
same in all three).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

#: ECMA-262's ``\s`` (22.2.2.9 CharacterClassEscape): WhiteSpace (TAB, VT, FF, ZWNBSP U+FEFF,
#: every Space_Separator) and LineTerminator (LF, CR, U+2028, U+2029), as code-point ranges.
ECMA_WHITESPACE: tuple[tuple[int, int], ...] = (
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
    (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
)
ECMA_DIGIT: tuple[tuple[int, int], ...] = ((0x30, 0x39),)
ECMA_WORD: tuple[tuple[int, int], ...] = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_MAX_CODE_POINT = 0x10FFFF


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Every code point outside ``ranges`` (sorted, disjoint), as ranges."""
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return tuple(out)


def _char(cp: int) -> str:
    r"""One code point as an escape that Rust's ``regex``, the ``regex`` package and ECMA-262
    (in a class) all read: ``\xHH``, ``\uHHHH`` or ``\UHHHHHHHH``."""
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _items(ranges: tuple[tuple[int, int], ...]) -> str:
    """``ranges`` as the inside of a character class."""
    return "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)


#: Each class escape -> the items of a class with the same code points. The negated ones are
#: spelled as positive ranges, so that they also mean the right thing inside another class
#: (``[a\S]``, ``[^\D]``) without nested classes, which the dialects read differently.
_CLASS_ITEMS = {
    "s": _items(ECMA_WHITESPACE), "S": _items(_complement(ECMA_WHITESPACE)),
    "d": _items(ECMA_DIGIT), "D": _items(_complement(ECMA_DIGIT)),
    "w": _items(ECMA_WORD), "W": _items(_complement(ECMA_WORD)),
}
#: Escapes whose operand runs past their letter, in braces (``\p{L}``, ``\x{41}``, ``\u{41}``).
_BRACED = frozenset("pPxuU")
_ASCII_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _rewrite(pattern: str, python: bool) -> str:
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            kind = pattern[i + 1]
            if kind in _CLASS_ITEMS:
                items = _CLASS_ITEMS[kind]
                i += 2
                if not in_class:
                    out.append(f"[{items}]")
                    continue
                # Beside a hyphen, a class escape makes no range to ECMA-262 ([\w-.] is \w, '-'
                # and '.'), but its ranges would: the hyphen is escaped.
                if out and out[-1] == "-":
                    out[-1] = "\\-"
                out.append(items)
                if pattern.startswith("-", i) and not pattern.startswith("-]", i):
                    out.append("\\-")
                    i += 1
            elif kind == "c" and i + 2 < n and pattern[i + 2] in _ASCII_LETTERS:
                out.append(_char(ord(pattern[i + 2]) % 32))  # \cC is U+0003
                i += 3
            elif kind in _BRACED and pattern.startswith("{", i + 2) and "}" in pattern[i + 2:]:
                j = pattern.index("}", i + 2) + 1
                out.append(pattern[i:j])  # \p{Script=Latin}: braces and all, never rewritten
                i = j
            else:
                out.append(pattern[i:i + 2])  # \\ \[ \$ \n ...: the escaped character as it is
                i += 2
            continue
        if c == "[" and not in_class:  # in a class, '[' is a literal to ECMA-262 (no nesting)
            in_class = True
            j = i + 1 + pattern.startswith("^", i + 1)
            j += pattern.startswith("]", j)  # a leading ']' is a literal to the engines here
            out.append(pattern[i:j])
            i = j
            continue
        if c == "]" and in_class:
            in_class = False
        elif c == "$" and not in_class and python:
            c = r"\Z"  # Python's $ also matches before a final newline
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=4096)
def ecma_pattern(pattern: str) -> str:
    r"""``pattern`` (ECMA-262) with ``\s \S \d \D \w \W`` and ``\cX`` written as explicit
    code-point sets, inside classes and out: what Rust's ``regex`` (llguidance, outlines-core)
    must be given to match what ECMA-262 matches."""
    return _rewrite(pattern, python=False)


@lru_cache(maxsize=4096)
def ecma_python_pattern(pattern: str) -> str:
    """``ecma_pattern``, and ``$`` (outside classes) as ``\\Z``: what the ``regex`` package must
    be given to match what ECMA-262 matches."""
    return _rewrite(pattern, python=True)


def with_ecma_patterns(schema: Any) -> Any:
    """A copy of ``schema`` with every ``pattern`` and ``patternProperties`` name rewritten by
    ``ecma_pattern``, for a backend that reads Rust's dialect (the schema itself is unchanged)."""
    from .schema import map_subschemas

    def rewrite(node: dict, _path: str) -> dict:
        pattern, named = node.get("pattern"), node.get("patternProperties")
        if not isinstance(pattern, str) and not isinstance(named, dict):
            return node
        node = dict(node)
        if isinstance(pattern, str):
            node["pattern"] = ecma_pattern(pattern)
        renamed = {ecma_pattern(k): v for k, v in named.items()} if isinstance(named, dict) else {}
        if isinstance(named, dict) and len(renamed) == len(named):  # two names made one: keep both
            node["patternProperties"] = renamed
        return node

    return map_subschemas(schema, rewrite)
