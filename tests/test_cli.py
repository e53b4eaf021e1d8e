"""Command-line exit codes: 2 for bad input (reason on stderr), 1 for a failed generation, 0 on success."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from constrained_spec.cli import app

runner = CliRunner()


def test_bad_regex_exits_2():
    res = runner.invoke(app, ["regex", "a(", "--prompt", "hi"])
    assert res.exit_code == 2
    assert "does not compile" in res.output


def test_bad_schema_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nonsense"}')
    res = runner.invoke(app, ["json", str(bad), "--prompt", "hi"])
    assert res.exit_code == 2
    assert "Invalid schema at /type" in res.output


def test_unsupported_keyword_exits_2():
    res = runner.invoke(app, ["json", '{"type": "array", "uniqueItems": true}', "--prompt", "hi"])
    assert res.exit_code == 2
    assert "'uniqueItems'" in res.output
    res = runner.invoke(app, ["json", '{"type": "integer", "minimum": 1}', "--prompt", "hi", "--backend", "outlines-core"])
    assert res.exit_code == 2
    assert "'minimum'" in res.output


def test_json_success_and_token_limit(smol):
    ok = runner.invoke(app, ["json", "schemas/person.json", "--prompt",
                             "Extract name, age, city, occupation: Tom Okafor, 52, harbour pilot in Rotterdam."])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout.strip().splitlines()[-1])["age"] == 52
    cut = runner.invoke(app, ["json", "schemas/person.json", "--prompt", "Tom", "--max-new-tokens", "3"])
    assert cut.exit_code == 1
    assert "max_new_tokens=3" in cut.output


def test_regex_stream_and_backend_options_are_used(smol):
    pattern = "[0-9]{3}-[0-9]{4}"
    whole = runner.invoke(app, ["regex", pattern, "--prompt", "A phone extension:", "--backend", "outlines-core"])
    streamed = runner.invoke(app, ["regex", pattern, "--prompt", "A phone extension:", "--stream", "--stats"])
    assert whole.exit_code == 0 and streamed.exit_code == 0, streamed.output
    assert whole.stdout.strip() == streamed.stdout.strip().splitlines()[0]
    assert "backend llguidance" in streamed.output


def test_help_and_usage_errors_do_not_import_torch():
    """``--help`` and argument errors answer without loading torch or transformers (under a second)."""
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from constrained_spec.cli import app; "
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
            "r = CliRunner().invoke(app, ['json']); assert r.exit_code == 2, r.output; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
