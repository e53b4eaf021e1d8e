"""The batch sweep (``constrained-spec bench batch``) on a few real documents: every
configuration's records equal the per-document target-only records, and the figures add up."""

from __future__ import annotations

import pytest

from constrained_spec.bench.batch import plot_sweep, run_batch_sweep, sweep_configs

pytestmark = pytest.mark.slow


def test_sweep_configs_always_include_per_document_rows():
    configs = sweep_configs([4])
    assert [(c.batch_size, c.kind) for c in configs] == [
        (1, "target-only"), (1, "target-only + prefix cache"), (1, "speculative + prefix cache"),
        (4, "target-only"), (4, "target-only + prefix cache"), (4, "speculative + prefix cache")]


def test_sweep_rows_identical_and_consistent(smol, tmp_path):
    report = run_batch_sweep([3], model=smol, limit=3, max_new_tokens=96)
    rows = {r["config"]: r for r in report["rows"]}
    assert len(rows) == 6
    tokens = {r["output_tokens"] for r in rows.values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # the same records, so the same token count
    for r in rows.values():
        assert r["errors"] == 0
        assert r["identical_to_per_document_target_only"].startswith("3/3"), r
        assert r["latency_p50_s"] <= r["latency_p99_s"] <= r["seconds"]
    assert rows["batch 1: target-only"]["kv_cache_mib"] is None
    assert 0 < rows["batch 3: target-only"]["kv_cache_mib"] < rows["batch 3: target-only + prefix cache"]["kv_cache_mib"]
    assert rows["batch 1: target-only"]["target_forwards_per_token"] >= 1.0  # one forward per token at least
    assert rows["batch 3: speculative + prefix cache"]["acceptance_by_kind"]["grammar"] > 0.5
    assert [r["batch_size"] for r in report["ratios"]] == [1, 3]
    assert plot_sweep(report, tmp_path / "sweep.png").stat().st_size > 1000


def test_extract_refuses_an_engine_on_another_model(smol):
    from constrained_spec.batching import BatchEngine
    from constrained_spec.errors import InvalidOptionError
    from constrained_spec.pipelines.extract import extract
    from tests.conftest import tiny_llama

    engine = BatchEngine(tiny_llama(64, 0), max_batch=2)
    with pytest.raises(InvalidOptionError, match="another model"):
        list(extract({"type": "object"}, ["a document"], model=smol, engine=engine))
