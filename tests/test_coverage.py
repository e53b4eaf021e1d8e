"""The coverage command on a small sample of the real-world corpus; timeouts leave nothing running."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from constrained_spec.bench.coverage import run_coverage

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "jsonschemabench"
pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason="the JSONSchemaBench corpus is not beside the checkout")


def test_coverage_sample_counts_add_up(smol_tokenizer):
    report = run_coverage(CORPUS, smol_tokenizer, sample=4, timeout_s=10, subsets=["Github_trivial", "Glaiveai2K"])
    rows = {r["subset"]: r for r in report["rows"]}
    assert set(rows) == {"Github_trivial", "Glaiveai2K", "all"}
    for r in rows.values():
        compiled = round(r["compiled_pct"] * r["schemas"] / 100)
        assert compiled + r["refused"] + r["timeouts"] + r["errors"] == r["schemas"]
    assert rows["all"]["schemas"] == 8
    assert rows["all"]["compiled_pct"] > 0
    assert rows["all"]["valid_instances_checked"] > 0
    assert not mp.active_children()


def test_timeouts_are_counted_and_leave_no_process(smol_tokenizer):
    report = run_coverage(CORPUS, smol_tokenizer, sample=2, timeout_s=0.001, subsets=["Kubernetes"])
    row = report["rows"][0]
    assert row["timeouts"] + row["refused"] == 2
    assert row["timeouts"] >= 1
    assert ("compile timeout", row["timeouts"]) in report["top_refusal_reasons"]
    assert not mp.active_children()


def test_generation_check_reports_outcomes(smol):
    report = run_coverage(CORPUS, smol.tokenizer, sample=1, timeout_s=10, subsets=["Glaiveai2K"],
                          backend="llguidance", generate=1, model=smol)
    gen = report["generation"]
    assert gen["schemas"] == 1 and sum(gen["outcomes"].values()) == 1
    assert not mp.active_children()


def test_instances_are_laid_out_as_the_constraint_writes_them():
    from constrained_spec.bench.coverage import _ordered_like

    schema = {"definitions": {"svc": {"type": "object", "properties": {"image": {"type": "string"},
                                                                       "n": {"type": "integer"}}}},
              "type": "object", "properties": {"services": {"type": "object", "additionalProperties": {"$ref": "#/definitions/svc"}}}}
    value = {"services": {"web": {"n": 6000.0, "image": "nginx"}}}
    out = _ordered_like(value, schema)
    assert json.dumps(out) == '{"services": {"web": {"image": "nginx", "n": 6000}}}'
    assert out == value  # the same JSON value
