"""Logits over the allowed ids only, for states that allow few tokens (``models.output_rows``)."""

from __future__ import annotations

import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import decode
from constrained_spec.models import output_rows as logits_module
from constrained_spec.models.output_rows import allowed_subset, project_rows, supports_subsets
from constrained_spec.drafters import LookupDrafter
from constrained_spec.decoding import FixedK
from tests.conftest import tiny_llama


@torch.no_grad()
def test_subset_rows_are_the_full_logits_on_their_ids():
    model = tiny_llama(300, seed=3)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(4))
    full = model(input_ids=ids).logits[0]
    hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    subsets = [None, torch.tensor([5, 17, 299]), None, torch.tensor([0, 1])]
    rows = [0, 3, 5, 8]
    got = project_rows(model, hidden[rows], subsets)
    assert got.shape == (4, 300) and got.dtype == torch.float64
    # The full rows: the model's own output layer, as its forward applies it to those rows.
    ref = model(input_ids=ids, logits_to_keep=torch.tensor([0, 5])).logits[0]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[1])
    for i, r in ((1, 3), (3, 8)):
        s = subsets[i]
        assert torch.allclose(got[i, s], full[r, s], rtol=1e-12, atol=1e-12)
        rest = torch.ones(300, dtype=torch.bool)
        rest[s] = False
        assert not got[i, rest].any()  # zeros: the mask removes them


def test_allowed_subset_takes_small_states_only():
    mask = torch.zeros(2000, dtype=torch.bool)
    mask[7] = True
    assert allowed_subset(mask) is None  # one token: no logits at all
    mask[[3, 1500]] = True
    assert allowed_subset(mask).tolist() == [3, 7, 1500]
    mask[: logits_module.SUBSET_MAX + 1] = True
    assert allowed_subset(mask) is None  # too many: the full projection


def test_models_whose_logits_are_more_than_the_output_layer_keep_it():
    model = tiny_llama(64, seed=1)
    assert supports_subsets(model)
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: out + 1)
    assert not supports_subsets(model)  # the subset path would skip the hook
    handle.remove()
    model.config.final_logit_softcapping = 30.0
    assert not supports_subsets(model)


def test_decoding_takes_both_paths_and_greedy_identity_holds(smol, monkeypatch):
    """Over the real tokenizer an invoice takes the subset path for digits, booleans and
    punctuation and the full one inside strings; target-only and lookup-speculative output are
    the same tokens, and the same as with the subset path turned off (float64: no near ties)."""
    target = tiny_llama(49152, seed=11, init=0.3)
    compiled = compile_constraint("schemas/invoice.json", smol.tokenizer)
    prompt = smol.tokenizer("Invoice INV-2291 from Acme GmbH dated 2024-03-05, total 1249.50 EUR, paid: true.")["input_ids"]
    seen = []
    real = logits_module.allowed_subset

    def spy(mask):
        out = real(mask)
        seen.append(out is not None)
        return out

    monkeypatch.setattr("constrained_spec.decoding.decoder.allowed_subset", spy)
    base = decode(target, compiled.matcher(), prompt, max_new_tokens=64)
    m = compiled.matcher()
    spec = decode(target, m, prompt, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=64)
    assert any(seen) and not all(seen)
    assert spec.tokens == base.tokens
    monkeypatch.setattr(logits_module, "SUBSET_MAX", 0)
    assert decode(target, compiled.matcher(), prompt, max_new_tokens=64).tokens == base.tokens


@torch.no_grad()
def test_a_bucketed_output_layer_with_a_bias_keeps_it_on_the_subset_path():
    from constrained_spec.models.bucketed_linear import BucketedLinear, RowSplit

    model = tiny_llama(300, seed=6)
    linear = torch.nn.Linear(32, 300, bias=True, dtype=torch.float64)
    torch.nn.init.normal_(linear.bias, std=3.0)
    model.lm_head = BucketedLinear(linear, RowSplit(), bucket=8, transposed=True)
    assert supports_subsets(model)
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(7))
    hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    full = linear(hidden)
    s = torch.tensor([2, 40, 41, 250])
    got = project_rows(model, hidden[[1, 4]], [s, None])
    assert torch.allclose(got[0, s], full[1, s], rtol=1e-12, atol=1e-12)
    assert torch.allclose(got[1], full[4], rtol=1e-12, atol=1e-12)
