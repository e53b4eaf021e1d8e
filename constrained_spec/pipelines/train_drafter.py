"""Training a draft head (``drafters.head``) for a target on the target's own constrained outputs.

On-policy distillation, in three stages:

1. The target decodes every training item (a prompt with a schema or a pattern) under its
   constraint, target-only: greedily, and sampled (``sampled`` more per item), so the head
   learns what the target writes under the masks it will draft with.
2. One forward per sequence gives the target's features at every position (the head's taps)
   and its masked law at the output positions the grammar does not force (a state allowing one
   token needs no draft); the draft vocabulary ``V_d`` is the ``draft_vocab`` tokens the
   outputs use most.
3. The head is trained on those positions to match the target's masked law restricted to
   ``V_d`` (cross-entropy against it: the KL up to a constant), teacher-forced at the first
   draft position and, as in EAGLE-3's training-time test, unrolled ``unroll`` steps on its own
   hidden states. A held-out share of the sequences measures first-token agreement (the
   greedy acceptance of the head's first draft token); the best checkpoint is kept.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..constraint import CompiledConstraint, vocabulary_of
from ..decoding import decode
from ..drafters.head import DraftHead, HeadConfig
from ..errors import InvalidOptionError


@dataclass
class TrainingSequence:
    """One decoded training sequence: all ids, the target's features at every position
    ``[T, taps * d]``, and at each unforced output position ``t`` (``rows``: the logits at ``t``
    predict ``ids[t + 1]``, which the grammar does not force) the target's masked law over
    ``V_d`` (``p`` ``[n, |V_d|]``, renormalized on ``M ∩ V_d``) and ``allowed = M ∩ V_d``."""

    ids: list[int]
    output_start: int
    features: torch.Tensor
    rows: torch.Tensor
    p: torch.Tensor
    allowed: torch.Tensor


@dataclass
class TrainReport:
    """What training did: sequences, steps, seconds, the held-out first-token agreement."""

    sequences: int
    held_out: int
    steps: int
    seconds: float
    draft_vocab: int
    best_agreement: float
    losses: list[float] = field(default_factory=list)


@torch.no_grad()
def decode_outputs(target: Any, items: Sequence[tuple[list[int], CompiledConstraint]], *, sampled: int = 1,
                   temperature: float = 0.8, max_new_tokens: int = 128, seed: int = 0
                   ) -> list[tuple[list[int], list[int], CompiledConstraint]]:
    """Stage 1: each item decoded by the target under its constraint, greedily and ``sampled``
    more times; (prompt, output, constraint) for every output of two tokens or more."""
    out = []
    for i, (prompt, compiled) in enumerate(items):
        runs = [dict(temperature=0.0)] + [dict(temperature=temperature, seed=seed * 1000 + i * 10 + j)
                                          for j in range(sampled)]
        for options in runs:
            res = decode(target, compiled.matcher(), prompt, max_new_tokens=max_new_tokens, **options)
            if len(res.tokens) >= 2:
                out.append((prompt, res.tokens, compiled))
    return out


def draft_vocabulary(outputs: Sequence[tuple[list[int], list[int], Any]], size: int, eos: int) -> list[int]:
    """The ``size`` tokens the outputs use most (EOS never: a draft does not end the text)."""
    counts = Counter(tok for _, tokens, _ in outputs for tok in tokens if tok != eos)
    return sorted(t for t, _ in counts.most_common(size))


@torch.no_grad()
def featurize(target: Any, outputs: Sequence[tuple[list[int], list[int], CompiledConstraint]],
              draft_vocab: Sequence[int], taps: Sequence[int]) -> list[TrainingSequence]:
    """Stage 2: one target forward per sequence -> features and the masked laws over ``V_d``."""
    vd = torch.tensor(list(draft_vocab), dtype=torch.long)
    seqs = []
    for prompt, tokens, compiled in outputs:
        ids = prompt + tokens
        fwd = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([fwd.hidden_states[t][0] for t in taps], dim=-1).float()
        logits = fwd.logits[0].double()
        walker = compiled.matcher()
        state = walker.state
        rows, ps, alloweds = [], [], []
        for j, tok in enumerate(tokens):
            t = len(prompt) - 1 + j
            mask = walker.allowed_mask(state)
            if int(mask.sum()) > 1:
                full = torch.zeros(logits.shape[-1], dtype=torch.bool)
                full[: mask.shape[0]] = mask
                allowed = full[vd]
                if bool(allowed.any()):
                    row = logits[t][vd].masked_fill(~allowed, float("-inf"))
                    rows.append(t)
                    ps.append(row.softmax(-1).float())
                    alloweds.append(allowed)
            state = walker.next_state(state, tok)  # type: ignore[assignment]
            if state is None:
                break
        if rows:
            seqs.append(TrainingSequence(ids, len(prompt), feats, torch.tensor(rows), torch.stack(ps),
                                         torch.stack(alloweds)))
    return seqs


def _losses(head: DraftHead, seq: TrainingSequence, unroll: int) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy of the head's law on ``M ∩ V_d`` against the target's at the
    unforced positions, teacher-forced and then ``unroll - 1`` passes on its own states; and
    (agreements, positions) of its first draft token with the target's argmax."""
    ids = torch.tensor(seq.ids)
    T = len(seq.ids)
    # Pair j = (g_j, x_{j+1}) predicts x_{j+2}; the law of ids[t + 1] is at pair t - 1.
    g = head.project_features(seq.features[: T - 1])[None]
    pos = torch.arange(T - 1)[None]
    nxt = ids[1:T][None]
    r = seq.rows - 1
    keep = r >= 0
    r, p, allowed = r[keep], seq.p[keep], seq.allowed[keep]
    total = torch.zeros((), dtype=head.fc.weight.dtype)
    agree = 0
    for step in range(unroll):
        h, logits = head(g, nxt, pos)
        # In pass s > 0 a pair's input is the head's own state from pass s - 1, as at the
        # (s + 1)-th token of a draft (EAGLE-3's training-time test).
        ll = logits[0, r].float().masked_fill(~allowed, -1e30).log_softmax(-1)
        total = total - (p * ll).sum()
        if step == 0:
            agree = int((ll.argmax(-1) == p.argmax(-1)).sum())
        g = torch.cat([g[:, :1], h[:, :-1]], dim=1)
    return total, agree, int(r.numel())


def train_head(target: Any, tokenizer: Any, items: Sequence[tuple[list[int], CompiledConstraint]], out_dir: str | Path, *,
               draft_vocab: int = 8192, steps: int | None = None, minutes: float | None = None, sampled: int = 1,
               unroll: int = 2, lr: float = 3e-4, held_out: float = 0.1, max_new_tokens: int = 128, seed: int = 0,
               name: str = "", progress: Callable[[str], None] | None = None) -> TrainReport:
    """Train a head for ``target`` on ``items`` and save the best one to ``out_dir`` (see the
    module docstring). Stops after ``steps`` optimizer steps or ``minutes`` of training,
    whichever comes first (one of them is required)."""
    if steps is None and minutes is None:
        raise InvalidOptionError("Invalid training budget: give steps or minutes.")
    if not items:
        raise InvalidOptionError("Invalid training data: expected at least one item.")
    torch.manual_seed(seed)
    vocab = vocabulary_of(tokenizer)
    config0 = HeadConfig.for_target(target, vocab.fingerprint, [0], name=name)
    t0 = time.perf_counter()
    outputs = decode_outputs(target, items, sampled=sampled, max_new_tokens=max_new_tokens, seed=seed)
    vd = draft_vocabulary(outputs, draft_vocab, vocab.eos_token_id)
    seqs = featurize(target, outputs, vd, config0.taps)
    if not seqs:
        raise InvalidOptionError("Invalid training data: no item produced an output the grammar does not force.")
    config = HeadConfig.for_target(target, vocab.fingerprint, vd, name=name)
    head = DraftHead(config, target.get_input_embeddings()).float().train()
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_held = max(1, int(len(seqs) * held_out)) if len(seqs) > 1 else 0
    held, train = [seqs[i] for i in order[:n_held]], [seqs[i] for i in order[n_held:]] or [seqs[order[0]]]
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    best, losses, step = -1.0, [], 0
    deadline = time.perf_counter() + 60 * minutes if minutes is not None else math.inf
    while (steps is None or step < steps) and time.perf_counter() < deadline:
        seq = train[step % len(train)]
        loss, _, n = _losses(head, seq, unroll)
        if n:
            opt.zero_grad()
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            losses.append(float(loss) / n)
        step += 1
        if step % max(1, len(train)) == 0 or (steps is not None and step == steps):
            agreement = evaluate(head, held or train)
            if agreement > best:
                best = agreement
                head.save(out_dir)
            if progress:
                progress(f"step {step}: loss {sum(losses[-50:]) / max(1, len(losses[-50:])):.3f}, "
                         f"held-out first-token agreement {agreement:.3f} (best {best:.3f})")
    if best < 0:
        best = evaluate(head, held or train)
        head.save(out_dir)
    return TrainReport(len(seqs), len(held), step, time.perf_counter() - t0, len(vd), best, losses)


@torch.no_grad()
def evaluate(head: DraftHead, sequences: Sequence[TrainingSequence]) -> float:
    """First-token agreement of the head with the target's masked argmax at unforced positions."""
    was = head.training
    head.eval()
    agree = count = 0
    for seq in sequences:
        _, a, n = _losses(head, seq, 1)
        agree, count = agree + a, count + n
    head.train(was)
    return agree / count if count else 0.0
