"""Imports go one way: a package of ``constrained_spec`` imports only from the layers below it, the
order the data flows (constraint -> drafters and models -> decoding -> batching -> api ->
pipelines and serving -> bench -> cli). Read from the source, so a new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "constrained_spec"
LAYERS = [
    {"errors"},
    {"config"},  # the runtime configuration, read once at load
    {"storage"},
    {"constraint"},
    {"drafters", "models", "remote"},  # the server client closes pydantic schemas as constraint does
    {"decoding"},
    {"batching"},
    {"api"},
    {"pipelines", "serving"},
    {"bench", "ray"},
    {"cli", "__init__"},
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _imports(path: Path) -> set[str]:
    """The top-level ``constrained_spec`` units ``path`` imports (relative or absolute)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            out |= {target[0] for target in _relative_targets(parts, node)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("constrained_spec."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("constrained_spec.")}
    return out


def _relative_targets(parts: list[str], node: ast.ImportFrom) -> list[list[str]]:
    """The module paths (inside ``constrained_spec``) a relative import names."""
    here = parts[:-1][: len(parts) - node.level] if node.level > 1 else parts[:-1]
    if node.module:
        return [here + node.module.split(".")]
    return [here + [alias.name] for alias in node.names]


def _exists(target: list[str]) -> bool:
    """Whether ``target`` is a module or package of ``constrained_spec``, or a name its parent
    package's ``__init__`` defines or imports."""
    if _is_module(target):
        return True
    init = ROOT.joinpath(*target[:-1], "__init__.py")
    return init.is_file() and target[-1] in init.read_text()


def test_every_relative_import_names_a_real_module():
    """Moved modules leave no import behind them, even one inside a function that only runs on
    a rare path (``from . import remote`` in a command that talks to a server)."""
    broken = []
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                broken += [f"{path.relative_to(ROOT)}: {'.'.join(t)}" for t in _relative_targets(parts, node)
                           if not _exists(t)]
    assert not broken


def test_every_unit_has_a_layer():
    units = {p.relative_to(ROOT).with_suffix("").parts[0] for p in ROOT.rglob("*.py")}
    assert units - set(LEVEL) == set()


def test_imports_go_down_the_layers_only():
    upward = []
    for path in ROOT.rglob("*.py"):
        unit = path.relative_to(ROOT).with_suffix("").parts[0]
        for target in _imports(path) - {unit}:
            if LEVEL.get(target, -1) >= LEVEL[unit]:
                upward.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not upward


def _module_graph() -> dict[str, set[str]]:
    """Each module of ``constrained_spec`` and the modules of its own package it imports, at the
    top or inside a function (dotted names; a package is its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = parts[:-1]
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                for target in _relative_targets(parts, node):
                    while target and not _is_module(target):
                        target = target[:-1]  # a name a module defines: the module
                    if target[: len(package)] == package and len(target) == len(package) + 1:
                        graph[name].add(".".join(target))
        graph[name].discard(name)
    return graph


def _is_module(target: list[str]) -> bool:
    """Whether ``target`` is a module or package of ``constrained_spec``."""
    path = ROOT.joinpath(*target)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_import_circles_among_the_modules_of_models():
    """Inside ``models/``, modules import one way too, function-local imports included (circles
    had been hidden in functions: ``cpu_kernels -> int4 -> dense_blocks -> cpu_kernels``,
    ``invariant -> growing_cache -> invariant``), so each module can be read, and moved, with
    the ones below it only. (Other packages still have circles of their own.)"""
    graph = {name: targets for name, targets in _module_graph().items() if name.startswith("models.")}
    circles, done, path = [], set(), []

    def visit(module: str) -> None:
        if module in path:
            circles.append(" -> ".join([*path[path.index(module):], module]))
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert not circles
