"""An installed wheel carries everything it runs: the subpackages and the benchmark prompts."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_runs_bench_on_one_prompt(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=300)
    wheel = next(wheels.glob("constrained_spec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "constrained_spec/data/extraction.jsonl" in names
    assert "constrained_spec/constraint/llguidance.py" in names and "constrained_spec/drafters/hybrid.py" in names
    # A fresh environment with only the wheel installed; its dependencies are borrowed from this
    # one by a plain path entry (not a site dir, so this checkout's editable install stays out).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": ""}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import constrained_spec; print(constrained_spec.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert str(venv) in where.stdout, where.stdout  # the installed wheel, not this checkout
    out = subprocess.run([str(venv / "bin" / "constrained-spec"), "bench", "--limit", "1", "--fixed-k", "4",
                          "--no-outlines", "--max-new-tokens", "64"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 extraction prompts" in out.stdout and "target-only" in out.stdout and "1/1" in out.stdout
