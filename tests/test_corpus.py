"""The corpus of the target's own outputs (``drafters.corpus``): its index equals brute-force
n-gram counts, it saves, loads and is refused on another tokenizer, its drafts stay inside the
constraint (a control without the matcher's check is caught), and drafting with it keeps the
output exact: greedy identity alone, in auto and in the batch engine, and the enumerated law."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters.corpus import CHAIN_CONFIDENCE, CorpusDrafter, OutputCorpus, corpus_in
from constrained_spec.errors import ModelLoadError, TokenizerMismatchError
from tests.conftest import tiny_llama
from tests.test_exactness import EOS, MODEL_VOCAB, PATTERN, PROMPT, TOKENS, exact_law, sample_pvalue


@pytest.fixture(scope="module")
def setup():
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    compiled = compile_constraint(PATTERN, vocab, kind="regex", backend="llguidance")
    target = tiny_llama(MODEL_VOCAB, seed=1)
    # The target's own greedy outputs on a few prompts, as train-drafter would index them.
    outputs = [decode(target, compiled.matcher(), p, max_new_tokens=16).tokens
               for p in (PROMPT, PROMPT[:3], [6, 6, 1], [3, 4, 5, 6, 1], [2, 2, 6])]
    return vocab, compiled, target, OutputCorpus(outputs, vocab.fingerprint, exclude=[EOS])


def brute_force(sequences, suffix, n, exclude):
    counts: Counter = Counter()
    for seq in sequences:
        for i in range(n, len(seq)):
            if list(seq[i - n : i]) == list(suffix[-n:]) and seq[i] not in exclude:
                counts[seq[i]] += 1
    return counts


def test_the_index_equals_brute_force_counts_within_each_sequence():
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    corpus = OutputCorpus(sequences, "fp", exclude=[0], max_order=5)
    assert len(corpus) == sum(map(len, sequences))
    for _ in range(300):
        suffix = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
        found = {n: dict(zip(nexts.tolist(), counts.tolist())) for n, nexts, counts in corpus.continuations(suffix)}
        for n in range(1, min(5, len(suffix)) + 1):
            expected = brute_force(sequences, suffix, n, {0})
            assert found.get(n, {}) == dict(expected)  # no n-gram across two sequences, never token 0
        for n, nexts, counts in corpus.continuations(suffix):
            assert list(counts) == sorted(counts, reverse=True)  # most frequent first


def test_save_load_and_another_tokenizer_is_refused(setup, tmp_path):
    vocab, _, _, corpus = setup
    corpus.save(tmp_path / "d")
    loaded = OutputCorpus.load(tmp_path / "d", vocab.fingerprint)
    assert loaded.tokens.tolist() == corpus.tokens.tolist() and len(loaded) == len(corpus)
    for suffix in ([1], [1, 2], [3, 4, 1]):
        a = [(n, x.tolist(), c.tolist()) for n, x, c in corpus.continuations(suffix)]
        assert a == [(n, x.tolist(), c.tolist()) for n, x, c in loaded.continuations(suffix)]
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        OutputCorpus.load(tmp_path / "d", "0" * 40)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "corpus.safetensors").write_bytes(b"not a corpus")
    with pytest.raises(ModelLoadError, match="Invalid draft corpus"):
        OutputCorpus.load(tmp_path / "bad", vocab.fingerprint)
    assert corpus_in(tmp_path / "nothing", vocab.fingerprint) is None
    assert corpus_in(tmp_path / "d", vocab.fingerprint) is corpus_in(tmp_path / "d", vocab.fingerprint)


def _drafts(compiled, target, corpus, prompt, seed=None, drafter_cls=None):
    m = compiled.matcher()
    drafter = (drafter_cls or CorpusDrafter)(corpus, m)
    drafts = []
    orig = drafter.propose
    drafter.propose = lambda c, s, k: drafts.append((list(c), s, orig(c, s, k))) or drafts[-1][2]  # type: ignore[method-assign]
    res = decode(target, m, prompt, drafter=drafter, k_policy=FixedK(3), temperature=1.0 if seed is not None else 0.0,
                 seed=seed, max_new_tokens=16)
    return m, drafts, res


class UncheckedCorpusDrafter(CorpusDrafter):
    """Known-wrong control: takes the most frequent continuation without asking the matcher."""

    def _next(self, output, state):
        for _, nexts, counts in self.corpus.continuations(output):
            nxt = self.matcher.next_state(state, int(nexts[0]))
            return int(nexts[0]), nxt if nxt is not None else state, 1.0
        return None


def test_drafts_stay_inside_the_constraint_and_never_propose_eos(setup):
    """A corpus full of EOS and of what the pattern forbids: every drafted token is one the
    matcher allows from its state; without the matcher's check the same test fails."""
    vocab, compiled, target, _ = setup
    rng = random.Random(1)
    noisy = OutputCorpus([[rng.randrange(7) for _ in range(12)] for _ in range(40)], vocab.fingerprint, exclude=[EOS])
    with_eos = OutputCorpus([[rng.randrange(7) for _ in range(12)] for _ in range(40)], vocab.fingerprint)

    def violations(corpus, drafter_cls=None):
        bad = 0
        for seed in range(20):
            m, drafts, _ = _drafts(compiled, target, corpus, PROMPT, seed, drafter_cls)
            for _, state, d in drafts:
                s = state
                for t in d.tokens:
                    nxt = m.next_state(s, t)
                    bad += t == EOS or nxt is None
                    s = nxt if nxt is not None else s
        return bad

    assert violations(noisy) == 0 and violations(with_eos) == 0
    assert violations(noisy, UncheckedCorpusDrafter) > 0


def test_a_proposal_continues_the_most_frequent_allowed_continuation_and_stops_when_unsure(setup):
    vocab, compiled, _, _ = setup
    m = compiled.matcher()
    # After "a": "b" twice, "c" once, then after "a b": "c" twice. A confidence counts one
    # continuation not seen yet: a share read off a few outputs is not a certainty.
    corpus = OutputCorpus([[1, 2, 4], [1, 2, 4], [1, 4], [2, 2]], vocab.fingerprint, exclude=[EOS])
    drafter = CorpusDrafter(corpus, m)
    drafter.reset([6])
    s1 = m.next_state(m.initial_state, 1)
    d = drafter.propose([6, 1], s1, 5)
    assert d.tokens == [2, 4] and d.confidence == [pytest.approx(2 / 4), pytest.approx(2 / 3)]
    assert d.states[1:] == [m.next_state(s1, 2), m.next_state(m.next_state(s1, 2), 4)]
    assert drafter.propose([6, 1], s1, 1).tokens == [2]
    # The prompt is never matched: an output of nothing proposes nothing.
    assert drafter.propose([6], m.initial_state, 5).tokens == []
    # After "a" always "b" (three times); after "a b" three continuations once each: the proposal
    # ends after its first token.
    free = compile_constraint("[abc]{0,6}", vocab, kind="regex", backend="llguidance").matcher()
    unsure = CorpusDrafter(OutputCorpus([[1, 2, 1], [1, 2, 4], [1, 2, 2]], vocab.fingerprint, exclude=[EOS]), free)
    unsure.reset([6])
    out = unsure.propose([6, 1], free.next_state(free.initial_state, 1), 5)
    assert out.tokens == [2] and out.confidence == [pytest.approx(3 / 4)]
    assert 1 / 4 < CHAIN_CONFIDENCE <= 2 / 3
    # Seen once, a continuation is as likely as not, however alone it is.
    once = CorpusDrafter(OutputCorpus([[1, 4]], vocab.fingerprint, exclude=[EOS]), m)
    once.reset([6])
    assert once.propose([6, 1], s1, 5).confidence == [pytest.approx(1 / 2)]


def test_greedy_output_with_the_corpus_is_the_target_only_output_alone_in_auto_and_in_a_batch(setup):
    from constrained_spec.decoding import AdaptiveK
    from constrained_spec.batching.engine import BatchEngine
    from constrained_spec.drafters import LookupDrafter
    from constrained_spec.drafters.hybrid import HybridDrafter

    vocab, compiled, target, corpus = setup
    prompts = [PROMPT, PROMPT[:3], [6, 6, 6, 1], [3, 4, 5, 6, 1], [1, 3, 1, 3, 1], [2, 6]]
    refs = [decode(target, compiled.matcher(), p, max_new_tokens=16).tokens for p in prompts]
    drafted = 0
    for p, ref in zip(prompts, refs):
        _, drafts, res = _drafts(compiled, target, corpus, p)
        assert res.tokens == ref
        drafted += sum(len(d.tokens) for _, _, d in drafts)
        m = compiled.matcher()
        hybrid = HybridDrafter([LookupDrafter(m), CorpusDrafter(corpus, m)])
        assert decode(target, m, p, drafter=hybrid, k_policy=AdaptiveK(8), max_new_tokens=16).tokens == ref
    assert drafted > 0
    engine = BatchEngine(target, max_batch=3)
    reqs = []
    for p in prompts:
        m = compiled.matcher()
        reqs.append(engine.submit(p, m, drafter=CorpusDrafter(corpus, m), k_policy=FixedK(3), max_new_tokens=16))
    list(engine.run())
    assert [r.result.tokens for r in reqs] == refs
    assert sum(r.result.stats.drafted for r in reqs) > 0


def test_sampling_with_the_corpus_is_exact(setup):
    """Power: as in test_exactness (N = 3000 draws, chi-square against the enumerated law)."""
    _, compiled, target, corpus = setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: _drafts(compiled, target, corpus, PROMPT, s)[2].tokens)
    assert pv > 1e-3


def test_a_directory_with_a_corpus_drafts_with_it_and_draft_false_turns_it_off(setup, tmp_path):
    from constrained_spec.api import DraftSource, resolve_draft
    from constrained_spec.decoding import SpecOptions
    from constrained_spec.models import ModelHandle

    vocab, _, target, corpus = setup
    handle = ModelHandle(target, vocab, "tiny")
    auto = SpecOptions(drafter="auto")
    corpus.save(tmp_path / "c")
    source = resolve_draft(str(tmp_path / "c"), handle, auto)
    assert isinstance(source, DraftSource) and source.head is None and source.corpus is not None
    assert source.corpus.tokens.tolist() == corpus.tokens.tolist()
    assert resolve_draft(False, handle, auto) is None
    assert resolve_draft(None, handle, auto) is None  # nothing ships for the tiny model
    other = OutputCorpus([[1, 2]], "0" * 40)
    other.save(tmp_path / "o")
    with pytest.raises(TokenizerMismatchError):
        resolve_draft(str(tmp_path / "o"), handle, auto)
