"""A draft model's draft vocabulary: where a state allows many tokens, its logits come from the
rows of its leading token ids and its prompt's tokens only (``models.output_rows.VocabularyRows``,
``QuantLinear.take_rows``), never from the whole output matrix; output and law stay the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from constrained_spec.drafters import ModelDrafter
from constrained_spec.models import output_rows, q4_vnni, q8_output
from constrained_spec.models.invariant import make_batch_invariant
from constrained_spec.models.output_rows import VocabularyRows, project_rows
from tests.conftest import tiny_llama
from tests.test_draft_model_pays import count_full_projections
from tests.test_exactness import BACKENDS, MODEL_VOCAB, _setup, exact_law, run, sample_pvalue


def test_the_packed_forms_give_back_the_rows_they_packed():
    """``unpack_rows`` is ``pack``'s inverse on any rows (``take_rows`` builds a layer of them)."""
    rng = np.random.default_rng(0)
    n, k = 64, 96
    ids = torch.tensor([63, 0, 17, 32, 31])
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d, m = (rng.standard_normal((n, k // 32)).astype(np.float32) for _ in range(2))
    got = q4_vnni.unpack_rows(*q4_vnni.pack(q, d, m), ids)
    for a, want in zip(got, (q, d, m)):
        assert np.array_equal(a.numpy(), want[ids.numpy()])
    q8 = rng.integers(-128, 128, (n, k)).astype(np.int8)
    for scale_cols, mins in ((k // 32, True), (k // 16, False)):  # a scale per block with mins; per half-block
        scale = rng.standard_normal((n, scale_cols)).astype(np.float32)
        mn = rng.standard_normal((n, k // 32)).astype(np.float32) if mins else None
        uq, us, um = q8_output.unpack_rows(*q8_output.pack_vnni(q8, scale, mn), ids)
        assert np.array_equal(uq.numpy(), q8[ids.numpy()]) and np.array_equal(us.numpy(), scale[ids.numpy()])
        assert (um is None) if mn is None else np.array_equal(um.numpy(), mn[ids.numpy()])


@torch.no_grad()
def test_vocabulary_rows_are_the_output_layers_logits_on_their_ids(tmp_path, monkeypatch):
    """On a GGUF model's packed output layer (``take_rows``) and on a plain float64 one: the
    logits of the leading ids and the extra tokens equal the full projection's there, -inf
    elsewhere."""
    from constrained_spec import load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    gguf = load_model(str(write_tiny_gguf(tmp_path / "m.gguf", layers=1, seed=3, hidden=256, ff=512, gpt2_vocab=2000)))
    plain = make_batch_invariant(tiny_llama(300, seed=3))
    for model, size, extra, tol in ((gguf.model, 100, [1500, 7, 1999], 1e-5), (plain, 40, [299, 41, 3], 1e-12)):
        hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(
            next(model.parameters()).dtype)
        full = project_rows(model, hidden, [None] * 3)
        rows = model.vocabulary_rows(size)
        assert rows is model.vocabulary_rows(size)  # built once per model and size
        wider = rows.with_tokens(extra)
        assert len(rows) == size and len(wider) == size + 2 and len(rows) == size  # the base is not changed
        got = wider.logits(hidden)
        member = wider.member
        assert member[:size].all() and member[torch.tensor(extra)].all()
        assert torch.allclose(got[:, member], full[:, member].to(got.dtype), rtol=tol, atol=tol)
        assert torch.isneginf(got[:, ~member]).all()


def _wide_draft_pair(tmp_path, monkeypatch):
    from constrained_spec import load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    shape = dict(arch="llama", types={"attn_q": "Q4_0"}, hidden=256, ff=512, gpt2_vocab=2000)
    target = load_model(str(write_tiny_gguf(tmp_path / "target.gguf", layers=2, seed=0, **shape)))
    # The draft is the target's file under another name: right where the target is, so it drafts.
    draft = load_model(str(write_tiny_gguf(tmp_path / "draft.gguf", layers=2, seed=0, **shape)))
    return target, draft


def test_a_draft_model_proposes_from_its_draft_vocabulary_where_a_state_allows_many(tmp_path, monkeypatch):
    """Free text over a 2,000-token vocabulary with a draft vocabulary of the first 256 ids
    (every state wide: ``SUBSET_MAX`` 0): every drafted token is one of them or of the prompt's,
    the draft's full projection never runs, and the greedy output is target-only's."""
    from constrained_spec import generate_regex

    target, draft = _wide_draft_pair(tmp_path, monkeypatch)
    monkeypatch.setattr(output_rows, "SUBSET_MAX", 0)
    monkeypatch.setitem(ModelDrafter.__init__.__kwdefaults__, "vocabulary", 256)  # as the factory builds it
    pattern, prompt = r"[a-z ]{20,60}\.", "Write some words: "
    base = generate_regex(target, pattern, prompt, drafter="none", max_new_tokens=40)
    allowed = set(range(256))
    proposed: list[int] = []
    plain_propose, plain_reset = ModelDrafter.propose, ModelDrafter.reset

    def watch(self, context, state, k):
        draft_ = plain_propose(self, context, state, k)
        proposed.extend(draft_.tokens)
        return draft_

    monkeypatch.setattr(ModelDrafter, "propose", watch)
    monkeypatch.setattr(ModelDrafter, "reset", lambda self, ids: allowed.update(ids) or plain_reset(self, ids))
    full_projections = count_full_projections(monkeypatch, draft)
    text, stats = generate_regex(target, pattern, prompt, drafter="model", draft=draft, k_max=4, max_new_tokens=40,
                                 return_stats=True)
    assert text == base and stats.drafted > 0 and proposed
    assert set(proposed) <= allowed
    assert not full_projections
    # Without it the same draft proposes outside those ids: the vocabulary is what kept it in.
    monkeypatch.setitem(ModelDrafter.__init__.__kwdefaults__, "vocabulary", None)
    proposed.clear()
    assert generate_regex(target, pattern, prompt, drafter="model", draft=draft, k_max=4, max_new_tokens=40) == base
    assert not set(proposed) <= allowed


def test_a_draft_vocabulary_is_gathered_at_the_first_ask_not_for_a_request_that_never_asks(tmp_path, monkeypatch):
    """The prompt's rows are gathered when the draft is first asked, once per request: a request
    where forced text drafts everything (the draft never asked) gathers none."""
    from constrained_spec import generate_regex

    target, draft = _wide_draft_pair(tmp_path, monkeypatch)
    monkeypatch.setattr(output_rows, "SUBSET_MAX", 0)
    monkeypatch.setitem(ModelDrafter.__init__.__kwdefaults__, "vocabulary", 256)
    gathered: list[list[int]] = []
    plain = VocabularyRows.with_tokens
    monkeypatch.setattr(VocabularyRows, "with_tokens", lambda self, tokens: gathered.append(list(tokens)) or plain(self, tokens))
    asked: list[int] = []
    plain_propose = ModelDrafter.propose
    monkeypatch.setattr(ModelDrafter, "propose", lambda self, c, s, k: asked.append(k) or plain_propose(self, c, s, k))
    forced, prompt = r"hello world\.", "Say hello: "
    base = generate_regex(target, forced, prompt, drafter="none")
    assert generate_regex(target, forced, prompt, drafter="hybrid", draft=draft) == base
    assert not asked and not gathered
    free = r"[a-z ]{20,60}\."
    base = generate_regex(target, free, prompt, drafter="none", max_new_tokens=40)
    assert generate_regex(target, free, prompt, drafter="model", draft=draft, k_max=4, max_new_tokens=40) == base
    assert len(asked) > 1 and len(gathered) == 1


def test_a_draft_vocabulary_keeps_the_sampled_law_exact(monkeypatch):
    """Every state on the draft vocabulary's path (``SUBSET_MAX`` 0), a vocabulary of ids 0..2
    and a prompt holding 1, 2 and 6: the draft never proposes 3 ("ab") or 5 ("ba"), allowed only
    beside 1 and 2 (4, "c", it proposes where no token of its vocabulary is allowed: the full
    projection), and the output law is still target-only's (chi-square on 1,500 draws; the
    reported-q mistake of test_exactness's control gives p < 1e-300 on 1,000)."""
    monkeypatch.setattr(output_rows, "SUBSET_MAX", 0)
    compiled, target, _ = _setup(BACKENDS[1])
    draft = make_batch_invariant(tiny_llama(MODEL_VOCAB, seed=2))
    prompt = [6, 6, 1, 2, 6]
    law = exact_law(compiled, target, prompt)
    assert any(t in key for key in law for t in (3, 4, 5))  # the law does use the tokens the draft cannot
    proposed: list[int] = []

    class Watched(ModelDrafter):
        def propose(self, context, state, k):
            d = super().propose(context, state, k)
            proposed.extend(d.tokens)
            return d

    pv = sample_pvalue(law, lambda s: run(compiled, target, lambda m: Watched(draft, m, temperature=1.0, vocabulary=3),
                                          s, prompt=prompt), n=1500)
    assert pv > 1e-3
    assert {1, 2, 4} <= set(proposed) and not set(proposed) & {3, 5}
