"""The examples run as written in the README."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["regex_phone.py", "schema_file.py", "people.py"])
def test_example_runs(smol, name, capsys):
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert out.strip()
    assert "failed" not in out
