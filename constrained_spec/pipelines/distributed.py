"""Extraction on Ray Data: each actor runs the batch engine over its share of the documents.

``extract_dataset(ds, schema)`` maps the dataset's batches through a stateful class, so each actor
loads the model, compiles the schema and builds its ``BatchEngine`` once and keeps them for every
batch it is given (Ray Data's own LLM processors work the same way with vLLM). A document that
fails is a row with its error, never a failed job. Output rows, in input order within each block:
``id``, ``value`` (the validated record as JSON text, or null), ``error_kind``, ``error_message``
and ``stats`` (JSON text).

Resuming a killed job (``extract_to``/``--resume``): the ids already in the output folder are
read first and skipped; a file left half-written by the kill is unreadable and removed, so its
ids are done again. Ray Data's own checkpointing (``ray.data.checkpoint``) is alpha in the
versions we test with and is not used. An output folder that already holds results is refused
unless the run resumes them or replaces them (``overwrite``/``--overwrite``: its result files
are removed first), so an earlier run's results are never mixed with or lost to a new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidOptionError
from .extract import DEFAULT_PROMPT_TEMPLATE, cut_to_complete_lines

#: Output columns, in order.
COLUMNS = ("id", "value", "error_kind", "error_message", "stats")
#: CPUs Ray reserves for each read, filter and write task. They are light, and a whole CPU each
#: would deadlock a machine whose actors hold every core (the actors wait for input that no
#: read task can be scheduled to produce): give actors a little less than a core each, e.g.
#: two actors at ``num_cpus=0.75`` on two cores.
IO_TASK_CPUS = 0.25


class _Extractor:
    """The per-actor state: model, schema, options and one engine, made once per actor."""

    def __init__(self, schema: Any, model: Any, draft: Any, prompt_template: str, options: dict[str, Any],
                 engine_batch: int, id_column: str, text_column: str, threads: int | None) -> None:
        import torch

        from ..constraint import load_schema
        from ..batching import BatchEngine
        from ..decoding import SpecOptions
        from ..models import resolve_model

        if threads:
            torch.set_num_threads(threads)  # an actor's share of the node's cores, not all of them
        self.options = SpecOptions.build(**options)
        self.schema = load_schema(schema)
        self.handle = resolve_model(model)
        self.draft = draft
        self.template = prompt_template
        self.id_column, self.text_column = id_column, text_column
        self.engine = BatchEngine(self.handle.model, max_batch=engine_batch, precision=self.handle.precision,
                                  profile=self.options.profile, prefix_cache=self.options.prefix_cache)

    def __call__(self, batch: dict[str, Any]) -> Any:
        import pyarrow as pa

        from .extract import extract

        ids = [str(i) for i in batch[self.id_column]]
        docs = list(zip(ids, (str(t) for t in batch[self.text_column])))
        out: dict[str, list[Any]] = {c: [] for c in COLUMNS}
        for result in extract(self.schema, docs, model=self.handle, draft=self.draft, prompt_template=self.template,
                              engine=self.engine, options=self.options):
            record = result.to_record()
            out["id"].append(result.id)
            out["value"].append(json.dumps(record["value"]) if result.ok else None)
            out["error_kind"].append(result.error["kind"] if result.error else None)
            out["error_message"].append(result.error["message"] if result.error else None)
            out["stats"].append(json.dumps(result.stats) if result.stats else None)
        # Every column a string (null where absent) in every block, so the files of one output
        # folder share one schema even when a block has no error at all.
        return pa.table({c: pa.array(out[c], type=pa.string()) for c in COLUMNS})


def extract_dataset(ds: Any, schema: Any, *, model: Any = None, draft: Any = None, id_column: str = "id",
                    text_column: str = "text", batch_size: int = 16, concurrency: int = 1,
                    num_cpus: float | None = None, num_gpus: float | None = None,
                    prompt_template: str = DEFAULT_PROMPT_TEMPLATE, **options: Any) -> Any:
    """A ``ray.data.Dataset`` of one row per document of ``ds``: id, value, error, stats.

    Args:
        ds: a Ray dataset with ``id_column`` and ``text_column``.
        schema: as in ``extract`` (a pydantic class or a JSON schema; it travels to the actors).
        model: loaded by each actor (None: the embedded model; a ``ModelHandle`` is not
            shipped, give an id or path).
        draft: as in ``generate_json``, loaded by each actor.
        batch_size: documents per Ray batch and rows of each actor's engine.
        concurrency: actors (each holds a model; on one machine, at most one per core group).
        num_cpus: CPUs per actor (rounded, also its torch threads; leave ``IO_TASK_CPUS`` per
            node free for reading and writing).
        num_gpus: GPUs per actor.
        options: ``SpecOptions`` fields, checked here before anything runs.
    """
    import ray.data

    from ..decoding import SpecOptions

    SpecOptions.build(**options)  # refuse a bad option on the driver, not in every actor
    for name, value in (("batch_size", batch_size), ("concurrency", concurrency)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidOptionError(f"Invalid {name}: expected an integer >= 1, got {value!r}.")
    if "{text}" not in prompt_template:
        raise InvalidOptionError("Invalid prompt_template: it must contain '{text}' where the document goes.")
    columns = set(ds.columns() or [])
    missing = [c for c in (id_column, text_column) if c not in columns]
    if missing:
        raise InvalidOptionError(f"Invalid dataset: no column {missing[0]!r} (it has {sorted(columns)}); "
                                 "set id_column= / text_column=.")
    threads = max(1, round(num_cpus)) if num_cpus else None
    return ds.map_batches(
        _Extractor, batch_size=batch_size, batch_format="numpy",
        fn_constructor_args=(schema, model, draft, prompt_template, options, batch_size, id_column, text_column,
                             threads),
        compute=ray.data.ActorPoolStrategy(size=concurrency), num_cpus=num_cpus, num_gpus=num_gpus)


def read_input(path: Path | str) -> Any:
    """A Ray dataset from a JSONL file, a folder of JSONL files, or Parquet (file or folder)."""
    import ray.data

    p = Path(path)
    if not p.exists():
        raise InvalidOptionError(f"Invalid input: {p} does not exist.")
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    suffixes = {f.suffix for f in files if f.is_file()}
    light = {"num_cpus": IO_TASK_CPUS}
    if suffixes <= {".parquet"} and suffixes:
        return ray.data.read_parquet(str(p), ray_remote_args=light)
    if suffixes <= {".jsonl", ".json"} and suffixes:
        paths = str(p) if p.is_file() else [str(f) for f in files if f.suffix in (".jsonl", ".json")]
        return ray.data.read_json(paths, lines=True, ray_remote_args=light)
    raise InvalidOptionError(f"Invalid input: {p} must be a JSONL file, a folder of JSONL files, or Parquet "
                             f"(found {sorted(suffixes) or 'no files'}).")


def done_ids(output: Path | str, fmt: str) -> set[str]:
    """Ids already written under ``output`` (for ``--resume``). A JSONL file the kill cut
    mid-write keeps its whole lines (the partial last one is cut off); a file that cannot be
    read at all (a Parquet file without its footer, an empty file) is removed, so its documents
    are done again."""
    out = Path(output)
    ids: set[str] = set()
    if not out.exists():
        return ids
    for f in sorted(out.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                found = [str(i) for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
            else:
                found = [str(json.loads(line)["id"]) for line in cut_to_complete_lines(f) if line.strip()]
        except Exception:  # unreadable: its rows are redone
            found = []
        if found:
            ids.update(found)
        else:
            f.unlink()
    return ids


#: The suffixes of the result files Ray Data writes (``write_parquet``, ``write_json``): what
#: ``overwrite`` removes from an output folder.
RESULT_SUFFIXES = (".parquet", ".json", ".jsonl")


def check_output_folder(output: Path | str, fmt: str, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse an output that would mix or lose results, before anything runs: a format other
    than parquet or jsonl, an output that is not a folder, ``resume`` with ``overwrite``, and a
    folder that already holds something without one of them."""
    if fmt not in ("parquet", "jsonl"):
        raise InvalidOptionError(f"Invalid output format: expected 'parquet' or 'jsonl', got {fmt!r}.")
    if resume and overwrite:
        raise InvalidOptionError("Invalid options: --resume (continue the results in the output) and --overwrite "
                                 "(replace them) cannot be used together; choose one.")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise InvalidOptionError(f"Invalid output: {out} exists and is not a folder.")
    if out.exists() and any(out.iterdir()) and not (resume or overwrite):
        raise InvalidOptionError(f"Invalid output: {out} already holds results; pass --resume to continue them, "
                                 "--overwrite to replace them (resume=True / overwrite=True in Python), or choose "
                                 "an empty folder.")


def prepare_output_folder(output: Path | str, fmt: str, *, resume: bool = False, overwrite: bool = False) -> set[str]:
    """Check the output (``check_output_folder``), remove its result files with ``overwrite``
    (files of other kinds stay), and return the ids already done (``done_ids``) with ``resume``."""
    check_output_folder(output, fmt, resume=resume, overwrite=overwrite)
    out = Path(output)
    if overwrite and out.is_dir():
        for f in out.iterdir():
            if f.is_file() and not f.name.startswith(".") and f.suffix in RESULT_SUFFIXES:
                f.unlink()
    return done_ids(out, fmt) if resume else set()


def extract_to(input_path: Path | str, output: Path | str, schema: Any, *, fmt: str = "parquet", resume: bool = False,
               overwrite: bool = False, **kwargs: Any) -> dict[str, int]:
    """``extract_dataset`` from a file or folder to an output folder (``fmt`` "parquet" or
    "jsonl"); with ``resume``, only ids not yet in the output; with ``overwrite``, the output's
    earlier result files are removed first (a folder holding anything is refused without one of
    the two). Returns counts."""
    out = Path(output)
    check_output_folder(out, fmt, resume=resume, overwrite=overwrite)
    id_column = kwargs.get("id_column", "id")
    ds = read_input(input_path)
    total = ds.count()
    # Only now, with the input read, are earlier results removed (overwrite) or read (resume).
    skip = prepare_output_folder(out, fmt, resume=resume, overwrite=overwrite)
    if skip:
        import warnings

        with warnings.catch_warnings():  # Ray suggests an expression filter; a set of ids is not one
            warnings.simplefilter("ignore", UserWarning)
            ds = ds.filter(lambda row: str(row[id_column]) not in skip, num_cpus=IO_TASK_CPUS)
    result = extract_dataset(ds, schema, **kwargs)
    os.makedirs(out, exist_ok=True)
    if fmt == "parquet":
        result.write_parquet(str(out), ray_remote_args={"num_cpus": IO_TASK_CPUS})
    else:
        result.write_json(str(out), ray_remote_args={"num_cpus": IO_TASK_CPUS})
    return {"documents": total, "skipped": len(skip), "written": total - len(skip)}
