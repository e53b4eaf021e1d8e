"""``constrained-spec bench drafts``: each candidate draft alone and inside auto, beside
target-only, auto alone and llama.cpp's rows, with its cost per drafted token and a verdict."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from constrained_spec.bench import single
from constrained_spec.bench.drafts import AUTO_ALONE, parse_candidates, run_drafts_bench
from constrained_spec.cli import app
from constrained_spec.errors import InvalidOptionError


def _fake_llama_cpp(monkeypatch):
    """A stand-in for llama.cpp's two rows (CI does not build it): the target-only value."""
    def rows(gguf_file, max_new_tokens):
        def prepare(schema, text, ids, tokens):
            return lambda: json.dumps({"ok": True})
        return {"llama.cpp grammar (reference)": prepare, "llama.cpp no grammar (reference)": prepare}
    monkeypatch.setattr(single, "llama_cpp_rows", rows)


def test_every_candidate_runs_alone_and_inside_auto_with_its_cost_and_a_verdict(smol, monkeypatch):
    """The embedded model's own file as a draft model and its shipped head: every row gives
    target-only's output, the costly rows say what a drafted token cost against a target step,
    and the verdict names the fastest auto row."""
    _fake_llama_cpp(monkeypatch)
    candidates = parse_candidates(f"{smol.gguf_file},head", None)
    assert [(c.label, c.kind) for c in candidates] == [(smol.gguf_file.name, "model"), ("head", "head")]
    report = run_drafts_bench(None, candidates, limit=1, max_new_tokens=32)
    rows = {r["config"]: r for r in report["rows"]}
    draft = smol.gguf_file.name
    assert list(rows) == ["target-only", AUTO_ALONE, f"{draft} alone", f"auto + {draft}", "head alone", "auto + head",
                          "llama.cpp grammar (reference)", "llama.cpp no grammar (reference)"]
    assert all(rows[name]["identical_outputs"] == "1/1" for name in list(rows)[:6])
    assert rows[f"{draft} alone"]["draft_ms_per_token"] > 0 and rows[f"{draft} alone"]["draft_cost_vs_target_step"] > 0
    assert rows[f"{draft} alone"]["acceptance_by_kind"]["model"] > 0.5  # the target itself: right nearly always
    assert rows[AUTO_ALONE]["vs_auto_alone"] == 1.0 and rows[AUTO_ALONE]["draft_ms_per_token"] is None
    assert report["verdict"].startswith(("use auto alone", "use draft="))


def test_the_verdict_recommends_a_draft_only_where_it_drafted_and_paid_beyond_noise():
    """A draft that stood aside inside auto (no tokens of its kind) is not recommended even when
    its row ran 2% faster (noise), one that drafted and ran 10% faster is, one that drafted and
    ran slower is named with its ratio."""
    from constrained_spec.bench.drafts import DraftCandidate, verdict

    def row(name, tps, vs, kinds=None):
        return {"config": name, "tokens_per_second": tps, "vs_auto_alone": vs, "speedup_vs_target_only": vs * 2,
                "acceptance_by_kind": kinds, "identical_outputs": "6/6"}

    a, b = DraftCandidate("a.gguf", "a.gguf", "model"), DraftCandidate("b.gguf", "b.gguf", "model")
    aside = [row(AUTO_ALONE, 5.0, 1.0), row("auto + a.gguf", 5.1, 1.02, {"copy": 0.9}),
             row("auto + b.gguf", 4.5, 0.9, {"model": 0.6})]
    said = verdict(aside, [a, b])
    assert said.startswith("use auto alone") and "a.gguf stood aside" in said and "gave 0.9x" in said
    paid = [row(AUTO_ALONE, 5.0, 1.0), row("auto + a.gguf", 5.5, 1.1, {"model": 0.8}), aside[2]]
    assert verdict(paid, [a, b]).startswith("use draft='a.gguf'")


def test_a_candidate_that_cannot_draft_for_the_target_is_refused_before_any_run(smol, tmp_path):
    """No file, another tokenizer's model, nothing given: each a clear error naming the problem."""
    with pytest.raises(InvalidOptionError, match="--draft"):
        parse_candidates(" , ", None)
    missing = tmp_path / "absent.gguf"
    result = CliRunner().invoke(app, ["bench", "drafts", "--draft", str(missing), "--limit", "1"])
    assert result.exit_code == 2, result.output
    assert "absent.gguf" in result.output and "Traceback" not in result.output
