"""What the target's own layers would pay as its draft (self-speculation), measured before a
drafter is built on them: for sets of the target's layers (its first layers alone, or its first
and last layers with the middle ones skipped), how often a set's first draft token is the token
the whole model wrote, and the speedup over target-only that bounds.

Procedure. The target decodes each prompt greedily (auto: its output is target-only's); its
prompt and output go through the whole model once into a KV cache; then at each output position
the grammar does not force, each set runs the position's token (``models.layer_subset``) over
that cache held to the position, so its layers attend to the whole model's keys and values of
the context, as a draft sharing the target's cache would; its masked argmax is compared with the
token the target wrote. The keys and values the set's layers wrote there are put back after.

The bound. A draft right with probability α per token, costing ``c`` of a target step per token
(its share of the layers: decode steps read every weight once on a CPU), drafting K tokens
verified in one pass, brings (1 - α^(K+1)) / (1 - α) tokens per 1 + K c steps; the best K's ratio
is reported. It takes the first token's agreement for every draft token (the later ones also
read the set's own keys at the draft positions), so a set whose bound is below 1 cannot pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..api import encode_prompt
from ..constraint import apply_mask, compile_constraint
from ..decoding import decode
from ..drafters.factory import build_drafter
from ..models import resolve_model
from ..models.layer_subset import layer_subset
from ..models.output_rows import allowed_subset, project_rows
from .single import DEFAULT_PROMPTS, workload_items

#: Largest K a bound considers (the decoder's own cap on the largest hardware profile).
K_MAX = 12


@dataclass(frozen=True)
class LayerSet:
    """A named set of a model's layer indices, ascending."""

    name: str
    layers: tuple[int, ...]


def layer_sets(num_layers: int) -> list[LayerSet]:
    """Early exits after half and three quarters of the layers; the first and last layers kept,
    the middle skipped, at four, five and six sevenths of them and half; and all of them (the
    control: its tokens are the target's, so it agrees everywhere, or the procedure is wrong)."""
    sets: list[LayerSet] = []
    for share in (0.5, 0.75):
        n = min(num_layers, max(1, round(share * num_layers)))
        sets.append(LayerSet(f"first {n}", tuple(range(n))))
    for share in (0.5, 4 / 7, 5 / 7, 6 / 7):
        n = min(num_layers, max(2, round(share * num_layers)))
        head, tail = (n + 1) // 2, n // 2
        sets.append(LayerSet(f"first {head} + last {tail}",
                             tuple(range(head)) + tuple(range(num_layers - tail, num_layers))))
    unique: dict[tuple[int, ...], LayerSet] = {}
    for s in sets:
        if len(s.layers) < num_layers:  # all of them is the control, last
            unique.setdefault(s.layers, s)
    return [*unique.values(), LayerSet(f"all {num_layers}", tuple(range(num_layers)))]


def best_bound(alpha: float, cost: float, k_max: int = K_MAX) -> tuple[int, float]:
    """(K, speedup over target-only) at the best K in 1..``k_max`` for a draft right with
    probability ``alpha`` per token at ``cost`` of a target step per token (module docstring);
    (0, 1.0) where no K beats target-only."""
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        ratio = tokens / (1.0 + k * cost)
        if ratio > best[1]:
            best = (k, ratio)
    return best


def _hold(cache: Any, length: int) -> None:
    """Every layer of ``cache`` (``models.growing_cache``) holding ``length`` positions: dropped
    ones cropped, or ones written before held again."""
    for layer in cache.layers:
        held = layer.get_seq_length()
        if held > length:
            layer.crop(length - held)
        elif held < length:
            layer.advance(length - held)


@torch.no_grad()
def agreements(model: Any, prompt: Sequence[int], output: Sequence[int], matcher: Any,
               sets: Sequence[LayerSet]) -> dict[str, tuple[int, int]]:
    """Per set: (positions where its first draft token is the one the target wrote, unforced
    output positions), over one output (module docstring)."""
    ids = list(prompt) + list(output)
    rows: list[tuple[int, torch.Tensor, int]] = []  # (position fed, its state's mask, the token written next)
    state = matcher.initial_state
    for j, token in enumerate(output):
        mask = matcher.allowed_mask(state)
        if int(mask.sum()) > 1:
            rows.append((len(prompt) - 1 + j, mask, token))
        state = matcher.next_state(state, token)
        if state is None:
            break
    cache = model.new_cache()
    model.base_model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
    found = {}
    for s in sets:
        view = layer_subset(model, s.layers)
        agreed = 0
        for at, mask, written in rows:
            _hold(cache, at + 1)
            kept = [(cache.layers[i].keys[:, :, at].clone(), cache.layers[i].values[:, :, at].clone()) for i in s.layers]
            _hold(cache, at)
            hidden = view(input_ids=torch.tensor([[ids[at]]]), cache=cache, use_cache=True).last_hidden_state[0, -1:]
            logits = project_rows(model, hidden, [allowed_subset(mask)])[0].double()
            agreed += int(apply_mask(logits, mask).argmax()) == written
            for i, (k, v) in zip(s.layers, kept):  # the whole model's keys and values back at ``at``
                cache.layers[i].keys[:, :, at] = k
                cache.layers[i].values[:, :, at] = v
        found[s.name] = (agreed, len(rows))
    return found


def run_self_draft_bench(model: Any = None, *, workload: str = "generation", prompts: Path | str = DEFAULT_PROMPTS,
                         limit: int | None = 4, max_new_tokens: int = 128,
                         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Each layer set's agreement with the target's own greedy outputs on ``workload``'s prompts
    and the bound it gives (module docstring): rows of ``layers``, ``cost`` (a share of a
    target step), ``agreement``, ``positions``, ``best_k`` and ``bound_vs_target_only``, and a
    verdict."""
    handle = resolve_model(model)
    target = handle.model
    sets = layer_sets(len(target.base_model.layers))
    items = workload_items(workload, prompts, limit)
    totals = {s.name: [0, 0] for s in sets}
    for n, item in enumerate(items, 1):
        compiled = compile_constraint(item["schema"], handle.tokenizer, kind="json")
        prompt = encode_prompt(handle, item["prompt"])
        matcher = compiled.matcher()
        drafter = build_drafter("hybrid", matcher, handle.tokenizer, source_text=item["prompt"])
        output = decode(target, matcher, prompt, drafter=drafter, max_new_tokens=max_new_tokens).tokens
        for name, (agreed, positions) in agreements(target, prompt, output, compiled.matcher(), sets).items():
            totals[name][0] += agreed
            totals[name][1] += positions
        if progress:
            progress(n, len(items))
    rows = []
    count = len(target.base_model.layers)
    for s in sets:
        agreed, positions = totals[s.name]
        alpha = agreed / positions if positions else 0.0
        cost = len(s.layers) / count
        k, bound = best_bound(alpha, cost)
        rows.append({"layers": s.name, "cost": round(cost, 3), "agreement": round(alpha, 3), "positions": positions,
                     "best_k": k, "bound_vs_target_only": round(bound, 3)})
    paying = [r for r in rows[:-1] if r["bound_vs_target_only"] > 1.0]
    verdict = ("no set of the target's layers can pay as its draft here (every bound <= 1.0x target-only)"
               if not paying else
               "best bound: " + max(paying, key=lambda r: r["bound_vs_target_only"])["layers"]
               + f" ({max(r['bound_vs_target_only'] for r in paying):.2f}x target-only at most, before auto's "
               "free drafts take their positions)")
    return {"model": handle.name, "workload": workload, "prompts": len(items), "rows": rows, "verdict": verdict}
