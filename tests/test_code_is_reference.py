"""The library's docstrings and comments say why, not when or how fast: measurements and their
dates live in the docs (docs/performance.md and the other pages hold what is true now,
docs/changelog.md the history), where they can be kept true; a figure in a comment goes stale
without anyone noticing. A comment that needs a measurement links the docs page that holds it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import constrained_spec

PACKAGE = Path(constrained_spec.__file__).parent
#: A calendar date (a draft's name such as "2020-12" has no day).
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(January|February|March|April|May|June|July|August|September|"
                  r"October|November|December) 20\d\d\b")
#: A timing, a throughput, a speed-up or a percentage: what a benchmark prints.
FIGURE = re.compile(r"\b\d+(\.\d+)?\s?(ms|us|µs|tok/s|tokens/s|tokens a second)\b|\b\d+\.\d+x\b|\b\d+(\.\d+)?\s?%"
                    r"|\b\d+(\.\d+)? s\b")
#: Settings that read like figures: a sampling period, a tolerance.
SETTING = re.compile(r"\bevery \d+(\.\d+)? ?(ms|s)\b|\bwithin \d+%")


def _is_figure(text: str) -> bool:
    text = SETTING.sub("", text)
    return bool(DATE.search(text) or FIGURE.search(text))


def _texts(path: Path):
    """(line, text) of every comment and docstring in ``path``."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                for offset, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + offset, line


def test_no_dates_or_benchmark_figures_in_library_comments() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text.strip()[:100]}"
             for path in sorted(PACKAGE.rglob("*.py")) for line, text in _texts(path)
             if _is_figure(text)]
    assert not found, "move these to the docs and link the page:\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for() -> None:
    for text in ("measured 2026-12-04", "a forward took 7.2 ms", "1.7x faster", "99% of schemas", "builds in 23 s",
                 "110 tok/s"):
        assert _is_figure(text), text
    for text in ("draft 2020-12", "K of 12 on gb200", "256 MiB by default", "x_1..x_k", "sampled every 50 ms",
                 "flat: within 10%"):
        assert not _is_figure(text), text
