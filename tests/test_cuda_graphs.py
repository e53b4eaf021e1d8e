"""The graphed decode and verify forwards (``models.cuda_graphs``): the static forward a graph
records, run on the CPU without recording it (``capture=False``), and on a GPU captured and
replayed (those tests are skipped where there is none).

What could break, and is checked bit for bit against the eager forward of the same model: the
row and key padding, the positions and mask built inside the forward, the keys written at
tensor positions, the hand-over of the runner's buffers between requests, the fallbacks to the
eager path, and the decoder on top (greedy speculative output equals target-only output).
"""

from __future__ import annotations

import pytest
import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.models.growing_cache import growing_cache
from constrained_spec.drafters import ModelDrafter
from constrained_spec.models.cuda_graphs import ROW_BUCKETS, install_cuda_graphs, key_bucket, row_bucket
from constrained_spec.models.invariant import make_batch_invariant
from tests.test_invariance import GPU, PATTERNS, VOCAB, smol_shaped

MODES = [pytest.param("cpu", id="static-forward-cpu"), pytest.param("cuda", id="graphs-gpu", marks=GPU)]


@pytest.fixture(autouse=True)
def _graphs_attend_in_float64(float64_attention):
    """A graphed forward attends in float64 over a float64 cache, as every GPU forward does; its
    static forward on the CPU is checked on that path too (the CPU's row kernel and float32 cache
    would otherwise take the forwards)."""


def graphed_model(device: str, seed: int = 0, vocab: int = 512, init: float = 0.02, capacity: int | None = None):
    layers = 30 if device == "cuda" else 4
    model = make_batch_invariant(smol_shaped(vocab, seed=seed, layers=layers, init=init, device=device),
                                 bucket_linears=True)
    runner = install_cuda_graphs(model, capacity=capacity or (2048 if device == "cuda" else 512),
                                 capture=device == "cuda")
    assert runner is not None
    return model, runner


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 13, 32, 33)] == [1, 2, 4, 8, 16, 32, None]
    assert [key_bucket(n, 2048) for n in (1, 256, 257, 600, 2048, 2049)] == [256, 256, 512, 1024, 2048, None]
    assert key_bucket(700, 600) is None and key_bucket(520, 600) == 600


@torch.no_grad()
def step(model, cache, ids, prompt_rows=0):
    """One forward; the hidden states of its new rows (every layer) and their logits."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True, prompt_rows=prompt_rows,
                output_hidden_states=True, logits_to_keep=len(ids) - prompt_rows)
    return torch.stack([h[0, prompt_rows:] for h in out.hidden_states]), out.logits[0]


@pytest.mark.parametrize("device", MODES)
def test_graphed_forwards_equal_eager_ones_bit_for_bit(device):
    """One-token and k-token passes through the runner give the eager forward's hidden states
    (every layer) and logits, bit for bit, and the same keys in the cache."""
    model, runner = graphed_model(device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 512, (60,), generator=g).tolist()
    feeds = [torch.randint(1, 512, (k,), generator=g).tolist() for k in (1, 1, 3, 1, 8, 13, 1, 32, 5, 1)]
    results = {}
    for enabled in (False, True):
        runner.enabled = enabled
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        step(model, cache, prompt, len(prompt) - 1)
        results[enabled] = [step(model, cache, ids) for ids in feeds]
        # A rollback of the last two feeds, then the last one again: the same bits.
        cache.crop(-len(feeds[-1]) - len(feeds[-2]))
        h, lg = step(model, cache, feeds[-1])
        assert not torch.equal(h, results[enabled][-1][0])  # (at other positions: other values)
        cache.crop(-len(feeds[-1]))
        step(model, cache, feeds[-2])
        h, lg = step(model, cache, feeds[-1])
        assert torch.equal(h, results[enabled][-1][0]) and torch.equal(lg, results[enabled][-1][1])
        results[enabled].append([la.keys.clone() for la in cache.layers])
    *eager, eager_keys = results[False]
    *graphed, graphed_keys = results[True]
    for i, ((he, le), (hg, lg)) in enumerate(zip(eager, graphed)):
        assert torch.equal(he, hg) and torch.equal(le, lg), f"feed {i} ({len(feeds[i])} tokens)"
    assert all(torch.equal(a, b) for a, b in zip(eager_keys, graphed_keys))
    assert runner.stats.served == len(feeds) + 3


@pytest.mark.parametrize("device", MODES)
@torch.no_grad()
def test_graphed_k_token_pass_equals_k_one_token_passes(device):
    """Batch invariance through the runner: a k-token verify pass (each row bucket) equals k
    one-token passes bit for bit."""
    model, runner = graphed_model(device)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 512, (40,), generator=g).tolist()
    out = torch.randint(1, 512, (24,), generator=g).tolist()
    cache = growing_cache(model.config.num_hidden_layers, torch.float64)
    step(model, cache, prompt, len(prompt) - 1)
    singles = [step(model, cache, [t]) for t in out]
    ref_h = torch.cat([h for h, _ in singles], dim=1)
    ref_l = torch.cat([lg for _, lg in singles])
    for k in (1, 2, 3, 7, 12, 21, 24):
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        step(model, cache, prompt, len(prompt) - 1)
        h, lg = step(model, cache, out[:k])
        assert torch.equal(h, ref_h[:, :k]) and torch.equal(lg, ref_l[:k]), f"k={k}"
    assert runner.stats.eager == 8 and runner.stats.served == 24 + 7


@pytest.mark.parametrize("device", MODES)
def test_requests_hand_the_buffers_over(device):
    """Two requests interleaved step by step: each moves into the runner's buffers in turn
    (the other moving out), and each one's results equal its run alone."""
    model, runner = graphed_model(device)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (30, 50)]
    feeds = [[torch.randint(1, 512, (k,), generator=g).tolist() for k in (1, 4, 1, 2)] for _ in prompts]
    alone = []
    for prompt, fs in zip(prompts, feeds):
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        step(model, cache, prompt, len(prompt) - 1)
        alone.append([step(model, cache, ids) for ids in fs])
    caches = [growing_cache(model.config.num_hidden_layers, torch.float64) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        step(model, cache, prompt, len(prompt) - 1)
    moves = runner.stats.moves
    together = [[], []]
    for i in range(4):
        for r in (0, 1):
            together[r].append(step(model, caches[r], feeds[r][i]))
    assert runner.stats.moves - moves == 8  # every step changed hands
    for r in (0, 1):
        for (ha, la), (ht, lt) in zip(alone[r], together[r]):
            assert torch.equal(ha, ht) and torch.equal(la, lt)
    # The request that moved out holds its own buffers with the same keys.
    assert not any(la.holds(k) for la, k in zip(caches[0].layers, runner.keys))
    assert all(la.holds(k) for la, k in zip(caches[1].layers, runner.keys))


def test_forwards_it_does_not_serve_take_the_eager_path():
    """More rows than the largest bucket, a context past the buffers, another kind of cache,
    prompt rows: eager, with the same bits as with no runner."""
    from transformers import DynamicCache

    model, runner = graphed_model("cpu", capacity=256)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(1, 512, (200,), generator=g).tolist()
    long_feed = torch.randint(1, 512, (ROW_BUCKETS[-1] + 3,), generator=g).tolist()
    tail = torch.randint(1, 512, (40,), generator=g).tolist()
    outs = {}
    for enabled in (False, True):
        runner.enabled = enabled
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        step(model, cache, prompt, len(prompt) - 1)
        outs[enabled] = [step(model, cache, long_feed)]  # 35 rows: eager (235 positions held)
        outs[enabled] += [step(model, cache, [t]) for t in tail[:10]]  # served (245 held)
        outs[enabled] += [step(model, cache, tail[10:13])]  # a bucket of 4 rows fits 256: served
        outs[enabled] += [step(model, cache, [t]) for t in tail[13:25]]  # 7 served, then past 256: eager
        dyn = DynamicCache(config=model.config)
        step(model, dyn, prompt[:20], 19)
        outs[enabled].append(step(model, dyn, tail[:2]))  # another cache: eager
    for (ha, la), (hb, lb) in zip(outs[False], outs[True]):
        assert torch.equal(ha, hb) and torch.equal(la, lb)
    assert runner.stats.served == 10 + 1 + 8


@pytest.mark.parametrize("device", MODES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_speculative_output_with_graphs_equals_target_only(device, pattern):
    """Through the decoder: a random draft model's proposals force verify passes of up to 9
    rows; greedy output with the runner equals target-only output without it, token for token."""
    target, runner = graphed_model(device, seed=2, vocab=VOCAB.size, init=0.2)
    draft = smol_shaped(VOCAB.size, seed=3, layers=2, init=0.2, device=device)
    compiled = compile_constraint(pattern, VOCAB, kind="regex")
    prompt = [t + 1 for t in b"Extract: name maria gonzalez, age 34, tags arch, bcn. Output JSON."]
    for start in range(2):
        ids = prompt[start:]
        runner.enabled = False
        base = decode(target, compiled.matcher(), ids, max_new_tokens=64)
        runner.enabled = True
        served = runner.stats.served
        same = decode(target, compiled.matcher(), ids, max_new_tokens=64)
        m = compiled.matcher()
        spec = decode(target, m, ids, drafter=ModelDrafter(draft, m), k_policy=FixedK(8), max_new_tokens=64)
        assert same.tokens == base.tokens and spec.tokens == base.tokens, start
        assert runner.stats.served - served >= len(base.tokens) - 1 + spec.stats.target_forwards - 1


@pytest.mark.parametrize("device", MODES)
def test_buffers_grow_as_a_request_needs_them(monkeypatch, device):
    """The runner's buffers start small and double while a request holds them (its keys moved
    over, the graphs of the old buffers dropped): the same bits as the eager forward throughout."""
    from constrained_spec.models import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "FIRST_BUFFER", 128)
    model, runner = graphed_model(device, capacity=600)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 512, (100,), generator=g).tolist()
    feeds = [torch.randint(1, 512, (k,), generator=g).tolist() for k in (1, 8, 16, 32, 32, 32, 32, 32, 32, 32, 3)]
    outs = {}
    for enabled in (False, True):
        runner.enabled = enabled
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        step(model, cache, prompt, len(prompt) - 1)
        outs[enabled] = [step(model, cache, ids) for ids in feeds]  # 100 -> 352 positions held
    for i, ((ha, la), (hb, lb)) in enumerate(zip(outs[False], outs[True])):
        assert torch.equal(ha, hb) and torch.equal(la, lb), i
    assert runner.keys[0].shape[2] == 512 and runner.stats.grows == 1  # the first key bucket (256), then 512
    assert runner.stats.served == len(feeds)
    if device == "cuda":  # the graphs of the first buffers were dropped, the later ones captured
        assert all(keys == 512 for _, keys in runner._graphs)


def test_a_forward_that_cannot_be_captured_falls_back_to_eager():
    """Capture failing (a model or a torch whose forward cannot be recorded): that forward and
    every later one run eagerly, with a warning, and the outputs are the eager ones."""
    model, runner = graphed_model("cpu")
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(1, 512, (30,), generator=g).tolist()
    feeds = [torch.randint(1, 512, (k,), generator=g).tolist() for k in (1, 3, 1)]
    runner.enabled = False
    cache = growing_cache(model.config.num_hidden_layers, torch.float64)
    step(model, cache, prompt, len(prompt) - 1)
    eager = [step(model, cache, ids) for ids in feeds]

    def cannot_capture(rows, keys):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.enabled, runner.capture, runner._graph = True, True, cannot_capture
    cache = growing_cache(model.config.num_hidden_layers, torch.float64)
    step(model, cache, prompt, len(prompt) - 1)
    with pytest.warns(UserWarning, match="CUDA graphs are off"):
        fallen = [step(model, cache, ids) for ids in feeds]
    assert not runner.enabled and runner.stats.served == 0 and runner.stats.eager == 2 * (1 + len(feeds))
    for (ha, la), (hb, lb) in zip(eager, fallen):
        assert torch.equal(ha, hb) and torch.equal(la, lb)


def test_only_stacks_it_replays_exactly_get_graphs():
    """A model that is not batch-invariant, or whose decoder stack does more than the static
    forward replays (here Qwen2's), keeps its eager forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert install_cuda_graphs(smol_shaped(512, seed=0, layers=2, device="cpu"), capture=False) is None
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    qwen = make_batch_invariant(Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval(), bucket_linears=True)
    assert install_cuda_graphs(qwen, capture=False) is None
    assert not hasattr(qwen.base_model, "graphed")
