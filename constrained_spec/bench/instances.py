"""Does a constraint's language hold a given JSON value, in any of its serializations?

JSON Schema says nothing about key order or number spelling, but a constraint writes one layout
(keys in ``properties`` order, fixed separators). A valid instance counts as rejected only if
no serialization of the same value is accepted: keys in any order, numbers as written or
positionally (``1e-06`` / ``0.000001``), integral floats as integers, strings with or without
``\\u`` escapes. The search runs on llguidance's byte-level matcher (one token per byte, so no
tokenization question arises) with rollback, and the serialization it finds is then walked
token by token through the real constraint.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Callable

#: Matcher steps one value may spend on the search before it counts as rejected.
DEFAULT_BUDGET = 200_000
_STACK_BYTES = 256 * 1024 * 1024
_RECURSION_LIMIT = 200_000


class _ByteTokens:
    """A tokenizer for llguidance with one token per byte (0-255) and EOS = 256."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteTokens()))


class _OutOfBudget(Exception):
    pass


def _scalar_forms(value: Any) -> list[bytes]:
    """The spellings of one JSON scalar that denote the same value."""
    if isinstance(value, str):
        forms = [json.dumps(value, ensure_ascii=False), json.dumps(value)]
    elif isinstance(value, float):
        forms = [json.dumps(value)]
        if value == value and value not in (float("inf"), float("-inf")):
            if value.is_integer():  # the same number: any integral float has an exact integer spelling
                forms.append(str(int(value)))
            forms.append(format(Decimal(repr(value)), "f"))
    else:  # int, bool, None
        forms = [json.dumps(value)]
    return [f.encode("utf-8") for f in dict.fromkeys(forms)]


class _Search:
    """Depth-first search over serializations, consuming bytes into one matcher with rollback."""

    def __init__(self, matcher: Any, budget: int) -> None:
        self.matcher = matcher
        self.budget = budget
        self.pieces: list[bytes] = []
        self.length = 0
        #: The longest text the language accepted as a prefix, and the piece it refused next.
        self.deepest = (b"", b"")

    def _eat(self, piece: bytes) -> bool:
        self.budget -= 1
        if self.budget < 0:
            raise _OutOfBudget
        n = self.matcher.try_consume_tokens(list(piece))
        if n < len(piece):
            if self.length + n > len(self.deepest[0]):
                self.deepest = (b"".join(self.pieces) + piece[:n], piece[n:])
            if n:
                self.matcher.rollback(n)
            return False
        self.pieces.append(piece)
        self.length += len(piece)
        return True

    def _undo(self, mark: int) -> None:
        while len(self.pieces) > mark:
            piece = self.pieces.pop()
            self.length -= len(piece)
            self.matcher.rollback(len(piece))

    def _then(self, piece: bytes, rest: Callable[[], bool]) -> bool:
        mark = len(self.pieces)
        if self._eat(piece) and rest():
            return True
        self._undo(mark)
        return False

    def value(self, value: Any, rest: Callable[[], bool]) -> bool:
        """Emit ``value`` in some accepted spelling such that ``rest()`` then succeeds."""
        if isinstance(value, dict):
            if not value:
                return self._then(b"{}", rest)
            return self._members(value, list(value), True, rest)
        if isinstance(value, list):
            if not value:
                return self._then(b"[]", rest)
            return self._items(value, 0, rest)
        return any(self._then(form, rest) for form in _scalar_forms(value))

    def _members(self, obj: dict, keys: list[str], first: bool, rest: Callable[[], bool]) -> bool:
        if not keys:
            return self._then(b"}", rest)
        for key in keys:  # tried in the value's order first: pass the value in the constraint's layout
            head = (b"{" if first else b", ") + json.dumps(key, ensure_ascii=False).encode("utf-8") + b": "
            others = [k for k in keys if k != key]
            if self._then(head, lambda: self.value(obj[key], lambda: self._members(obj, others, False, rest))):
                return True
        return False

    def _items(self, items: list, i: int, rest: Callable[[], bool]) -> bool:
        if i == len(items):
            return self._then(b"]", rest)
        head = b"[" if i == 0 else b", "
        return self._then(head, lambda: self.value(items[i], lambda: self._items(items, i + 1, rest)))


def byte_matcher(grammar: str) -> Any:
    """An llguidance matcher for ``grammar`` over single-byte tokens."""
    from llguidance import LLMatcher

    from ..constraint.llguidance import parser_limits

    return LLMatcher(_byte_tokenizer(), grammar, limits=parser_limits())


@dataclass(frozen=True)
class SearchResult:
    """The outcome of looking for a value in a language.

    ``found``: an accepted serialization, or None. ``complete``: the search tried every
    option, so None means the language holds no serialization of the value (False: it ran out
    of budget or depth and cannot tell). ``where``: on failure, the longest accepted prefix the
    search reached, ``⟂``, and the piece the language refused there.
    """

    found: str | None
    complete: bool = True
    where: str = ""


def serialization_in_language(matcher: Any, value: Any, budget: int = DEFAULT_BUDGET) -> str | None:
    """A serialization of ``value`` that ``matcher``'s language accepts as a whole, or None.

    Object keys are tried in the value's own order first, then the others, so a value already
    laid out in the constraint's key order is found without backtracking. None also when the
    search runs out of ``budget`` matcher steps.
    """
    return search_serialization(matcher, value, budget).found


def search_serialization(matcher: Any, value: Any, budget: int = DEFAULT_BUDGET) -> SearchResult:
    """Search ``matcher``'s language for a serialization of ``value`` (see ``SearchResult``)."""
    matcher.reset()
    search = _Search(matcher, budget)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(search.value(value, matcher.is_accepting))
        except _OutOfBudget:
            outcome.append(f" (search stopped after {budget} steps)")
        except RecursionError:
            outcome.append(" (value nested too deeply to search)")

    # Each nesting level and each member costs a few Python frames: search on a thread with
    # a large stack and a raised recursion limit (restored after).
    limit = sys.getrecursionlimit()
    old_stack = threading.stack_size(_STACK_BYTES)
    try:
        sys.setrecursionlimit(max(limit, _RECURSION_LIMIT))
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old_stack)
        sys.setrecursionlimit(limit)
    if outcome and outcome[0] is True:
        return SearchResult(b"".join(search.pieces).decode("utf-8"))
    reason = outcome[0] if outcome and isinstance(outcome[0], str) else ""
    prefix, refused = search.deepest
    where = prefix[-80:].decode("utf-8", "replace") + "⟂" + refused[:40].decode("utf-8", "replace")
    return SearchResult(None, complete=not reason, where=where + reason)
