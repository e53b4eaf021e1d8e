"""outlines-core's index loses part of a regex's language; the end-marker workaround restores it.

outlines-core 0.2.14 (docs/upstream-outlines-core.md) drops a token whose last byte leaves a
state where the text could already end unless the text after it is complete again, and its
DFA keeps only the leftmost-first match (``a|ab`` never writes ``ab``). The backend indexes
``(?:pattern)<marker>`` instead (constraint/outlines_core.py). Checked here by brute force:
every token sequence up to a length is accepted iff its text fully matches the pattern
(Python's ``re.fullmatch``), on the backend and, as a negative control that shows the check
has power, not on outlines-core's own index.
"""

from __future__ import annotations

import itertools
import re

import pytest
from outlines_core import Index, Vocabulary

from constrained_spec import InvalidRegexError
from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.constraint.outlines_core import MarkedIndex, build_index

EOS = 0
TOKENS = {1: b"a", 2: b"b", 3: b"ab", 4: b"c", 5: b"bc", 6: b"x", 7: b"y", 8: b"z", 9: b"yz", 10: b"zy",
          11: b"1", 12: b"3", 13: b"4", 14: b"14", 15: b".", 16: b".1", 17: b"3.",
          18: b"\x00", 19: b"a\x00"}  # two tokens with the first end-marker candidate's byte
VOCAB = TokenVocabulary.build(TOKENS, EOS, size=21)  # id 20: a padding row
MAX_LEN = 4
#: (pattern for outlines-core, the same language in Python's syntax)
PATTERNS = [
    (r"(ab)?", r"(ab)?"),
    (r"[0-9]+(\.[0-9]+)?", r"[0-9]+(\.[0-9]+)?"),
    (r"a|ab|abc", r"a|ab|abc"),
    (r"x(yz)*", r"x(yz)*"),
    (r"(a|ab)(c|bc)?", r"(a|ab)(c|bc)?"),
    (r"x[ab]*(?-u:\b)", r"x[ab]*\b"),  # an ASCII word boundary at the end sees the marker as the end
    (r"x*$", r"x*"),  # a trailing $ asserts nothing in a whole match
    (r".*", r".*"),  # the marker byte itself is in the language: another marker is proven free
]


def accepted(step, is_final, initial: int, tokens: tuple[int, ...]) -> bool:
    state = initial
    for t in tokens:
        state = step(state, t)
        if state is None:
            return False
    return is_final(state)


def mismatches(step, is_final, initial: int, pattern: str) -> list[bytes]:
    """Texts of token sequences up to MAX_LEN whose acceptance disagrees with ``re.fullmatch``."""
    rx = re.compile(pattern.encode(), re.DOTALL * 0)
    out = []
    for n in range(MAX_LEN + 1):
        for tokens in itertools.product(TOKENS, repeat=n):
            text = b"".join(TOKENS[t] for t in tokens)
            if accepted(step, is_final, initial, tokens) != bool(rx.fullmatch(text)):
                out.append(text)
    return out


@pytest.mark.parametrize("pattern, python_pattern", PATTERNS)
def test_accepts_exactly_the_token_sequences_whose_text_matches(pattern, python_pattern):
    m = compile_constraint(pattern, VOCAB, kind="regex", backend="outlines-core").matcher()
    assert mismatches(m.next_state, m.is_final, m.initial_state, python_pattern) == []


@pytest.mark.parametrize("pattern, python_pattern", PATTERNS[:5])
def test_outlines_core_own_index_fails_the_same_check(pattern, python_pattern):
    """Negative control: the check above catches the unpatched index (if this starts to fail,
    outlines-core fixed its index and the workaround may go)."""
    grouped: dict[bytes, list[int]] = {}
    for t, b in TOKENS.items():
        grouped.setdefault(b, []).append(t)
    index = Index(pattern, Vocabulary(EOS, grouped))
    finals = set(index.get_final_states())
    assert mismatches(index.get_next_state, finals.__contains__, index.get_initial_state(), python_pattern)


@pytest.mark.parametrize("pattern, _", PATTERNS)
def test_mask_agrees_with_next_state(pattern, _):
    """The mask is the set of tokens with a next state, plus EOS exactly in final states; the
    marker's own token (an id past the vocabulary) never shows."""
    m = compile_constraint(pattern, VOCAB, kind="regex", backend="outlines-core").matcher()
    frontier, seen = [m.initial_state], {m.initial_state}
    while frontier:
        state = frontier.pop()
        mask = m.allowed_mask(state)
        assert mask.shape == (VOCAB.size,) and not bool(mask[20])
        with_next = {t for t in TOKENS if m.next_state(state, t) is not None}
        assert set(mask.nonzero().flatten().tolist()) == with_next | ({EOS} if m.is_final(state) else set())
        assert m.next_state(state, VOCAB.size) is None
        for t in with_next:
            nxt = m.next_state(state, t)
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)


def test_a_number_and_a_decimal_regex_can_write_their_fractions(smol_tokenizer):
    """The issue's two cases on the real tokenizer (single-digit tokens: ``3`` then ``.``)."""
    ids = lambda s: smol_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    number = compile_constraint({"type": "number"}, smol_tokenizer, backend="outlines-core").matcher()
    decimal = compile_constraint(r"[0-9]+(\.[0-9]+)?", smol_tokenizer, kind="regex",
                                 backend="outlines-core").matcher()
    for m, text in [(number, "1.1"), (number, "-0.25e+3"), (decimal, "3.14"), (decimal, "3")]:
        states = m.walk(m.initial_state, ids(text))
        assert len(states) == len(ids(text)) + 1 and m.is_final(states[-1]), text
        assert bool(m.allowed_mask(states[-1])[m.eos_token_id])
    m = decimal
    three = m.walk(m.initial_state, ids("3"))[-1]
    assert bool(m.allowed_mask(three)[ids(".")[0]])  # the token outlines-core's own index drops


@pytest.mark.parametrize("pattern, reason", [
    (r"(?s).*", "every ASCII character can follow a complete match"),
    (r"a$b|c", "asserts the end of the text"),
    (r"(?x)a b", "verbose"),
])
def test_patterns_the_workaround_cannot_make_exact_are_refused(pattern, reason):
    with pytest.raises(InvalidRegexError, match=re.escape(reason)):
        compile_constraint(pattern, VOCAB, kind="regex", backend="outlines-core")


@pytest.mark.parametrize("pattern, match", [("a(", "does not compile"), (r"[^\s\S]", "matches nothing"),
                                            ("q", "no sequence of tokens")])
def test_bad_patterns_keep_their_errors(pattern, match):
    with pytest.raises(InvalidRegexError, match=re.escape(match)):
        compile_constraint(pattern, VOCAB, kind="regex", backend="outlines-core")


def test_the_disk_cache_round_trips_a_marked_index(tmp_path, monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path))
    built = build_index(r"(ab)?c", VOCAB)
    assert isinstance(built, MarkedIndex) and len(list((tmp_path / "index").glob("*.pkl"))) == 1
    again = build_index(r"(ab)?c", VOCAB)  # read back from the file
    assert again is not built and again.get_final_states() == built.get_final_states()
    for state in built.final_states | {built.get_initial_state()}:
        assert sorted(again.get_allowed_tokens(state)) == sorted(built.get_allowed_tokens(state))
    assert sorted(built.get_allowed_tokens(built.get_initial_state())) == [1, 3, 4]  # a, ab, c
