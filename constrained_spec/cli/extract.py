"""extract: typed records from a JSONL of documents, in process or on Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import InvalidOptionError
from .common import AdaptiveOpt, app, BackendOpt, DrafterOpt, DraftOpt, DtypeOpt, err, KOpt, LenientOpt, MaxOpt, _model_arg, ModelOpt, _options, PrecisionOpt, ProfileOpt, _run_guarded, _schema_arg, SeedOpt, ServerOpt, TempOpt, WhitespaceOpt, ClosedOpt


@app.command("extract")
def extract_cmd(
    schema: str = typer.Option(..., "--schema", help="module:Class or file.py:Class of a pydantic model, or a JSON schema file."),
    input: Path = typer.Option(..., "--input", "-i", help="JSONL of {id, text} per line, or a folder (one document per file, the file name its id)."),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL to write: {id, value, stats} or {id, error: {kind, message}} per line."),
    resume: bool = typer.Option(False, "--resume", help="Skip ids already in the output file and append the rest."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an output that already holds records (without it, or --resume, such an output is refused)."),
    prompt_template: Optional[Path] = typer.Option(None, "--prompt-template", help="File with a template using {text}, {fields}, {schema}."),
    batch_size: int = typer.Option(1, "--batch-size", help="Documents decoded together in the batch engine (one forward per step for all, each speculating); 1: one by one."),
    model: Optional[str] = ModelOpt,
    draft: Optional[str] = DraftOpt,
    drafter: str = DrafterOpt,
    temperature: float = TempOpt,
    seed: Optional[int] = SeedOpt,
    max_new_tokens: int = MaxOpt,
    k_max: Optional[int] = KOpt,
    profile: Optional[str] = ProfileOpt,
    adaptive: bool = AdaptiveOpt,
    dtype: Optional[str] = DtypeOpt,
    precision: Optional[str] = PrecisionOpt,
    backend: str = BackendOpt,
    lenient: bool = LenientOpt,
    whitespace: str = WhitespaceOpt,
    closed: bool = ClosedOpt,
    server: Optional[str] = ServerOpt,
    engine: str = typer.Option("local", "--engine", help="local (this process) or ray (Ray Data actors, each running the batch engine; --output is then a folder)."),
    concurrency: int = typer.Option(1, "--concurrency", help="With --engine ray: actors, each holding a model."),
    num_cpus: Optional[float] = typer.Option(None, "--num-cpus", help="With --engine ray: CPUs per actor (also its torch threads)."),
    num_gpus: Optional[float] = typer.Option(None, "--num-gpus", help="With --engine ray: GPUs per actor."),
    address: Optional[str] = typer.Option(None, "--address", envvar="RAY_ADDRESS", help="With --engine ray: the Ray cluster to join (default: a local one)."),
    output_format: str = typer.Option("parquet", "--output-format", help="With --engine ray: parquet or jsonl files in the --output folder."),
) -> None:
    """Extract one typed record per document, with a progress bar and a summary.

    Example: constrained-spec extract --schema examples/people.py:Person --input examples/documents --output people.jsonl

    On Ray Data (input: JSONL, a folder of JSONL, or Parquet; output: a folder):
    constrained-spec extract --engine ray --schema schemas/person.json --input docs.jsonl --output out/ --concurrency 2 --num-cpus 1
    """
    decoding = dict(drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, k_max=k_max,
                    profile=profile, adaptive=adaptive, backend=backend, lenient=lenient, whitespace=whitespace,
                    closed=closed)
    if engine == "ray":
        _run_guarded(lambda: _extract_on_ray(
            schema, input, output, resume=resume, overwrite=overwrite,
            template=prompt_template.read_text() if prompt_template else None,
            fmt=output_format, address=address, model=model, draft=draft, batch_size=batch_size,
            concurrency=concurrency, num_cpus=num_cpus, num_gpus=num_gpus, options=decoding))
        return
    if engine != "local":
        err.print(f"[red]error:[/] Invalid --engine: expected local or ray, got {engine!r}.")
        raise typer.Exit(2)
    _run_guarded(lambda: _extract_locally(schema, input, output, resume=resume, overwrite=overwrite,
                                          prompt_template=prompt_template, batch_size=batch_size, model=model,
                                          dtype=dtype, precision=precision, draft=draft, server=server,
                                          decoding=decoding))


def _check_output_file(output: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything loads, an output that would lose records: ``--resume`` with
    ``--overwrite``, a folder, and a file that already holds records without one of the two (an
    empty or blank file holds none and is overwritten silently)."""
    if resume and overwrite:
        raise InvalidOptionError("Invalid options: --resume (continue the records in --output) and --overwrite "
                                 "(replace them) cannot be used together; choose one.")
    if output.is_dir():
        raise InvalidOptionError(f"Invalid --output: {output} is a folder; --engine local writes one JSONL file "
                                 "(a folder is --engine ray's output).")
    if resume or overwrite or not output.is_file():
        return
    with output.open("rb") as fh:
        holds_records = any(line.strip() for line in fh)
    if holds_records:
        raise InvalidOptionError(f"Invalid --output: {output} already holds records; pass --resume to skip their ids "
                                 "and append the rest, or --overwrite to replace the file.")


def _extract_locally(schema: str, input: Path, output: Path, *, resume: bool, overwrite: bool,
                     prompt_template: Optional[Path], batch_size: int, model: Optional[str], dtype: Optional[str],
                     precision: Optional[str], draft: Optional[str], server: Optional[str],
                     decoding: dict[str, Any]) -> None:
    """``extract --engine local``: in this process (or on ``server``), with a progress bar and a
    summary; exits 1 when a document failed."""
    from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE, JsonlWriter, extract, read_documents

    _check_output_file(output, resume=resume, overwrite=overwrite)  # before any model or schema work
    options = _options(**decoding)
    spec = _schema_arg(schema)
    template = prompt_template.read_text() if prompt_template else DEFAULT_PROMPT_TEMPLATE
    if not input.exists():
        raise ValueError(f"Invalid input: {input} does not exist.")
    docs = list(read_documents(input))
    writer = JsonlWriter(output, resume=resume)
    todo = [(i, t) for i, t in docs if i not in writer.done_ids]
    if len(todo) < len(docs):
        err.print(f"[dim]resume: {len(docs) - len(todo)} of {len(docs)} documents already in {output}[/]")
    if server:  # the running server decodes; --batch-size requests are in flight at once
        import os

        results = extract(spec, todo, prompt_template=template, batch_size=batch_size, options=options,
                          server=server, api_key=os.environ.get("CONSTRAINED_SPEC_API_KEY"))
    else:
        results = extract(spec, todo, model=_model_arg(model, dtype, precision), draft=draft,
                          prompt_template=template, batch_size=batch_size, options=options)
    summary = _run_with_progress(results, len(todo), writer)
    Console(stderr=True).print(_summary_table(summary, output))
    if summary["failed"]:
        raise typer.Exit(1) from None


def _extract_on_ray(schema: str, input: Path, output: Path, *, resume: bool, overwrite: bool, template: Optional[str],
                    fmt: str, address: Optional[str], model: Optional[str], draft: Optional[str], batch_size: int,
                    concurrency: int, num_cpus: Optional[float], num_gpus: Optional[float],
                    options: dict[str, Any]) -> None:
    """``extract --engine ray``: Ray Data actors from files to an output folder."""
    import time

    try:
        import ray
    except ImportError:
        raise InvalidOptionError("--engine ray needs the ray extra: pip install 'constrained_spec\\[ray]'") from None
    from ..pipelines.distributed import check_output_folder, extract_to
    from ..pipelines.extract import DEFAULT_PROMPT_TEMPLATE

    check_output_folder(output, fmt, resume=resume, overwrite=overwrite)  # before Ray starts
    spec = _schema_arg(schema)  # a pydantic class travels to the actors by value (cloudpickle)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    t0 = time.perf_counter()
    counts = extract_to(input, output, spec, fmt=fmt, resume=resume, overwrite=overwrite, model=model, draft=draft,
                        batch_size=max(batch_size, 1), concurrency=concurrency, num_cpus=num_cpus, num_gpus=num_gpus,
                        prompt_template=template or DEFAULT_PROMPT_TEMPLATE, **options)
    seconds = time.perf_counter() - t0
    err.print(f"{counts['written']} documents written to {output} ({counts['skipped']} already there) in "
              f"{seconds:.1f} s: {counts['written'] / seconds:.2f} documents/s")


def _summary_table(summary: dict[str, Any], output: Path) -> Table:
    table = Table(title=f"extraction summary ({output})", show_header=False)
    for key, value in summary.items():
        if key == "failures_by_kind":
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
        table.add_row(key.replace("_", " "), str(value))
    return table


def _run_with_progress(results: Any, total: int, writer: Any) -> dict[str, Any]:
    """Write each result as it comes, with a progress bar showing tokens/s and acceptance."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..pipelines.extract import Summary

    summary = Summary()
    with Progress(TextColumn("[bold]extract"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[speed]}"), console=err, transient=False) as bar:
        task = bar.add_task("extract", total=total, speed="")
        for result in results:
            writer.write(result.to_record())
            summary.add(result)
            bar.update(task, advance=1, speed=summary.progress_line())
    return summary.as_dict()
