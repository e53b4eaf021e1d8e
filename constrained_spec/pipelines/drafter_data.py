"""Prompts for training and evaluating a draft head: extraction and generation, from real schemas.

Two kinds of prompt, because a drafter meets both:

- *generation*: "Write a realistic example JSON object for this JSON schema: <schema>" (the
  values come from the model, not from the prompt: what a learned draft is for);
- *extraction*: a short document rendered from one of the schema's valid instances, and the
  request to extract it as JSON (the values are in the prompt: copy drafts cover much of it).

Training data comes from the JSONSchemaBench subsets *except* Glaiveai2K, which is reserved for
evaluation (``generation_workload`` builds the bench's held-out prompts from it), and from the
repository's own example prompts. Schemas are kept small enough that a prompt stays a few
hundred tokens. A training row carries its schema's valid instances as ``references`` (for an
extraction prompt, the instance its document describes): answers the target's prompt pass can
read in one forward, where decoding one costs a forward a token (``pipelines.train_drafter``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

#: The subset reserved for evaluating trained drafters: never train on it.
HELD_OUT_SUBSET = "Glaiveai2K"
GENERATION_TEMPLATE = "Write a realistic example JSON object for this JSON schema:\n{schema}"
EXTRACTION_TEMPLATE = ("Extract the record described below as JSON matching this schema:\n{schema}\n\n"
                       "Text:\n{document}")
#: Schemas longer than this (compact JSON characters) are skipped: the prompt would dominate.
MAX_SCHEMA_CHARS = 1500
_PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"


#: The kinds of training prompt: an example object for a schema, or a document's values extracted.
PROMPT_KINDS = ("generation", "extraction")


def default_data_dir() -> Path:
    """Where the JSONSchemaBench subsets are (``$CONSTRAINED_SPEC_SCHEMA_DATA`` or ../shared/data)."""
    import os

    env = os.environ.get("CONSTRAINED_SPEC_SCHEMA_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "data" / "jsonschemabench"
        if candidate.is_dir():
            return candidate
    return Path("../shared/data/jsonschemabench")


def _compact(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def describe(value: Any, path: str = "") -> list[str]:
    """A JSON value as the lines of a plain document ("shipping address city: Lyon")."""
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in describe(v, f"{path} {k}".strip())]
    if isinstance(value, list):
        return [line for i, v in enumerate(value, 1) for line in describe(v, f"{path} {i}".strip())]
    text = value if isinstance(value, str) else json.dumps(value)
    return [f"{path or 'value'}: {text}"]


def _subset_rows(data_dir: Path, subset: str) -> Iterator[dict[str, Any]]:
    path = data_dir / f"{subset}.jsonl"
    if path.is_file():
        with path.open() as f:
            for line in f:
                yield json.loads(line)


def _instances(data_dir: Path, subset: str) -> dict[str, list[Any]]:
    return {row["id"]: row["valid"] for row in _subset_rows(data_dir / "valid_instances", subset)}


def subsets(data_dir: Path) -> list[str]:
    """The subset names present in ``data_dir``."""
    return sorted(p.stem for p in data_dir.glob("*.jsonl"))


def schema_prompts(data_dir: Path, subset_names: list[str], *, per_subset: int, seed: int = 0,
                   kinds: tuple[str, ...] = PROMPT_KINDS, references: bool = False) -> list[dict[str, Any]]:
    """Up to ``per_subset`` prompts of each kind from each named subset (small object schemas,
    a seeded sample); rows ``{"id", "kind", "prompt", "schema"}``, with ``references`` also
    ``"references"`` where the schema has valid instances: all of them for a generation prompt,
    the one its document describes for an extraction prompt."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for subset in subset_names:
        candidates = [r for r in _subset_rows(data_dir, subset)
                      if isinstance(r["schema"], dict) and r["schema"].get("type") == "object"
                      and len(_compact(r["schema"])) <= MAX_SCHEMA_CHARS]
        rng.shuffle(candidates)
        instances = _instances(data_dir, subset) if "extraction" in kinds or references else {}
        for kind in kinds:
            pool = candidates if kind == "generation" else [r for r in candidates if instances.get(r["id"])]
            for r in pool[:per_subset]:
                schema = _compact(r["schema"])
                answers = instances.get(r["id"], [])
                if kind == "generation":
                    prompt = GENERATION_TEMPLATE.format(schema=schema)
                else:
                    answers = answers[:1]
                    document = "\n".join(describe(answers[0]))[:MAX_SCHEMA_CHARS]
                    prompt = EXTRACTION_TEMPLATE.format(schema=schema, document=document)
                row = {"id": f"{subset}/{r['id']}/{kind}", "kind": kind, "prompt": prompt, "schema": r["schema"]}
                if references and answers:
                    row["references"] = answers
                rows.append(row)
    return rows


def repository_prompts() -> list[dict[str, Any]]:
    """The repository's own example prompts (the bench's extraction tasks and the people set)."""
    rows = []
    for name in ("extraction.jsonl", "people.jsonl"):
        path = _PACKAGE_DATA / name
        if path.is_file():
            for i, line in enumerate(path.read_text().splitlines()):
                r = json.loads(line)
                if "prompt" in r and "schema" in r:
                    rows.append({"id": f"repo/{name}/{r.get('id', i)}", "kind": "extraction",
                                 "prompt": r["prompt"], "schema": r["schema"]})
    return rows


def training_prompts(data_dir: Path | str | None = None, *, per_subset: int = 40, seed: int = 0,
                     kinds: tuple[str, ...] = PROMPT_KINDS) -> list[dict[str, Any]]:
    """The training prompts: every subset but ``HELD_OUT_SUBSET``, of ``kinds`` (the same
    schemas for a kind whichever others are asked), with their schemas' valid instances as
    references, and with extraction the repository's examples (extraction prompts: the bench's
    among them)."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    names = [s for s in subsets(data_dir) if s != HELD_OUT_SUBSET]
    examples = repository_prompts() if "extraction" in kinds else []
    return schema_prompts(data_dir, names, per_subset=per_subset, seed=seed, kinds=kinds, references=True) + examples


def generation_workload(data_dir: Path | str | None = None, *, limit: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """The held-out generation prompts of the bench: ``limit`` Glaiveai2K schemas, never trained on."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    return schema_prompts(data_dir, [HELD_OUT_SUBSET], per_subset=limit, seed=seed, kinds=("generation",))


def write_jsonl(rows: list[dict[str, Any]], path: Path | str) -> Path:
    """Write ``rows`` one JSON object per line."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out
