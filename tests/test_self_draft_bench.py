"""``bench self-draft``: the target's own layers as its draft, measured against its own outputs
(``bench.self_draft``, ``models.layer_subset``)."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.bench.self_draft import agreements, best_bound, layer_sets, LayerSet
from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import decode
from constrained_spec.models.layer_subset import layer_subset


def test_layer_sets_are_early_exits_and_skipped_middles_with_all_layers_last():
    sets = layer_sets(28)
    names = [s.name for s in sets]
    assert names == ["first 14", "first 21", "first 7 + last 7", "first 8 + last 8", "first 10 + last 10",
                     "first 12 + last 12", "all 28"]
    assert sets[3].layers == tuple(range(8)) + tuple(range(20, 28))
    assert [s.name for s in layer_sets(2)] == ["first 1", "all 2"]  # the same layers are one set


def test_the_bound_is_the_tokens_a_pass_brings_over_the_steps_it_costs():
    k, bound = best_bound(0.8, 0.5)
    assert k == 2 and bound == pytest.approx((1 + 0.8 + 0.64) / 2.0)
    assert best_bound(0.9, 0.0)[0] == 12  # a free draft: the longest K
    assert best_bound(0.3, 0.7) == (0, 1.0)  # pays at no K
    assert best_bound(1.0, 0.1) == (12, 13 / 2.2)


@torch.no_grad()
def test_a_layer_subset_runs_its_layers_only_and_leaves_the_model_whole(tmp_path, monkeypatch):
    """The view's forward equals the whole stack's with the other layers taken out, and the
    model itself still runs every layer."""
    from constrained_spec import load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    handle = load_model(str(write_tiny_gguf(tmp_path / "m.gguf", layers=3, seed=1, gpt2_vocab=2000)))
    model, ids = handle.model, torch.tensor([[5, 17, 300, 42]])
    whole = model.base_model(input_ids=ids).last_hidden_state
    view = layer_subset(model, [0, 2])
    got = view(input_ids=ids).last_hidden_state
    layers = model.base_model.layers
    skipped = layers[1]
    try:  # the reference: the stack with layer 1 made the identity
        layers[1] = _Identity()
        want = model.base_model(input_ids=ids).last_hidden_state
    finally:
        layers[1] = skipped
    assert torch.equal(got, want) and not torch.equal(got, whole)
    assert len(model.base_model.layers) == 3 and torch.equal(model.base_model(input_ids=ids).last_hidden_state, whole)
    with pytest.raises(ValueError, match="ascending"):
        layer_subset(model, [2, 0])


class _Identity(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def test_every_layer_agrees_with_the_targets_own_tokens_and_fewer_layers_less(tmp_path, monkeypatch):
    """Over a cache the whole model filled, the set of all layers picks the token the target
    wrote at every unforced position (the control: the cache is held and put back right), and
    the cache is left as the whole model filled it."""
    from constrained_spec import load_model
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    handle = load_model(str(write_tiny_gguf(tmp_path / "m.gguf", layers=4, seed=2, gpt2_vocab=2000)))
    compiled = compile_constraint(r"[a-z ]{40,80}\.", handle.tokenizer, kind="regex")
    prompt = handle.tokenizer("Some words: ")["input_ids"]
    output = decode(handle.model, compiled.matcher(), prompt, max_new_tokens=40).tokens
    sets = [LayerSet("first 1", (0,)), LayerSet("first 2 + last 1", (0, 1, 3)), LayerSet("all 4", (0, 1, 2, 3))]
    found = agreements(handle.model, prompt, output, compiled.matcher(), sets)
    agreed, positions = found["all 4"]
    assert positions >= 10 and agreed == positions
    assert found["first 1"][0] < positions  # a random model's one layer is not its four
