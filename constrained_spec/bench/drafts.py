"""Which draft to use on your model: each candidate alone and inside auto, beside target-only,
auto without a draft and llama.cpp's two rows (``constrained-spec bench drafts``; the Qwen
pair's table is in docs/drafters.md).

A candidate is a draft model (a GGUF file or any id ``load_model`` takes, same tokenizer as the
target) or a learned head ("head": the one found for the target; or a directory saved by
``train-drafter``). Every row runs in one process on the same prompts, interleaved prompt by
prompt (``bench.single``), so the ratios are side by side; the verdict names the fastest auto
row and what each candidate's drafted token costs against a one-token target step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import InvalidOptionError
from ..models import resolve_model
from .single import BASELINE, DEFAULT_PROMPTS, BenchConfig, run_bench

#: The row of auto with nothing learned: what every draft must beat inside auto.
AUTO_ALONE = "auto alone (draft=False)"
#: How much faster than auto alone a candidate's row must be to be recommended: two runs of one
#: row differ by a few percent on a shared 2-core machine (docs/drafters.md, "Measured").
NOISE = 0.03


@dataclass(frozen=True)
class DraftCandidate:
    """One draft to compare: its label in the table, the ``draft=`` value a request takes, and
    the drafter kind that runs it alone ("model" or "head")."""

    label: str
    draft: Any
    kind: str


def parse_candidates(text: str, target: Any) -> list[DraftCandidate]:
    """The candidates of ``--draft``: comma-separated draft models (paths or ids) and heads
    ("head" for the target's own, or a head directory). Each draft model is loaded once here,
    so its load is outside every timing and its tokenizer checked against the target's now."""
    from ..api import SpecOptions, resolve_draft
    from ..drafters.head import is_head_dir

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InvalidOptionError("Invalid --draft: expected comma-separated draft models or heads, got nothing.")
    handle = resolve_model(target)
    out = []
    for name in names:
        if name == "head" or is_head_dir(name):
            draft: Any = True if name == "head" else name
            resolve_draft(draft, handle, SpecOptions(drafter="head"))  # a clear error now if there is none
            out.append(DraftCandidate(f"head ({Path(name).name})" if name != "head" else "head", draft, "head"))
        else:
            source = resolve_draft(name, handle, SpecOptions(drafter="model"))
            assert source is not None and source.model is not None
            out.append(DraftCandidate(Path(name).name, source.model, "model"))
    return out


def draft_configs(candidates: list[DraftCandidate]) -> list[BenchConfig]:
    """Target-only, auto alone, then each candidate alone and inside auto."""
    configs = [BenchConfig(BASELINE, "none"), BenchConfig(AUTO_ALONE, "hybrid", draft=False)]
    for c in candidates:
        configs += [BenchConfig(f"{c.label} alone", c.kind, draft=c.draft),
                    BenchConfig(f"auto + {c.label}", "hybrid", draft=c.draft)]
    return configs


def run_drafts_bench(model: Any, candidates: list[DraftCandidate], *, prompts: Path | str = DEFAULT_PROMPTS,
                     workload: str = "extraction", limit: int | None = None, max_new_tokens: int = 128,
                     llama_cpp: bool = True, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every candidate's rows on the prompts (see the module docstring): the ``bench single``
    report with, per row, its ratio to auto alone and its draft's cost per drafted token, and a
    ``verdict``."""
    report = run_bench(prompts, model=model, configs=draft_configs(candidates), max_new_tokens=max_new_tokens,
                       outlines_reference=False, llama_cpp=llama_cpp, limit=limit, workload=workload,
                       progress=progress)
    rows = {row["config"]: row for row in report["rows"]}
    auto = rows[AUTO_ALONE]["tokens_per_second"]
    for row in report["rows"]:
        row["vs_auto_alone"] = round(row["tokens_per_second"] / auto, 3) if auto else None
    report["verdict"] = verdict(report["rows"], candidates)
    return report


def verdict(rows: list[dict[str, Any]], candidates: list[DraftCandidate]) -> str:
    """Which configuration to use: auto with the candidate that drafted inside auto and beat
    auto alone by more than the noise of one run (``NOISE``), else auto alone, saying why each
    candidate is not chosen (it stood aside, or it drafted and did not pay)."""
    by_name = {row["config"]: row for row in rows}
    paying, why_not = [], []
    for c in candidates:
        row = by_name[f"auto + {c.label}"]
        drafted = c.kind in (row.get("acceptance_by_kind") or {})
        if drafted and (row["vs_auto_alone"] or 0) >= 1 + NOISE:
            paying.append((row["tokens_per_second"], c, row))
        elif drafted:
            why_not.append(f"{c.label} drafted inside auto and gave {row['vs_auto_alone']}x auto alone")
        else:
            why_not.append(f"{c.label} stood aside inside auto (asking it would not have paid)")
    if paying:
        _, best, row = max(paying, key=lambda p: p[0])
        return (f"use draft={best.label!r} with auto: {row['tokens_per_second']} tok/s, {row['vs_auto_alone']}x auto "
                f"alone, {row['speedup_vs_target_only']}x target-only, outputs identical {row['identical_outputs']}")
    alone = by_name[AUTO_ALONE]
    return (f"use auto alone ({alone['tokens_per_second']} tok/s, {alone['speedup_vs_target_only']}x target-only): "
            + "; ".join(why_not))
