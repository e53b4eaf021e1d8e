"""The learned draft head: exact with any weights (greedy identity, the enumerated sampled law,
a pruned draft vocabulary), its incremental cache equal to a fresh one, saved and loaded, and
refused on another tokenizer."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters.head import DraftHead, HeadConfig, HeadDrafter, load_head
from constrained_spec.errors import ModelLoadError, TokenizerMismatchError
from tests.conftest import tiny_llama
from tests.test_exactness import EOS, MODEL_VOCAB, PATTERN, PROMPT, TOKENS, exact_law, sample_pvalue

#: The head may propose only these: "b" (2) and "ba" (5) are outside its draft vocabulary, so
#: they come only from the verifier's residual.
DRAFT_VOCAB = (1, 3, 4)


@pytest.fixture(scope="module")
def setup():
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    compiled = compile_constraint(PATTERN, vocab, kind="regex", backend="llguidance")
    target = tiny_llama(MODEL_VOCAB, seed=1)
    head = make_head(target, vocab.fingerprint)
    return vocab, compiled, target, head


def make_head(target, fingerprint: str, seed: int = 7) -> DraftHead:
    torch.manual_seed(seed)
    config = HeadConfig.for_target(target, fingerprint, DRAFT_VOCAB, name="tiny")
    head = DraftHead(config, target.get_input_embeddings()).double().eval()
    with torch.no_grad():
        head.lm_head.weight.mul_(8.0)  # a peaked law, far from the target's: mistakes would show
    return head


def test_greedy_output_is_the_target_only_output(setup):
    _, compiled, target, head = setup
    for prompt in (PROMPT, PROMPT[:3], [6, 6, 6, 1]):
        ref = decode(target, compiled.matcher(), prompt, max_new_tokens=16)
        m = compiled.matcher()
        res = decode(target, m, prompt, drafter=HeadDrafter(head, m), k_policy=FixedK(3), max_new_tokens=16)
        assert res.tokens == ref.tokens and res.finished == ref.finished
        assert res.stats.drafted > 0  # the head did draft (from the target's features)


def _run(compiled, target, make, seed):
    m = compiled.matcher()
    return decode(target, m, PROMPT, drafter=make(m), k_policy=FixedK(3), temperature=1.0, seed=seed,
                  max_new_tokens=16).tokens


def test_sampling_with_the_head_is_exact(setup):
    """Power: as in test_exactness (N = 3000); the control below, whose q ignores the pruned
    vocabulary, must fail the same test."""
    _, compiled, target, head = setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: _run(compiled, target, lambda m: HeadDrafter(head, m, temperature=1.0), s))
    assert pv > 1e-3


class UnprunedQHead(HeadDrafter):
    """Known-wrong: drafts from the law over M ∩ V_d but reports q over all of M (as if tokens
    outside the draft vocabulary could have been drafted)."""

    def propose(self, context, state, k):
        d = super().propose(context, state, k)
        if d.q is not None:
            rows = []
            for i, row in enumerate(d.q):
                mask = self.matcher.allowed_mask(d.states[i])
                allowed = torch.zeros(row.shape[0], dtype=torch.bool)
                allowed[: mask.shape[0]] = mask
                allowed[self.matcher.eos_token_id] = False
                wrong = row.clone()
                wrong[allowed & ~self._in_vocab] = row.max()  # mass where nothing is ever drafted
                rows.append(wrong / wrong.sum())
            d.q = torch.stack(rows)
        return d


def test_negative_control_q_outside_the_draft_vocabulary_is_caught(setup):
    _, compiled, target, head = setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: _run(compiled, target, lambda m: UnprunedQHead(head, m, temperature=1.0), s))
    assert pv < 1e-4


def test_the_draft_never_leaves_the_draft_vocabulary(setup):
    _, compiled, target, head = setup
    for seed in range(30):
        m = compiled.matcher()
        drafter = HeadDrafter(head, m, temperature=1.0)
        drafts = []
        orig = drafter.propose
        drafter.propose = lambda c, s, k: drafts.append(orig(c, s, k)) or drafts[-1]  # type: ignore[method-assign]
        decode(target, m, PROMPT, drafter=drafter, k_policy=FixedK(3), temperature=1.0, seed=seed, max_new_tokens=16)
        assert all(t in DRAFT_VOCAB for d in drafts for t in d.tokens)
        assert all(float(d.q[i, t]) > 0 for d in drafts if d.q is not None for i, t in enumerate(d.tokens))


@torch.no_grad()
def test_incremental_cache_equals_a_fresh_one(setup):
    """After steps with rejections, the head's proposal equals that of a head fed the whole
    context's features at once (its cache rolled back exactly)."""
    _, compiled, target, head = setup
    m = compiled.matcher()
    drafter = HeadDrafter(head, m)
    from constrained_spec.decoding import SpeculativeDecoder

    dec = SpeculativeDecoder(target, m, [6, 1, 2, 6, 3, 4, 5, 1, 6, 6], drafter=drafter, k_policy=FixedK(3),
                             max_new_tokens=2)
    for _ in dec.run():
        pass
    context = dec.prompt_ids + dec.output
    out = target(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i][0] for i in head.config.taps], dim=-1)
    fresh = HeadDrafter(head, m)
    fresh.observe(0, context[:-1], feats)
    a = drafter.propose(context, m.state, 3)
    b = fresh.propose(context, m.state, 3)
    assert a.tokens == b.tokens
    h1, l1 = drafter._sync(context[-1])
    h2, l2 = fresh._sync(context[-1])
    assert torch.allclose(l1, l2, atol=1e-9)


def test_save_load_and_a_head_for_another_tokenizer_is_refused(setup, tmp_path):
    vocab, compiled, target, head = setup
    head.save(tmp_path / "head")
    loaded = load_head(tmp_path / "head", target, vocab.fingerprint)
    for a, b in zip(head.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    m1, m2 = compiled.matcher(), compiled.matcher()
    r1 = decode(target, m1, PROMPT, drafter=HeadDrafter(head, m1), k_policy=FixedK(3), max_new_tokens=16)
    r2 = decode(target, m2, PROMPT, drafter=HeadDrafter(loaded, m2), k_policy=FixedK(3), max_new_tokens=16)
    assert r1.tokens == r2.tokens and r1.stats.accepted == r2.stats.accepted
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        load_head(tmp_path / "head", target, "0" * 40)
    with pytest.raises(ModelLoadError, match="head_config.json"):
        load_head(tmp_path, target, vocab.fingerprint)


def test_a_few_training_steps_learn_the_target_and_the_saved_head_drafts_exactly(setup, tmp_path):
    """Training on the target's own outputs raises the head's first-token agreement on them
    (from a random head's), saves a head that loads, and drafting with it keeps the output."""
    from constrained_spec.pipelines.train_drafter import decode_outputs, draft_vocabulary, evaluate, featurize, train_head

    vocab, compiled, target, _ = setup
    prompts = [PROMPT, PROMPT[:4], [6, 6, 1, 2], [3, 4, 5, 6, 1], [2, 2, 6], [5, 6, 3]]
    items = [(p, compiled) for p in prompts]

    report = train_head(target, vocab, items, tmp_path / "head", steps=120, sampled=3, unroll=2, lr=3e-3,
                        held_out=0.0, draft_vocab=4, seed=0)
    assert report.steps == 120 and report.draft_vocab <= 4
    head = load_head(tmp_path / "head", target, vocab.fingerprint)
    outputs = decode_outputs(target, items, sampled=3, seed=0)
    seqs = featurize(target, outputs, list(head.config.draft_vocab), head.config.taps)
    untrained = DraftHead(head.config, target.get_input_embeddings()).double()
    assert evaluate(head.float(), seqs) > evaluate(untrained.float(), seqs) + 0.1
    assert report.best_agreement >= 0.6
    m1 = compiled.matcher()
    ref = decode(target, compiled.matcher(), PROMPT, max_new_tokens=16)
    res = decode(target, m1, PROMPT, drafter=HeadDrafter(head.double(), m1), k_policy=FixedK(3), max_new_tokens=16)
    assert res.tokens == ref.tokens
    assert set(head.config.draft_vocab) == set(draft_vocabulary(outputs, 4, EOS))
