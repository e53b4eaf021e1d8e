"""Command-line exit codes: 2 for bad input (reason on stderr), 1 for a failed generation, 0 on success."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

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


# --------------------------------------------------------------------------------------------
# bench: one subcommand per workload; the one-command form's flags reach the same harness with
# the same arguments (the harnesses are replaced by recorders here, so no model runs).
# --------------------------------------------------------------------------------------------

class _Reached(Exception):
    """Raised by a recording harness: the command got that far."""


def _recorder(calls: list, name: str, returns=_Reached):
    def fake(*args, **kwargs):
        clean = lambda v: "<callable>" if callable(v) else v  # noqa: E731  (progress lambdas differ per call)
        calls.append((name, tuple(clean(a) for a in args), {k: clean(v) for k, v in kwargs.items()}))
        if returns is _Reached:
            raise _Reached(name)
        return returns
    return fake


@pytest.fixture()
def harnesses(monkeypatch):
    """Every harness and model loader replaced by a recorder; returns the list of calls."""
    import constrained_spec.models as models
    from constrained_spec.bench import batch, coverage, forward_profile, long_prompt, neighbour, serve, single

    calls: list = []
    monkeypatch.setattr(models, "resolve_model", lambda m=None, **k: SimpleNamespace(model=m, tokenizer=("tokenizer", m)))
    monkeypatch.setattr(models, "load_model", lambda m=None, **k: ("loaded", m, tuple(sorted(k.items()))))
    monkeypatch.setattr(single, "has_shipped_head", lambda handle: False)
    monkeypatch.setattr(single, "run_bench", _recorder(calls, "run_bench"))
    monkeypatch.setattr(batch, "run_batch_sweep", _recorder(calls, "run_batch_sweep"))
    monkeypatch.setattr(serve, "run_serve_bench", _recorder(calls, "run_serve_bench"))
    monkeypatch.setattr(long_prompt, "run_long_prompt_bench", _recorder(calls, "run_long_prompt_bench", returns=[]))
    monkeypatch.setattr(long_prompt, "run_long_prompt_server", _recorder(calls, "run_long_prompt_server"))
    monkeypatch.setattr(neighbour, "run_neighbour_bench", _recorder(calls, "run_neighbour_bench"))
    monkeypatch.setattr(forward_profile, "profile_forward", _recorder(calls, "profile_forward"))
    monkeypatch.setattr(coverage, "run_coverage", _recorder(calls, "run_coverage"))
    return calls


def _calls_of(calls: list, argv: list[str]) -> list:
    """The harness calls one command line makes (it stops at the first, or where a stub ends it)."""
    calls.clear()
    res = runner.invoke(app, argv)
    assert res.exit_code != 2 or res.exception is not None, res.output  # not a usage error
    assert calls, (argv, res.output)
    return list(calls)


OLD_AND_NEW = [
    (["bench"], ["bench", "single"]),
    (["bench", "--fixed-k", "", "--workload", "generation", "--limit", "10", "--max-new-tokens", "128"],
     ["bench", "single", "--fixed-k", "", "--workload", "generation", "--limit", "10", "--max-new-tokens", "128"]),
    (["bench", "--precision", "float32,native", "--fixed-k", "16,20", "--no-outlines", "--no-llama-cpp", "--json", "b.json"],
     ["bench", "single", "--precision", "float32,native", "--fixed-k", "16,20", "--no-outlines", "--no-llama-cpp",
      "--json", "b.json"]),
    (["bench", "--precision", "float32", "--profile", "cpu", "--prompts", "p.jsonl", "-m", "some/model"],
     ["bench", "single", "--precision", "float32", "--profile", "cpu", "--prompts", "p.jsonl", "-m", "some/model"]),
    (["bench", "--batch", "1,4,16,64", "--plot", "sweep.png"], ["bench", "batch", "1,4,16,64", "--plot", "sweep.png"]),
    (["bench", "--batch", "1,16", "--documents", "d.jsonl", "--limit", "8", "--precision", "native", "--json", "s.json"],
     ["bench", "batch", "1,16", "--documents", "d.jsonl", "--limit", "8", "--precision", "native", "--json", "s.json"]),
    (["bench", "--serve", "1,8,32"], ["bench", "serve", "1,8,32"]),
    (["bench", "--serve", "2", "--documents", "d.jsonl", "--limit", "4", "--max-new-tokens", "64"],
     ["bench", "serve", "2", "--documents", "d.jsonl", "--limit", "4", "--max-new-tokens", "64"]),
    (["bench", "--long-prompt", "3900", "--json", "long.json"], ["bench", "long-prompt", "3900", "--json", "long.json"]),
    (["bench", "--long-prompt", "500", "--no-server"], ["bench", "long-prompt", "500", "--no-server"]),
    (["bench", "--neighbour"], ["bench", "neighbour"]),
    (["bench", "--neighbour", "--limit", "5", "--no-llama-cpp", "--max-new-tokens", "64"],
     ["bench", "neighbour", "--limit", "5", "--no-llama-cpp", "--max-new-tokens", "64"]),
    (["bench", "--profile-forward"], ["bench", "profile"]),
    (["bench", "--profile-forward", "--precision", "native", "--forward-ks", "1,4"],
     ["bench", "profile", "--precision", "native", "--ks", "1,4"]),
    (["bench", "--profile-forward", "--precision", "native", "--forward-ks", "1,4"],
     ["bench", "profile", "--precision", "native", "--forward-ks", "1,4"]),
    (["coverage", "corpus", "--sample", "5", "--backend", "llguidance", "--lenient"],
     ["bench", "coverage", "corpus", "--sample", "5", "--backend", "llguidance", "--lenient"]),
]


@pytest.mark.parametrize("old,new", OLD_AND_NEW, ids=lambda argv: " ".join(argv) or "bench")
def test_bench_old_flags_and_subcommands_reach_the_same_harness(harnesses, tmp_path, monkeypatch, old, new):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    before = _calls_of(harnesses, old)
    after = _calls_of(harnesses, new)
    assert before == after


def test_bench_old_flags_pick_the_workload_in_the_old_order(harnesses):
    """The one-command form checked --profile-forward, --neighbour, --long-prompt, --batch, --serve in turn."""
    expected = [(["bench", "--profile-forward", "--neighbour", "--batch", "1"], "profile_forward"),
                (["bench", "--neighbour", "--long-prompt", "100", "--serve", "1"], "run_neighbour_bench"),
                (["bench", "--long-prompt", "100", "--batch", "1"], "run_long_prompt_bench"),
                (["bench", "--batch", "1", "--serve", "1"], "run_batch_sweep"),
                (["bench", "--serve", "1", "--workload", "generation"], "run_serve_bench")]
    for argv, harness in expected:
        assert _calls_of(harnesses, argv)[0][0] == harness, argv


def test_bench_help_lists_every_workload_and_bad_mixes_are_usage_errors():
    res = runner.invoke(app, ["bench", "--help"])
    assert res.exit_code == 0
    for name in ("single", "batch", "serve", "long-prompt", "neighbour", "profile", "coverage"):
        assert name in res.output
        sub = runner.invoke(app, ["bench", name, "--help"])
        assert sub.exit_code == 0 and "Example: constrained-spec bench" in sub.output, name
    assert "--profile-forward" not in res.output  # the old flags still parse, out of sight
    mixed = runner.invoke(app, ["bench", "--limit", "2", "batch", "1"])
    assert mixed.exit_code == 2 and "after the subcommand" in mixed.output
    bad = runner.invoke(app, ["bench", "batch", "0,x"])
    assert bad.exit_code == 2 and "Invalid --batch" in bad.output
