"""One options object, checked in one place; seeds reach every drafter; the public surface."""

from __future__ import annotations

import pytest
import torch

import constrained_spec
from constrained_spec import (
    CompiledConstraint, InvalidOptionError, ModelHandle, SpecOptions, compile_constraint, extract, generate_json,
)
from constrained_spec.decoding import FixedK, SpeculativeDecoder
from constrained_spec.drafters import LookupDrafter, ModelDrafter, build_drafter
from tests.conftest import tiny_llama

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string", "enum": ["red", "green", "blue", "cyan"]}, "maxItems": 3}}, "required": ["name", "tags"]}


@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    return ModelHandle(tiny_llama(49152, seed=61, init=0.3, dtype=torch.float32), smol_tokenizer, "tiny")


@pytest.mark.parametrize("bad, match", [
    (dict(temprature=0.5), "Did you mean 'temperature'"),
    (dict(drafter="medusa"), "Invalid drafter"),
    (dict(k_max=-1), "Invalid k_max"),
    (dict(k_max=2.5), "Invalid k_max"),
    (dict(temperature=-0.1), "Invalid temperature"),
    (dict(temperature=float("nan")), "Invalid temperature"),
    (dict(max_new_tokens=0), "Invalid max_new_tokens"),
    (dict(seed="7"), "Invalid seed"),
    (dict(backend="xgrammar"), "Invalid backend"),
    (dict(profile="tpu"), "Invalid profile"),
    (dict(adaptive="yes"), "Invalid adaptive"),
])
def test_bad_options_are_named(bad, match):
    with pytest.raises(InvalidOptionError, match=match):
        SpecOptions.build(**bad)
    assert issubclass(InvalidOptionError, ValueError)


def test_options_object_and_keywords_combine():
    base = SpecOptions(drafter="lookup", temperature=0.7, seed=3)
    merged = SpecOptions.build(base, seed=4)
    assert (merged.drafter, merged.temperature, merged.seed) == ("lookup", 0.7, 4)
    assert SpecOptions.build().drafter_kind == "hybrid"
    assert SpecOptions(drafter="none").resolve_k_max("json")[1] == 0
    assert SpecOptions(k_max=5).resolve_k_max("json")[1] == 5


@pytest.mark.parametrize("batch_size", [1, 9])
def test_extract_refuses_unknown_options_on_both_paths(tiny, batch_size):
    """A typo used to pass unnoticed on the batched path (above 8 documents)."""
    with pytest.raises(InvalidOptionError, match="temprature"):
        list(extract(SCHEMA, ["a", "b"], model=tiny, batch_size=batch_size, temprature=0.7))
    with pytest.raises(InvalidOptionError, match="bogus_option"):
        list(extract(SCHEMA, ["a", "b"], model=tiny, batch_size=batch_size, bogus_option=1))


def test_generate_json_refuses_unknown_options(tiny):
    with pytest.raises(InvalidOptionError, match="Did you mean 'max_new_tokens'"):
        generate_json(tiny, SCHEMA, "x", max_new_token=8)


def test_seed_reproduces_sampled_output_with_a_draft_model_inside_hybrid(tiny):
    """The draft model inside the hybrid drafter samples from the request's generator, and the
    adaptive K policy of a seeded request depends on nothing else: same seed, same output."""
    draft = ModelHandle(tiny_llama(49152, seed=62, init=0.3, dtype=torch.float32), tiny.tokenizer, "draft")

    def sample(seed):
        # Open objects: the random model's keys of its own give the draft model positions to draft.
        stream = generate_json(tiny, SCHEMA, "Name: Ada. Tags: red, cyan.", draft=draft, drafter="hybrid",
                               temperature=1.0, seed=seed, max_new_tokens=40, stream=True, closed=False)
        try:
            for _ in stream:
                pass
        except constrained_spec.TokenLimitError:  # a random model may run out: the text still counts
            pass
        return stream.text, stream.stats.ks, stream.stats.per_kind.get("model", {}).get("drafted", 0)

    runs = [sample(11) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][2] > 0  # the draft model did propose tokens
    assert sample(12)[0] != runs[0][0]  # another seed, another sample (the law is far from one-hot)


def test_the_generator_reaches_every_part_of_a_hybrid(tiny):
    compiled = compile_constraint(SCHEMA, tiny.tokenizer)
    m = compiled.matcher()
    hybrid = build_drafter("hybrid", m, tiny.tokenizer, draft_model=tiny.model, temperature=1.0)
    model_parts = [p for p in hybrid.parts if isinstance(p, ModelDrafter)]
    assert model_parts and model_parts[0].generator is None
    dec = SpeculativeDecoder(tiny.model, m, [1, 2, 3], drafter=hybrid, k_policy=FixedK(4), temperature=1.0, seed=5)
    assert dec.generator is not None and model_parts[0].generator is dec.generator


def test_decoder_needs_a_fresh_matcher_shared_with_its_drafter(tiny):
    compiled = compile_constraint(SCHEMA, tiny.tokenizer)
    with pytest.raises(InvalidOptionError, match="compiled.matcher"):
        SpeculativeDecoder(tiny.model, compiled, [1, 2, 3])  # type: ignore[arg-type]
    used = compiled.matcher()
    used.advance(tiny.tokenizer('{"', add_special_tokens=False)["input_ids"])
    with pytest.raises(InvalidOptionError, match="already committed"):
        SpeculativeDecoder(tiny.model, used, [1, 2, 3])
    with pytest.raises(InvalidOptionError, match="another matcher"):
        SpeculativeDecoder(tiny.model, compiled.matcher(), [1, 2, 3], drafter=LookupDrafter(compiled.matcher()))


def test_public_surface():
    names = constrained_spec.__all__
    assert names == sorted(names)
    for name in ("compile_constraint", "SpecOptions", "CompiledConstraint", "Matcher", "InvalidOptionError",
                 "LookupDrafter", "ModelDrafter", "GrammarDrafter", "CopyDrafter", "HybridDrafter", "AdaptiveK", "FixedK"):
        assert name in names and hasattr(constrained_spec, name)
    assert callable(constrained_spec.extract)  # the function; the module is constrained_spec.pipelines.extract
    import constrained_spec.pipelines.extract as module
    assert module.extract is constrained_spec.extract
    assert isinstance(compile_constraint({"type": "boolean"}, tiny_tokenizer()), CompiledConstraint)


def tiny_tokenizer():
    from constrained_spec.constraint import TokenVocabulary

    return TokenVocabulary.build({1: b"true", 2: b"false", 3: b"t", 4: b"f"}, 0)


def test_a_dead_end_raises_its_own_error_with_the_partial_text(tiny):
    """A grammar state that allows no token at all (a backend defect) stops with DeadEndError."""
    from constrained_spec import DeadEndError
    from constrained_spec.constraint import OutlinesMatcher

    compiled = compile_constraint(r"ab[0-9]{5}", tiny.tokenizer, kind="regex", backend="outlines-core")

    class DeadAfterTwo(OutlinesMatcher):
        def allowed_mask(self, state):
            mask = super().allowed_mask(state)
            return torch.zeros_like(mask) if self.num_tokens >= 2 and state == self.state else mask

    m = DeadAfterTwo(compiled)
    with pytest.raises(DeadEndError, match="no token is allowed") as err:
        list(SpeculativeDecoder(tiny.model, m, [1, 2, 3], max_new_tokens=10).run())
    assert len(err.value.partial_text) >= 2 and err.value.partial_text.startswith("ab")
