"""The "indented" JSON layout: whitespace the model may choose (one line or pretty-printed),
bounded per structural point, on both backends; and greedy speculative output equal to
target-only output under it (float64 tiny models, no ties)."""

from __future__ import annotations

import json
import re

import pytest

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.constraint.layout import JSON_LAYOUTS, MAX_INDENT
from constrained_spec.constraint.outlines_core_schema import schema_to_regex
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters import CopyDrafter, GrammarDrafter, HybridDrafter, LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama

BACKENDS = ["outlines-core", "llguidance"]
BYTES = TokenVocabulary.build({b + 1: bytes([b]) for b in range(256)}, 0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "inner": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                  "additionalProperties": False},
    },
    "required": ["name", "tags", "inner"],
    "additionalProperties": False,
}
VALUE = {"name": "a", "tags": [1, 2], "inner": {"x": True}}
COMPACT = json.dumps(VALUE, separators=(",", ":"))


def accepts(matcher, text: str) -> bool:
    """Whether ``text`` is a complete member of the language (one byte a token)."""
    state = matcher.initial_state
    for b in text.encode():
        state = matcher.next_state(state, b + 1)
        if state is None:
            return False
    return matcher.is_final(state)


@pytest.fixture(scope="module", params=BACKENDS)
def indented(request):
    return compile_constraint(SCHEMA, BYTES, backend=request.param, whitespace="indented")


def test_one_line_and_pretty_printed_json_are_both_in_the_language(indented):
    m = indented.matcher()
    for text in (json.dumps(VALUE), COMPACT, json.dumps(VALUE, indent=2), json.dumps(VALUE, indent=4)):
        assert accepts(m, text), text


def test_whitespace_is_capped_at_every_structural_point(indented):
    """Wherever a newline and ``MAX_INDENT`` spaces may go, one more space may not: the regex is
    matched once per point, never repeated, so its bound is the cap per position."""
    m = indented.matcher()
    points = []
    for i in range(len(COMPACT) + 1):
        if accepts(m, COMPACT[:i] + "\n" + " " * MAX_INDENT + COMPACT[i:]):
            points.append(i)
            assert not accepts(m, COMPACT[:i] + "\n" + " " * (MAX_INDENT + 1) + COMPACT[i:]), i
            assert accepts(m, COMPACT[:i] + " " + COMPACT[i:]), i
            for extra in ("  ", "\n\n", " \n", "\n\t", "\t"):  # two matches, or a tab: past the layout
                assert not accepts(m, COMPACT[:i] + extra + COMPACT[i:]), (i, extra)
    # after { [ , : and before } ]: every point where canonical or pretty-printed JSON breaks a line
    assert {COMPACT[i - 1] for i in points} >= set("{[,:") and {COMPACT[i] for i in points} >= set("}]")
    assert len(COMPACT) not in points and 0 not in points  # nothing before or after the value: EOS ends it


def test_named_layouts_write_spaces_and_newlines_only():
    """Why outlines-core may take NUL as every named layout's end marker without a probe."""
    for name, ws in JSON_LAYOUTS.items():
        chars = {chr(c) for c in range(256) if ws is not None and re.fullmatch(f"(?:{ws})", chr(c))}
        assert chars <= {" ", "\n"}, name
        assert schema_to_regex(SCHEMA, name).end_marker == 0


PADDED_VOCAB = 49152 + 64
TEXT = ("Event: Spring Robotics Meetup at Oslo Science Park on 2025-04-17, attendees Ingrid and Lars. "
        "Return it as pretty-printed JSON.")


@pytest.fixture(scope="module")
def models():
    return tiny_llama(PADDED_VOCAB, seed=41, init=0.3), tiny_llama(PADDED_VOCAB, seed=42, init=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [1, 4, 12])
def test_greedy_speculative_equals_target_only_under_the_indented_layout(smol, models, backend, k):
    target, draft = models
    compiled = compile_constraint("schemas/event.json", smol.tokenizer, backend=backend, whitespace="indented")
    prompt = smol.tokenizer(TEXT)["input_ids"]
    base = decode(target, compiled.matcher(), prompt, max_new_tokens=60)
    text = smol.tokenizer.decode(base.tokens)
    assert "\n" in text  # the layout is exercised: canonical JSON would not allow this output
    tok = lambda s: smol.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    makers = [
        lambda m: ModelDrafter(draft, m),
        lambda m: LookupDrafter(m),
        lambda m: GrammarDrafter(m, tok),
        lambda m: HybridDrafter([GrammarDrafter(m, tok), CopyDrafter(m, tok, smol.tokenizer.decode, source=TEXT),
                                 LookupDrafter(m), ModelDrafter(draft, m)]),
    ]
    for make in makers:
        m = compiled.matcher()
        res = decode(target, m, prompt, drafter=make(m), k_policy=FixedK(k), max_new_tokens=60)
        assert res.tokens == base.tokens
        assert res.finished == base.finished
