"""Both backends on the real tokenizer: the same masks, forced text, refusals and greedy identity.
(The brute-force contract on small languages is in test_constraint_contract.py.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from pathlib import Path

import pytest
import torch

from constrained_spec import ModelHandle, UnsupportedSchemaFeatureError, compile_constraint, generate_json
from constrained_spec.constraint import GuidanceMatcher
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters import CopyDrafter, GrammarDrafter, HybridDrafter, LookupDrafter
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parent.parent
PERSON = json.loads((ROOT / "schemas" / "person.json").read_text())
REGEXES = [r"[a-c]{2,4}x?", r"\d{3}-\d{4}", r"(ab|cd)-[0-9a-f]{2,3}"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_same_masks_for_the_same_regex(smol_tokenizer, pattern):
    """Along six seeded random walks of up to 12 tokens (each token drawn from llguidance's
    mask, EOS left out), both backends agree at every state: the same forced bytes, the same
    ``is_final`` and ``is_done``, and the same mask wherever no text is forced; in a forced
    stretch llguidance allows only the canonical tokenization of the forced text, so its mask is
    a non-empty subset of outlines-core's. Every drawn token is allowed by both."""
    o = compile_constraint(pattern, smol_tokenizer, kind="regex", backend="outlines-core").matcher()
    g = compile_constraint(pattern, smol_tokenizer, kind="regex", backend="llguidance").matcher()
    assert isinstance(g, GuidanceMatcher)
    rng = random.Random(0)
    for _ in range(6):
        so, sg = o.initial_state, g.initial_state
        for _ in range(12):
            mo, mg = o.allowed_mask(so), g.allowed_mask(sg)
            assert o.forced_bytes(so) == g.forced_bytes(sg)
            if o.forced_bytes(so):
                assert bool((mg <= mo).all()) and bool(mg.any())
            else:
                assert torch.equal(mo, mg)
            assert o.is_final(so) == g.is_final(sg) and o.is_done(so) == g.is_done(sg)
            choices = [t for t in mg.nonzero().flatten().tolist() if t != o.eos_token_id]
            if not choices:
                break
            t = rng.choice(choices)
            so, sg = o.next_state(so, t), g.next_state(sg, t)
            assert so is not None and sg is not None


def test_llguidance_rollback_leaves_identical_masks(smol_tokenizer):
    compiled = compile_constraint(PERSON, smol_tokenizer, backend="llguidance")
    tok = lambda s: smol_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    a, b = tok('{"name": "Maria'), tok('{"name": "Tom Okafor", "age": 5')
    first = compiled.matcher()
    sa = first.walk(first.initial_state, a)[-1]
    mask_a = first.allowed_mask(sa).clone()
    sb = first.walk(first.initial_state, b)[-1]  # moves the matcher away (rollback + consume)
    first.allowed_mask(sb)
    fresh = compiled.matcher()  # no caches: the mask comes from the matcher again
    fresh.walk(fresh.initial_state, b)
    sa2 = fresh.walk(fresh.initial_state, a)[-1]
    assert len(fresh.walk(fresh.initial_state, a)) == len(a) + 1
    assert torch.equal(fresh.allowed_mask(sa2), mask_a)
    assert fresh.forced_bytes(fresh.initial_state) == b'{"name": "'


def test_json_forced_text_agrees(smol_tokenizer):
    for backend in ("outlines-core", "llguidance"):
        c = compile_constraint(PERSON, smol_tokenizer, backend=backend).matcher()
        assert c.forced_bytes(c.initial_state) == b'{"name": "'


def test_llguidance_greedy_identity_with_drafters(smol):
    compiled = compile_constraint(PERSON, smol.tokenizer, backend="llguidance")
    target = tiny_llama(49152 + 64, seed=51, init=0.3)
    prompt = smol.tokenizer('Record: name "Maria Gonzalez", age 34, city "Barcelona", occupation "architect".')["input_ids"]
    base = decode(target, compiled.matcher(), prompt, max_new_tokens=40)
    tokenize = lambda s: smol.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for k in (1, 4, 12):
        c = compiled.matcher()
        hybrid = HybridDrafter([GrammarDrafter(c, tokenize), CopyDrafter(c, tokenize, smol.tokenizer.decode),
                                LookupDrafter(c)])
        assert decode(target, c, prompt, drafter=hybrid, k_policy=FixedK(k), max_new_tokens=40).tokens == base.tokens


def test_strict_refuses_and_lenient_names_what_it_relaxed(smol_tokenizer):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
              "required": ["tags"]}
    with pytest.raises(UnsupportedSchemaFeatureError) as err:
        compile_constraint(schema, smol_tokenizer, backend="llguidance")
    assert err.value.keyword == "uniqueItems"
    handle = ModelHandle(tiny_llama(49152, seed=52, init=0.3), smol_tokenizer, "tiny")
    schema2 = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "multipleOf": 2}},
               "required": ["ok"]}
    try:
        _, stats = generate_json(handle, schema2, "ok?", backend="llguidance", lenient=True, max_new_tokens=12,
                                 return_stats=True)
        assert stats.backend == "llguidance"
    except Exception as e:  # a random model may not finish or may break the relaxed keyword: never silently
        assert type(e).__name__ in ("TokenLimitError", "OutputValidationError")


def test_llguidance_enforces_minimum_and_maximum(smol_tokenizer):
    handle = ModelHandle(tiny_llama(49152, seed=53, init=0.3), smol_tokenizer, "tiny")
    schema = {"type": "integer", "minimum": 5, "maximum": 9}
    with pytest.raises(UnsupportedSchemaFeatureError, match="minimum"):
        generate_json(handle, schema, "a number", backend="outlines-core")
    for seed in range(5):
        value = generate_json(handle, schema, "a number", backend="llguidance", temperature=1.0, seed=seed)
        assert 5 <= value <= 9


def test_compile_timeout_leaves_nothing_running(smol_tokenizer):
    big = json.loads((ROOT / "schemas" / "contact.json").read_text())
    with pytest.raises(TimeoutError, match="longer than"):
        compile_constraint({**big, "title": "timeout-probe"}, smol_tokenizer, backend="outlines-core", timeout_s=0.001)
    assert not mp.active_children()
    c = compile_constraint(PERSON, smol_tokenizer, backend="llguidance", timeout_s=30)
    m = c.matcher()
    assert m.forced_bytes(m.initial_state)
    assert not mp.active_children()


@pytest.mark.parametrize("kind, source", [
    ("regex", "((a{1,100}){1,100}){1,100}b"),
    ("regex", "(" + "|".join(f"x{i}y{i}z" for i in range(3000)) + ")"),
    ("json", {"type": "string", "pattern": "^((([a-z]{1,30}){1,30}){1,30}){1,30}$"}),
    ("json", {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 30}}}$"}},
                         "required": [f"k{i}"]} for i in range(300)]}),
    ("json", json.loads('{"type":"object","properties":{"a":' * 60 + '{"type":"integer"}' + '}}' * 60)),
])
def test_pathological_constraints_are_bounded_without_a_process(smol_tokenizer, kind, source):
    """llguidance's own limits bound these (measured: at most ~0.5 s here); with timeout_s the
    compile runs in a thread, so no process is spawned, and a tight deadline raises in time."""
    import time

    from constrained_spec.constraint import clear_cache

    clear_cache()
    t0 = time.perf_counter()
    try:
        compile_constraint(source, smol_tokenizer, kind=kind, backend="llguidance", lenient=True, timeout_s=10)
    except ValueError:  # refused with a named reason is bounded too
        pass
    assert time.perf_counter() - t0 < 5
    assert not mp.active_children()


def test_llguidance_deadline_raises_in_time(smol_tokenizer, monkeypatch):
    """The deadline answers on time even if a compile ran long (simulated: the real pathological
    cases finish in milliseconds once the tokenizer's tables are built)."""
    import time

    from constrained_spec.constraint import clear_cache
    from constrained_spec.constraint import compile as compile_module

    clear_cache()
    monkeypatch.setattr(compile_module, "_compile", lambda *a, **k: time.sleep(2))
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="longer than"):
        compile_constraint("[0-9]+", smol_tokenizer, kind="regex", backend="llguidance", timeout_s=0.05)
    assert time.perf_counter() - t0 < 1
    assert not mp.active_children()


@pytest.mark.parametrize("prefix, explored, then", [
    ('{"a":', ' {"b":', ' ["'),
    ('{"a": {"required":', ' {"array":', ' ["'),  # the held-out generation prompt where it was seen
])
def test_a_walk_back_from_an_explored_draft_gives_the_masks_of_a_fresh_replay(smol_tokenizer, prefix, explored, then):
    """Masks computed along a draft that opened a nested object's key, then a different token
    from the draft's start: every mask equals a fresh matcher's along the same tokens. With
    llguidance 1.9.1's rollback the third mask allowed '":' inside the array and refused '",'
    (greedy speculative output then left target-only output); the matcher now moves back by
    copying a snapshot, never by rolling back."""
    ids = lambda text: smol_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    compiled = compile_constraint({"type": "object"}, smol_tokenizer, backend="llguidance")
    m = compiled.matcher()
    start = m.walk(m.initial_state, ids(prefix))[-1]
    draft = m.walk(start, ids(explored))
    assert len(draft) == len(ids(explored)) + 1
    for state in draft:
        m.allowed_mask(state)
    after = m.next_state(start, ids(then)[0])
    assert after is not None
    fresh = compiled.matcher()
    path = ids(prefix) + ids(then)[:1]
    expected = fresh.allowed_mask(fresh.walk(fresh.initial_state, path)[-1])
    assert torch.equal(m.allowed_mask(after), expected)
    # And back down the explored draft: its masks again equal a fresh replay's.
    for state, n in zip(draft[1:], range(1, len(draft))):
        replay = compiled.matcher()
        want = replay.allowed_mask(replay.walk(replay.initial_state, ids(prefix) + ids(explored)[:n])[-1])
        assert torch.equal(m.allowed_mask(state), want)


def _takes(compiled, text: str, tokenizer) -> bool:
    """Whether ``text`` (as the tokenizer cuts it) is a complete output of ``compiled``."""
    m = compiled.matcher()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    states = m.walk(m.state, ids)
    return len(states) == len(ids) + 1 and m.is_done(states[-1])


@pytest.mark.parametrize("backend", ["llguidance", "outlines-core"])
def test_a_pydantic_class_is_decoded_with_its_declared_fields_only(smol_tokenizer, backend):
    """Pydantic's default ``extra="ignore"`` writes no ``additionalProperties``, which JSON Schema
    reads as "any other key"; validation would drop such keys, so decoding closes those objects,
    nested ones too (a model ran away inside them). ``extra="allow"`` stays open, a dict field
    keeps its value schema, and a dict schema is taken as written."""
    from pydantic import BaseModel, ConfigDict

    from constrained_spec.constraint.schema import pydantic_schema

    class City(BaseModel):
        name: str

    class Person(BaseModel):
        name: str
        city: City
        scores: dict[str, int]

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str

    closed = compile_constraint(Person, smol_tokenizer, backend=backend)
    assert _takes(closed, '{"name": "Ana", "city": {"name": "Oslo"}, "scores": {"a": 1}}', smol_tokenizer)
    assert not _takes(closed, '{"name": "Ana", "city": {"name": "Oslo"}, "scores": {"a": 1}, "age": 3}', smol_tokenizer)
    assert not _takes(closed, '{"name": "Ana", "city": {"name": "Oslo", "code": "NO"}, "scores": {"a": 1}}', smol_tokenizer)
    assert not _takes(closed, '{"name": "Ana", "city": {"name": "Oslo"}, "scores": {"a": "x"}}', smol_tokenizer)
    if backend == "llguidance":  # outlines-core emits declared properties only, open or not
        assert _takes(compile_constraint(Open, smol_tokenizer, backend=backend), '{"name": "Ana", "age": 3}', smol_tokenizer)
        as_dict = compile_constraint(Person.model_json_schema(), smol_tokenizer, backend=backend)
        assert _takes(as_dict, '{"name": "Ana", "city": {"name": "Oslo"}, "scores": {"a": 1}, "age": 3}', smol_tokenizer)
    schema = pydantic_schema(Person)
    assert schema["additionalProperties"] is False and schema["$defs"]["City"]["additionalProperties"] is False
    assert schema["properties"]["scores"]["additionalProperties"] == {"type": "integer"}
    assert pydantic_schema(Open)["additionalProperties"] is True


def test_close_objects_closes_plain_objects_and_leaves_joined_ones_as_written():
    """``close_objects`` closes every object that lists its properties (nested, in ``$defs``, in
    ``anyOf`` branches), and returns a schema that joins object schemas unchanged: closing a part
    of an ``allOf`` would refuse what the whole allows. Checked with jsonschema: what the closed
    copy accepts, the original accepts, and a joined schema still takes its combined object."""
    import jsonschema

    from constrained_spec.constraint.schema import close_objects

    plain = {"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                              "b": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}]}},
             "$defs": {"B": {"type": "object", "properties": {"y": {"type": "string"}}}}}
    closed = close_objects(plain)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["B"]["additionalProperties"] is False
    assert "additionalProperties" not in plain  # a copy: the caller's schema is untouched
    for value, ok in [({"a": {"x": 1}, "b": {"y": "s"}}, True), ({"a": {"x": 1}, "z": 1}, False),
                      ({"a": {"x": 1, "w": 2}}, False), ({"b": {"y": "s", "w": 2}}, False), ({"b": None}, True)]:
        assert jsonschema.Draft202012Validator(closed).is_valid(value) is ok, value
        assert jsonschema.Draft202012Validator(plain).is_valid(value)  # the original takes every one

    inherit = {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {"type": "integer"}}}],
               "$defs": {"Base": {"type": "object", "properties": {"name": {"type": "string"}}}}}
    beside_ref = {"$ref": "#/$defs/Base", "properties": {"extra": {"type": "integer"}},
                  "$defs": {"Base": {"type": "object", "properties": {"name": {"type": "string"}}}}}
    conditional = {"type": "object", "properties": {"kind": {"type": "string"}},
                   "if": {"properties": {"kind": {"const": "a"}}}, "then": {"properties": {"n": {"type": "integer"}}}}
    for joined in (inherit, beside_ref, conditional):
        assert close_objects(joined) == joined
    assert jsonschema.Draft202012Validator(close_objects(inherit)).is_valid({"name": "x", "extra": 1})
