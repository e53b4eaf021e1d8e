"""Batched-step cost on a GPU: forward seconds against batch size b and step width w (1 + drafts),
the numbers the batch engine's step budget is fitted on (``decoding/budget.py``).

    python benchmarks/gpu_batch_cost.py

bfloat16, SmolLM2-135M's shapes with random weights, batch-invariant (as ``load_model`` makes
GPU models), each row with 200 cached tokens in a ``RowCache``, the step built as the engine
builds it. Prints one JSON line per b with the median milliseconds per w, and the fitted
t0 + t1 * rows.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from constrained_spec.batching.cache import RowCache
from constrained_spec.models.invariant import make_batch_invariant
from tests.test_invariance import smol_shaped


@torch.no_grad()
def step_ms(model, b: int, w: int, past: int = 200, reps: int = 10) -> float:
    cache = RowCache(model.config.num_hidden_layers, b, 2048, dtype=torch.float64)
    cache.active = b
    ids = torch.randint(1, 500, (b, past), device="cuda")
    pos = torch.arange(past, device="cuda")[None].expand(b, past)
    mask = (torch.arange(past)[None, :] <= torch.arange(past)[:, None])[None, None].expand(b, 1, past, past)
    model(input_ids=ids, position_ids=pos, attention_mask=mask.cuda(), cache=cache, use_cache=True, logits_to_keep=1)
    cache.lengths[:b] = past
    times = []
    for _ in range(reps):
        ids = torch.randint(1, 500, (b, w), device="cuda")
        positions = cache.lengths[:b, None] + torch.arange(w)
        keys = torch.arange(past + w)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(input_ids=ids, position_ids=positions.cuda(), attention_mask=mask.cuda(), cache=cache, use_cache=True,
              logits_to_keep=torch.arange(w, device="cuda"))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    model = make_batch_invariant(smol_shaped(49152, seed=0), bucket_linears=True)
    rows, ms = [], []
    for b in (1, 4, 16, 64):
        line = {}
        for w in (1, 4, 8, 13):
            t = step_ms(model, b, w)
            line[w] = round(t, 2)
            rows.append(b * w)
            ms.append(t)
        print(json.dumps({"batch": b, "ms_by_width": line}), flush=True)
    t1, t0 = np.polyfit(rows, ms, 1)
    print(json.dumps({"fit_ms": {"t0": round(float(t0), 2), "t1_per_row": round(float(t1), 4)}}))


if __name__ == "__main__":
    main()
