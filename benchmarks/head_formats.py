"""Draft head weight formats side by side: cost per draft token and first-token agreement.

Usage: python benchmarks/head_formats.py TRAIN_DIR DATA.jsonl

TRAIN_DIR is a ``constrained-spec train-drafter --out`` directory (its saved head and the
decoded outputs it kept), DATA.jsonl the ``--data`` it was trained on (with the default seed
and held-out share, so the agreement is measured on the same held-out sequences). For float32,
bfloat16 (compute in bfloat16) and int8 (stored per row scaled, computed in float32 or on the
int8 weight-only kernel, the default where torch has it) it prints: the head's seconds per draft token (one decoder-layer
step over a 300-position cache, the projection over V_d, the mask over the full vocabulary),
that cost over a one-token target forward at native precision, the agreement of its first
draft token with the target's masked argmax on the kept outputs, and the file size.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train_dir", type=Path)
    ap.add_argument("data", type=Path)
    args = ap.parse_args()

    from constrained_spec import load_model
    from constrained_spec.drafters.head import load_head
    from constrained_spec.pipelines.train_drafter import OUTPUTS_FILE, DecodedOutput, evaluate, featurize, load_items

    handle = load_model()
    target, fp = handle.model, handle.vocabulary.fingerprint
    base = load_head(args.train_dir, target, fp, int8_kernel=False)
    rows_in = load_items(handle, args.data)[0]
    saved = torch.load(args.train_dir / OUTPUTS_FILE, weights_only=False)["outputs"]
    outputs = [DecodedOutput(i, rows_in[i][1], toks, rows_in[i][2], f, h) for i, toks, f, h in saved]
    seqs = featurize(target, outputs, list(base.config.draft_vocab))
    order = list(range(len(seqs)))
    random.Random(0).shuffle(order)
    held = [seqs[i] for i in order[: max(1, int(len(seqs) * 0.1))]]
    ids = torch.randint(100, 40000, (1, 300))
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(5):
            target(input_ids=ids[:, :1], logits_to_keep=1)
        one_forward = (time.perf_counter() - t0) / 5
    rows = []
    for label, fmt, kernel in (("float32", "float32", False), ("bfloat16", "bfloat16", False),
                               ("int8 (f32)", "int8", False), ("int8 kernel", "int8", True)):
        with tempfile.TemporaryDirectory() as tmp:
            base.save(tmp, weights=fmt)
            size = (Path(tmp) / "head.safetensors").stat().st_size
            head = load_head(tmp, target, fp, int8_kernel=kernel)
        if fmt == "bfloat16":
            head = head.to(torch.bfloat16)
        d = head.config.hidden_size
        cache = DynamicCache()
        with torch.no_grad():
            g = torch.randn(1, 300, d, dtype=head.dtype)
            head(g, torch.randint(100, 4000, (1, 300)), torch.arange(300)[None], cache)
            h = torch.randn(1, 1, d, dtype=head.dtype)
            full = torch.zeros(49152, dtype=torch.float64)
            n = 100
            t0 = time.perf_counter()
            for i in range(n):
                hh, ll = head(h, torch.tensor([[500]]), torch.tensor([[300 + i]]), cache)
                full[head.vocab_ids] = ll[0, -1].double()
                int(full.argmax())
                cache.crop(-1)
            per = (time.perf_counter() - t0) / n
        agreement = evaluate(head, [_as(seq, head.dtype) for seq in held])
        rows.append((label, per, size, agreement))
    print(f"one-token target forward (native): {1000 * one_forward:.2f} ms")
    print(f"{len(held)} held-out sequences, {sum(int(s.rows.numel()) for s in held)} unforced positions")
    print(f"{'format':12} {'ms/draft token':>15} {'vs forward':>11} {'file MB':>8} {'first-token agreement':>22}")
    for fmt, per, size, agreement in rows:
        print(f"{fmt:12} {1000 * per:15.2f} {per / one_forward:11.3f} {size / 2**20:8.1f} {agreement:22.3f}")


def _as(seq, dtype):
    from dataclasses import replace

    return replace(seq, features=seq.features.to(dtype))


if __name__ == "__main__":
    main()
