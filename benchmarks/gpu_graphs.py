"""GPU check of the CUDA graphs (``models.cuda_graphs``): eager against graphed forwards, side by
side in one run. Run from the repository root on a CUDA machine:

    python benchmarks/gpu_graphs.py [--json FILE]

(``--device cpu --layers 2`` is a dry run of the script itself: the static forwards unrecorded.)

SmolLM2-135M's shapes in bfloat16 with random weights (its real weights do not fit the device
machine's transfer limit; speed does not depend on their values). Prints:
- per forward, after a 300-token context, for 1, 4, 12 and 21 new rows (median of 20, CUDA
  synchronized): the stock model (transformers' kernels, not batch-invariant), the
  batch-invariant model eager, and the same model replaying graphs;
- graphed against eager, bit for bit: the hidden states (every layer) and logits of a run of
  decode and verify passes;
- decoding (regex constraints over a byte vocabulary, 96 new tokens, greedy): tokens per second
  target-only and with the grammar drafter (forced text, K up to 12), eager and graphed, whether the outputs
  are identical, and the graphs' cold start (captures and their seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from constrained_spec.constraint import compile_constraint  # noqa: E402
from constrained_spec.decoding import FixedK, decode  # noqa: E402
from constrained_spec.models.growing_cache import growing_cache  # noqa: E402
from constrained_spec.drafters import GrammarDrafter  # noqa: E402
from constrained_spec.models.cuda_graphs import install_cuda_graphs  # noqa: E402
from constrained_spec.models.invariant import make_batch_invariant  # noqa: E402
from tests.test_invariance import PATTERNS, VOCAB, smol_shaped  # noqa: E402

ROWS = (1, 4, 12, 21)
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def forward_ms(model, cache_dtype, rows: int, context: int = 300, repeats: int = 20) -> float:
    """Median ms of one forward of ``rows`` new tokens (logits for each) after ``context`` positions."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(1, 260, (context + rows,), generator=g).tolist()
    cache = growing_cache(model.config.num_hidden_layers, cache_dtype)
    kw = {"prompt_rows": context - 1} if getattr(model, "batch_invariant", False) else {}
    model(input_ids=torch.tensor([ids[:context]], device=DEVICE), cache=cache, use_cache=True, logits_to_keep=1, **kw)
    new = torch.tensor([ids[context:]], device=DEVICE)
    times = []
    for _ in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        model(input_ids=new, cache=cache, use_cache=True, logits_to_keep=rows)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        cache.crop(-rows)
    return statistics.median(times[3:])


@torch.no_grad()
def graphed_vs_eager(model, runner) -> dict:
    """Values of hidden states (every layer) and logits that differ, graphed against eager."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 260, (300,), generator=g).tolist()
    feeds = [torch.randint(1, 260, (k,), generator=g).tolist() for k in (1, 1, 4, 1, 12, 1, 21, 2, 1, 8)]
    runs = {}
    for enabled in (False, True):
        runner.enabled = enabled
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        model(input_ids=torch.tensor([prompt], device=DEVICE), cache=cache, use_cache=True, prompt_rows=299,
              logits_to_keep=1)
        outs = []
        for ids in feeds:
            o = model(input_ids=torch.tensor([ids], device=DEVICE), cache=cache, use_cache=True,
                      output_hidden_states=True, logits_to_keep=len(ids))
            outs.append((torch.stack([h[0] for h in o.hidden_states]).float(), o.logits[0].float()))
        runs[enabled] = outs
    runner.enabled = True
    dh = sum(int((a[0] != b[0]).sum()) for a, b in zip(runs[False], runs[True]))
    dl = sum(int((a[1] != b[1]).sum()) for a, b in zip(runs[False], runs[True]))
    total_h = sum(a[0].numel() for a in runs[False])
    total_l = sum(a[1].numel() for a in runs[False])
    flips = sum(int((a[1].argmax(-1) != b[1].argmax(-1)).sum()) for a, b in zip(runs[False], runs[True]))
    return {"hidden_values_differing": f"{dh}/{total_h}", "logit_values_differing": f"{dl}/{total_l}",
            "argmax_flips": flips}


def decoding(model, runner, new_tokens: int = 96, modes: tuple[bool, ...] = (False, True)) -> dict:
    """Tokens per second target-only and with the grammar drafter, eager and graphed."""
    base_text = b"Extract: name maria gonzalez, age 34, tags arch, bcn. Output JSON."
    rows = {}
    outputs = {}
    for enabled in modes:
        runner.enabled = enabled
        for drafter in ("target-only", "grammar"):
            tokens = seconds = forwards = 0.0
            outs = []
            for pattern in PATTERNS:
                compiled = compile_constraint(pattern, VOCAB, kind="regex")
                for s in range(2):
                    ids = [t + 1 for t in base_text[s:]]
                    m = compiled.matcher()
                    d = GrammarDrafter(m, lambda text: [b + 1 for b in text.encode()]) if drafter == "grammar" else None
                    sync()
                    t0 = time.perf_counter()
                    r = decode(model, m, ids, drafter=d, k_policy=FixedK(12) if d else None, max_new_tokens=new_tokens)
                    sync()
                    seconds += time.perf_counter() - t0
                    tokens += len(r.tokens)
                    forwards += r.stats.target_forwards
                    outs.append(r.tokens)
            name = f"{drafter}, {'graphs' if enabled else 'eager'}"
            rows[name] = {"tokens_per_second": round(tokens / seconds, 1), "seconds": round(seconds, 2),
                          "target_forwards_per_token": round(forwards / tokens, 3)}
            outputs[name] = outs
    runner.enabled = True
    if False not in modes:
        return rows
    ref = outputs["target-only, eager"]
    for name in rows:
        rows[name]["identical_to_target_only_eager"] = outputs[name] == ref
        rows[name]["speedup_vs_target_only_eager"] = round(rows[name]["tokens_per_second"]
                                                           / rows["target-only, eager"]["tokens_per_second"], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    report: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__}
    import transformers

    report["transformers"] = transformers.__version__
    shape = dict(seed=2, init=0.2, layers=args.layers, device=DEVICE)
    stock = smol_shaped(VOCAB.size, **shape)
    model = make_batch_invariant(smol_shaped(VOCAB.size, **shape), bucket_linears=True)
    runner = install_cuda_graphs(model, capture=DEVICE == "cuda")
    t0 = time.perf_counter()
    report["first_request"] = decoding(model, runner, new_tokens=16)["target-only, graphs"]
    report["first_request"]["captures"] = runner.stats.captures
    report["first_request"]["capture_seconds"] = round(runner.stats.capture_seconds, 2)
    report["first_request"]["wall_seconds_incl_eager_control"] = round(time.perf_counter() - t0, 2)
    per_forward = {}
    for rows in ROWS:
        runner.enabled = False
        eager = forward_ms(model, torch.float64, rows)
        runner.enabled = True
        graphed = forward_ms(model, torch.float64, rows)
        per_forward[rows] = {"stock_eager_ms": round(forward_ms(stock, None, rows), 2),
                             "invariant_eager_ms": round(eager, 2), "invariant_graphs_ms": round(graphed, 2),
                             "graphs_speedup": round(eager / graphed, 1)}
        print(rows, per_forward[rows], flush=True)
    report["per_forward"] = per_forward
    report["graphed_vs_eager"] = graphed_vs_eager(model, runner)
    print(report["graphed_vs_eager"], flush=True)
    decoding(model, runner, modes=(True,))  # every bucket the timed runs meet captured first
    report["decoding"] = decoding(model, runner)
    if args.profile:  # where a graphed speculative step spends its time outside the forward
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        decoding(model, runner, modes=(True,))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    report["graph_stats"] = {"captures": runner.stats.captures, "capture_seconds": round(runner.stats.capture_seconds, 2),
                             "served": runner.stats.served, "eager": runner.stats.eager, "buckets": runner.stats.buckets}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
