"""End-to-end on the embedded SmolLM2-135M-Instruct: valid outputs, identical greedy outputs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel

from constrained_spec import generate_json, generate_regex, load_model
from constrained_spec.bench.single import DEFAULT_PROMPTS

ROOT = Path(__file__).resolve().parent.parent
# The benchmark prompts ship with the package, each with its schema inline.
PROMPTS = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]


class Person(BaseModel):
    name: str
    age: int
    city: str


def test_load_model_is_memoized(smol):
    assert load_model() is smol
    assert smol.model.config.vocab_size == 49152


def test_pydantic_instance(smol):
    prompt = "Extract name, age and city as JSON.\nText: Maria Gonzalez is a 34-year-old architect in Barcelona."
    person, stats = generate_json(smol, Person, prompt, return_stats=True)
    assert isinstance(person, Person)
    assert person.age == 34 and "Maria" in person.name and person.city == "Barcelona"
    assert stats.finished and stats.output_tokens > 5
    assert stats.target_forwards <= stats.output_tokens


@pytest.mark.parametrize("item", PROMPTS[:4], ids=[p["id"] for p in PROMPTS[:4]])
def test_greedy_speculative_equals_target_only_and_validates(smol, item):
    schema = item["schema"]
    base, s0 = generate_json(smol, schema, item["prompt"], drafter="none", return_stats=True)
    assert s0.target_forwards == s0.output_tokens  # target-only: one forward per token
    for drafter in ("lookup", "hybrid"):
        spec, s1 = generate_json(smol, schema, item["prompt"], drafter=drafter, return_stats=True)
        jsonschema.validate(spec, schema)
        assert spec == base
        assert s1.output_tokens == s0.output_tokens
        assert s1.target_forwards < s1.output_tokens  # drafted spans landed
    assert s1.target_forwards <= 0.6 * s1.output_tokens  # hybrid: forced keys and copied values


def test_regex_full_match(smol):
    pattern = r"\+?[0-9]{1,3} [0-9]{3} [0-9]{3} [0-9]{4}"
    text = generate_regex(smol, pattern, "Write a phone number for Daniel Kim: +1 415 555 0199.")
    assert re.fullmatch(pattern, text)


def test_model_drafter_with_itself_as_draft(smol):
    """The target as its own draft: greedy proposals always land, output unchanged."""
    schema = json.loads((ROOT / "schemas" / "person.json").read_text())
    prompt = PROMPTS[0]["prompt"]
    base = generate_json(smol, schema, prompt, drafter="none")
    value, stats = generate_json(smol, schema, prompt, draft=smol, drafter="model", k_max=3, return_stats=True)
    assert value == base
    assert stats.drafter == "model" and stats.acceptance_rate == 1.0


def test_auto_drafts_from_the_shipped_corpus_and_equals_target_only_on_held_out_generation(smol):
    """The package ships the embedded model's corpus of its own outputs: auto uses it by
    default (draft=False not), and the output stays the target-only output."""
    from constrained_spec.api import resolve_draft
    from constrained_spec.decoding import SpecOptions
    from constrained_spec.pipelines.drafter_data import generation_workload

    # A handle of its own: what the session's earlier requests taught the shared handle's K
    # policy (which drafters pay on other workloads) must not decide whether this one drafts.
    smol = dataclasses.replace(smol, estimates=None)
    source = resolve_draft(None, smol, SpecOptions(drafter="auto"))
    assert source is not None and source.corpus is not None and source.head is None and len(source.corpus) > 10_000
    assert resolve_draft(False, smol, SpecOptions(drafter="auto")) is None
    items = generation_workload(limit=2)
    if not items:
        pytest.skip("no Glaiveai2K schemas here")
    drafted = 0
    for item in items:
        base = generate_json(smol, item["schema"], item["prompt"], drafter="none", max_new_tokens=128)
        spec, stats = generate_json(smol, item["schema"], item["prompt"], max_new_tokens=128, return_stats=True)
        off = generate_json(smol, item["schema"], item["prompt"], draft=False, max_new_tokens=128)
        assert spec == base == off
        drafted += stats.per_kind.get("corpus", {}).get("drafted", 0)
    assert drafted > 0
