"""Greedy speculative output == greedy target-only output, token for token (float64, no ties).

Tiny random models over the real SmolLM2 tokenizer, with 64 padding rows in the output layer
that the constraint must always mask.
"""

from __future__ import annotations

import pytest

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, SpeculativeDecoder, decode
from constrained_spec.drafters import LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama

BACKENDS = ["outlines-core", "llguidance"]

PADDED_VOCAB = 49152 + 64
SCHEMAS = ["schemas/person.json", "schemas/invoice.json", "schemas/event.json"]
TEXT = ('Record: name "Maria Gonzalez", age 34, city "Barcelona", occupation "architect". '
        'Invoice INV-2291 from Acme GmbH dated 2024-03-05, total 1249.50 EUR, paid: true.')


@pytest.fixture(scope="module")
def models():
    return tiny_llama(PADDED_VOCAB, seed=11, init=0.3), tiny_llama(PADDED_VOCAB, seed=12, init=0.3)


@pytest.fixture(scope="module")
def prompt(smol_tokenizer):
    return smol_tokenizer(TEXT)["input_ids"]


def constraint_for(path, tokenizer_handle, backend="outlines-core"):
    """The compiled constraint of a schema file (each decode takes a fresh matcher of it)."""
    return compile_constraint(path, tokenizer_handle.tokenizer, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema_path", SCHEMAS)
@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity(smol, models, prompt, schema_path, kind, k, backend):
    target, draft = models
    compiled = constraint_for(schema_path, smol, backend)
    baseline = decode(target, compiled.matcher(), prompt, max_new_tokens=48)
    m = compiled.matcher()
    drafter = ModelDrafter(draft, m) if kind == "model" else LookupDrafter(m)
    spec = decode(target, m, prompt, drafter=drafter, k_policy=FixedK(k), max_new_tokens=48)
    assert spec.tokens == baseline.tokens
    assert spec.finished == baseline.finished
    assert all(t < 49152 for t in spec.tokens)  # padding rows never chosen
    assert spec.stats.output_tokens == len(spec.tokens)
    assert spec.stats.target_forwards == len(spec.stats.ks)
    assert sum(spec.stats.accepted_per_step) + spec.stats.target_forwards >= len(spec.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_as_its_own_draft_accepts_everything(smol, models, prompt, backend):
    """A draft identical to the target is always right under greedy: every step lands K + 1 tokens."""
    target, _ = models
    compiled = constraint_for("schemas/person.json", smol, backend)
    k = 4
    m = compiled.matcher()
    res = decode(target, m, prompt, drafter=ModelDrafter(target, m), k_policy=FixedK(k), max_new_tokens=40)
    assert res.stats.drafted > 0
    assert res.stats.accepted == res.stats.drafted
    assert res.stats.target_forwards <= -(-len(res.tokens) // (k + 1)) + 1
    assert res.tokens == decode(target, compiled.matcher(), prompt, max_new_tokens=40).tokens



@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_skipping_rows_of_single_token_states_changes_nothing(smol, models, prompt, monkeypatch, temperature):
    """Rows whose state allows one token are not projected onto the vocabulary; the tokens (and,
    sampling with one seed, every random draw) equal those of a decoder that computes every row."""
    target, draft = models
    compiled = constraint_for("schemas/invoice.json", smol)
    kept: list[int] = []
    real_forward = SpeculativeDecoder._verify_forward

    def counting_forward(self, plan):
        kept.append(len(plan.rows))
        return real_forward(self, plan)

    monkeypatch.setattr(SpeculativeDecoder, "_verify_forward", counting_forward)
    def run():
        m = compiled.matcher()
        return decode(target, m, prompt, drafter=LookupDrafter(m), k_policy=FixedK(4), temperature=temperature,
                      seed=7, max_new_tokens=48)

    skipped = run()
    rows_skipped = sum(k + 1 for k in skipped.stats.ks) - sum(kept)
    monkeypatch.setattr(SpeculativeDecoder, "_single_token", lambda self, state, mask: False)
    kept.clear()
    full = run()
    assert sum(kept) == sum(k + 1 for k in full.stats.ks)  # the reference computed every row
    assert rows_skipped > 0  # some states of the schema allow a single token
    assert skipped.tokens == full.tokens
