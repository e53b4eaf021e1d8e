"""Training a head from references: answers read by the target in one forward instead of decoded.
The features recorded along a reference are those of one fresh forward over prompt and answer
(the prompt's cache rolled back between answers), an answer the constraint refuses is never
read, an item with references is not decoded, and the held-out agreement is measured on items
never trained on."""

from __future__ import annotations

import json

import pytest
import torch

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.drafters.head import default_taps
from constrained_spec.pipelines.train_drafter import (TrainingSequence, _split_held_out, reference_ids,
                                                      reference_outputs, train_head)
from tests.conftest import tiny_llama
from tests.test_exactness import EOS, MODEL_VOCAB, PATTERN, PROMPT, TOKENS


@pytest.fixture(scope="module")
def setup():
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    compiled = compile_constraint(PATTERN, vocab, kind="regex", backend="llguidance")
    return vocab, compiled, tiny_llama(MODEL_VOCAB, seed=1)


def _fresh(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps (concatenated) and final hidden state of one forward over ``ids``, no cache."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    n = target.config.num_hidden_layers
    taps = torch.cat([out.hidden_states[t][0] for t in default_taps(n)], dim=-1)
    return taps, out.hidden_states[n][0]


def test_each_reference_is_read_after_its_prompt_as_one_fresh_forward_reads_it(setup):
    _, compiled, target = setup
    items = [(PROMPT, compiled), ([6, 6, 1], compiled), ([2, 6], compiled)]
    # Item 0: three answers from one prompt cache (the second and third read after a rollback);
    # item 1: one answer of a single token (nothing to learn from: dropped); item 2: none.
    references = [[[1, 2], [3, 4], [2, 1, 4]], [[5]], []]
    outputs = reference_outputs(target, items, references)
    assert [(o.item, o.tokens) for o in outputs] == [(0, [1, 2]), (0, [3, 4]), (0, [2, 1, 4])]
    for o in outputs:
        ids = o.prompt + o.tokens
        taps, final = _fresh(target, ids)
        assert o.features.shape[0] == len(ids) - 1 and o.final.shape[0] == len(o.tokens)
        assert torch.allclose(o.features.double(), taps[:-1], atol=1e-8)
        assert torch.allclose(o.final.double(), final[len(o.prompt) - 1 : -1], atol=1e-8)


def test_a_reference_is_kept_only_in_a_layout_its_constraint_accepts(smol):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "rooms": {"type": "integer"}},
              "required": ["city", "rooms"]}
    compiled = compile_constraint(schema, smol.tokenizer)
    ids = reference_ids(smol.tokenizer, compiled, {"city": "Lyon", "rooms": 3})
    assert ids is not None and json.loads(smol.tokenizer.decode(ids)) == {"city": "Lyon", "rooms": 3}
    assert reference_ids(smol.tokenizer, compiled, {"city": "Lyon"}) is None  # "rooms" is required
    assert reference_ids(smol.tokenizer, compiled, {"city": "Lyon", "rooms": "three"}) is None
    phone = compile_constraint(r"\(\d{3}\) \d{3}-\d{4}", smol.tokenizer, kind="regex")
    ids = reference_ids(smol.tokenizer, phone, "(555) 123-4567", "regex")
    assert ids is not None and smol.tokenizer.decode(ids) == "(555) 123-4567"
    for refused in ("555-1234", "(555) 123-45678", "", 5551234567):
        assert reference_ids(smol.tokenizer, phone, refused, "regex") is None


def test_an_item_with_references_is_read_not_decoded_and_stays_out_of_the_corpus(setup, tmp_path):
    from constrained_spec.drafters.corpus import OutputCorpus

    vocab, compiled, target = setup
    items = [(PROMPT, compiled), ([6, 6, 1, 2], compiled), ([3, 4, 5, 6, 1], compiled)]
    references = [[[2, 1, 4], [1, 1, 4]], [], [[3, 2]]]
    report = train_head(target, vocab, items, tmp_path / "head", steps=3, sampled=0, held_out=0.0, draft_vocab=4,
                        references=references)
    assert report.steps == 3
    saved = torch.load(tmp_path / "head" / "outputs.pt", weights_only=False)["outputs"]
    read = sorted((i, toks) for i, toks, _, _ in saved if i != 1)
    assert read == [(0, [1, 1, 4]), (0, [2, 1, 4]), (2, [3, 2])]  # the references themselves
    assert [i for i, *_ in saved].count(1) == 1  # item 1 decoded, greedily only
    corpus = OutputCorpus.load(tmp_path / "head", vocab.fingerprint)
    decoded = next(toks for i, toks, _, _ in saved if i == 1)
    assert len(corpus) == len(decoded) and (corpus.tokens < 0).sum() == 1  # the decoded output only
    with pytest.raises(Exception, match="one list per item"):
        train_head(target, vocab, items, tmp_path / "other", steps=1, references=[[]])


def test_the_held_out_sequences_come_from_items_never_trained_on():
    def seq(item: int) -> TrainingSequence:
        return TrainingSequence([0, 1], 1, torch.zeros(1, 1), torch.zeros(0), torch.zeros(0, 1), torch.zeros(0, 1),
                                item=item)

    seqs = [seq(i) for i in (0, 0, 0, 1, 1, 2, 3, 3, 4, 5)]
    for s in range(20):
        held, train = _split_held_out(seqs, 0.3, seed=s)
        assert {x.item for x in held}.isdisjoint({x.item for x in train})
        assert len(held) + len(train) == len(seqs) and len({x.item for x in held}) == 1


def test_a_time_budget_stops_stage_one_and_takes_a_sample_of_the_file(setup, monkeypatch):
    """With a deadline, no item starts after it (the one started finishes) and the items go in
    a seeded random order; without one, every item is read in the file's order."""
    import random
    import time

    from constrained_spec.pipelines.train_drafter import _first_stage

    _, compiled, target = setup
    items = [([6, 1, 2, k], compiled) for k in range(1, 7)]
    references = [[[1, 2], [3, 4]] for _ in items]
    options = dict(sampled=0, max_new_tokens=8, seed=5, batch=1, drafter_for=None, progress=None)
    everything = _first_stage(target, items, references, **options)
    assert [o.item for o in everything] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    forward = target.model.forward

    def slow(*args, **kwargs):  # every forward 0.2 s: an item (prompt and two answers) 0.6 s
        time.sleep(0.2)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target.model, "forward", slow)
    cut = _first_stage(target, items, references, deadline=time.perf_counter() + 0.3, **options)
    order = list(range(len(items)))
    random.Random(5).shuffle(order)
    assert [o.item for o in cut] == [order[0]] * 2 and order[0] != 0
    assert _first_stage(target, items, references, deadline=time.perf_counter(), **options) == []


def test_minutes_bound_the_whole_run_stage_one_included(setup, monkeypatch, tmp_path):
    """A 3 s budget over data that takes 7 s to read: stage one stops at about half of it, the
    training takes the rest, and the run ends within the budget (plus the item in flight and
    one evaluation), with steps taken."""
    import time

    vocab, compiled, target = setup
    items = [([6, 1, 2, k % 6 + 1], compiled) for k in range(12)]
    references = [[[1, 2], [3, 4]] for _ in items]
    forward = target.model.forward

    def slow(*args, **kwargs):  # every forward 0.2 s: reading everything would take 12 * 0.6 s
        time.sleep(0.2)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target.model, "forward", slow)
    report = train_head(target, vocab, items, tmp_path / "head", minutes=0.05, held_out=0.0, draft_vocab=4,
                        references=references)
    saved = torch.load(tmp_path / "head" / "outputs.pt", weights_only=False)["outputs"]
    assert 2 <= len(saved) <= 8  # one to four items of twelve read
    assert report.steps > 0 and report.seconds < 6.0
