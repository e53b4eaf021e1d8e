"""The repetition guard: fires within a few cycles on a loop, on both backends, in the engine
and in extract; never on a cycle that the constraint's state tells apart, nor below its span."""

from __future__ import annotations

import pytest
import torch

from constrained_spec import RepetitionError, TokenLimitError
from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.decoding.repetition import MIN_SPAN, repeated_cycle
from constrained_spec.drafters import GrammarDrafter, LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama

EOS = 0
TOKENS = {1: b"a", 2: b"b", 3: b"c", 4: b"x"}
VOCAB = TokenVocabulary.build(TOKENS, EOS, size=5)
PROMPT = [4, 1, 2, 3, 4]


class FakeMatcher:
    """Each state allows other tokens (a counter's states would differ near its bound)."""

    def is_final(self, s):
        return False

    def allowed_mask(self, s):
        return torch.tensor([bool((s >> i) & 1) for i in range(5)])


@pytest.mark.parametrize("tokens, states, repeats, expected", [
    ([9] + [1, 2] * 8, [0] + [1, 0] * 8, 8, 2),  # 8 copies of "ab", the state back each time
    ([9] + [1, 2] * 7, [0] + [1, 0] * 7, 8, None),  # 7 copies
    ([9] + [1, 2] * 8, [0] + list(range(1, 17)), 8, None),  # the state moves on (a counter): no loop
    ([1] * (MIN_SPAN - 1), [0] * (MIN_SPAN - 1), 8, None),  # "0000..." shorter than the span
    ([1] * MIN_SPAN, [0] * MIN_SPAN, 8, 1),
    ([1, 2] * 20, [1, 0] * 20, 0, None),  # off
])
def test_repeated_cycle(tokens, states, repeats, expected):
    assert repeated_cycle(tokens, states, repeats, FakeMatcher()) == expected


def looping_target():
    """A tiny target that prefers "a" and "b" to anything else: under x?(ab)*c it loops on "ab"."""
    target = tiny_llama(6, seed=3)
    bias = torch.zeros(6, dtype=torch.float64)
    bias[1] = bias[2] = 50.0
    target.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return target


@pytest.mark.parametrize("backend", ["outlines-core", "llguidance"])
def test_a_loop_is_stopped_within_a_few_cycles(backend):
    target = looping_target()
    compiled = compile_constraint(r"x?(ab)*c", VOCAB, kind="regex", backend=backend)
    m = compiled.matcher()
    res = decode(target, m, PROMPT, drafter=LookupDrafter(m), k_policy=FixedK(3), max_new_tokens=300, max_repeats=8)
    assert not res.finished and len(res.tokens) == 16  # stopped at the token the 8th copy ends on
    assert res.tokens[:16] == [1, 2] * 8
    off = decode(target, compiled.matcher(), PROMPT, max_new_tokens=60, max_repeats=0)
    assert len(off.tokens) == 60 and not off.finished  # without the guard it runs to the limit


def test_the_error_names_the_cycle_and_is_a_token_limit_error():
    from constrained_spec.api import repetition_error
    from constrained_spec.decoding import SpeculativeDecoder

    compiled = compile_constraint(r"x?(ab)*c", VOCAB, kind="regex")
    dec = SpeculativeDecoder(looping_target(), compiled.matcher(), PROMPT, max_new_tokens=300, max_repeats=8)
    for _ in dec.run():
        pass
    assert dec.repetition == (2, 8) and not dec.finished

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(TOKENS[i].decode() for i in ids)

    err = repetition_error(dec, Tok())
    assert isinstance(err, RepetitionError) and isinstance(err, TokenLimitError)
    assert err.cycle == "ab" and err.repeats == 8 and err.partial_text == "ab" * 8
    assert "max_repeats" in str(err)


def test_engine_stops_the_looping_row_and_keeps_the_others():
    target = looping_target()
    compiled = compile_constraint(r"x?(ab)*c", VOCAB, kind="regex")
    plain = compile_constraint(r"x(a|b){2,5}c", VOCAB, kind="regex")
    engine = BatchEngine(target, max_batch=2, prefix_cache=False)
    loop = engine.submit(PROMPT, compiled.matcher(), max_new_tokens=300, max_repeats=8)
    fine = engine.submit(PROMPT, plain.matcher(), max_new_tokens=300, max_repeats=8)
    list(engine.run())
    assert loop.decoder.repetition == (2, 8) and len(loop.result.tokens) == 16
    assert fine.decoder.repetition is None and fine.result.finished
    assert fine.result.tokens == decode(target, plain.matcher(), PROMPT, max_new_tokens=300).tokens


@pytest.mark.parametrize("batch_size", [1, 2])
def test_extract_records_the_loop_as_its_own_error_kind(smol, batch_size):
    """A model that writes "a" forever inside a JSON string: each document's record carries the
    kind RepetitionError (one by one and in the engine), and the run goes on."""
    from constrained_spec import ModelHandle, extract

    target = tiny_llama(49152, seed=5)
    a = smol.tokenizer.convert_tokens_to_ids("a")
    bias = torch.zeros(49152, dtype=torch.float64)
    bias[a] = 50.0
    target.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    handle = ModelHandle(target, smol.tokenizer, "looping")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    records = [r.to_record() for r in extract(schema, ["Maria", "Tom", "Aisha"], model=handle, batch_size=batch_size,
                                              drafter="none", max_new_tokens=200)]
    assert [r["error"]["kind"] for r in records] == ["RepetitionError"] * 3
    assert all("'a'" in r["error"]["message"] for r in records)


def _tokenize(text: str) -> list[int]:
    ids = {v.decode(): k for k, v in TOKENS.items()}
    return [ids[c] for c in text]


DRAFTERS = {
    "lookup": lambda target, m: LookupDrafter(m),
    "grammar": lambda target, m: GrammarDrafter(m, _tokenize),
    # The target itself as its draft: every draft token is accepted, so a step emits K + 1
    # tokens and the stop falls inside a step for most K.
    "model": lambda target, m: ModelDrafter(target, m),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_stop_falls_on_the_same_token_with_every_drafter_and_k(drafter, k):
    """Greedy output, errors included, does not depend on the drafter: the error's token count,
    its partial output and the cycle are those of target-only decoding."""
    target = looping_target()
    compiled = compile_constraint(r"x?(ab)*c", VOCAB, kind="regex")
    ref = decode(target, compiled.matcher(), PROMPT, max_new_tokens=300, max_repeats=8)
    m = compiled.matcher()
    res = decode(target, m, PROMPT, drafter=DRAFTERS[drafter](target, m), k_policy=FixedK(k), max_new_tokens=300,
                 max_repeats=8)
    assert ref.tokens == [1, 2] * 8 and not ref.finished
    assert res.tokens == ref.tokens and not res.finished
    assert m.num_tokens == len(ref.tokens)  # the matcher holds exactly the output


@pytest.mark.parametrize("max_batch", [1, 3])
@pytest.mark.parametrize("k", [2, 5])
def test_the_stop_falls_on_the_same_token_in_the_batch_engine(max_batch, k):
    """In the engine, beside rows that finish and rows that loop, each looping row stops where it
    stops alone, its cache cut to its output, and the other rows are unchanged."""
    from constrained_spec.decoding import SpeculativeDecoder

    target = looping_target()
    compiled = compile_constraint(r"x?(ab)*c", VOCAB, kind="regex")
    plain = compile_constraint(r"x(a|b){2,5}c", VOCAB, kind="regex")
    ref = decode(target, compiled.matcher(), PROMPT, max_new_tokens=300, max_repeats=8)
    engine = BatchEngine(target, max_batch=max_batch, prefix_cache=False)
    rows = []
    for i in range(4):
        c = compiled if i % 2 == 0 else plain
        m = c.matcher()
        rows.append(engine.submit(PROMPT[: 3 + i % 3], m, drafter=ModelDrafter(target, m), k_policy=FixedK(k),
                                  max_new_tokens=300, max_repeats=8))
    list(engine.run())
    for i, row in enumerate(rows):
        alone = SpeculativeDecoder(target, (compiled if i % 2 == 0 else plain).matcher(), PROMPT[: 3 + i % 3],
                                   max_new_tokens=300, max_repeats=8)
        for _ in alone.run():
            pass
        assert row.result.tokens == alone.output
        assert row.decoder.repetition == alone.repetition
    assert rows[0].decoder.repetition is not None and rows[0].result.tokens == ref.tokens
    assert rows[1].decoder.repetition is None


def test_generate_json_raises_the_same_error_with_every_drafter(smol):
    """Through the public API on the real tokenizer: a model that writes "a" forever inside a
    string, with a prompt full of "a"s for lookup and copy to draft from; the error's partial text
    and cycle are the same for drafter none, lookup and auto."""
    from constrained_spec import ModelHandle, generate_json

    target = tiny_llama(49152, seed=5)
    bias = torch.zeros(49152, dtype=torch.float64)
    bias[smol.tokenizer.convert_tokens_to_ids("a")] = 50.0
    target.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    handle = ModelHandle(target, smol.tokenizer, "looping")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    errors = {}
    for drafter in ("none", "lookup", "auto"):
        with pytest.raises(RepetitionError) as info:
            generate_json(handle, schema, "The name: Maria " + "a" * 20, drafter=drafter, max_new_tokens=200)
        errors[drafter] = (info.value.partial_text, info.value.cycle, info.value.repeats)
    assert errors["none"][1] == "a"
    assert errors["lookup"] == errors["none"] and errors["auto"] == errors["none"]
