"""The learned draft head: exact with any weights (greedy identity, the enumerated sampled law,
a pruned draft vocabulary), its incremental cache equal to a fresh one, saved and loaded, and
refused on another tokenizer."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

from constrained_spec.constraint import TokenVocabulary, compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters.head import DraftHead, HeadConfig, HeadDrafter, default_taps, load_head
from constrained_spec.drafters.order import DraftOrder
from constrained_spec.errors import ModelLoadError, TokenizerMismatchError
from tests.conftest import tiny_llama
from tests.test_exactness import EOS, MODEL_VOCAB, N_CONTROL, PATTERN, PROMPT, TOKENS, exact_law, sample_pvalue

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
    pv = sample_pvalue(law, lambda s: _run(compiled, target, lambda m: UnprunedQHead(head, m, temperature=1.0), s),
                       N_CONTROL)
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


@torch.no_grad()
def test_the_inference_path_computes_the_training_forward(setup, monkeypatch):
    """``HeadRunner`` (fused matrices, its own cache) gives ``DraftHead.forward``'s hidden states
    and logits: a prompt of pairs (fed in two parts, the cache growing between), then one pair
    at a time, then a crop and another pair."""
    from constrained_spec.drafters import head_runner
    from constrained_spec.drafters.head_runner import HeadRunner

    monkeypatch.setattr(head_runner, "INITIAL_CAPACITY", 1)

    _, _, _, head = setup
    torch.manual_seed(3)
    d = head.config.hidden_size
    g = torch.randn(9, d, dtype=torch.float64)
    x = torch.randint(0, 7, (9,))
    cache, runner = DynamicCache(), HeadRunner(head)
    h, logits = head(g[None, :6], x[None, :6], torch.arange(6)[None], cache)
    runner.step(g[:2], x[:2], 0)
    rh, rl = runner.step(g[2:6], x[2:6], 2)
    assert torch.allclose(rh, h[0, -1], atol=1e-10) and torch.allclose(rl, logits[0, -1], atol=1e-10)
    for t in (6, 7):
        h, logits = head(g[None, t : t + 1], x[None, t : t + 1], torch.tensor([[t]]), cache)
        rh, rl = runner.step(g[t : t + 1], x[t : t + 1], t)
        assert torch.allclose(rl, logits[0, -1], atol=1e-10)
    cache.crop(-1)
    runner.crop(7)
    assert runner.length == 7
    h, logits = head(g[None, 8:9], x[None, 8:9], torch.tensor([[7]]), cache)
    rh, rl = runner.step(g[8:9], x[8:9], 7)
    assert torch.allclose(rh, h[0, -1], atol=1e-10) and torch.allclose(rl, logits[0, -1], atol=1e-10)
    assert not torch.allclose(rl, head(g[None, 8:9], x[None, 8:9], torch.tensor([[7]]))[1][0, -1], atol=1e-6)


def test_a_prefix_pass_is_a_full_pass_for_what_later_passes_read(setup):
    """``DraftHead.prefix``: the last position's state and every position's keys and values as a
    full pass gives them, so a later pass attending to its cache computes the same states, and
    the gradients through both (of the head's weights and of the inputs) are equal."""
    _, _, _, head = setup
    torch.manual_seed(3)
    d = head.config.hidden_size
    x, pos = torch.randint(0, 7, (1, 9)), torch.arange(9)[None]
    g = torch.randn(1, 9, d, dtype=torch.float64)

    def run(prefix: bool) -> tuple[torch.Tensor, list[torch.Tensor], DynamicCache]:
        head.zero_grad()
        inputs = g.clone().requires_grad_(True)
        cache = DynamicCache()
        first = (head.prefix if prefix else lambda *a: head.hidden(*a)[:, -1:])(inputs[:, :6], x[:, :6], pos[:, :6], cache)
        later = head.hidden(torch.cat([first, inputs[:, 6:8]], dim=1), x[:, 6:9], pos[:, 6:9], cache)
        loss = head.logits(later).logsumexp(-1).sum() + first.square().sum()
        loss.backward()
        grads = [inputs.grad] + [q.grad.clone() for q in head.parameters() if q.grad is not None]
        return later.detach(), grads, cache

    later_full, grads_full, cache_full = run(prefix=False)
    later_prefix, grads_prefix, cache_prefix = run(prefix=True)
    head.zero_grad()
    assert torch.allclose(later_prefix, later_full, atol=1e-12, rtol=0)
    for a, b in ((cache_prefix.layers[0].keys, cache_full.layers[0].keys),
                 (cache_prefix.layers[0].values, cache_full.layers[0].values)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12, rtol=0)
    assert len(grads_prefix) == len(grads_full) > 5
    for a, b in zip(grads_prefix, grads_full):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-9)
    assert grads_full[0][0, :5].abs().sum() > 0  # the prompt's inputs do get gradients (through their keys)


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
    seqs = featurize(target, outputs, list(head.config.draft_vocab))
    untrained = DraftHead(head.config, target.get_input_embeddings()).double()
    assert evaluate(head.float(), seqs) > evaluate(untrained.float(), seqs) + 0.1
    assert report.best_agreement >= 0.6
    assert len(report.losses) == 120 and all(isinstance(x, float) for x in report.losses)
    assert report.hard_agreement is None or 0.0 <= report.hard_agreement <= 1.0
    m1 = compiled.matcher()
    ref = decode(target, compiled.matcher(), PROMPT, max_new_tokens=16)
    res = decode(target, m1, PROMPT, drafter=HeadDrafter(head.double(), m1), k_policy=FixedK(3), max_new_tokens=16)
    assert res.tokens == ref.tokens
    assert set(head.config.draft_vocab) == set(draft_vocabulary(outputs, 4, EOS))
    # The recorded features are the target's own: those of one fresh forward over the sequence.
    o = outputs[0]
    fwd = target(input_ids=torch.tensor([o.prompt + o.tokens]), output_hidden_states=True)
    fresh = torch.cat([fwd.hidden_states[t][0] for t in head.config.taps], dim=-1)[:-1]
    assert torch.allclose(o.features.double(), fresh.double(), atol=1e-5)
    # Resuming a finished run takes up its checkpoint: no step is repeated.
    again = train_head(target, vocab, items, tmp_path / "head", steps=120, sampled=3, unroll=2, lr=3e-3,
                       held_out=0.0, draft_vocab=4, seed=0)
    assert again.steps == 120 and again.decode_seconds < report.decode_seconds


def test_batched_decoding_of_the_training_outputs_gives_the_same_outputs_and_features(setup):
    """Stage 1 in the batch engine (runs of different lengths joining and leaving, lookup
    drafting) decodes what one request at a time decodes, greedy and seeded sampled alike, and
    records the features of one fresh forward over each sequence."""
    from constrained_spec.drafters import LookupDrafter
    from constrained_spec.pipelines.train_drafter import decode_outputs

    _, compiled, target, _ = setup
    prompts = [PROMPT, PROMPT[:4], [6, 6, 1, 2], [3, 4, 5, 6, 1], [2, 2, 6], [5, 6, 3], [1, 3, 1, 3, 1]]
    items = [(p, compiled) for p in prompts]
    lookup = lambda i, m: LookupDrafter(m)  # noqa: E731
    one = decode_outputs(target, items, sampled=2, seed=0, drafter_for=lookup)
    many = decode_outputs(target, items, sampled=2, seed=0, drafter_for=lookup, batch=4)
    assert len(one) == len(many) >= len(prompts)
    assert [(o.item, o.tokens) for o in many] == [(o.item, o.tokens) for o in one]
    for a, b in zip(one, many):
        assert torch.allclose(a.features, b.features, atol=1e-6) and torch.allclose(a.final, b.final, atol=1e-6)
        fwd = target(input_ids=torch.tensor([b.prompt + b.tokens]), output_hidden_states=True)
        fresh = torch.cat([fwd.hidden_states[t][0] for t in default_taps(target.config.num_hidden_layers)], -1)[:-1]
        assert torch.allclose(b.features.double(), fresh.double(), atol=1e-5)


def test_unrolled_training_passes_keep_the_prompt_teacher_forced(setup):
    """The training loss: pass 0 is the head over the target's features; pass 1 is the head over
    its own pass-0 states from the first loss row on, attending to the teacher-forced states
    before it (as a draft at inference attends to the accepted positions), computed here in
    one plain forward over the whole sequence; and the learning rate decays from lr to lr/10."""
    from constrained_spec.pipelines.train_drafter import _losses, decayed_lr, decode_outputs, featurize

    _, compiled, target, head = setup
    outputs = decode_outputs(target, [([6, 1, 2, 6, 3], compiled), (PROMPT, compiled)], sampled=1, seed=0)
    seqs = featurize(target, outputs, list(head.config.draft_vocab))
    assert seqs
    with torch.no_grad():
        for seq in seqs:
            T = len(seq.ids)
            ids = torch.tensor(seq.ids)
            g = head.project_features(seq.features[: T - 1])[None]
            nxt, pos = ids[1:T][None], torch.arange(T - 1)[None]
            r = seq.rows - 1
            keep = r >= 0
            r, p, allowed = r[keep], seq.p[keep], seq.allowed[keep]
            a = int(r.min())
            assert a > 0  # the split is exercised

            def loss_of(h):
                ll = head.logits(h[0, r]).float().masked_fill(~allowed, -1e30).log_softmax(-1)
                return -(p * ll).sum()

            h0 = head.hidden(g, nxt, pos)
            g1 = torch.cat([g[:, :a], h0[:, a - 1 : T - 2]], dim=1)
            h1 = head.hidden(g1, nxt, pos)
            one, agree, n = _losses(head, seq, 1)
            two, _, _ = _losses(head, seq, 2)
            assert n.numel() == r.numel() and torch.equal(
                agree, head.logits(h0[0, r]).masked_fill(~allowed, -1e30).argmax(-1) == p.argmax(-1))
            assert torch.allclose(one, loss_of(h0).to(one.dtype), rtol=1e-5)
            assert torch.allclose(two, (loss_of(h0) + loss_of(h1)).to(two.dtype), rtol=1e-5)
    assert decayed_lr(1.0, 0.0) == 1.0 and abs(decayed_lr(1.0, 1.0) - 0.1) < 1e-12
    assert all(decayed_lr(1.0, x / 10) > decayed_lr(1.0, (x + 1) / 10) for x in range(10))


def test_lookup_coverage_follows_prompt_lookup():
    """Where prompt lookup would have drafted the right token: the longest earlier n-gram
    decides (a wrong continuation after a 3-gram match is a miss even if a 1-gram would hit)."""
    from constrained_spec.pipelines.train_drafter import lookup_covered

    ids = [1, 2, 3, 9, 1, 2, 3, 4]
    # t=6: (1, 2, 3) seen, followed by 9, not 4; t=5: (1, 2) seen, followed by 3; t=3: 9 new.
    assert lookup_covered(ids, [3, 5, 6]) == [False, True, False]
    assert lookup_covered([1, 2, 5, 2, 5], [3]) == [True]
    assert lookup_covered([1, 2, 5, 2, 5], [3], ignore={2}) == [False]  # a lone structural token


def _drafted_by_head(results) -> int:
    return sum(r.stats.per_kind.get("head", {}).get("drafted", 0) for r in results)


def test_in_a_batch_and_behind_other_drafters_the_output_is_the_target_only_output(setup):
    """The batch engine hands each row's features to its head (it drafts), rows with a head
    alone and a head behind lookup (rolling over lookup's tokens on its own states) beside
    each other, and every row equals its target-only run; the same drafters one request at a
    time give the same output."""
    from constrained_spec.batching.engine import BatchEngine
    from constrained_spec.drafters import LookupDrafter
    from constrained_spec.drafters.hybrid import HybridDrafter

    _, compiled, target, head = setup
    prompts = [PROMPT, PROMPT[:3], [6, 6, 6, 1], [3, 4, 5, 6, 1], [1, 3, 1, 3, 1]]
    refs = [decode(target, compiled.matcher(), p, max_new_tokens=16).tokens for p in prompts]

    def make(i, m):
        return HeadDrafter(head, m) if i % 2 == 0 else HybridDrafter([LookupDrafter(m), HeadDrafter(head, m)])

    engine = BatchEngine(target, max_batch=3)
    reqs = []
    for i, p in enumerate(prompts):
        m = compiled.matcher()
        reqs.append(engine.submit(p, m, drafter=make(i, m), k_policy=FixedK(3), max_new_tokens=16))
    list(engine.run())
    assert [r.result.tokens for r in reqs] == refs
    assert _drafted_by_head([r.result for r in reqs]) > 0
    singles = []
    for i, p in enumerate(prompts):
        m = compiled.matcher()
        singles.append(decode(target, m, p, drafter=make(i, m), k_policy=FixedK(3), max_new_tokens=16))
    assert [r.tokens for r in singles] == refs and _drafted_by_head(singles) > 0


def test_int8_and_bfloat16_weights_load_close_and_draft_exactly(setup, tmp_path):
    vocab, compiled, target, head = setup
    for weights, tol in (("int8", 0.02), ("bfloat16", 0.01)):
        head.save(tmp_path / weights, weights=weights)
        loaded = load_head(tmp_path / weights, target, vocab.fingerprint)
        for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
            assert (a - b).abs().max() <= tol * a.abs().max() + 1e-12, name
        m = compiled.matcher()
        res = decode(target, m, PROMPT, drafter=HeadDrafter(loaded, m), k_policy=FixedK(3), max_new_tokens=16)
        assert res.tokens == decode(target, compiled.matcher(), PROMPT, max_new_tokens=16).tokens
    size = {w: (tmp_path / w / "head.safetensors").stat().st_size for w in ("int8", "bfloat16")}
    assert size["int8"] < 0.8 * size["bfloat16"]


def test_int8_weights_run_on_the_int8_kernel_close_to_their_dequantized_law_and_draft_exactly(setup, tmp_path):
    """A float32 head saved as int8 keeps its int8 bytes and runs them on torch's int8 kernel:
    every linear layer is replaced, its logits stay within bfloat16 rounding of the same head
    dequantized, and greedy drafting still gives the target-only output."""
    from constrained_spec.drafters.int8_linear import Int8Linear, int8_kernel_available

    if not int8_kernel_available():
        pytest.skip("this torch has no int8 weight-only CPU kernel")
    vocab, compiled, _, _ = setup
    target = tiny_llama(MODEL_VOCAB, seed=1, dtype=torch.float32)
    make_head(target, vocab.fingerprint).float().save(tmp_path / "int8", weights="int8")
    kernel = load_head(tmp_path / "int8", target, vocab.fingerprint)  # float32 target: the kernel by default
    plain = load_head(tmp_path / "int8", target, vocab.fingerprint, int8_kernel=False)
    linears = [m for m in kernel.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and sum(isinstance(m, Int8Linear) for m in kernel.modules()) == 10  # fc, proj, q, k, v, o, gate, up, down, lm_head
    g = torch.randn(1, 6, len(kernel.config.taps) * kernel.config.hidden_size)
    tokens, pos = torch.tensor([[1, 3, 4, 1, 6, 3]]), torch.arange(6)[None]
    with torch.no_grad():
        a = kernel(kernel.project_features(g), tokens, pos)[1]
        b = plain(plain.project_features(g), tokens, pos)[1]
    assert a.dtype == torch.float32 and (a - b).abs().max() <= 0.02 * b.abs().max()
    kernel.save(tmp_path / "again", weights="int8")  # saved from the kernel: the same bytes back
    again = load_head(tmp_path / "again", target, vocab.fingerprint, int8_kernel=False)
    for (name, x), y in zip(plain.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(x, y, rtol=1e-2, atol=1e-6), name
    for prompt in (PROMPT, [6, 6, 6, 1]):
        m = compiled.matcher()
        res = decode(target, m, prompt, drafter=HeadDrafter(kernel, m), k_policy=FixedK(3), max_new_tokens=16)
        assert res.tokens == decode(target, compiled.matcher(), prompt, max_new_tokens=16).tokens
        assert res.stats.drafted > 0


def test_int8_linear_copies_weights_off_a_64_byte_boundary_before_the_kernel_reads_them():
    """Weights read from a safetensors file sit at the file's offsets; torch's int8 kernel read
    such a weight with aligned AVX-512 loads and crashed the process for 4+ rows (the shipped
    head's ``fc``, at offset 52 mod 64, on an AVX-512 EPYC). The layer holds an aligned copy, and
    its rows equal those of the same weights allocated aligned."""
    from constrained_spec.drafters.int8_linear import KERNEL_ALIGNMENT, Int8Linear, int8_kernel_available

    if not int8_kernel_available():
        pytest.skip("this torch has no int8 weight-only CPU kernel")
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (64, 1728), dtype=torch.int8)
    off = torch.empty(w.numel() + KERNEL_ALIGNMENT, dtype=torch.int8)
    start = (-off.data_ptr() + 52) % KERNEL_ALIGNMENT
    misaligned = off[start : start + w.numel()].view(64, 1728)
    misaligned.copy_(w)
    assert misaligned.data_ptr() % KERNEL_ALIGNMENT == 52
    scale = torch.rand(64) / 100
    layer, reference = Int8Linear(misaligned, scale), Int8Linear(w, scale)
    assert layer.weight.data_ptr() % KERNEL_ALIGNMENT == 0 and torch.equal(layer.weight, w)
    x = torch.randn(16, 1728)
    with torch.no_grad():
        assert torch.equal(layer(x), reference(x))


def test_draft_false_a_directory_and_a_head_for_another_tokenizer(setup, tmp_path):
    from constrained_spec.api import DraftSource, resolve_draft
    from constrained_spec.decoding import SpecOptions
    from constrained_spec.models import ModelHandle

    vocab, _, target, head = setup
    handle = ModelHandle(target, vocab, "tiny")
    auto = SpecOptions(drafter="auto")
    assert resolve_draft(None, handle, auto) is None  # no head ships for the tiny model
    assert resolve_draft(False, handle, auto) is None
    from constrained_spec.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="no draft head ships"):
        resolve_draft(True, handle, auto)
    head.save(tmp_path / "h")
    source = resolve_draft(str(tmp_path / "h"), handle, auto)
    assert isinstance(source, DraftSource) and source.head is not None and source.model is None
    assert source.head.config == head.config
    assert resolve_draft(str(tmp_path / "h"), handle, SpecOptions(drafter="lookup")) is None
    other = DraftHead(HeadConfig.for_target(target, "0" * 40, DRAFT_VOCAB), target.get_input_embeddings())
    with pytest.raises(TokenizerMismatchError, match="another tokenizer"):
        resolve_draft(other, handle, auto)


def test_a_head_that_does_not_pay_is_not_drafted():
    from constrained_spec.decoding import AdaptiveK

    policy = AdaptiveK(8)
    order = DraftOrder(policy)
    assert order.draft_room([], "head", 4, 0.0) >= 1  # the prior: a head token pays
    assert DraftOrder(FixedK(3).estimates).draft_room(["grammar"], "head", 2, 1.0) == 2
    for _ in range(20):  # the head's tokens were always rejected: none is worth drafting
        policy.update(["head", "head"], 0, None, 0.0)
    assert order.draft_room([], "head", 4, 0.0) == 0
    # After a long forced span, one more costly token adds little: fewer are drafted.
    fresh = DraftOrder(AdaptiveK(8))
    assert fresh.draft_room(["grammar"] * 6, "head", 4, 0.0) <= fresh.draft_room([], "head", 4, 0.0)


def test_a_head_token_is_weighed_at_its_confidence_and_gated_before_it_is_drawn():
    """The acceptance of a gated token comes from its confidence bucket, calibrated on the
    verdicts: confident tokens that were accepted and unsure ones that were rejected make the
    gate pass the first and refuse the second (with a probe now and then); a baseline K opens
    every gate; trim keeps what the calibration says pays."""
    from constrained_spec.decoding import AdaptiveK

    policy = AdaptiveK(8, deterministic=True)
    assert policy.alpha_at("head", 0.99) > policy.alpha_at("head", 0.6) > policy.alpha_at("head", 0.2)
    assert policy.alpha_at("head", None) == policy.alpha("head")
    for _ in range(30):
        policy.update(["head", "head"], 2, None, 0.0, [0.97, 0.99])  # confident: accepted
        policy.update(["head"], 0, None, 0.0, [0.6])  # unsure: rejected
    assert policy.alpha_at("head", 0.97) > 0.9 and policy.alpha_at("head", 0.6) < 0.1
    assert policy.alpha_at("head+", 0.99) > 0.9
    order = DraftOrder(policy)
    gate = order.costly_gate([], None, "head", 0.0)
    assert gate(0.97) and gate(0.99)  # a confident run goes on
    refused = sum(not order.costly_gate([], None, "head", 0.0)(0.6) for _ in range(16))
    assert 12 <= refused < 16  # refused, but probed now and then
    assert DraftOrder(FixedK(3).estimates).costly_gate([], None, "head", 0.0)(0.01)
    assert policy.trim(["head", "head"], [0.97, 0.99]) == 2
    assert policy.trim(["head", "head"], [0.6, 0.99]) <= 1  # stops at the unsure first (a probe may keep it)


class PeekingHead(HeadDrafter):
    """Known-wrong: keeps its draft only up to the first token that is not the mode of its own
    law there, so the draft length depends on the tokens drawn (which a confidence gate, asked
    before the draw, never does). Drafting at temperature 10, so the mode is often not drawn."""

    def propose(self, context, state, k):
        d = super().propose(context, state, k)
        if d.q is not None:
            keep = next((i for i, (t, row) in enumerate(zip(d.tokens, d.q)) if int(row.argmax()) != t), len(d.tokens))
            d = d.prefix(keep)
        return d


def test_sampling_with_a_confidence_gated_head_is_exact(setup):
    """The adaptive policy (seeded: deterministic estimates) gates the head by its confidence;
    the enumerated law still holds. Power: as in test_exactness (N = 3000); the control, whose
    draft length depends on the token it drew, must fail the same test (N_CONTROL draws)."""
    from constrained_spec.decoding import AdaptiveK

    _, compiled, target, head = setup
    law = exact_law(compiled, target, PROMPT)

    def run(make, seed):
        m = compiled.matcher()
        policy = AdaptiveK(3, costly_draft=True, costly_kind="head", deterministic=True)
        return decode(target, m, PROMPT, drafter=make(m), k_policy=policy, temperature=1.0, seed=seed,
                      max_new_tokens=16).tokens

    pv = sample_pvalue(law, lambda s: run(lambda m: HeadDrafter(head, m, temperature=1.0), s))
    assert pv > 1e-3
    bad = sample_pvalue(law, lambda s: run(lambda m: PeekingHead(head, m, temperature=10.0), s), n=N_CONTROL)
    assert bad < 1e-4


def test_the_head_drafts_before_lookup_only_where_lookup_is_mostly_rejected():
    from constrained_spec.decoding import AdaptiveK

    policy = AdaptiveK(8, deterministic=True)  # priors only: no timings, nothing from other requests
    order = DraftOrder(policy)
    assert not order.prefers_costly([], "lookup", "head", 0.0)  # prior: lookup 0.5, head 0.6 - its cost
    assert not DraftOrder(FixedK(3).estimates).prefers_costly([], "lookup", "head", 0.0)
    for _ in range(20):  # lookup's spans were rejected at their first token
        policy.update(["lookup", "lookup"], 0, None, 0.0)
    assert order.prefers_costly([], "lookup", "head", 0.0)
    assert not order.prefers_costly([], "grammar", "head", 0.0)  # forced text is not overtaken
    for _ in range(40):  # now they are right
        policy.update(["lookup"], 1, None, 0.0)
    assert not order.prefers_costly([], "lookup", "head", 0.0)


def test_a_preferred_head_drafts_where_lookup_could_and_the_output_is_unchanged(setup, monkeypatch):
    """With an order that puts the head first, its tokens lead the proposal although lookup
    has one there, and greedy output stays the target-only output."""
    from constrained_spec.drafters import LookupDrafter
    from constrained_spec.drafters.hybrid import HybridDrafter

    _, compiled, target, head = setup
    prompt = [1, 3, 1, 3, 1, 3, 1]  # a repeating prompt: lookup always has a span to offer
    ref = decode(target, compiled.matcher(), prompt, max_new_tokens=16)
    kinds = {}
    for name in ("FixedK", "HeadFirst"):
        if name == "HeadFirst":
            monkeypatch.setattr(DraftOrder, "prefers_costly", lambda self, *args: True)
        m = compiled.matcher()
        res = decode(target, m, prompt, drafter=HybridDrafter([LookupDrafter(m), HeadDrafter(head, m)]),
                     k_policy=FixedK(4), max_new_tokens=16)
        assert res.tokens == ref.tokens
        kinds[name] = res.stats.per_kind
    assert kinds["HeadFirst"].get("head", {}).get("drafted", 0) > kinds["FixedK"].get("head", {}).get("drafted", 0)
    assert kinds["HeadFirst"].get("lookup", {}).get("drafted", 0) < kinds["FixedK"].get("lookup", {}).get("drafted", 0)


def test_the_hybrid_gates_its_head_and_the_head_alone_gates_itself(setup, monkeypatch):
    """An order whose gate refuses every head token leaves the head out of the hybrid's drafts
    and of its own (drafting alone); one that refuses to ask it never runs the head at all
    (no time spent, nothing in its cache); the output stays the target-only output every way."""
    from constrained_spec.drafters import LookupDrafter
    from constrained_spec.drafters.hybrid import HybridDrafter

    _, compiled, target, head = setup
    orders = {"FixedK": {}, "Shut": {"costly_gate": lambda self, *args: (lambda c: False)},
              "NotAsked": {"worth_asking": lambda self, *args, **kwargs: False}}
    prompt = [6, 6, 6, 1]  # lookup has nothing here: the head is asked
    ref = decode(target, compiled.matcher(), prompt, max_new_tokens=16)
    drafted, ran = {}, {}
    for name, overrides in orders.items():
        for alone in (False, True):
            with monkeypatch.context() as patch:
                for method, replacement in overrides.items():
                    patch.setattr(DraftOrder, method, replacement)
                m = compiled.matcher()
                part = HeadDrafter(head, m)
                drafter = part if alone else HybridDrafter([LookupDrafter(m), part])
                res = decode(target, m, prompt, drafter=drafter, k_policy=FixedK(4), max_new_tokens=16)
            assert res.tokens == ref.tokens
            drafted[(name, alone)] = res.stats.per_kind.get("head", {}).get("drafted", 0)
            ran[(name, alone)] = part.seconds > 0 or part.fed > 0
    assert drafted[("FixedK", False)] > 0 and drafted[("FixedK", True)] > 0
    assert drafted[("Shut", False)] == 0 and drafted[("Shut", True)] == 0
    assert ran[("Shut", False)] and ran[("Shut", True)]  # asked, then refused token by token
    assert drafted[("NotAsked", False)] == 0 and drafted[("NotAsked", True)] == 0
    assert not ran[("NotAsked", False)] and not ran[("NotAsked", True)]


def test_the_hybrid_asks_its_free_parts_most_likely_first(setup):
    """Without a budget the declared order; with one, the free parts by their acceptance
    estimates at the next position (copies that keep failing go after lookup) and the head
    ahead of the first free part it beats."""
    from constrained_spec.decoding import AdaptiveK
    from constrained_spec.drafters.base import Drafter
    from constrained_spec.drafters.hybrid import HybridDrafter

    _, compiled, _, head = setup
    m = compiled.matcher()

    class Named(Drafter):
        def __init__(self, matcher, name):
            super().__init__(matcher)
            self.name = name

    hybrid = HybridDrafter([Named(m, "grammar"), Named(m, "copy"), Named(m, "lookup"), HeadDrafter(head, m)])
    names = lambda kinds: [p.name for p in hybrid._order(kinds)]  # noqa: E731
    assert names([]) == ["grammar", "copy", "lookup", "head"]
    hybrid.set_estimates(FixedK(4).estimates)
    assert names([]) == ["grammar", "copy", "lookup", "head"]
    policy = AdaptiveK(8, deterministic=True)  # priors: grammar 0.85, copy 0.6, lookup 0.5, head 0.6 less 0.15
    hybrid.set_estimates(policy.estimates)
    assert names([]) == ["grammar", "copy", "lookup", "head"]
    assert names(["lookup"]) == ["grammar", "lookup", "copy", "head"]  # "lookup+" 0.75 continues its span
    for _ in range(20):  # copies rejected at their first token
        policy.update(["copy"], 0, None, 0.0)
    assert names([]) == ["grammar", "lookup", "head", "copy"]


def test_a_heads_first_ask_pays_for_feeding_it_the_prompt(setup, monkeypatch):
    """A head's first ask of a request feeds it every pair of the prompt and output so far. The
    first request times that per pair; from the next on, ``catch_up_seconds`` prices the first
    ask by it, and inside auto a catch-up of a second (a head far larger than its steps) is
    never paid again, where before it was asked (probed) in every request; the output stays
    target-only's."""
    from constrained_spec.decoding import AdaptiveK, RecentEstimates
    from constrained_spec.drafters.hybrid import HybridDrafter

    _, compiled, target, head = setup
    prompt = [6, 6, 6, 1, 3, 4, 5, 6, 1, 3]
    ref = decode(target, compiled.matcher(), prompt, max_new_tokens=24)
    plain_sync = HeadDrafter._sync
    catch_ups: list[int] = []

    def slow_first_sync(self, last):
        if self.fed == 0:
            catch_ups.append(len(self.tokens))
            time.sleep(1.0)
        return plain_sync(self, last)

    monkeypatch.setattr(HeadDrafter, "_sync", slow_first_sync)
    recent = RecentEstimates()
    fed = []
    for _ in range(3):
        m = compiled.matcher()
        part = HeadDrafter(head, m)
        res = decode(target, m, prompt, drafter=HybridDrafter([part]), k_policy=AdaptiveK(8, recent=recent),
                     max_new_tokens=24)
        assert res.tokens == ref.tokens
        fed.append(len(catch_ups))
    assert fed[0] == 1 and fed[2] == 1, fed  # fed once, in the first request only
    per_pair = recent.draft_timings[head][2]
    assert per_pair >= 1.0 / catch_ups[0]  # the first ask's second, per pair it fed
    # Priced before its first ask: the pairs it holds features for, at that rate; nothing after.
    assert part.catch_up_seconds(prompt) == pytest.approx(len(part.tokens) * per_pair) and part.tokens
    part.fed = 1
    assert part.catch_up_seconds(prompt) == 0.0
