"""The whole decoder samples exactly the target-only grammar-masked law.

A small constrained language over a hand-built vocabulary, a float64 tiny target and a
different tiny draft. The exact probability of every complete token sequence under
target-only masked sampling is enumerated (a slow reference: one full forward per prefix,
no cache), then the speculative decoder's samples are compared by a chi-square test.

Power: with N = 3000 runs per test, the correct decoder gave p = 0.35 (seeds 0..2999), while
the two known-wrong variants kept as negative controls gave p ~ 1e-133 (correction sampled
from p instead of the residual) and p < 1e-300 (a draft that samples from the masked q but
reports the unmasked q). The tests assert p > 1e-3 for the right decoder and p < 1e-4 for the
controls, so the test has power ~1 against either mistake. The controls run N_CONTROL = 1000
draws on one backend (the mistakes are in the verifier and the draft, not the automaton):
there they gave p = 5e-47 and p < 1e-300 (the batch engine's control, test_engine, 2e-33; the
head's, test_head, 6e-19).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import constrained_spec.decoding.decoder as decoder_mod
from constrained_spec.constraint import TokenVocabulary, apply_mask, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.decoding.verifier import Verdict, masked_probs
from constrained_spec.drafters import LookupDrafter, ModelDrafter
from tests.conftest import tiny_llama

BACKENDS = ["outlines-core", "llguidance"]

EOS = 0
TOKENS = {1: b"a", 2: b"b", 3: b"ab", 4: b"c", 5: b"ba", 6: b"x"}
MODEL_VOCAB = 10  # rows 7..9 are embedding padding: never allowed
PATTERN = r"[ab]{1,2}c?"
PROMPT = [6, 1, 2, 6, 3, 4, 5, 1]
N = 3000
N_CONTROL = 1000


def _setup(backend: str):
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    compiled = compile_constraint(PATTERN, vocab, kind="regex", backend=backend)
    target = tiny_llama(MODEL_VOCAB, seed=1)
    draft = tiny_llama(MODEL_VOCAB, seed=2)
    return compiled, target, draft


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request):
    """The compiled constraint (each run takes a fresh matcher of it), target and draft, per backend."""
    return _setup(request.param)


@pytest.fixture(scope="module")
def control_setup():
    """The same on one backend, for the negative controls."""
    return _setup(BACKENDS[1])


@torch.no_grad()
def exact_law(compiled, target, prompt) -> dict[tuple[int, ...], float]:
    """P(sequence) under target-only masked sampling at T = 1, by enumeration."""
    law: dict[tuple[int, ...], float] = {}
    constraint = compiled.matcher()

    def visit(prefix: list[int], state: int, prob: float) -> None:
        if constraint.is_done(state):
            law[tuple(prefix)] = law.get(tuple(prefix), 0.0) + prob
            return
        logits = target(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].clone()
        p = masked_probs(apply_mask(logits, constraint.allowed_mask(state)), 1.0)
        for t in torch.nonzero(p).flatten().tolist():
            if t == EOS:
                law[tuple(prefix)] = law.get(tuple(prefix), 0.0) + prob * float(p[t])
            else:
                visit(prefix + [t], constraint.next_state(state, t), prob * float(p[t]))

    visit([], constraint.initial_state, 1.0)
    return law


def sample_pvalue(law, draw, n: int = N) -> float:
    """Chi-square p-value of ``n`` draws against ``law`` (bins with expected count < 5 merged)."""
    keys = sorted(law, key=lambda k: -law[k])
    counts = {k: 0 for k in keys}
    other = 0
    for seed in range(n):
        out = tuple(draw(seed))
        if out in counts:
            counts[out] += 1
        else:
            other += 1
    assert other == 0, "the decoder produced a sequence outside the language"
    big = [k for k in keys if law[k] * n >= 5]
    small = [k for k in keys if law[k] * n < 5]
    obs = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    exp = [law[k] * n for k in big] + ([sum(law[k] for k in small) * n] if small else [])
    return float(chisquare(np.array(obs), np.array(exp) * (sum(obs) / sum(exp))).pvalue)


def run(compiled, target, make_drafter, seed, k=3, prompt=PROMPT):
    """One sampled request: a fresh matcher, the drafter built on it, K fixed."""
    matcher = compiled.matcher()
    return decode(target, matcher, prompt, drafter=make_drafter(matcher), k_policy=FixedK(k), temperature=1.0,
                  seed=seed, max_new_tokens=16).tokens


def test_language_is_nontrivial(setup):
    compiled, target, _ = setup
    law = exact_law(compiled, target, PROMPT)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    assert len(law) >= 12 and max(law.values()) < 0.5


def test_backends_agree_on_the_law():
    """Both backends define the same language here, so the same enumerated law."""
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    target = tiny_llama(MODEL_VOCAB, seed=1)
    laws = [exact_law(compile_constraint(PATTERN, vocab, kind="regex", backend=b), target, PROMPT) for b in BACKENDS]
    assert laws[0].keys() == laws[1].keys()
    assert all(abs(laws[0][k] - laws[1][k]) < 1e-12 for k in laws[0])


def test_model_drafter_sampling_is_exact(setup):
    compiled, target, draft = setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: run(compiled, target, lambda m: ModelDrafter(draft, m, temperature=1.0), s))
    assert pv > 1e-3


def test_lookup_drafter_sampling_is_exact(setup):
    compiled, target, _ = setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: run(compiled, target, LookupDrafter, s))
    assert pv > 1e-3


def _correction_from_p(p, x, q, generator=None):
    """Known-wrong verifier: at the first rejection, sample from p_i rather than the residual."""
    k = x.shape[0]
    for i in range(k):
        qi = q[i, x[i]] if q is not None else 1.0
        if torch.rand((), dtype=p.dtype, generator=generator) * qi > p[i, x[i]]:
            return Verdict(i, int(torch.multinomial(p[i], 1, generator=generator)), False)
    return Verdict(k, int(torch.multinomial(p[k], 1, generator=generator)), True)


class UnmaskedQDrafter(ModelDrafter):
    """Known-wrong drafter: samples from the masked q but reports the unmasked softmax as q."""

    @torch.no_grad()
    def propose(self, context, state, k):
        d = super().propose(context, state, k)
        if d.q is not None:
            rows = []
            for i in range(len(d.tokens)):
                logits = self.model(input_ids=torch.tensor([context + d.tokens[:i]])).logits[0, -1]
                rows.append(torch.softmax(logits.double() / self.temperature, -1))
            d.q = torch.stack(rows)
        return d


def test_negative_control_correction_from_p_is_caught(control_setup, monkeypatch):
    compiled, target, draft = control_setup
    law = exact_law(compiled, target, PROMPT)
    monkeypatch.setattr(decoder_mod, "verify_sampled", _correction_from_p)
    pv = sample_pvalue(law, lambda s: run(compiled, target, lambda m: ModelDrafter(draft, m, temperature=1.0), s),
                       N_CONTROL)
    assert pv < 1e-4


def test_negative_control_unmasked_q_is_caught(control_setup):
    compiled, target, draft = control_setup
    law = exact_law(compiled, target, PROMPT)
    pv = sample_pvalue(law, lambda s: run(compiled, target, lambda m: UnmaskedQDrafter(draft, m, temperature=1.0), s),
                       N_CONTROL)
    assert pv < 1e-4


def _greedy_tokenize(text: str) -> list[int]:
    """Longest-match tokenizer over TOKENS (enough for forced text in these tests)."""
    by_bytes = sorted(((b, t) for t, b in TOKENS.items()), key=lambda bt: -len(bt[0]))
    data, out = text.encode(), []
    while data:
        b, t = next((b, t) for b, t in by_bytes if data.startswith(b))
        out.append(t)
        data = data[len(b):]
    return out


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_hybrid_drafter_with_mixed_q_is_exact(setup, adaptive):
    """Forced, copied (one-hot q) and model (sampled q) tokens in one draft; with the adaptive
    policy the verified length also varies with the kinds drafted, which must not bias it."""
    from constrained_spec.decoding.kpolicy import AdaptiveK
    from constrained_spec.drafters import GrammarDrafter, HybridDrafter

    compiled0, target, draft = setup
    vocab = TokenVocabulary.build(TOKENS, EOS, size=7)
    compiled = compile_constraint(r"xx[ab]{1,2}c?", vocab, kind="regex", backend=compiled0.backend)
    law = exact_law(compiled, target, PROMPT)
    kinds: set[str] = set()

    def draw(seed):
        m = compiled.matcher()
        hybrid = HybridDrafter([GrammarDrafter(m, _greedy_tokenize), LookupDrafter(m),
                                ModelDrafter(draft, m, temperature=1.0)])
        policy = AdaptiveK(4) if adaptive else FixedK(4)
        res = decode(target, m, PROMPT, drafter=hybrid, k_policy=policy, temperature=1.0, seed=seed,
                     max_new_tokens=16)
        kinds.update(k for k, row in res.stats.per_kind.items() if row["drafted"])
        return res.tokens

    assert sample_pvalue(law, draw) > 1e-3
    assert {"grammar", "model"} <= kinds
