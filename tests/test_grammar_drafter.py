"""The grammar-forced, copy and hybrid drafters: only tokens the matcher allows, and honest
accounting, on both constraint backends."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters import CopyDrafter, GrammarDrafter, HybridDrafter, LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama

SCHEMAS = sorted(str(p) for p in (Path(__file__).resolve().parent.parent / "schemas").glob("*.json"))


def tokenize_with(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module", params=["outlines-core", "llguidance"])
def compiled(smol, request):
    """Schema file -> compiled constraint, per backend; each test takes fresh matchers."""
    return {path: compile_constraint(path, smol.tokenizer, backend=request.param) for path in SCHEMAS}


def allowed_tokens(matcher, state):
    return [t for t in matcher.allowed_mask(state).nonzero().flatten().tolist() if t != matcher.eos_token_id]


def person(compiled):
    return compiled[[p for p in SCHEMAS if p.endswith("person.json")][0]].matcher()


@pytest.mark.parametrize("path", SCHEMAS, ids=[Path(p).stem for p in SCHEMAS])
def test_forced_drafts_follow_the_matcher_on_random_walks(smol, compiled, path):
    constraint = compiled[path].matcher()
    drafter = GrammarDrafter(constraint, tokenize_with(smol.tokenizer))
    rng = random.Random(0)
    proposals = 0
    for walk in range(12):
        state = constraint.initial_state
        for _ in range(80):
            d = drafter.propose([], state, 12)
            assert len(d.states) == len(d.tokens) + 1
            assert constraint.walk(state, d.tokens) == d.states  # every token allowed, states right
            assert constraint.eos_token_id not in d.tokens
            proposals += bool(d.tokens)
            if constraint.is_done(state):
                break
            allowed = allowed_tokens(constraint, state)
            if not allowed:
                break
            state = constraint.next_state(state, rng.choice(allowed))
    assert proposals > 0


def test_forced_text_of_the_start_state(smol, compiled):
    constraint = person(compiled)
    drafter = GrammarDrafter(constraint, tokenize_with(smol.tokenizer))
    assert constraint.forced_bytes(constraint.initial_state) == b'{"name": "'
    tokens, _ = drafter.forced(constraint.initial_state)
    assert smol.tokenizer.decode(tokens) == '{"name": "'


def test_hybrid_accounting_adds_up(smol, compiled):
    invoice = compiled[[p for p in SCHEMAS if p.endswith("invoice.json")][0]]
    constraint = invoice.matcher()
    target, draft = tiny_llama(49152, seed=21, init=0.3), tiny_llama(49152, seed=22, init=0.3)
    prompt = smol.tokenizer('Invoice INV-2291 from Acme GmbH, 2024-03-05, 1249.50 EUR, paid.')["input_ids"]
    hybrid = HybridDrafter([GrammarDrafter(constraint, tokenize_with(smol.tokenizer)), LookupDrafter(constraint),
                            ModelDrafter(draft, constraint)])
    res = decode(target, constraint, prompt, drafter=hybrid, k_policy=FixedK(8), max_new_tokens=60)
    st = res.stats
    assert res.tokens == decode(target, invoice.matcher(), prompt, max_new_tokens=60).tokens
    kinds = st.per_kind
    assert {"grammar", "target"} <= set(kinds)
    assert sum(r["drafted"] for r in kinds.values()) == st.drafted
    assert sum(r["accepted"] for k, r in kinds.items() if k != "target") == st.accepted
    assert sum(r["supplied"] for r in kinds.values()) == st.output_tokens
    assert kinds["grammar"]["accepted"] > 0


@pytest.mark.parametrize("k", [1, 4, 12])
def test_grammar_and_hybrid_greedy_identity(smol, compiled, k):
    event = compiled[[p for p in SCHEMAS if p.endswith("event.json")][0]]
    target = tiny_llama(49152 + 64, seed=31, init=0.3)
    text = "Spring Robotics Meetup, Oslo Science Park, 2025-04-17: Ingrid, Lars."
    prompt = smol.tokenizer(text)["input_ids"]
    base = decode(target, event.matcher(), prompt, max_new_tokens=50)
    tok = tokenize_with(smol.tokenizer)
    makers = [
        lambda m: GrammarDrafter(m, tok),
        lambda m: HybridDrafter([GrammarDrafter(m, tok), LookupDrafter(m)]),
        lambda m: HybridDrafter([GrammarDrafter(m, tok), CopyDrafter(m, tok, smol.tokenizer.decode, source=text),
                                 LookupDrafter(m)]),
    ]
    for make in makers:
        m = event.matcher()
        res = decode(target, m, prompt, drafter=make(m), k_policy=FixedK(k), max_new_tokens=50)
        assert res.tokens == base.tokens


def test_copy_drafter_copies_values_and_closes_them(smol, compiled):
    constraint = person(compiled)
    tok = smol.tokenizer
    copy = CopyDrafter(constraint, tokenize_with(tok), lambda ids: tok.decode(ids))
    prompt = tok("Text: Maria Gonzalez is a 34-year-old architect who lives in Barcelona. Bye")["input_ids"]
    copy.reset(prompt)
    for written, expected in [('{"name": "Maria', ' Gonzalez'), ('{"name": "Maria Gonzalez", "age": 3', '4, "city": "'),
                              ('{"name": "Maria Gonzalez", "age": 34, "city": "Bar', 'celona", "occupation": "')]:
        out = tokenize_with(tok)(written)
        state = constraint.walk(constraint.initial_state, out)[-1]
        d = copy.propose(prompt + out, state, 12)
        assert constraint.walk(state, d.tokens) == d.states
        assert tok.decode(d.tokens).startswith(expected), (written, tok.decode(d.tokens))
    # a value start has nothing to copy yet
    out = tokenize_with(tok)('{"name": "')
    state = constraint.walk(constraint.initial_state, out)[-1]
    assert copy.propose(prompt + out, state, 12).tokens == []


@pytest.mark.parametrize("path", SCHEMAS, ids=[Path(p).stem for p in SCHEMAS])
def test_copy_drafts_follow_the_matcher_on_random_walks(smol, compiled, path):
    constraint = compiled[path].matcher()
    tok = smol.tokenizer
    copy = CopyDrafter(constraint, tokenize_with(tok), lambda ids: tok.decode(ids))
    prompt = tok('Maria Gonzalez, 34, Barcelona. INV-2291 Acme Tools GmbH 2024-03-05 1249.50 EUR paid "x" {y}')["input_ids"]
    copy.reset(prompt)
    rng = random.Random(1)
    for _ in range(8):
        out: list[int] = []
        state = constraint.initial_state
        for _ in range(60):
            d = copy.propose(prompt + out, state, 12)
            assert constraint.walk(state, d.tokens) == d.states
            if constraint.is_done(state):
                break
            allowed = allowed_tokens(constraint, state)
            t = rng.choice(d.tokens[:1] + allowed[:50]) if allowed else None
            if t is None:
                break
            out.append(t)
            state = constraint.next_state(state, t)


@pytest.mark.parametrize("backend", ["outlines-core", "llguidance"])
def test_grammar_learns_the_targets_tokenization(smol, backend):
    schema = {"type": "object", "properties": {"zzq": {"type": "boolean"}}, "required": ["zzq"]}
    compiled = compile_constraint(schema, smol.tokenizer, backend=backend)
    constraint = compiled.matcher()
    tok = smol.tokenizer
    grammar = GrammarDrafter(constraint, tokenize_with(tok))
    s0 = constraint.initial_state
    first = grammar.propose([], s0, 12)
    alt = tok.convert_tokens_to_ids("{")
    assert first.tokens[0] != alt  # the tokenizer writes '{"' as one token
    if not constraint.allows(s0, alt):
        pytest.skip(f"{backend} allows only the canonical tokenization of forced text")
    grammar.update(first, 0, alt)  # the target rejected it and wrote '{' instead
    again = GrammarDrafter(constraint, tokenize_with(tok)).propose([], s0, 12)  # later in the request
    assert again.tokens[0] == alt
    assert tok.decode(again.tokens) == tok.decode(first.tokens)
    assert constraint.walk(s0, again.tokens) == again.states
    # learning is per request: a seeded request never depends on what an earlier one learned
    fresh = compiled.matcher()
    assert GrammarDrafter(fresh, tokenize_with(tok)).propose([], fresh.initial_state, 12).tokens == first.tokens


@pytest.mark.parametrize("value, rest, expected", [
    ("Maria", " Gonzalez is a 34-year-old architect", " Gonzalez"),  # a sentence word ends a name
    ("Tom", " Okafor (52) now works", " Okafor"),  # an opening parenthesis
    ("The", " Spring Robotics Meetup takes place", " Spring Robotics Meetup"),  # lower case after a title
    ("harbour", " pilot in Rotterdam.", " pilot"),  # a lower-case value runs to a sentence word
    ("2", "024-03-05. Amount due", "024-03-05"),  # a full stop before a space
    ("daniel.", "kim@northwind.io or call", "kim@northwind.io"),  # a dot inside a word is not an end
    ("Rot", "terdam.<|im_end|>", "terdam"),  # a chat marker follows the document
    ("Bank", " of the West", ""),  # a guess: "of" after a proper name ends it (wrong here; costs one pass)
    ("Acme", " Tools GmbH Berlin", None),  # nothing ends it: copy on
])
def test_copy_guesses_where_a_value_ends(value, rest, expected):
    from constrained_spec.drafters.copy import _value_end

    end = _value_end(rest, value)
    assert (rest[:end] if end is not None else None) == expected


def test_copy_closes_a_name_and_prefers_the_document_over_earlier_text(smol, compiled):
    constraint = person(compiled)
    tok = smol.tokenizer
    copy = CopyDrafter(constraint, tokenize_with(tok), lambda ids: tok.decode(ids))
    # "Maria" occurs twice: in the instructions (followed by "Callas") and in the document
    prompt = tok("Like Maria Callas, write JSON.\nText: Maria Gonzalez is a 34-year-old architect.")["input_ids"]
    copy.reset(prompt)
    out = tokenize_with(tok)('{"name": "Maria')
    state = constraint.walk(constraint.initial_state, out)[-1]
    d = copy.propose(prompt + out, state, 20)
    assert tok.decode(d.tokens) == ' Gonzalez", "age": '  # the name, its close and the forced next key


def test_lookup_ignores_matches_made_of_punctuation(smol, compiled):
    from constrained_spec.constraint import vocabulary_of
    from constrained_spec.drafters import structural_tokens

    constraint = person(compiled)
    tok = smol.tokenizer
    ignore = structural_tokens(vocabulary_of(tok))
    assert all(tok.decode([t]).strip(' \t\n\r"{}[],:') == "" for t in ignore)
    assert tok('": "', add_special_tokens=False)["input_ids"][0] in ignore
    out = tokenize_with(tok)('{"name": "Maria Gonzalez", "age": 34, "city": "')
    state = constraint.walk(constraint.initial_state, out)[-1]
    # the last tokens ' "' also followed "name": ... earlier: a plain lookup proposes "Maria" again
    assert LookupDrafter(constraint).propose(out, state, 4).tokens
    assert LookupDrafter(constraint, ignore=ignore).propose(out, state, 4).tokens == []


def test_copy_matches_a_recased_value_and_a_changed_start(smol):
    """A model that writes "Arch" for the prompt's "architect", or "john.kim@..." for
    "daniel.kim@...", still gets the rest of the value and its end proposed."""
    copy = CopyDrafter(None, None, None,  # type: ignore[arg-type]
                       source="Maria is an architect who lives in Oslo. Mail daniel.kim@northwind.io or call.")
    copy.reset([])
    assert copy._continuation('{"occupation": "Arch') == ("itect", True)
    assert copy._continuation('{"email": "john.kim@north') == ("wind.io", True)
    assert copy._continuation('{"city": "Bergen') == ("", False)  # nothing to copy
