"""Issue #21: prompt rows multiplied in float32 against bfloat16 (``models.int4``), interleaved
prompt by prompt in one process.

Usage: python benchmarks/prompt_matmul_ab.py [--generation 10] [--thresholds 24,128]

Runs ``generate_json`` over the extraction bench's prompts and held-out generation prompts,
target-only and auto, with every int4 layer's ``prompt_dtype`` set to float32 and to bfloat16
in turn (best of two passes), and prints the whole-request speedup of bfloat16, whether each
auto output equals its own target-only output, and how many target-only outputs the prompt
numerics changed. On a CPU without bfloat16 instructions the bfloat16 rows are slower: the
library picks float32 there by itself. Measured 2026-12-03 on the 2-core AVX512_BF16 EPYC:
extraction target-only 1.06x, auto 1.10x; generation target-only 1.05x, auto 1.14x; 6/6 and
10/10 auto outputs equal to target-only; 1 of 6 and 1 of 10 target-only outputs changed.

``--thresholds A,B`` keeps the machine's dense dtype and compares two values of
``MIN_DENSE_ROWS`` for it instead (segments shorter than the threshold stay on the kernel).
"""

import argparse
import json
import time

import torch

from constrained_spec.api import generate_json
from constrained_spec.models import int4
from constrained_spec.models.int4 import Int4Linear
from constrained_spec.models.loading import load_model
from constrained_spec.bench.single import load_prompts
from constrained_spec.pipelines.drafter_data import generation_workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generation", type=int, default=10, help="held-out generation prompts")
    parser.add_argument("--thresholds", default="", help="A,B: compare two MIN_DENSE_ROWS values instead")
    args = parser.parse_args()
    handle = load_model()
    layers = [m for m in handle.model.modules() if isinstance(m, Int4Linear)]
    dense = int4.prompt_matmul_dtype()
    if args.thresholds:
        a, b = (int(v) for v in args.thresholds.split(","))
        modes = {f"from {a} rows": (dense, a), f"from {b} rows": (dense, b)}
    else:
        modes = {name: (dtype, int4.MIN_DENSE_ROWS[dtype]) for name, dtype in DTYPES.items()}
    work = [("extraction", it, 256) for it in load_prompts()]
    work += [("generation", it, 128) for it in generation_workload(limit=args.generation)]
    runs: dict[tuple[str, str, str], list[tuple[float, str]]] = {}
    for _ in range(2):
        for _, item, max_new in work:
            for drafter in ("none", "auto"):
                for name, (dtype, least) in modes.items():
                    int4.MIN_DENSE_ROWS[dtype] = least
                    for layer in layers:
                        layer.prompt_dtype = dtype
                    t0 = time.perf_counter()
                    try:
                        out = json.dumps(generate_json(handle, item["schema"], item["prompt"], drafter=drafter,
                                                       max_new_tokens=max_new), sort_keys=True)
                    except Exception as e:  # an error's partial text is an output too (greedy identity)
                        out = type(e).__name__ + str(getattr(e, "text", ""))
                    runs.setdefault((item["id"], drafter, name), []).append((time.perf_counter() - t0, out))
    first, second = modes
    for kind in ("extraction", "generation"):
        ids = [item["id"] for k, item, _ in work if k == kind]
        for drafter in ("none", "auto"):
            total = {n: sum(min(t for t, _ in runs[(i, drafter, n)]) for i in ids) for n in modes}
            print(f"{kind} {drafter}: {first} {total[first]:.2f} s, {second} {total[second]:.2f} s, "
                  f"{total[first] / total[second]:.3f}x")
        for n in modes:
            same = sum(runs[(i, "none", n)][0][1] == runs[(i, "auto", n)][0][1] for i in ids)
            print(f"  {n}: auto == target-only {same}/{len(ids)}")
        changed = sum(runs[(i, "none", first)][0][1] != runs[(i, "none", second)][0][1] for i in ids)
        print(f"  target-only outputs changed by the prompt numerics: {changed}/{len(ids)}")


if __name__ == "__main__":
    main()
