"""The batch sweep: whole extraction jobs at several batch sizes, side by side in one run
(``constrained-spec bench batch``; figures in docs/extraction.md).

For each batch size, three configurations run the same documents through ``extract``: batched
target-only without the prefix cache (the path extraction had before the batch engine), batched
target-only with it, and batched speculation with it (the default). Batch 1 is always part of the
sweep: it is per-document decoding, target-only and speculative. Every record is compared with
the per-document target-only record of the same document.

Figures per configuration: output tokens per second over the whole job (prompt passes included)
and over its decode phase (wall time less the requests' prompt passes: a joining request's
share of its first batched step, by tokens), per-request latency p50 /
p99 (from a request's admission to its last token; every job submits all its documents at
once, so time spent waiting for a slot is left out), target forwards per output token (every
forward the job ran, counted at the model), accepted tokens by drafter kind, and the memory of
the batched keys and values: the engine's row cache plus the prefix cache's entries at the end
of the job (both only grow during a job, so this is their peak; per-document rows keep one
request's cache at a time and report none).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from pydantic import BaseModel, Field

from ..batching import BatchEngine
from ..decoding.prefix import prefix_cache_for
from ..models import ModelHandle, resolve_model
from .single import save_figure
from ..pipelines.extract import ExtractionResult, extract
from .quality import field_accuracy

#: 64 short biographies with the values a reader would extract, shipped with the package.
DEFAULT_DOCUMENTS = Path(__file__).resolve().parent.parent / "data" / "people.jsonl"


class Person(BaseModel):
    """The record extracted from each document (the same as ``examples/people.py``)."""

    name: str = Field(description="the person's full name")
    age: int = Field(description="age in years")
    city: str = Field(description="the city where the person lives")
    occupation: str = Field(description="their job, in a few words")


@dataclass(frozen=True)
class SweepConfig:
    """One job: a batch size, a drafter (``none`` or ``auto``) and whether the prefix cache is on."""

    batch_size: int
    drafter: str
    prefix_cache: bool

    @property
    def kind(self) -> str:
        """The configuration without its batch size (one line of the plot)."""
        if self.drafter == "none":
            return "target-only + prefix cache" if self.prefix_cache else "target-only"
        return "speculative + prefix cache" if self.prefix_cache else "speculative"

    @property
    def name(self) -> str:
        return f"batch {self.batch_size}: {self.kind}"


def sweep_configs(batch_sizes: list[int]) -> list[SweepConfig]:
    """Batch 1 (per-document) first, then each batch size: target-only, + prefix cache, speculative."""
    sizes = sorted({1, *batch_sizes})
    return [SweepConfig(b, d, p) for b in sizes for d, p in (("none", False), ("none", True), ("auto", True))]


def load_documents(path: Path | str = DEFAULT_DOCUMENTS, limit: int | None = None) -> list[dict[str, Any]]:
    """``{"id", "text", "expected"?}`` records from a JSONL file."""
    docs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return docs[:limit] if limit else docs


@contextmanager
def _count_forwards(handle: ModelHandle) -> Iterator[list[int]]:
    """Counts forwards of the model's decoder stack (every pass, with or without logits)."""
    count = [0]
    stack = getattr(handle.model, "base_model", handle.model)
    hook = stack.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        hook.remove()


def _row(config: SweepConfig, results: list[ExtractionResult], seconds: float, forwards: int,
         kv_mib: float | None, reference: list[Any] | None, docs: list[dict[str, Any]]) -> dict[str, Any]:
    # Valid records only: a failed document's figures are not kept on every path.
    stats = [r.decode_stats for r in results if r.ok and r.decode_stats is not None]
    tokens = sum(s.output_tokens for s in stats)
    prompt_seconds = sum(s.prefill_seconds for s in stats)
    latencies = [s.total_seconds for s in stats]
    kinds: dict[str, list[int]] = {}
    for s in stats:
        for kind, row in s.per_kind.items():
            if kind != "target" and row["drafted"]:
                k = kinds.setdefault(kind, [0, 0])
                k[0] += row["drafted"]
                k[1] += row["accepted"]
    values = [r.to_record().get("value") for r in results]
    right = total = 0
    for value, doc in zip(values, docs):
        if doc.get("expected"):
            r, t = field_accuracy(value, doc["expected"])
            right, total = right + r, total + t
    decode = seconds - prompt_seconds
    return {
        "config": config.name,
        "kind": config.kind,
        "batch_size": config.batch_size,
        "documents": len(results),
        "errors": sum(not r.ok for r in results),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
        "decode_tokens_per_second": round(tokens / decode, 2) if decode > 0 else None,
        "prompt_pass_seconds": round(prompt_seconds, 3),
        "latency_p50_s": round(float(np.quantile(latencies, 0.5)), 3) if latencies else None,
        "latency_p99_s": round(float(np.quantile(latencies, 0.99)), 3) if latencies else None,
        "target_forwards_per_token": round(forwards / tokens, 3) if tokens else None,
        "acceptance_by_kind": {k: round(a / d, 3) for k, (d, a) in kinds.items()} or None,
        "kv_cache_mib": kv_mib,
        "identical_to_per_document_target_only": f"{sum(a == b for a, b in zip(values, reference))}/{len(values)}"
        if reference is not None else f"{len(values)}/{len(values)} (reference)",
        "field_accuracy": f"{right}/{total}" if total else None,
    }


def run_batch_sweep(batch_sizes: list[int], *, model: Any = None, documents: Path | str = DEFAULT_DOCUMENTS,
                    limit: int | None = None, max_new_tokens: int = 128,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every configuration of ``sweep_configs(batch_sizes)`` on the documents (greedy) and
    return the report: one row per configuration, plus ratios of each batch size's speculative
    row against its target-only rows."""
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"Batch sizes must be integers >= 1, got {batch_sizes!r}.")
    handle = resolve_model(model)
    docs = load_documents(documents, limit)
    list(extract(Person, docs[:2], model=handle, batch_size=2, max_new_tokens=32))  # warm the kernels
    rows: list[dict[str, Any]] = []
    reference: list[Any] | None = None
    prefixes = prefix_cache_for(handle.model)
    for config in sweep_configs(batch_sizes):
        prefixes.clear()  # each job computes its shared prefix once, as a fresh run would
        engine = BatchEngine(handle.model, max_batch=config.batch_size, precision=handle.precision,
                             prefix_cache=config.prefix_cache) if config.batch_size > 1 else None
        with _count_forwards(handle) as forwards:
            start = time.perf_counter()
            results = list(extract(Person, docs, model=handle, batch_size=config.batch_size, engine=engine,
                                   drafter=config.drafter, prefix_cache=config.prefix_cache,
                                   max_new_tokens=max_new_tokens))
            seconds = time.perf_counter() - start
        kv = None if engine is None else round(
            (engine.peak_kv_bytes + (prefixes.bytes if config.prefix_cache else 0)) / 2**20, 1)
        row = _row(config, results, seconds, forwards[0], kv, reference, docs)
        if reference is None:
            reference = [r.to_record().get("value") for r in results]
        rows.append(row)
        if progress:
            progress(f"{config.name}: {row['tokens_per_second']} tok/s")
    return {"model": handle.name, "precision": handle.precision, "documents": len(docs),
            "max_new_tokens": max_new_tokens, "rows": rows, "ratios": _ratios(rows)}


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size: speculative + prefix cache against target-only (the whole job) and against
    target-only + prefix cache (the decode phase, and per-request latency)."""
    by = {(r["batch_size"], r["kind"]): r for r in rows}
    out = []
    for b in sorted({r["batch_size"] for r in rows}):
        spec, plain, cached = (by.get((b, k)) for k in ("speculative + prefix cache", "target-only",
                                                          "target-only + prefix cache"))
        if not (spec and plain and cached):
            continue
        out.append({
            "batch_size": b,
            "job_vs_target_only": round(spec["tokens_per_second"] / plain["tokens_per_second"], 2),
            "decode_vs_target_only_prefix": round(spec["decode_tokens_per_second"] / cached["decode_tokens_per_second"], 2),
            "latency_p50_vs_target_only_prefix": round(spec["latency_p50_s"] / cached["latency_p50_s"], 2),
        })
    return out


def plot_sweep(report: dict[str, Any], path: Path | str) -> Path:
    """PNG: output tokens/s (whole job) against batch size, one line per configuration kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in dict.fromkeys(r["kind"] for r in report["rows"]):
        pts = [(r["batch_size"], r["tokens_per_second"]) for r in report["rows"] if r["kind"] == kind]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded at once)")
    ax.set_ylabel("output tokens / s (whole job)")
    ax.set_title(f"{report['model']} ({report['precision']}): {report['documents']} extraction documents")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
