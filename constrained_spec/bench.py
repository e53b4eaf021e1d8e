"""Side-by-side benchmark: target-only vs speculative decoding, plus outlines as an outside reference.

All configurations run in one process, interleaved prompt by prompt, so machine noise hits them
alike; figures are reported as ratios against target-only decoding measured in the same run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api import generate_json
from .constraint import compile_regex, load_schema, schema_to_regex
from .models import ModelHandle, resolve_model

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "extraction.jsonl"


@dataclass
class ConfigFigures:
    """Aggregate figures of one configuration over all prompts."""

    name: str
    output_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    constraint_seconds: float = 0.0
    identical: int = 0
    prompts: int = 0
    outputs: list[Any] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second (prefill included)."""
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def summary(self, baseline: "ConfigFigures") -> dict[str, Any]:
        """The row printed and written with ``--json``."""
        tps = self.tokens_per_second
        return {
            "config": self.name,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(tps, 2),
            "speedup_vs_target_only": round(tps / baseline.tokens_per_second, 3) if baseline.tokens_per_second else None,
            "target_forwards_per_token": round(self.target_forwards / self.output_tokens, 3) if self.target_forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "constraint_ms_per_token": round(1000 * self.constraint_seconds / self.output_tokens, 3)
            if self.target_forwards and self.output_tokens else None,
            "identical_outputs": f"{self.identical}/{self.prompts}",
        }


def load_prompts(path: Path | str = DEFAULT_PROMPTS) -> list[dict[str, Any]]:
    """Benchmark items: ``{"id", "schema" (file name in schemas/ or a path), "prompt"}`` per JSONL line."""
    path = Path(path)
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for item in items:
        sp = Path(item["schema"])
        if not sp.is_absolute() and not sp.is_file():
            sp = path.parent.parent / "schemas" / item["schema"]
        item["schema_path"] = str(sp)
    return items


def _outlines_generator(handle: ModelHandle, regex: str) -> Any:
    """outlines' own transformers generator over the very same regex (same language, same layout)."""
    import outlines
    from outlines.types import Regex

    model = outlines.from_transformers(handle.model, handle.tokenizer)
    return outlines.Generator(model, Regex(regex))


def run_bench(
    prompts: Path | str = DEFAULT_PROMPTS,
    *,
    model: Any = None,
    k_max: int | None = None,
    max_new_tokens: int = 256,
    outlines_reference: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """Run every configuration on every prompt; return the figures (see ``ConfigFigures.summary``)."""
    handle = resolve_model(model)
    items = load_prompts(prompts)
    configs = {"target-only": "none", "lookup": "lookup", "grammar": "grammar", "hybrid (auto)": "hybrid"}
    figures = {name: ConfigFigures(name) for name in configs}
    ref = ConfigFigures("outlines + transformers (reference)") if outlines_reference else None
    # Warm up once (first-call allocations, thread pools) so no configuration pays for it.
    generate_json(handle, {"type": "boolean"}, "Is water wet?", drafter="none", max_new_tokens=4)
    for i, item in enumerate(items):
        schema, _ = load_schema(item["schema_path"])
        regex = schema_to_regex(schema)
        compile_regex(regex, handle.vocabulary)  # compile outside the timings
        base_value = None
        for name, drafter in configs.items():
            t0 = time.perf_counter()
            value, stats = generate_json(handle, schema, item["prompt"], drafter=drafter, k_max=k_max,
                                         max_new_tokens=max_new_tokens, return_stats=True)
            fig = figures[name]
            fig.seconds += time.perf_counter() - t0
            fig.output_tokens += stats.output_tokens
            fig.target_forwards += stats.target_forwards
            fig.drafted += stats.drafted
            fig.accepted += stats.accepted
            fig.constraint_seconds += stats.constraint_seconds
            fig.prompts += 1
            fig.outputs.append(value)
            if base_value is None:
                base_value = value
            fig.identical += value == base_value
        if ref is not None:
            gen = _outlines_generator(handle, regex)
            text = handle.tokenizer.apply_chat_template(
                [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=False)
            gen(text, max_new_tokens=2, do_sample=False)  # compile its own index outside the timing
            t0 = time.perf_counter()
            out = gen(text, max_new_tokens=max_new_tokens, do_sample=False)
            ref.seconds += time.perf_counter() - t0
            ref.output_tokens += len(handle.tokenizer(out, add_special_tokens=False)["input_ids"])
            ref.prompts += 1
            try:
                ref.identical += json.loads(out) == base_value
            except json.JSONDecodeError:
                pass
        if progress is not None:
            progress(i + 1, len(items))
    baseline = figures["target-only"]
    rows = [f.summary(baseline) for f in figures.values()]
    if ref is not None:
        rows.append(ref.summary(baseline))
    return {
        "model": handle.name,
        "prompts": len(items),
        "k_max": k_max,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
        "outputs": {item["id"]: figures["hybrid (auto)"].outputs[j] for j, item in enumerate(items)},
    }
