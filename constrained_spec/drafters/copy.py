"""Copying from the prompt: the value being written continues as it does in the prompt."""

from __future__ import annotations

import re
from typing import Callable

from ..constraint import Matcher, State
from .base import Draft, Drafter, DraftKind, cut_to_constraint

_PHRASE_END = re.compile(r'[\n"<]|[.,;:!?)(](?=[\s<]|$)|\s+\(')  # "<": a chat marker follows
_STRUCTURAL = re.compile(r'[\[\]{}",:]')
_NEXT_WORD = re.compile(r"\s+([A-Za-z]+)")
#: Words that start the sentence around an extracted value rather than continue it
#: ("Maria Gonzalez| is a", "INV-2291| from", "harbour pilot| in Rotterdam").
_VALUE_STOP_WORDS = frozenset(
    "is are was were be been being at in on from for to and or with by who whom which that as has have had "
    "will would can could may might should does did its his her their our your since until after before".split())


def _value_end(rest: str, value: str) -> int | None:
    """Where the copied prompt text most likely stops being the value, or None if it may go on.

    At a phrase end (punctuation, a quote, a newline, an opening parenthesis), before a
    sentence word, and, for a value that starts capitalized or with a digit (names, titles,
    codes), before the first lower-case word. A guess: a wrong one costs one verify pass at
    most, a right one lets the closing quote and the next key land in the same pass.
    """
    phrase = _PHRASE_END.search(rest)
    limit = phrase.start() if phrase else len(rest)
    first = value.lstrip()[:1]
    proper = first.isupper() or first.isdigit()
    for m in _NEXT_WORD.finditer(rest, 0, limit):
        word = m.group(1)
        if word.lower() in _VALUE_STOP_WORDS or (proper and word[0].islower()):
            return m.start()
    return phrase.start() if phrase else None


class CopyDrafter(Drafter):
    """Copies text from the prompt: the value being written continues as it does in the prompt.

    Matching works on text, not tokens, because a value inside JSON is tokenized differently
    from the same words in running text (``"B``, ``arc``, ``elona`` against `` Barcelona``).
    The tail of the current value is looked up in the prompt; its continuation, up to the end
    of the phrase, is tokenized and proposed. Where the copy ends the value, the closing
    character and the text the constraint forces after it are appended (``", "age": ``), so a
    whole field can land in one verify pass. Deterministic: q is one-hot.
    """

    name = DraftKind.COPY

    def __init__(self, matcher: Matcher, tokenize: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], *, close_values: bool = True,
                 max_chars: int = 48, source: str | None = None) -> None:
        super().__init__(matcher)
        self.tokenize = tokenize
        self.decode = decode
        #: Append the value's closing character and the forced text after it (JSON).
        self.close_values = close_values
        self.max_chars = max_chars
        #: The text to copy from: the user's prompt when the caller knows it (a chat template's
        #: system text would otherwise offer "Hugging Face" after an "H"); else the decoded prompt.
        self.source = source
        self.prompt_len = 0
        self.prompt_text = ""

    def reset(self, prompt_ids: list[int]) -> None:
        """Remember the prompt's length and the text to copy from."""
        self.prompt_len = len(prompt_ids)
        self.prompt_text = self.source if self.source is not None else self.decode(prompt_ids)

    def _continuation(self, output_text: str) -> tuple[str, bool]:
        """Prompt text continuing the current value, and whether it stops at a phrase end."""
        last = None
        for last in _STRUCTURAL.finditer(output_text):
            pass
        value = output_text[last.end():] if last else output_text
        start = self._find(value.lstrip())
        if start < 0:
            return "", False
        rest = self.prompt_text[start : start + self.max_chars]
        end = _value_end(rest, value)
        return (rest[:end], True) if end is not None else (rest, False)

    def _find(self, value: str) -> int:
        """Where the prompt continues ``value``: the end of the last occurrence of its longest
        tail (24, 12 or 6 characters; a whole value must start a word there), matched exactly,
        else ignoring case (a model writes "Architect" for "architect"); -1 if none."""
        if not value:
            return -1
        tails = [t for t in dict.fromkeys(value[-n:] for n in (24, 12, 6)) if len(t) >= 3 or t == value]
        for flags in (0, re.IGNORECASE):
            for tail in tails:
                start = -1
                for m in re.finditer(re.escape(tail), self.prompt_text, flags):
                    at_word_start = m.start() == 0 or not self.prompt_text[m.start() - 1].isalnum()
                    if tail != value or at_word_start:
                        start = m.end()  # the last occurrence: the document comes after the instructions
                if start >= 0:
                    return start
        return -1

    def _closing(self, state: State) -> str:
        """The character that ends the current value here, when only one can, plus forced text."""
        if not self.close_values:
            return ""
        allowed = self.matcher.allowed_bytes(state)
        for close in (b'"', b",", b"}", b"]"):
            if close[0] in allowed and (close == b'"' or sum(b in allowed for b in b",}]") == 1):
                after = self.matcher.forced_bytes(allowed[close[0]])
                return (close + after).decode("utf-8", errors="ignore")
        return ""

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """The copied continuation (and the value's end), cut where the matcher rejects it."""
        if k <= 0 or len(context) <= self.prompt_len:
            return self.empty(state)
        text, phrase_end = self._continuation(self.decode(context[self.prompt_len :]))
        tokens = self.tokenize(text) if text else []
        states = cut_to_constraint(self.matcher, state, tokens)
        if phrase_end or len(states) <= len(tokens):  # the value ends here, by the prompt or the matcher
            copied = self.decode(tokens[: len(states) - 1]) if len(states) > 1 else ""
            closing = self._closing(states[-1])
            if closing:
                tokens = self.tokenize(copied + closing)
                states = cut_to_constraint(self.matcher, state, tokens)
        n = min(k, len(states) - 1)
        return Draft(tokens[:n], states[: n + 1], None, self.name)
