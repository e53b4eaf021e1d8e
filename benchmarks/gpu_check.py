"""GPU check for native precision's invariance claim (run from the repository root on a CUDA machine).

    python benchmarks/gpu_check.py

bfloat16, SmolLM2-135M's shapes with random weights (see tests/test_invariance.py). Prints,
for the default kernels (sdpa, cuBLAS) and for ``make_batch_invariant``: how far a k-token
forward's hidden states and logits are from k one-token forwards, how many greedy argmaxes
differ, whether greedy speculative decoding equals target-only decoding, and forward times.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import DynamicCache

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, decode
from constrained_spec.drafters import ModelDrafter
from constrained_spec.models.invariant import make_batch_invariant
from tests.test_invariance import PATTERNS, VOCAB, smol_shaped


@torch.no_grad()
def row_dependence(model, prompt: list[int], out: list[int], invariant: bool) -> dict:
    """Max |difference| of hidden states and logits, and argmax flips, k-token vs one-token passes."""
    extra = {"prompt_rows": len(prompt) - 1} if invariant else {}

    def run(cache, ids, first: bool):
        kw = extra if first else {}
        skip = len(prompt) - 1 if first else 0
        o = model(input_ids=torch.tensor([ids], device="cuda"), cache=cache, use_cache=True,
                  output_hidden_states=True, logits_to_keep=len(ids) - skip, **kw)
        return o.hidden_states[-1][0, skip:].float(), o.logits[0].float()

    cache = DynamicCache(config=model.config)
    h, lg = run(cache, prompt, True)
    ref_h, ref_l = [h[-1]], [lg[-1]]
    for t in out:
        h, lg = run(cache, [t], False)
        ref_h.append(h[0])
        ref_l.append(lg[0])
    ref_h, ref_l = torch.stack(ref_h), torch.stack(ref_l)
    worst_h = worst_l = 0.0
    flips = differing = 0
    for k in range(1, len(out) + 1):
        h, lg = run(DynamicCache(config=model.config), prompt + out[:k], True)
        dh = float((h - ref_h[: k + 1]).abs().max())
        dl = float((lg - ref_l[: k + 1]).abs().max())
        worst_h, worst_l = max(worst_h, dh), max(worst_l, dl)
        differing += dh > 0 or dl > 0
        flips += int((lg.argmax(-1) != ref_l[: k + 1].argmax(-1)).sum())
    return {"k_values_differing": f"{differing}/{len(out)}", "max_abs_hidden": worst_h, "max_abs_logits": worst_l,
            "argmax_flips": flips}


def identity(target, draft, invariant: bool, prompts: int = 4) -> str:
    same = total = 0
    base_text = b"Extract: name maria gonzalez, age 34, tags arch, bcn. Output JSON."
    for pattern in PATTERNS:
        compiled = compile_constraint(pattern, VOCAB, kind="regex")
        for s in range(prompts):
            ids = [t + 1 for t in base_text[s:]]
            base = decode(target, compiled.matcher(), ids, max_new_tokens=96)
            m = compiled.matcher()
            spec = decode(target, m, ids, drafter=ModelDrafter(draft, m), k_policy=FixedK(8), max_new_tokens=96)
            same += spec.tokens == base.tokens
            total += 1
    return f"{same}/{total}"


@torch.no_grad()
def forward_ms(model, new: int, invariant: bool, past: int = 100) -> float:
    ids = torch.randint(1, 500, (1, past), device="cuda")
    times = []
    for _ in range(12):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        step = torch.randint(1, 500, (1, new), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times[2:]), 2)


def main() -> None:
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 512, (60,), generator=g).tolist()
    out = torch.randint(1, 512, (24,), generator=g).tolist()
    for invariant in (False, True):
        label = "invariant" if invariant else "default kernels"
        model = smol_shaped(512, seed=0)
        target = smol_shaped(VOCAB.size, seed=2, init=0.2)
        if invariant:
            make_batch_invariant(model)
            make_batch_invariant(target)
        draft = smol_shaped(VOCAB.size, seed=3, layers=2, init=0.2)
        report = {"mode": label, **row_dependence(model, prompt, out, invariant),
                  "greedy_spec_equals_target_only": identity(target, draft, invariant),
                  "forward_ms": {n: forward_ms(model, n, invariant) for n in (1, 4, 8, 13, 24)}}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
