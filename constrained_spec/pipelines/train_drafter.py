"""Training a draft head (``drafters.head``) for a target on the target's own constrained outputs.

Distillation of the target's own masked law, in three stages:

1. The target decodes every training item (a prompt with a schema or a pattern) under its
   constraint: greedily, and sampled (``sampled`` more per item), so the head learns what the
   target writes under the masks it will draft with. The decoding is speculative with the
   model-free drafters (exact: greedy output is target-only output, sampled output follows the
   target's law), and the verify forwards hand their hidden states to a ``FeatureRecorder``:
   the features the head reads and the final hidden state come from the decode itself, with no
   second pass over the target (a 400-token prompt costs seconds at native precision here).
   An item with ``references`` (answers the constraint accepts: a schema's valid instances) is
   read instead of decoded (``reference_outputs``): its prompt in one forward, then each answer
   in one forward from the prompt's cache. A decode pays a forward per step; a reference pays
   one for all its tokens, so the same minutes give the head several times the positions. The
   contexts are then the references' rather than the target's own, but the labels of stage 2
   are still the target's law at each of them.
2. At the output positions the grammar does not force (a state allowing one token needs no
   draft) the target's masked law over the draft vocabulary ``V_d`` (its logits from the final
   hidden state, renormalized on ``M ∩ V_d``); ``V_d`` is the ``draft_vocab`` tokens the
   outputs use most, with the grammar's structural tokens always in.
3. The head is trained on those positions to match the target's masked law restricted to
   ``V_d`` (cross-entropy against it: the KL up to a constant), teacher-forced at the first
   draft position and, as in EAGLE-3's training-time test, unrolled ``unroll`` steps on its own
   hidden states. A held-out share of the sequences measures first-token agreement (the
   greedy acceptance of the head's first draft token); the best head is saved, and a
   checkpoint (head, optimizer, step, the decoded outputs) lets an interrupted run resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from ..constraint import CompiledConstraint, Matcher, State, vocabulary_of
from ..decoding import AdaptiveK, FixedK, RecentEstimates, SpeculativeDecoder
from ..drafters.base import Draft, Drafter
from ..drafters.corpus import OutputCorpus
from ..drafters.head import DraftHead, HeadConfig, default_taps
from ..errors import InvalidOptionError

CHECKPOINT_FILE = "checkpoint.pt"
#: References read per training line at most by default (JSONSchemaBench has one or two a schema).
REFERENCES = 4
#: The share of a time budget that reads and decodes the data; training takes the rest. More
#: data raised a head's agreement far more than more steps did (docs/training.md).
STAGE_ONE_SHARE = 0.5
#: Runs decoded at once in stage 1 by default: the batch engine at 16 rows decodes several times
#: the tokens per second of one request (docs/performance.md, the batch sweep).
DECODE_BATCH = 16
OUTPUTS_FILE = "outputs.pt"


class FeatureRecorder(Drafter):
    """A drafter that drafts nothing and keeps the target's features of every position fed
    (rolled-back positions are overwritten by what is fed there next)."""

    name = "recorder"

    def __init__(self, matcher: Matcher, layers: Sequence[int]) -> None:
        super().__init__(matcher)
        self.layers = tuple(layers)
        self.rows: dict[int, torch.Tensor] = {}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layers

    def reset(self, prompt_ids: list[int]) -> None:
        self.rows = {}

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        return self.empty(state)

    def observe(self, start: int, tokens: Sequence[int], features: torch.Tensor) -> None:
        for i, row in enumerate(features.float().unbind(0)):
            self.rows[start + i] = row

    def features(self, length: int) -> torch.Tensor | None:
        """``[length, layers * d]`` for positions ``0..length-1``; None if any was never fed."""
        if any(i not in self.rows for i in range(length)):
            return None
        return torch.stack([self.rows[i] for i in range(length)])


@dataclass
class DecodedOutput:
    """One output of stage 1: its prompt and tokens, the constraint, and the target's features
    at positions ``0..T-2`` (the taps, concatenated) and its final hidden state at the output's
    predicting positions ``len(prompt)-1 .. T-2``."""

    item: int
    prompt: list[int]
    tokens: list[int]
    compiled: CompiledConstraint
    features: torch.Tensor
    final: torch.Tensor


@dataclass
class TrainingSequence:
    """One training sequence: all ids, the target's features at every position
    ``[T - 1, taps * d]``, and at each unforced output position ``t`` (``rows``: the logits at
    ``t`` predict ``ids[t + 1]``, which the grammar does not force) the target's masked law over
    ``V_d`` (``p`` ``[n, |V_d|]``, renormalized on ``M ∩ V_d``) and ``allowed = M ∩ V_d``."""

    ids: list[int]
    output_start: int
    features: torch.Tensor
    rows: torch.Tensor
    p: torch.Tensor
    allowed: torch.Tensor
    #: Per row: whether prompt lookup would propose the right token there (``lookup_covered``).
    covered: torch.Tensor | None = None
    #: The training item it came from (sequences of one item are held out together); -1: unknown.
    item: int = -1


@dataclass
class TrainProgress:
    """Where a run is: the phase ("decode", "references" or "train"), done of total, and in
    training the recent loss and the held-out first-token agreement (latest and best)."""

    phase: str
    done: int
    total: int
    loss: float | None = None
    agreement: float | None = None
    best: float | None = None
    #: The latest agreement where prompt lookup would be wrong (``TrainReport.hard_agreement``).
    hard: float | None = None


@dataclass
class TrainReport:
    """What training did: sequences, steps, seconds (decode and train), the held-out
    first-token agreement of the saved head."""

    sequences: int
    held_out: int
    steps: int
    seconds: float
    draft_vocab: int
    best_agreement: float
    decode_seconds: float = 0.0
    #: The saved head's held-out agreement where prompt lookup would be wrong: the positions
    #: it drafts inside "auto", which tries lookup first.
    hard_agreement: float | None = None
    losses: list[float] = field(default_factory=list)
    #: What the data had that was not used: a line whose constraint did not compile, a reference
    #: its constraint refused (``load_items``).
    skipped: list[str] = field(default_factory=list)


def _tap_layers(target: Any) -> tuple[tuple[int, ...], int]:
    n = target.config.num_hidden_layers
    return default_taps(n), n


@torch.no_grad()
def decode_outputs(target: Any, items: Sequence[tuple[list[int], CompiledConstraint]], *, sampled: int = 1,
                   temperature: float = 0.8, max_new_tokens: int = 128, seed: int = 0, batch: int = 1,
                   drafter_for: Callable[[int, Matcher], Drafter | None] | None = None,
                   progress: Callable[[TrainProgress], None] | None = None, features: bool = True,
                   deadline: float | None = None) -> list[DecodedOutput]:
    """Stage 1: each item decoded by the target under its constraint, greedily and ``sampled``
    more times, recording the target's features on the way. ``drafter_for(i, matcher)``: the
    model-free drafter item ``i`` decodes with (None: target-only); it changes the speed, never
    the law. ``batch`` > 1 decodes that many runs at once in the batch engine (the same greedy
    outputs: its rows equal single requests; sampled ones are draws of the same law). Outputs
    of fewer than two tokens are dropped. ``features=False`` records no features (the outputs'
    ``features`` and ``final`` are then empty): for a corpus, which needs only the tokens.
    ``deadline`` (a ``time.perf_counter()`` value): no run starts after it (those started finish)."""
    runs = [(i, temp, run_seed) for i in range(len(items))
            for temp, run_seed in [(0.0, None)] + [(temperature, seed * 1000 + i * 10 + j) for j in range(sampled)]]
    stage = _DecodeStage(target, items, drafter_for, features)

    def report(done: int) -> None:
        if progress:
            progress(TrainProgress("decode", done, len(runs)))

    if batch > 1:
        _decode_batched(target, stage, runs, batch=batch, max_new_tokens=max_new_tokens, report=report,
                        deadline=deadline)
        return stage.outputs
    for n, (i, temp, run_seed) in enumerate(runs):
        if _past(deadline):
            break
        matcher, recorder, drafter, k_policy = stage.start(i, run_seed)
        dec = SpeculativeDecoder(target, matcher, items[i][0], drafter=drafter, k_policy=k_policy, temperature=temp,
                                 seed=run_seed, max_new_tokens=max_new_tokens)
        for _ in dec.run():
            pass
        stage.keep(i, dec.output, recorder)
        report(n + 1)
    return stage.outputs


@torch.no_grad()
def reference_outputs(target: Any, items: Sequence[tuple[list[int], CompiledConstraint]],
                      references: Sequence[Sequence[Sequence[int]]],
                      progress: Callable[[TrainProgress], None] | None = None,
                      deadline: float | None = None) -> list[DecodedOutput]:
    """Stage 1 for items with references: the target's features along each reference (token ids
    the item's constraint accepts) after the item's prompt, as ``decode_outputs`` records them
    along a decoded output. The prompt is fed once per item, each reference from its cache
    (rolled back after). References of fewer than two tokens are dropped; no item starts after
    ``deadline`` (a ``time.perf_counter()`` value)."""
    from ..decoding.decoder import tap_features
    from ..models.growing_cache import growing_cache

    taps, final = _tap_layers(target)
    device = next(target.parameters()).device
    # A batch-invariant model computes prompt rows on its prompt path (``models.invariant``):
    # every row fed here is read at once, like a prompt's.
    invariant = bool(getattr(target, "batch_invariant", False))
    outputs: list[DecodedOutput] = []
    references = [[list(a) for a in answers if len(a) >= 2] for answers in references]
    total, done = sum(len(r) for r in references), 0

    def feed(cache: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        extra: dict[str, Any] = {"prompt_rows": len(tokens)} if invariant else {}
        out = target.base_model(input_ids=torch.tensor([list(tokens)], device=device), cache=cache, use_cache=True,
                                output_hidden_states=True, **extra)
        return (tap_features(out.hidden_states, taps, 0, len(tokens)),
                tap_features(out.hidden_states, (final,), 0, len(tokens)))

    for i, ((prompt, constraint), answers) in enumerate(zip(items, references)):
        if not answers:
            continue
        if _past(deadline):
            break
        cache = target.new_cache() if invariant else growing_cache(target.config.num_hidden_layers)
        prompt_features, prompt_final = feed(cache, prompt)
        for answer in answers:
            features, last = feed(cache, answer)
            cache.crop(-len(answer))
            # Position t's features, t < len(prompt) + len(answer) - 1; the final hidden state at
            # the positions predicting the answer's tokens (the prompt's last one first).
            outputs.append(DecodedOutput(i, prompt, answer, constraint,
                                         torch.cat([prompt_features, features[:-1]]),
                                         torch.cat([prompt_final[-1:], last[:-1]])))
            done += 1
            if progress:
                progress(TrainProgress("references", done, total))
    return outputs


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


class _DecodeStage:
    """Stage 1's runs: what each one decodes with (its matcher, feature recorder, drafter and K
    policy) and the outputs kept."""

    def __init__(self, target: Any, items: Sequence[tuple[list[int], CompiledConstraint]],
                 drafter_for: Callable[[int, Matcher], Drafter | None] | None, features: bool) -> None:
        self.items, self.drafter_for, self.features = items, drafter_for, features
        self.taps, self.final = _tap_layers(target)
        self.hidden_size = target.config.hidden_size
        self.recent = RecentEstimates()  # the K policies of this run's requests learn from each other
        self.outputs: list[DecodedOutput] = []

    def start(self, i: int, run_seed: int | None) -> tuple[Matcher, FeatureRecorder, Drafter, Any]:
        """(matcher, recorder, drafter, K policy) of a run of item ``i``."""
        from ..drafters.hybrid import HybridDrafter

        matcher = self.items[i][1].matcher()
        recorder = FeatureRecorder(matcher, (*self.taps, self.final))
        other = self.drafter_for(i, matcher) if self.drafter_for is not None else None
        # Speculation only changes the speed: a seeded sampled run keeps its K choices
        # independent of timings, so the same seed gives the same output.
        k_policy = AdaptiveK(12, deterministic=run_seed is not None, recent=self.recent) if other is not None else FixedK(0)
        if not self.features:
            return matcher, recorder, other, k_policy
        return matcher, recorder, HybridDrafter([other, recorder]) if other is not None else recorder, k_policy

    def keep(self, i: int, tokens: list[int], recorder: FeatureRecorder) -> None:
        """Keep a run's output (with its features, unless none are recorded) if it has two tokens or more."""
        prompt, constraint = self.items[i]
        if not self.features:
            if len(tokens) >= 2:
                self.outputs.append(DecodedOutput(i, prompt, list(tokens), constraint, torch.empty(0), torch.empty(0)))
            return
        feats = recorder.features(len(prompt) + len(tokens) - 1) if len(tokens) >= 2 else None
        if feats is not None:
            width = len(self.taps) * self.hidden_size
            self.outputs.append(DecodedOutput(i, prompt, list(tokens), constraint, feats[:, :width].clone(),
                                              feats[len(prompt) - 1:, width:].clone()))


def _decode_batched(target: Any, stage: _DecodeStage, runs: list[tuple[int, float, int | None]], *, batch: int,
                    max_new_tokens: int, report: Callable[[int], None], deadline: float | None = None) -> None:
    """The runs in the batch engine, ``batch`` at once (the next submitted as one finishes, none
    after ``deadline``); outputs kept in the runs' order."""
    from ..batching.engine import BatchEngine

    engine = BatchEngine(target, max_batch=batch, prefix_cache=False)
    submitted = {}  # request id -> (its run's index, its recorder)
    queue = iter(enumerate(runs))

    def submit_next() -> None:
        if (run := next(queue, None)) is None:
            return
        n, (i, temp, run_seed) = run
        matcher, recorder, drafter, k_policy = stage.start(i, run_seed)
        req = engine.submit(stage.items[i][0], matcher, drafter=drafter, k_policy=k_policy, temperature=temp,
                            seed=run_seed, max_new_tokens=max_new_tokens)
        submitted[req.id] = (n, recorder)

    for _ in range(batch):
        submit_next()
    finished: list[tuple[int, list[int], FeatureRecorder]] = []
    for req in engine.run():
        if req.error is not None:
            raise req.error
        n, recorder = submitted[req.id]
        finished.append((n, req.result.tokens, recorder))
        report(len(finished))
        if not _past(deadline):
            submit_next()
    for n, tokens, recorder in sorted(finished, key=lambda f: f[0]):  # the runs' order, not the finishing one
        stage.keep(runs[n][0], tokens, recorder)


def save_corpus(outputs: Sequence[DecodedOutput], vocab: Any, out: str | Path) -> OutputCorpus:
    """Index the outputs' tokens as the target's corpus (``drafters.corpus``) and save it to
    ``out``, where ``draft=out`` loads it beside a head."""
    corpus = OutputCorpus([o.tokens for o in outputs], vocab.fingerprint, exclude=[vocab.eos_token_id])
    corpus.save(out)
    return corpus


def draft_vocabulary(outputs: Sequence[DecodedOutput], size: int, eos: int, always: Sequence[int] = ()) -> list[int]:
    """``always`` (the grammar's structural tokens, say), then the tokens the outputs use most,
    ``size`` in all (EOS never: a draft does not end the text)."""
    chosen = [t for t in dict.fromkeys(always) if t != eos][:size]
    taken = set(chosen)
    counts = Counter(tok for o in outputs for tok in o.tokens if tok != eos and tok not in taken)
    chosen += [t for t, _ in counts.most_common(max(0, size - len(chosen)))]
    return sorted(chosen)


def lookup_covered(ids: Sequence[int], rows: Sequence[int], ignore: frozenset[int] | set[int] = frozenset(), *,
                   max_ngram: int = 3, max_candidates: int = 8) -> list[bool]:
    """For each position ``t`` of ``rows``: whether prompt lookup on ``ids[: t + 1]`` has
    ``ids[t + 1]`` among its candidates (the longest n-gram, at most ``max_ngram``, ending at
    ``t`` that occurred before; its ``max_candidates`` most recent occurrences; a lone token of
    ``ignore`` makes no match). Those positions cost the head nothing to miss inside "auto".

    An approximation of ``drafters.lookup``, written again because that one needs the request's
    matcher: it picks the candidate the constraint accepts furthest and falls back to shorter
    n-grams when the constraint cuts every candidate; and it also skips longer n-grams made only
    of ``ignore`` tokens, which this counts as matches."""
    index: dict[tuple[int, ...], list[int]] = {}
    for n in range(1, max_ngram + 1):
        for j in range(len(ids) - n + 1):
            index.setdefault(tuple(ids[j : j + n]), []).append(j)
    out = []
    for t in rows:
        hit = False
        for n in range(min(max_ngram, t), 0, -1):
            tail = tuple(ids[t + 1 - n : t + 1])
            if n == 1 and tail[0] in ignore:
                break
            starts = [j for j in index.get(tail, ()) if j + n <= t][-max_candidates:]  # continuation in context
            if starts:
                hit = t + 1 < len(ids) and any(ids[j + n] == ids[t + 1] for j in starts)
                break
        out.append(hit)
    return out


@torch.no_grad()
def featurize(target: Any, outputs: Sequence[DecodedOutput], draft_vocab: Sequence[int],
              ignore: frozenset[int] | set[int] = frozenset()) -> list[TrainingSequence]:
    """Stage 2: the masked laws over ``V_d`` at the unforced output positions (the target's
    logits from its recorded final hidden state, no second forward), and where prompt lookup
    would have drafted them (``lookup_covered``, ``ignore`` its structural tokens)."""
    vd = torch.tensor(list(draft_vocab), dtype=torch.long)
    lm_head = target.get_output_embeddings()
    seqs = []
    for o in outputs:
        walker = o.compiled.matcher()
        state = walker.state
        rows, alloweds = [], []
        for j, tok in enumerate(o.tokens):  # token j's law is at position len(prompt) - 1 + j
            mask = walker.allowed_mask(state)
            if int(mask.sum()) > 1:
                full = torch.zeros(max(mask.shape[0], int(vd.max()) + 1), dtype=torch.bool)
                full[: mask.shape[0]] = mask
                allowed = full[vd]
                if bool(allowed.any()):
                    rows.append(j)
                    alloweds.append(allowed)
            state = walker.next_state(state, tok)  # type: ignore[assignment]
            if state is None:
                break
        if not rows:
            continue
        h = o.final[torch.tensor(rows)].to(next(target.parameters()).dtype if _float_params(target) else torch.float32)
        logits = lm_head(h).double()
        allowed = torch.stack(alloweds)
        p = logits[:, vd].masked_fill(~allowed, float("-inf")).softmax(-1).float()
        at = torch.tensor(rows) + len(o.prompt) - 1
        ids = o.prompt + o.tokens
        seqs.append(TrainingSequence(ids, len(o.prompt), o.features, at, p, allowed,
                                     torch.tensor(lookup_covered(ids, at.tolist(), ignore), dtype=torch.bool), o.item))
    return seqs


def _float_params(target: Any) -> bool:
    dtype = next(target.parameters()).dtype
    return dtype.is_floating_point


def _losses(head: DraftHead, seq: TrainingSequence, unroll: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of the head's law on ``M ∩ V_d`` against the target's at the
    unforced positions, teacher-forced and then ``unroll - 1`` passes on its own states; per
    position, whether its first draft token is the target's argmax, and whether prompt lookup
    covers it (all False when unknown)."""
    ids = torch.tensor(seq.ids)
    T = len(seq.ids)
    # Pair j = (g_j, x_{j+1}) predicts x_{j+2}; the law of ids[t + 1] is at pair t - 1.
    g = head.project_features(seq.features[: T - 1])[None]
    pos = torch.arange(T - 1)[None]
    nxt = ids[1:T][None]
    r = seq.rows - 1
    keep = r >= 0
    r, p, allowed = r[keep], seq.p[keep], seq.allowed[keep]
    covered = seq.covered[keep] if seq.covered is not None else torch.zeros(r.shape, dtype=torch.bool)
    # The pairs before the first loss row (the prompt, mostly) run once, teacher-forced, and
    # the later passes attend to their keys: at inference a draft attends to the accepted
    # positions' target features, never to the head's own states there. Closer to inference
    # than rolling the whole sequence on its own states, and the later passes cost only the
    # output's pairs (about a quarter of a training sequence here). The first pass computes
    # only the keys and values before its last pair (``DraftHead.prefix``): nothing else reads
    # the head's states there.
    a = int(r.min()) if r.numel() else 0
    first = g[:, :1]  # a pass's input at its first pair: the state before it
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    if a > 0:
        cache = DynamicCache()
        first = head.prefix(g[:, :a], nxt[:, :a], pos[:, :a], cache)
        prefix = (cache.layers[0].keys, cache.layers[0].values)
        g, nxt, pos, r = g[:, a:], nxt[:, a:], pos[:, a:], r - a
    total = torch.zeros((), dtype=head.fc.weight.dtype)
    hits = torch.zeros(r.shape, dtype=torch.bool)
    for step in range(unroll):
        cache = None
        if prefix is not None:
            cache = DynamicCache()
            cache.update(*prefix, 0)
        h = head.hidden(g, nxt, pos, cache)
        # Only the rows with a loss go through the vocabulary projection.
        ll = head.logits(h[0, r]).float().masked_fill(~allowed, -1e30).log_softmax(-1)
        total = total - (p * ll).sum()
        if step == 0:
            hits = ll.argmax(-1) == p.argmax(-1)
        # In pass s > 0 a pair's input is the head's own state from pass s - 1, as at the
        # (s + 1)-th token of a draft (EAGLE-3's training-time test).
        g = torch.cat([first, h[:, :-1]], dim=1)
    return total, hits, covered


def _init_lm_head(head: DraftHead, target: Any) -> None:
    """Start the head's projection from the target's output rows of ``V_d`` (its final hidden
    state is trained to play the target's, so those rows are the right start)."""
    out = target.get_output_embeddings()
    with torch.no_grad():
        if hasattr(out, "gather_rows"):  # a packed matrix (a GGUF model's): only these rows, dequantized exactly
            rows = out.gather_rows(torch.as_tensor(head.vocab_ids, dtype=torch.int64))
        else:
            weight = getattr(out, "weight", None)
            if weight is None or not weight.dtype.is_floating_point or weight.shape[-1] != head.config.hidden_size:
                weight = target.get_input_embeddings().weight  # a tied model's output rows
            rows = weight[head.vocab_ids]
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight.dtype))


def _fingerprint(items: Sequence[tuple[list[int], Any]], options: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for prompt, _ in items:
        h.update(json.dumps(prompt).encode())
    return h.hexdigest()


def train_head(target: Any, tokenizer: Any, items: Sequence[tuple[list[int], CompiledConstraint]], out_dir: str | Path, *,
               draft_vocab: int = 8192, steps: int | None = None, minutes: float | None = None, sampled: int = 1,
               unroll: int = 2, lr: float = 3e-4, held_out: float = 0.1, max_new_tokens: int = 128, seed: int = 0,
               name: str = "", always: Sequence[int] = (), eval_every: int | None = None, resume: bool = True,
               batch: int = 1, lookup_ignore: Sequence[int] = (), drafter_for: Callable[[int, Matcher], Drafter | None] | None = None,
               references: Sequence[Sequence[Sequence[int]]] | None = None,
               progress: Callable[[TrainProgress], None] | None = None) -> TrainReport:
    """Train a head for ``target`` on ``items`` and save the best one to ``out_dir`` (see the
    module docstring). ``references[i]``: item ``i``'s answers as token ids, read instead of
    decoding the item (none, or an empty list: the item is decoded). ``minutes`` is the whole
    run's budget: stage 1 starts no item after ``STAGE_ONE_SHARE`` of it and training takes what
    is left; training also stops after ``steps`` optimizer steps (one of the two is required;
    with steps alone, every item is read or decoded). With ``resume``, a checkpoint in ``out_dir`` from the same items and options is
    taken up where it stopped (the stage-1 outputs too). The corpus saved beside the head
    indexes the decoded outputs only: the references are not the target's own text."""
    _check_training_options(items, steps, minutes, draft_vocab, batch)
    references = list(references) if references is not None else [[] for _ in items]
    if len(references) != len(items):
        raise InvalidOptionError(f"Invalid references: expected one list per item ({len(items)}), got {len(references)}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = vocabulary_of(tokenizer)
    options: dict[str, Any] = dict(draft_vocab=draft_vocab, sampled=sampled, max_new_tokens=max_new_tokens, seed=seed,
                                   unroll=unroll, held_out=held_out)
    if any(references):  # a run without references resumes the checkpoints of the code before them
        options["references"] = [[list(a) for a in r] for r in references]
    fingerprint = _fingerprint(items, options)
    t0 = time.perf_counter()
    outputs = _saved_outputs(out, fingerprint, items) if resume else None
    if outputs is None:
        deadline = t0 + 60 * minutes * STAGE_ONE_SHARE if minutes is not None else None
        outputs = _first_stage(target, items, references, sampled=sampled, max_new_tokens=max_new_tokens, seed=seed,
                               batch=batch, drafter_for=drafter_for, progress=progress, deadline=deadline)
        torch.save({"fingerprint": fingerprint,
                    "outputs": [(o.item, o.tokens, o.features, o.final) for o in outputs]}, out / OUTPUTS_FILE)
    decode_seconds = time.perf_counter() - t0
    decoded = [o for o in outputs if not references[o.item]]
    if decoded:
        save_corpus(decoded, vocab, out)
    vd = draft_vocabulary(outputs, draft_vocab, vocab.eos_token_id, always)
    seqs = featurize(target, outputs, vd, frozenset(lookup_ignore))
    del outputs
    if not seqs:
        raise InvalidOptionError("Invalid training data: no item produced an output the grammar does not force.")
    if minutes is not None:  # what stage one left, and never less than a tenth of the budget
        minutes = max(minutes - (time.perf_counter() - t0) / 60, minutes * (1 - STAGE_ONE_SHARE) / 5)
    config = HeadConfig.for_target(target, vocab.fingerprint, vd, name=name)
    head = DraftHead(config, target.get_input_embeddings()).float().train()
    _init_lm_head(head, target)
    held, train = _split_held_out(seqs, held_out, seed)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    run = _TrainRun(head, opt, out, fingerprint)
    if resume:
        run.resume()
    run.train(train, held, steps=steps, minutes=minutes, lr=lr, unroll=unroll,
              eval_every=eval_every or max(1, min(len(train), 200)), progress=progress)
    if run.best < 0:
        run.best, run.hard = agreements(head, held or train)
        head.save(out)
    return TrainReport(len(seqs), len(held), run.step, time.perf_counter() - t0, len(vd), run.best, decode_seconds,
                       hard_agreement=run.hard, losses=run.losses)


def _first_stage(target: Any, items: Sequence[tuple[list[int], CompiledConstraint]],
                 references: Sequence[Sequence[Sequence[int]]], *, sampled: int, max_new_tokens: int, seed: int,
                 batch: int, drafter_for: Callable[[int, Matcher], Drafter | None] | None,
                 progress: Callable[[TrainProgress], None] | None,
                 deadline: float | None = None) -> list[DecodedOutput]:
    """Stage 1: the items with references read (``reference_outputs``), then the others decoded
    (``decode_outputs``), none started after ``deadline``; every output names its item's index
    in ``items``. With a deadline the items go in a seeded random order, so a cut keeps a sample
    of the whole file (a data file is often grouped by source), not its first lines."""
    order = list(range(len(items)))
    if deadline is not None:
        random.Random(seed).shuffle(order)
    with_references = [i for i in order if references[i]]
    read = reference_outputs(target, [items[i] for i in with_references], [references[i] for i in with_references],
                             progress, deadline) if with_references else []
    for o in read:
        o.item = with_references[o.item]
    rest = [i for i in order if not references[i]]
    if not rest or _past(deadline):
        return read
    pick = (lambda j, matcher: drafter_for(rest[j], matcher)) if drafter_for is not None else None  # noqa: E731
    decoded = decode_outputs(target, [items[i] for i in rest], sampled=sampled, max_new_tokens=max_new_tokens,
                             seed=seed, batch=batch, drafter_for=pick, progress=progress, deadline=deadline)
    for o in decoded:
        o.item = rest[o.item]
    return read + decoded


def _check_training_options(items: Sequence[Any], steps: int | None, minutes: float | None, draft_vocab: int,
                            batch: Any) -> None:
    """Refuse a missing or non-positive budget, no items, an empty draft vocabulary or a bad batch."""
    if steps is None and minutes is None:
        raise InvalidOptionError("Invalid training budget: give steps or minutes.")
    if (steps is not None and steps < 1) or (minutes is not None and minutes <= 0):
        raise InvalidOptionError(f"Invalid training budget: steps={steps!r}, minutes={minutes!r}; expected positive values.")
    if not items:
        raise InvalidOptionError("Invalid training data: expected at least one item.")
    if draft_vocab < 1:
        raise InvalidOptionError(f"Invalid draft_vocab: expected a positive size, got {draft_vocab!r}.")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidOptionError(f"Invalid batch: expected an integer >= 1, got {batch!r}.")


def _saved_outputs(out: Path, fingerprint: str,
                   items: Sequence[tuple[list[int], CompiledConstraint]]) -> list[DecodedOutput] | None:
    """The decoded outputs saved in ``out`` by a run on the same items and options; None if none."""
    outputs_path = out / OUTPUTS_FILE
    if not outputs_path.is_file():
        return None
    saved = torch.load(outputs_path, weights_only=False)
    if saved.get("fingerprint") != fingerprint:
        return None
    return [DecodedOutput(i, items[i][0], toks, items[i][1], f, h) for i, toks, f, h in saved["outputs"]]


def _split_held_out(seqs: list[Any], held_out: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(held-out, training) sequences, split by item (an item's outputs or references all on one
    side, so the held-out agreement is on prompts never trained on): a seeded shuffle of the
    items, ``held_out`` of them (at least one when there are two or more) held out; training
    keeps at least one sequence."""
    groups: dict[int, list[int]] = {}
    for n, seq in enumerate(seqs):
        groups.setdefault(seq.item if seq.item >= 0 else -1 - n, []).append(n)  # an unknown item: a group alone
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    n_held = max(1, int(len(keys) * held_out)) if len(keys) > 1 and held_out > 0 else 0
    held = [seqs[n] for k in keys[:n_held] for n in groups[k]]
    train = [seqs[n] for k in keys[n_held:] for n in groups[k]]
    random.Random(seed).shuffle(train)  # an item's sequences not in a row
    return held, train or [seqs[groups[keys[0]][0]]]


class _TrainRun:
    """The head's optimization, checkpointed in ``out``: optimizer steps taken, the best held-out
    agreement so far (-1: none yet) and its hard agreement, and the loss of every step."""

    def __init__(self, head: DraftHead, opt: torch.optim.Optimizer, out: Path, fingerprint: str) -> None:
        self.head, self.opt, self.out, self.fingerprint = head, opt, out, fingerprint
        self.ckpt_path = out / CHECKPOINT_FILE
        self.step, self.best, self.hard = 0, -1.0, None
        self.losses: list[float] = []

    def resume(self) -> None:
        """Take up a checkpoint from a run on the same items and options, if there is one."""
        if not self.ckpt_path.is_file():
            return
        ckpt = torch.load(self.ckpt_path, weights_only=False)
        if ckpt.get("fingerprint") == self.fingerprint:
            self.head.load_state_dict(ckpt["head"])
            self.opt.load_state_dict(ckpt["optimizer"])
            self.step, self.best, self.losses, self.hard = ckpt["step"], ckpt["best"], ckpt["losses"], ckpt.get("hard")

    def train(self, train: list[Any], held: list[Any], *, steps: int | None, minutes: float | None, lr: float,
              unroll: int, eval_every: int, progress: Callable[[TrainProgress], None] | None) -> None:
        """Step through ``train`` in turn until ``steps`` or ``minutes`` run out, evaluating on
        ``held`` (or ``train`` when nothing is held out) every ``eval_every`` steps and at the end."""
        deadline = time.perf_counter() + 60 * minutes if minutes is not None else math.inf
        t_train = time.perf_counter()

        def lr_now() -> float:  # the schedule follows whichever budget ends first
            done = self.step / steps if steps is not None else 0.0
            if minutes is not None:
                done = max(done, (time.perf_counter() - t_train) / max(1e-9, deadline - t_train))
            return decayed_lr(lr, done)

        while (steps is None or self.step < steps) and time.perf_counter() < deadline:
            loss = self.optimizer_step(train[self.step % len(train)], unroll, lr_now)
            if loss is not None:
                self.losses.append(loss)
            self.step += 1
            last = (steps is not None and self.step == steps) or time.perf_counter() >= deadline
            if self.step % eval_every == 0 or last:
                agreement, hard_now = self.evaluate_and_save(held or train)
                if progress:
                    recent = self.losses[-eval_every:]
                    per_step = max(1e-9, (time.perf_counter() - t_train) / max(1, self.step))
                    total = steps if steps is not None else \
                        self.step + max(0, int((deadline - time.perf_counter()) / per_step))
                    progress(TrainProgress("train", self.step, total, sum(recent) / max(1, len(recent)), agreement,
                                           self.best, hard_now))

    def optimizer_step(self, seq: Any, unroll: int, lr_now: Callable[[], float]) -> float | None:
        """One optimizer step on ``seq``: its loss per scored token, or None (no step) when it
        has nothing to score."""
        loss, hits, _ = _losses(self.head, seq, unroll)
        n = int(hits.numel())
        if not n:
            return None
        for group in self.opt.param_groups:
            group["lr"] = lr_now()
        self.opt.zero_grad()
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach()) / n

    def evaluate_and_save(self, seqs: list[Any]) -> tuple[float, float | None]:
        """The agreement on ``seqs`` (and its hard part); the head saved when it is the best so
        far, and the checkpoint always."""
        agreement, hard_now = agreements(self.head, seqs)
        if agreement > self.best:
            self.best, self.hard = agreement, hard_now
            self.head.save(self.out)
        torch.save({"fingerprint": self.fingerprint, "head": self.head.state_dict(), "optimizer": self.opt.state_dict(),
                    "step": self.step, "best": self.best, "hard": self.hard, "losses": self.losses}, self.ckpt_path)
        return agreement, hard_now


def decayed_lr(lr: float, done: float) -> float:
    """The learning rate at ``done`` (0-1) of the budget: a cosine from ``lr`` down to a tenth
    of it. The budget is steps or minutes, so the schedule follows whichever ends first."""
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, done)))))


@torch.no_grad()
def evaluate(head: DraftHead, sequences: Sequence[TrainingSequence]) -> float:
    """First-token agreement of the head with the target's masked argmax at unforced positions."""
    return agreements(head, sequences)[0]


@torch.no_grad()
def agreements(head: DraftHead, sequences: Sequence[TrainingSequence]) -> tuple[float, float | None]:
    """First-token agreement at the unforced positions, and at those of them prompt lookup
    would miss (None where there are none)."""
    was = head.training
    head.eval()
    agree = count = hard = hard_count = 0
    for seq in sequences:
        _, hits, covered = _losses(head, seq, 1)
        agree, count = agree + int(hits.sum()), count + int(hits.numel())
        hard, hard_count = hard + int(hits[~covered].sum()), hard_count + int((~covered).sum())
    head.train(was)
    return (agree / count if count else 0.0), (hard / hard_count if hard_count else None)


@dataclass
class TrainingItem:
    """One line of a training file: the prompt's text and ids, its compiled constraint, and its
    references as token ids (each accepted by the constraint from its start)."""

    text: str
    prompt: list[int]
    compiled: CompiledConstraint
    references: list[list[int]] = field(default_factory=list)


def load_items(handle: Any, path: str | Path, *, limit: int | None = None,
               references: int = 0) -> tuple[list[TrainingItem], list[str]]:
    """The training items of a JSONL file (``{"prompt", "schema"}`` or ``{"prompt", "regex"}``
    per line, optionally ``"references"``: answers, JSON values for a schema or strings for a
    regex), for each line that compiles, with up to ``references`` of its answers the
    constraint accepts (``reference_ids``); and a message for each line that does not compile
    or answer that is refused."""
    from ..api import encode_prompt
    from ..constraint import compile_constraint
    from ..errors import ConstrainedSpecError

    items, skipped = [], []
    p = Path(path)
    if not p.is_file():
        raise InvalidOptionError(f"Invalid training data: {str(p)!r} is not a file.")
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidOptionError(f"Invalid training data: line {n} of {str(p)!r} is not JSON ({e}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or ("schema" in row) == ("regex" in row):
            raise InvalidOptionError(f"Invalid training data: line {n} of {str(p)!r} needs a \"prompt\" and one of "
                                     "\"schema\" or \"regex\".")
        answers = row.get("references", [])
        if not isinstance(answers, list):
            raise InvalidOptionError(f"Invalid training data: line {n} of {str(p)!r} has \"references\" that is not "
                                     "a list.")
        try:
            kind, constraint = ("json", row["schema"]) if "schema" in row else ("regex", row["regex"])
            compiled = compile_constraint(constraint, handle.tokenizer, kind=kind)
        except ConstrainedSpecError as e:
            skipped.append(f"line {n}: {e}")
            continue
        item = TrainingItem(row["prompt"], encode_prompt(handle, row["prompt"]), compiled)
        for k, answer in enumerate(answers[:references] if references > 0 else []):
            ids = reference_ids(handle.tokenizer, compiled, answer, kind)
            if ids is None:
                skipped.append(f"line {n}: reference {k + 1} is not accepted by its {kind} constraint")
            else:
                item.references.append(ids)
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items, skipped


def reference_ids(tokenizer: Any, compiled: CompiledConstraint, answer: Any, kind: str = "json") -> list[int] | None:
    """``answer`` as token ids the constraint accepts from its start (a regex's answer: its
    string; a schema's: its JSON text, in the first of the usual layouts the grammar allows,
    since a grammar may fix the separators); None if no layout is accepted."""
    if kind == "regex":
        texts = [answer] if isinstance(answer, str) else []
    else:
        texts = [json.dumps(answer, ensure_ascii=False), json.dumps(answer, ensure_ascii=False, separators=(",", ":")),
                 json.dumps(answer, ensure_ascii=False, indent=2)]
    matcher = compiled.matcher()
    for text in texts:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if ids and len(matcher.walk(matcher.state, ids)) == len(ids) + 1:  # no token cut
            return ids
    return None


def train_drafter(target: Any = None, data: str | Path = "", out: str | Path = "", *, minutes: float | None = None,
                  steps: int | None = None, draft_vocab: int = 8192, sampled: int = 1, max_new_tokens: int = 128,
                  limit: int | None = None, seed: int = 0, unroll: int = 3, lr: float = 5e-4, resume: bool = True,
                  batch: int = DECODE_BATCH, references: int = REFERENCES,
                  progress: Callable[[TrainProgress], None] | None = None) -> TrainReport:
    """Train a draft head for ``target`` (an id, a path, a handle or None for the embedded
    model) on the prompts of ``data`` (JSONL, see ``load_items``) and save it to ``out``, which
    ``draft=out`` then loads, within ``minutes`` (see ``train_head``). A line with references
    has up to ``references`` of them read (0: none, every line decoded); the others are
    decoded with the model-free drafters ("auto" without a head), ``batch`` runs at once in the
    batch engine: the same greedy outputs as target-only, faster."""
    from ..drafters.lookup import structural_tokens
    from ..models import resolve_model

    if references < 0:
        raise InvalidOptionError(f"Invalid references: expected 0 or more, got {references!r}.")
    handle = resolve_model(target)
    rows, drafter_for, skipped = _decode_items(handle, data, limit, references)
    structural = sorted(structural_tokens(handle.vocabulary))  # always drafted; no lookup match alone
    report = train_head(handle.model, handle.tokenizer, [(r.prompt, r.compiled) for r in rows], out,
                        draft_vocab=draft_vocab, steps=steps, minutes=minutes, sampled=sampled,
                        max_new_tokens=max_new_tokens, seed=seed, name=handle.name, unroll=unroll, lr=lr,
                        always=structural, resume=resume, batch=batch, lookup_ignore=structural,
                        drafter_for=drafter_for, references=[r.references for r in rows], progress=progress)
    report.skipped = skipped
    return report


def build_corpus(target: Any = None, data: str | Path = "", out: str | Path = "", *, max_new_tokens: int = 128,
                 limit: int | None = None, batch: int = DECODE_BATCH,
                 progress: Callable[[TrainProgress], None] | None = None) -> OutputCorpus:
    """Decode the prompts of ``data`` greedily with ``target`` (as stage 1 of ``train_drafter``,
    without features) and save the outputs' corpus (``drafters.corpus``) to ``out``, which
    ``draft=out`` then loads (beside a head already there)."""
    from ..models import resolve_model

    handle = resolve_model(target)
    rows, drafter_for, _ = _decode_items(handle, data, limit)
    outputs = decode_outputs(handle.model, [(r.prompt, r.compiled) for r in rows], sampled=0,
                             max_new_tokens=max_new_tokens, batch=batch, drafter_for=drafter_for, progress=progress,
                             features=False)
    if not outputs:
        raise InvalidOptionError("Invalid training data: no item produced an output of two tokens or more.")
    Path(out).mkdir(parents=True, exist_ok=True)
    return save_corpus(outputs, handle.vocabulary, out)


def _decode_items(handle: Any, data: str | Path, limit: int | None,
                  references: int = 0) -> tuple[list[TrainingItem], Callable[[int, Matcher], Drafter | None], list[str]]:
    """The usable items of ``data`` (with up to ``references`` references each), the
    model-free drafter each decodes with, and what was skipped (``load_items``)."""
    from ..drafters.factory import build_drafter

    rows, skipped = load_items(handle, data, limit=limit, references=references)
    if not rows:
        raise InvalidOptionError(f"Invalid training data: no usable line in {str(data)!r}"
                                 + (f" ({skipped[0]})." if skipped else "."))
    texts = [r.text for r in rows]
    drafter_for = lambda i, matcher: build_drafter("hybrid", matcher, handle.tokenizer, source_text=texts[i],  # noqa: E731
                                                   head=False)
    return rows, drafter_for, skipped
