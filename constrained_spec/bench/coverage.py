"""Schema coverage: how many real-world schemas compile, how fast, why the others are refused,
and whether every valid instance of a compiled schema is accepted by its constraint.

Each schema compiles in a worker process with a per-schema timeout; a worker that runs out of
time is killed and replaced, so nothing is left running after a timeout.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..constraint import DEFAULT_JSON_WHITESPACE, CompiledConstraint, clear_cache, compile_constraint, load_schema
from ..errors import ConstrainedSpecError, UnsupportedSchemaFeatureError
from ..storage import CACHE_ENV
from .instances import byte_matcher, search_serialization


@dataclass
class SubsetCoverage:
    """Counts of one subset (one JSONL file of the corpus)."""

    name: str
    schemas: int = 0
    compiled: int = 0
    refused: int = 0
    timeouts: int = 0
    errors: int = 0
    compile_ms: list[float] = field(default_factory=list)
    relaxed: int = 0
    instances_checked: int = 0
    instances_rejected: int = 0
    #: Valid instances the search could neither find nor rule out within its budget.
    instances_undetermined: int = 0
    rejected_examples: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """Figures for the table and ``--json``."""
        ms = self.compile_ms
        pct = lambda q: round(float(np.quantile(ms, q)), 1) if ms else None  # noqa: E731
        return {
            "subset": self.name,
            "schemas": self.schemas,
            "compiled_pct": round(100 * self.compiled / self.schemas, 1) if self.schemas else 0.0,
            "refused": self.refused,
            "timeouts": self.timeouts,
            "errors": self.errors,
            "relaxed": self.relaxed,
            "compile_ms_p50": pct(0.5),
            "compile_ms_p90": pct(0.9),
            "valid_instances_checked": self.instances_checked,
            "valid_instances_rejected": self.instances_rejected,
            "valid_instances_undetermined": self.instances_undetermined,
        }


def _ordered_like(value: Any, schema: Any, root: Any = None, depth: int = 0) -> Any:
    """The same JSON value laid out as the constraint most likely writes it: object keys in the
    schema's property order (merged through local ``$ref``s and ``allOf`` / ``anyOf`` / ``oneOf``
    branches, first appearance first; unlisted keys last), and integral floats as integers (JSON
    Schema counts 6000.0 as the integer 6000; the grammars write it without the fraction)."""
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if depth > 50 or not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = _properties(schema, root)
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: _ordered_like(value[k], props.get(k, extra), root, depth + 1) for k in keys}
    if isinstance(value, list):
        items = _first(schema, root, "items")
        if isinstance(items, list):
            return [_ordered_like(v, items[i] if i < len(items) else {}, root, depth + 1) for i, v in enumerate(value)]
        return [_ordered_like(v, items if isinstance(items, dict) else {}, root, depth + 1) for v in value]
    return value


def _branches(schema: dict, root: Any, depth: int = 0) -> list[dict]:
    """The schema and, recursively, its ``allOf`` / ``anyOf`` / ``oneOf`` branches (resolved)."""
    out = [schema]
    if depth < 10:
        for key in ("allOf", "anyOf", "oneOf"):
            for branch in schema.get(key) or []:
                branch = _resolve(branch, root)
                if isinstance(branch, dict):
                    out += _branches(branch, root, depth + 1)
    return out


def _properties(schema: dict, root: Any) -> dict[str, Any]:
    """Property name -> subschema, in order of first appearance across the branches."""
    props: dict[str, Any] = {}
    for branch in _branches(schema, root):
        if isinstance(branch.get("properties"), dict):
            for name, sub in branch["properties"].items():
                props.setdefault(name, sub)
    return props


def _first(schema: dict, root: Any, key: str) -> Any:
    """The first value of ``key`` across the schema's branches."""
    return next((b[key] for b in _branches(schema, root) if key in b), None)


def _resolve(schema: Any, root: Any) -> Any:
    """Follow local ``$ref``s (``#/definitions/x``, ``#/$defs/x``), a few levels deep."""
    for _ in range(10):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#")):
            return schema
        node: Any = root
        for part in schema["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return schema
        schema = node
    return schema


def _accepts(compiled: CompiledConstraint, tokens: list[int]) -> bool:
    """Whether a fresh matcher of ``compiled`` takes ``tokens`` and ends in a final state."""
    matcher = compiled.matcher()
    states = matcher.walk(matcher.initial_state, tokens)
    return len(states) > len(tokens) and matcher.is_final(states[-1])


def _worker(conn: Any, tokenizer: Any, backend: str, lenient: bool) -> None:
    """Compile each schema and check its valid instances, per request, until the pipe closes."""
    import tempfile

    from llguidance import LLMatcher

    # A corpus run would leave thousands of outlines-core indexes in the disk cache: this
    # process keeps its own, removed when it ends.
    scratch = tempfile.TemporaryDirectory(prefix="constrained-spec-coverage-")
    os.environ[CACHE_ENV] = scratch.name
    compile_constraint({"type": "boolean"}, tokenizer, backend=backend)  # tokenizer tables built before timing
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    while True:
        try:
            schema, values = conn.recv()
        except EOFError:
            scratch.cleanup()
            return
        t0 = time.perf_counter()
        try:
            compiled = compile_constraint(schema, tokenizer, backend=backend, lenient=lenient)  # type: ignore[arg-type]
            grammar = compiled.grammar if backend == "llguidance" else LLMatcher.grammar_from_regex(compiled.pattern)
        except UnsupportedSchemaFeatureError as e:
            conn.send(("refused", 0.0, f"unsupported keyword {e.keyword}", ([], [])))
            continue
        except Exception as e:  # the backends raise with free-form text
            conn.send(("error", 0.0, str(e).split("\n")[0][:200], ([], [])))
            continue
        finally:
            clear_cache()  # one schema at a time: keep the worker small
        ms = 1000 * (time.perf_counter() - t0)
        rejected: list[str] = []
        undetermined: list[str] = []
        matcher = None
        for value in values:
            # Fast path: the value as the corpus writes it, and as the constraint lays it out.
            ordered = _ordered_like(value, schema.schema)
            layouts = sorted({json.dumps(value, ensure_ascii=False), json.dumps(ordered, ensure_ascii=False)})
            if any(_accepts(compiled, tokenize(text)) for text in layouts):
                continue
            # Slow path: any key order and number spelling, searched on the byte-level language.
            matcher = matcher or byte_matcher(grammar)
            result = search_serialization(matcher, ordered)
            if result.found is not None and _accepts(compiled, tokenize(result.found)):
                continue
            if result.found is not None:
                rejected.append(result.found[:120] + " (in the language; its token walk is rejected)")
            elif result.complete:
                rejected.append(result.where)
            else:
                undetermined.append(result.where)
        relaxed = list(compiled.warnings)
        conn.send(("ok", ms, "; ".join(relaxed), (rejected, undetermined)))


class _CompilePool:
    """One worker process; replaced when a compile exceeds its time."""

    def __init__(self, tokenizer: Any, backend: str, lenient: bool) -> None:
        # spawn, not fork: the parent may hold Rust thread pools (llguidance, tokenizers) that a
        # forked child would inherit locked.
        self._ctx = mp.get_context("spawn")
        self._args = (tokenizer, backend, lenient)
        self._start()

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker, args=(child, *self._args), daemon=True)
        self._proc.start()
        child.close()

    def run(self, schema: Any, values: list[Any],
            timeout_s: float) -> tuple[str, float, str, tuple[list[str], list[str]]]:
        """``(status, compile_ms, reason, (rejected, undetermined))``; status is ok, refused, error
        or timeout; the lists say where each rejected or undetermined instance stopped."""
        self._conn.send((schema, values))
        if self._conn.poll(timeout_s):
            return self._conn.recv()
        self.close()
        self._start()
        return ("timeout", 1000 * timeout_s, f"no result within {timeout_s:g} s", ([], []))

    def close(self) -> None:
        """Stop the worker and wait for it."""
        self._proc.kill()
        self._proc.join()
        self._conn.close()


def run_coverage(
    corpus: Path | str,
    tokenizer: Any,
    *,
    sample: int | None = None,
    timeout_s: float = 10.0,
    subsets: list[str] | None = None,
    backend: str = "outlines-core",
    lenient: bool = False,
    generate: int = 0,
    model: Any = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Coverage of a backend ("outlines-core" or "llguidance") over a JSONSchemaBench-style folder.

    Args:
        corpus: folder with ``<Subset>.jsonl`` (``{"id", "schema"}`` per line) and optionally
            ``valid_instances/<Subset>.jsonl`` (``{"id", "valid": [...]}``).
        tokenizer: the tokenizer whose vocabulary the constraints are compiled over.
        sample: schemas per subset (a seeded random sample); None for all.
        timeout_s: per-schema compile limit.
        generate: also generate with ``model`` (default: the embedded one) for this many
            compiled schemas and report how many outputs were schema-valid.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = Path(corpus)
    files = _corpus_files(corpus, subsets)
    if backend not in ("outlines-core", "llguidance"):
        raise ValueError(f"Invalid backend: expected 'outlines-core' or 'llguidance', got {backend!r}.")
    pool = _CompilePool(tokenizer, backend, lenient)
    tally = _Tally(backend, generate)
    results = []
    try:
        for path in files:
            results.append(_cover_subset(path, corpus, pool, tally, sample=sample, seed=seed, timeout_s=timeout_s,
                                         progress=progress))
    finally:
        pool.close()
    total = _total(results)
    generation = _generate_check(tally.compiled_schemas, model, backend, lenient) if generate else None
    return {
        "generation": generation,
        "backend": backend,
        "lenient": lenient,
        "layout": DEFAULT_JSON_WHITESPACE,
        "timeout_s": timeout_s,
        "sample": sample,
        "rows": [s.row() for s in results] + [total.row()],
        "top_refusal_reasons": tally.reasons.most_common(10),
        "top_relaxed_keywords": tally.relaxed.most_common(10),
        "rejected_instance_examples": [e for s in results for e in s.rejected_examples][:10],
        "median_compile_ms_all": statistics.median(total.compile_ms) if total.compile_ms else None,
    }


def _corpus_files(corpus: Path, subsets: list[str] | None) -> list[Path]:
    """The corpus's ``<Subset>.jsonl`` files (only ``subsets`` when given); none is an error."""
    files = sorted(corpus.glob("*.jsonl"))
    if subsets:
        files = [f for f in files if f.stem in subsets]
    if not files:
        raise ValueError(f"Invalid corpus: no <Subset>.jsonl files in {corpus}.")
    return files


def _subset_items(path: Path, corpus: Path, sample: int | None, seed: int) -> tuple[list[dict], dict[Any, list]]:
    """(the subset's schemas, a seeded sample of ``sample`` when given; its valid instances by id)."""
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if sample is not None and sample < len(items):
        items = random.Random(seed).sample(items, sample)
    instances = {}
    inst_path = corpus / "valid_instances" / path.name
    if inst_path.is_file():
        for line in inst_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                instances[rec["id"]] = rec["valid"]
    return items, instances


@dataclass
class _Tally:
    """What a run counts across subsets: refusal reasons, relaxed keywords, and the first
    ``generate`` compiled schemas (to generate from afterwards)."""

    backend: str
    generate: int
    reasons: Counter[str] = field(default_factory=Counter)
    relaxed: Counter[str] = field(default_factory=Counter)
    compiled_schemas: list[dict] = field(default_factory=list)

    def record(self, sub: SubsetCoverage, item_id: Any, schema: Any, values: list[Any],
               outcome: tuple[str, float, str, tuple[list[str], list[str]]]) -> None:
        """Count one schema's ``_CompilePool.run`` outcome into ``sub`` and the tally."""
        status, ms, error, (rejected, undetermined) = outcome
        if status == "refused":
            sub.refused += 1
            self.reasons[error] += 1
        elif status == "ok":
            sub.compiled += 1
            if len(self.compiled_schemas) < self.generate:
                self.compiled_schemas.append(schema.schema)
            if error:
                sub.relaxed += 1
                self.relaxed.update({re.sub(r"\s*\(\d+ times\)", "", w) for w in error.split("; ")})
            sub.compile_ms.append(ms)
            sub.instances_checked += len(values)
            sub.instances_rejected += len(rejected)
            sub.instances_undetermined += len(undetermined)
            sub.rejected_examples += [f"{item_id}: {t}" for t in rejected[:1]]
            sub.rejected_examples += [f"{item_id} (undetermined): {t}" for t in undetermined[:1]]
        elif status == "timeout":
            sub.timeouts += 1
            self.reasons["compile timeout"] += 1
        else:
            sub.errors += 1
            self.reasons[f"{self.backend}: {error[:80]}"] += 1


def _cover_subset(path: Path, corpus: Path, pool: _CompilePool, tally: _Tally, *, sample: int | None, seed: int,
                  timeout_s: float, progress: Callable[[str, int, int], None] | None) -> SubsetCoverage:
    """One subset's schemas, each compiled in ``pool`` with its valid instances checked."""
    items, instances = _subset_items(path, corpus, sample, seed)
    sub = SubsetCoverage(path.stem)
    for n, item in enumerate(items, start=1):
        sub.schemas += 1
        try:
            schema = load_schema(item["schema"])
        except ConstrainedSpecError as e:
            sub.refused += 1
            tally.reasons[type(e).__name__] += 1
            continue
        values = instances.get(item["id"], [])
        tally.record(sub, item["id"], schema, values, pool.run(schema, values, timeout_s))
        if progress is not None:
            progress(path.stem, n, len(items))
    return sub


def _total(results: list[SubsetCoverage]) -> SubsetCoverage:
    """The subsets' counts summed, as the "all" row."""
    total = SubsetCoverage("all")
    for sub in results:
        for name in ("schemas", "compiled", "refused", "timeouts", "errors", "relaxed", "instances_checked",
                     "instances_rejected", "instances_undetermined"):
            setattr(total, name, getattr(total, name) + getattr(sub, name))
        total.compile_ms += sub.compile_ms
    return total


def _generate_check(schemas: list[dict], model: Any, backend: str, lenient: bool) -> dict[str, Any]:
    """Generate one value per schema; count schema-valid outputs and the ways the others failed."""
    from ..api import generate_json

    outcomes: Counter[str] = Counter()
    for schema in schemas:
        prompt = "Write one realistic JSON value that follows this JSON schema.\n\n" + json.dumps(schema)[:3000]
        try:
            generate_json(model, schema, prompt, backend=backend, lenient=lenient, max_new_tokens=384)  # type: ignore[arg-type]
            outcomes["schema-valid"] += 1
        except ConstrainedSpecError as e:
            outcomes[type(e).__name__] += 1
    n = len(schemas)
    return {"schemas": n, "schema_valid_pct": round(100 * outcomes["schema-valid"] / n, 1) if n else None,
            "outcomes": dict(outcomes)}
