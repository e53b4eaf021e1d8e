"""The forward profile (``constrained-spec bench profile``, formerly ``bench --profile-forward``): every
part timed, the parts within the plain time, the bytes a forward reads, and bad ``--forward-ks`` refused."""

from __future__ import annotations

import types

import torch
from typer.testing import CliRunner

from constrained_spec.cli import app
from constrained_spec.models.invariant import make_batch_invariant
from constrained_spec.bench.forward_profile import PARTS, profile_forward
from tests.conftest import tiny_llama


def test_profile_splits_each_pass_into_its_parts():
    model = make_batch_invariant(tiny_llama(300, seed=0, dtype=torch.float32))
    handle = types.SimpleNamespace(model=model, device=torch.device("cpu"))
    rows = profile_forward(handle, "float32", ks=(1, 5), context=40, reps=3)
    assert [r.k for r in rows] == [1, 5]
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for r in rows:
        assert set(r.parts_ms) == set(PARTS) and r.total_ms > 0
        assert all(v >= 0 for v in r.parts_ms.values())
        assert sum(r.parts_ms.values()) <= r.total_ms * 1.0001
        assert r.parts_ms["linears"] > 0 and r.parts_ms["attention"] > 0 and r.parts_ms["output projection"] > 0
        assert abs(r.weight_mb - params / 1e6) < 1e-6  # every weight and buffer once (nothing tied here)
        # 2 layers x keys and values x 2 heads x 8 dims x (context + k) positions x 8 bytes (the
        # float64 copies a batch-invariant model's cache holds, as the decoder's does)
        assert abs(r.kv_mb - 2 * 2 * 2 * 8 * (40 + r.k) * 8 / 1e6) < 1e-9
    assert rows[1].ms_per_token < rows[1].total_ms
    # The pass leaves the cache as it found it: the same profile can run again.
    assert len(profile_forward(handle, "float32", ks=(2,), context=40, reps=1)) == 1


def test_bad_forward_ks_are_refused():
    for bad in ("1,x", "0,4"):
        for argv in (["bench", "--profile-forward", "--forward-ks", bad], ["bench", "profile", "--ks", bad]):
            r = CliRunner().invoke(app, argv)
            assert r.exit_code == 2 and "Invalid --forward-ks" in r.output, r.output
