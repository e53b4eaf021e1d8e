"""The ``constrained-spec`` command line: json, regex, demo, extract, coverage and bench.

Exit codes: 0 success; 2 bad usage or bad input (invalid schema, pattern, prompt, option);
1 generation failure (token limit reached, output failed validation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import (
    ConstrainedSpecError, InvalidOptionError, InvalidSchemaError, ModelLoadError, OutputValidationError, TokenLimitError,
)

app = typer.Typer(
    help="Fast, exact structured output: schema- and regex-constrained generation with speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # long messages stay whole lines (and greppable)

EXAMPLE_PROMPT = (
    "Extract the person described below as JSON with the fields name, age, city and occupation.\n\n"
    "Text: Maria Gonzalez is a 34-year-old architect who lives in Barcelona. She designs public libraries."
)

ModelOpt = typer.Option(None, "--model", "-m", help="Model id or local path; default: the embedded SmolLM2-135M-Instruct.")
def _draft_value(value: Optional[str]) -> Any:
    """--draft none: no learned draft; --draft shipped: the head the package ships for the model."""
    if isinstance(value, str) and value.lower() in ("none", "off", "false"):
        return False
    return True if isinstance(value, str) and value.lower() == "shipped" else value


DraftOpt = typer.Option(None, "--draft", callback=_draft_value, help="What auto drafts with besides forced text, copies and lookup (default: the corpus of the model's own outputs the package ships for it): shipped (the shipped draft head too), a directory from train-drafter (its head and corpus), a draft model id or path (same tokenizer), or none (nothing learned).")
DrafterOpt = typer.Option("auto", "--drafter", help="none | model | head | lookup | grammar | hybrid | auto (= hybrid: forced text, copy from the prompt, lookup, the shipped corpus, then the head / --draft).")
TempOpt = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples exactly from the masked target.")
SeedOpt = typer.Option(None, "--seed", help="Seed for sampling.")
MaxOpt = typer.Option(512, "--max-new-tokens", help="Generation limit.")
KOpt = typer.Option(None, "--k-max", help="The most tokens verified per step (default: from the hardware / task profile, see --profile).")
StatsOpt = typer.Option(False, "--stats", help="Print speed figures to stderr.")
BackendOpt = typer.Option("auto", "--backend", help="Constraint backend: auto (llguidance), llguidance or outlines-core.")
StreamOpt = typer.Option(False, "--stream", help="Print the text as tokens are accepted.")
ProfileOpt = typer.Option(None, "--profile", help="Hardware profile for K_max: cpu, a100-80gb, h100-80gb, h100-80gb-x8, gb200-nvl72 (default: $CONSTRAINED_SPEC_PROFILE or detected).")
AdaptiveOpt = typer.Option(True, "--adaptive/--no-adaptive", help="Choose K per step from measured acceptance and cost (--no-adaptive: K = k-max every step).")
DtypeOpt = typer.Option(None, "--dtype", help="Model dtype, e.g. float32 or bfloat16 (default: float32 on CPU, bfloat16 on GPU).")
PrecisionOpt = typer.Option(None, "--precision", help="native (the embedded GGUF's 4-bit layers on the int4 kernel; the CPU default), float32 or bfloat16 (the GPU default).")
WhitespaceOpt = typer.Option("canonical", "--whitespace", help="JSON layout: canonical (json.dumps style), flexible, compact, or a whitespace regex.")
LenientOpt = typer.Option(False, "--lenient", help="llguidance: relax keywords it cannot enforce (listed with --stats); the output is still validated.")
PromptOpt = typer.Option(None, "--prompt", "-p", help="The prompt; read from standard input when omitted.")
ServerOpt = typer.Option(None, "--server", envvar="CONSTRAINED_SPEC_SERVER", help="Send the request to a running 'constrained-spec serve' at this URL (no model load here; its key from $CONSTRAINED_SPEC_API_KEY).")


def _prompt_text(prompt: Optional[str]) -> str:
    if prompt is not None:
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        err.print("[red]error:[/] give --prompt TEXT or pipe the prompt on standard input")
        raise typer.Exit(2) from None
    return sys.stdin.read()


def _print_stats(stats: Any) -> None:
    s = dataclasses.asdict(stats)
    err.print(
        f"[dim]{s['output_tokens']} tokens in {s['total_seconds']:.2f}s ({s['tokens_per_second']:.1f} tok/s), "
        f"{s['target_forwards']} target forwards ({s['forwards_per_token']:.2f}/token), drafter {s['drafter']}, "
        f"backend {s['backend']}{' (relaxed: ' + ', '.join(s['relaxed']) + ')' if s['relaxed'] else ''}, "
        f"profile {s['profile']} (K_max {s['k_max']}, {s['k_policy']}), acceptance {s['acceptance_rate']:.2f}, "
        f"K per step {s['ks'][:40]}{'...' if len(s['ks']) > 40 else ''}[/]"
    )


def _print_stream(stream: Any, stats: bool) -> None:
    """Print pieces as they come; on failure the partial line is already out, the error follows."""
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if stats and stream.stats is not None:
        _print_stats(stream.stats)


def _run_guarded(fn: Any) -> Any:
    """Map errors to exit codes: 2 for bad input, 1 for a generation that failed."""
    try:
        return fn()
    except (TokenLimitError, OutputValidationError) as e:
        err.print(f"[red]generation failed:[/] {e}")
        raise typer.Exit(1) from None
    except (ConstrainedSpecError, ValueError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None


@app.command("json")
def json_cmd(
    schema: str = typer.Argument(..., help="JSON schema: a file path, JSON text, or module:Class / file.py:Class of a pydantic model."),
    prompt: Optional[str] = PromptOpt,
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
    stats: bool = StatsOpt,
    stream: bool = StreamOpt,
    server: Optional[str] = ServerOpt,
) -> None:
    """Generate JSON that validates against SCHEMA and print it.

    Example: constrained-spec json schemas/person.json --prompt "Extract: Maria, 34, architect in Barcelona" --stats
    """
    text = _prompt_text(prompt)

    def render(value: Any) -> str:
        if hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        return json.dumps(value, ensure_ascii=False)

    if server:
        from . import remote

        _run_guarded(lambda: _remote_and_print(
            server, remote.json_constraint(remote.schema_dict(_schema_arg(schema)), lenient), text,
            lambda t: render(json.loads(t)), stream=stream, stats=stats, temperature=temperature, seed=seed,
            max_new_tokens=max_new_tokens, drafter=drafter, k_max=k_max, adaptive=adaptive))
        return
    from .api import generate_json

    _run_guarded(lambda: _generate_and_print(
        generate_json, _schema_arg(schema), text, render, stream=stream, stats=stats, model=_model_arg(model, dtype, precision),
        draft=draft, options=_options(drafter=drafter, temperature=temperature, seed=seed,
                                      max_new_tokens=max_new_tokens, k_max=k_max, profile=profile, adaptive=adaptive,
                                      backend=backend, lenient=lenient, whitespace=whitespace)))


def _options(**values: Any) -> Any:
    """The command's ``SpecOptions``, validated in the one place every caller uses."""
    from .decoding import SpecOptions

    return SpecOptions.build(**values)


def _generate_and_print(generate: Any, target: Any, prompt: str, render: Any, *, stream: bool, stats: bool,
                        model: Any, draft: Any, options: Any) -> None:
    """Run ``generate_json`` / ``generate_regex`` for a command: streamed or whole, stats on stderr."""
    if stream:
        _print_stream(generate(model, target, prompt, draft=draft, options=options, stream=True), stats)
        return
    value, st = generate(model, target, prompt, draft=draft, options=options, return_stats=True)
    print(render(value))
    if stats:
        _print_stats(st)


def _remote_and_print(server: str, constraint: dict[str, Any], prompt: str, render: Any, *, stream: bool,
                      stats: bool, **options: Any) -> None:
    """``json`` / ``regex`` through a running server (``--server``)."""
    import os

    from . import remote

    body = remote.chat_body(prompt, constraint=constraint, stream=stream, **options)
    key = os.environ.get("CONSTRAINED_SPEC_API_KEY")
    if stream:
        try:
            for piece in remote.stream(server, body, api_key=key):
                sys.stdout.write(piece)
                sys.stdout.flush()
        finally:
            sys.stdout.write("\n")
        return
    text, reply = remote.generate(server, body, api_key=key)
    print(render(text))
    if stats:
        figures = reply.get("constrained_spec", {})
        err.print(f"[dim]server {server}: " + ", ".join(f"{k} {v}" for k, v in figures.items()) + "[/]")


def _model_arg(model: Optional[str], dtype: Optional[str], precision: Optional[str] = None) -> Any:
    """The model as given, or loaded now when a dtype or precision is asked for."""
    if dtype is None and precision is None:
        return model
    from .models import load_model

    return load_model(model, dtype=dtype, precision=precision)


def _schema_arg(schema: str) -> Any:
    """A pydantic class for ``module:Class``; otherwise the text or path as given."""
    if ":" in schema and not schema.lstrip().startswith("{") and not Path(schema).exists():
        import importlib
        import importlib.util

        module, _, cls = schema.rpartition(":")
        try:
            if module.endswith(".py"):  # a file path: load it as a module
                spec = importlib.util.spec_from_file_location(Path(module).stem, module)
                if spec is None or spec.loader is None or not Path(module).is_file():
                    raise ImportError(f"no such file {module}")
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
            else:
                mod = importlib.import_module(module)
            return getattr(mod, cls)
        except (ImportError, AttributeError) as e:
            raise InvalidSchemaError(f"Invalid schema: cannot import {schema!r} ({e}).") from None
    return schema


@app.command("regex")
def regex_cmd(
    pattern: str = typer.Argument(..., help="Regular expression the whole output must match."),
    prompt: Optional[str] = PromptOpt,
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
    stats: bool = StatsOpt,
    stream: bool = StreamOpt,
    server: Optional[str] = ServerOpt,
) -> None:
    """Generate a string that fully matches PATTERN and print it.

    Example: constrained-spec regex '[0-9]{3}-[0-9]{4}' --prompt "A phone extension:"
    """
    text = _prompt_text(prompt)
    if server:
        from . import remote

        _run_guarded(lambda: _remote_and_print(
            server, remote.regex_constraint(pattern), text, str, stream=stream, stats=stats, temperature=temperature,
            seed=seed, max_new_tokens=max_new_tokens, drafter=drafter, k_max=k_max, adaptive=adaptive))
        return
    from .api import generate_regex

    _run_guarded(lambda: _generate_and_print(
        generate_regex, pattern, text, str, stream=stream, stats=stats, model=_model_arg(model, dtype, precision),
        draft=draft, options=_options(drafter=drafter, temperature=temperature, seed=seed,
                                      max_new_tokens=max_new_tokens, k_max=k_max, profile=profile, adaptive=adaptive,
                                      backend=backend)))


@app.command("demo")
def demo_cmd() -> None:
    """The main job in one command: generate_json on the embedded model, target-only and speculative.

    Prints the extracted object and the speed figures of both runs.
    """
    from .api import generate_json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                       "occupation": {"type": "string"}},
        "required": ["name", "age", "city", "occupation"],
    }

    def go() -> None:
        generate_json(None, {"type": "boolean"}, "Is water wet?", drafter="none", max_new_tokens=4)  # warm-up
        base, s0 = generate_json(None, schema, EXAMPLE_PROMPT, drafter="none", return_stats=True)
        value, s1 = generate_json(None, schema, EXAMPLE_PROMPT, drafter="auto", return_stats=True)
        print(json.dumps(value, ensure_ascii=False, indent=2))
        for label, st in (("target-only", s0), ("speculative", s1)):
            err.print(f"[bold]{label}[/]", end=": ")
            _print_stats(st)
        err.print(f"speedup {s1.tokens_per_second / s0.tokens_per_second:.2f}x; identical output: {value == base}")

    _run_guarded(go)


@app.command("extract")
def extract_cmd(
    schema: str = typer.Option(..., "--schema", help="module:Class or file.py:Class of a pydantic model, or a JSON schema file."),
    input: Path = typer.Option(..., "--input", "-i", help="JSONL of {id, text} per line, or a folder (one document per file, the file name its id)."),
    output: Path = typer.Option(..., "--output", "-o", help="JSONL to write: {id, value, stats} or {id, error: {kind, message}} per line."),
    resume: bool = typer.Option(False, "--resume", help="Skip ids already in the output file and append the rest."),
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
    from .pipelines.extract import DEFAULT_PROMPT_TEMPLATE, JsonlWriter, extract, read_documents

    if engine == "ray":
        _run_guarded(lambda: _extract_on_ray(
            schema, input, output, resume=resume, template=prompt_template.read_text() if prompt_template else None,
            fmt=output_format, address=address, model=model, draft=draft, batch_size=batch_size,
            concurrency=concurrency, num_cpus=num_cpus, num_gpus=num_gpus,
            options=dict(drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                         k_max=k_max, profile=profile, adaptive=adaptive, backend=backend, lenient=lenient,
                         whitespace=whitespace)))
        return
    if engine != "local":
        err.print(f"[red]error:[/] Invalid --engine: expected local or ray, got {engine!r}.")
        raise typer.Exit(2)

    def go() -> None:
        options = _options(drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                           k_max=k_max, profile=profile, adaptive=adaptive, backend=backend, lenient=lenient,
                           whitespace=whitespace)
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

    _run_guarded(go)


def _extract_on_ray(schema: str, input: Path, output: Path, *, resume: bool, template: Optional[str], fmt: str,
                    address: Optional[str], model: Optional[str], draft: Optional[str], batch_size: int,
                    concurrency: int, num_cpus: Optional[float], num_gpus: Optional[float],
                    options: dict[str, Any]) -> None:
    """``extract --engine ray``: Ray Data actors from files to an output folder."""
    import time

    try:
        import ray
    except ImportError:
        raise InvalidOptionError("--engine ray needs the ray extra: pip install 'constrained_spec\\[ray]'") from None
    from .pipelines.distributed import extract_to
    from .pipelines.extract import DEFAULT_PROMPT_TEMPLATE

    spec = _schema_arg(schema)  # a pydantic class travels to the actors by value (cloudpickle)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    t0 = time.perf_counter()
    counts = extract_to(input, output, spec, fmt=fmt, resume=resume, model=model, draft=draft,
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

    from .pipelines.extract import Summary

    summary = Summary()
    with Progress(TextColumn("[bold]extract"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[speed]}"), console=err, transient=False) as bar:
        task = bar.add_task("extract", total=total, speed="")
        for result in results:
            writer.write(result.to_record())
            summary.add(result)
            bar.update(task, advance=1, speed=summary.progress_line())
    return summary.as_dict()


@app.command("coverage")
def coverage_cmd(
    corpus: Path = typer.Argument(..., help="Folder of <Subset>.jsonl schemas (+ valid_instances/), e.g. ../shared/data/jsonschemabench."),
    sample: Optional[int] = typer.Option(None, "--sample", help="Schemas per subset (seeded random sample); default all."),
    timeout_s: float = typer.Option(10.0, "--timeout", help="Per-schema compile limit in seconds."),
    subset: Optional[list[str]] = typer.Option(None, "--subset", help="Only these subsets (repeatable)."),
    backend: list[str] = typer.Option(["outlines-core", "llguidance"], "--backend", help="Backends to measure (repeatable)."),
    lenient: bool = typer.Option(False, "--lenient", help="llguidance: relax unimplemented keywords (listed) instead of refusing."),
    generate: int = typer.Option(0, "--generate", help="Also generate with the model for this many compiled schemas; report schema-valid %."),
    model: Optional[str] = ModelOpt,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this file."),
) -> None:
    """Compile coverage, compile time and refusal reasons per subset; valid instances checked against each constraint.

    Example: constrained-spec coverage ../shared/data/jsonschemabench --sample 50 --timeout 10
    """
    from .pipelines.coverage import run_coverage
    from .models import resolve_model

    def go() -> None:
        if not corpus.is_dir():
            raise ValueError(f"Invalid corpus: {corpus} is not a folder.")
        handle = resolve_model(model)
        reports = []
        out = Console(width=max(160, Console().width))
        for be in backend:
            report = run_coverage(corpus, handle.tokenizer, sample=sample, timeout_s=timeout_s, subsets=subset,
                                  backend=be, lenient=lenient, generate=generate, model=handle,
                                  progress=lambda name, i, n: err.print(f"[dim]{name} {i}/{n}[/]", end="\r"))
            err.print()
            reports.append(report)
            mode = " (lenient)" if lenient and be == "llguidance" else ""
            table = Table(title=f"schema coverage: {be}{mode}, layout {report['layout']}, timeout {timeout_s:g} s")
            cols = {"subset": "subset", "schemas": "schemas", "compiled_pct": "compiled %", "refused": "refused",
                    "timeouts": "timeouts", "errors": "errors", "relaxed": "relaxed", "compile_ms_p50": "ms p50",
                    "compile_ms_p90": "ms p90", "valid_instances_checked": "instances",
                    "valid_instances_rejected": "rejected", "valid_instances_undetermined": "undetermined"}
            for c, header in cols.items():
                table.add_column(header, justify="left" if c == "subset" else "right", no_wrap=True)
            for row in report["rows"]:
                table.add_row(*["-" if row[c] is None else str(row[c]) for c in cols])
            out.print(table)
            out.print("top refusal reasons: " + ("; ".join(f"{r} ({n})" for r, n in report["top_refusal_reasons"]) or "none"))
            if report["top_relaxed_keywords"]:
                out.print("relaxed: " + "; ".join(f"{r} ({n})" for r, n in report["top_relaxed_keywords"]))
            if report["generation"]:
                g = report["generation"]
                out.print(f"generated for {g['schemas']} schemas: {g['schema_valid_pct']}% schema-valid; {g['outcomes']}")
        if json_out:
            json_out.write_text(json.dumps(reports, indent=2))
            err.print(f"figures written to {json_out}")

    _run_guarded(go)


@app.command("bench")
def bench_cmd(
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {id, schema, prompt}; default: the extraction prompts shipped in the package."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N prompts."),
    model: Optional[str] = ModelOpt,
    fixed_k: str = typer.Option("4,8,12,16,20", "--fixed-k", help="Comma-separated fixed K values to compare with adaptive K."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    profile: Optional[str] = ProfileOpt,
    dtype: Optional[str] = DtypeOpt,
    precision: Optional[str] = typer.Option(None, "--precision", help="One precision, or several side by side in one run: float32,native or native-exact,native (the embedded model)."),
    outlines_reference: bool = typer.Option(True, "--outlines/--no-outlines", help="Include outlines' transformers generator as a reference row."),
    llama_cpp: bool = typer.Option(True, "--llama-cpp/--no-llama-cpp", help="Include llama.cpp's grammar path on the embedded GGUF as a reference row (where llama-cpp-python is installed)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this file."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of tokens over time and K per step (with --batch: tokens/s against batch size)."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Comma-separated batch sizes, e.g. 1,4,16,64: the batch sweep instead (whole extraction jobs on --documents)."),
    documents: Optional[Path] = typer.Option(None, "--documents", help="With --batch or --serve: JSONL of {id, text, expected?}; default: the 64 people documents shipped in the package."),
    serve: Optional[str] = typer.Option(None, "--serve", help="Comma-separated client counts, e.g. 1,8,32: the server load test instead (a server started here, or --server)."),
    server: Optional[str] = typer.Option(None, "--server", help="With --serve: load-test the server at this URL instead of starting one."),
    workload: str = typer.Option("extraction", "--workload", help="extraction (the shipped prompts or --prompts) or generation (example objects for held-out Glaiveai2K schemas, never trained on)."),
    profile_forward: bool = typer.Option(False, "--profile-forward", help="Instead: where a target forward's time goes (output projection, linears, attention, norms, other) for verify passes of --forward-ks new tokens, at each --precision (default native,float32)."),
    forward_ks: str = typer.Option("1,4,12,21", "--forward-ks", help="With --profile-forward: the new tokens per pass."),
    neighbour: bool = typer.Option(False, "--neighbour", help="Instead: each request's time alone, beside one busy core and beside another torch process, with the thread governor and with fixed threads (first --limit prompts, default 3)."),
    long_prompt: Optional[int] = typer.Option(None, "--long-prompt", min=64, help="Instead: a document of this many tokens (e.g. 3900) in the batch engine, chunked prefill against one-step prefill: memory, the stall of short requests arriving a second after it, and three schemas over the one document; then through `serve`: memory, the request against in process, short requests beside it (--no-server: skip)."),
    long_server: bool = typer.Option(True, "--server/--no-server", help="With --long-prompt: also measure through a `serve` child process."),
) -> None:
    """Target-only vs every drafter and K policy on the extraction prompts, side by side in one run.

    Example: constrained-spec bench --json bench-results.json --plot bench.png

    With --batch: batched target-only, with and without the prefix cache, and batched speculation
    at each batch size, on whole extraction jobs. Example: constrained-spec bench --batch 1,4,16,64 --plot batch.png
    """
    from .pipelines.bench import DEFAULT_PROMPTS, default_configs, plot_trace, run_bench

    if profile_forward:
        _run_guarded(lambda: _forward_profile(model, dtype, precision, forward_ks, json_out))
        return
    if neighbour:
        _run_guarded(lambda: _neighbour_bench(limit or 3, max_new_tokens, llama_cpp, json_out))
        return
    if long_prompt is not None:
        _run_guarded(lambda: _long_prompt_bench(long_prompt, json_out, long_server))
        return
    if batch is not None:
        _run_guarded(lambda: _batch_sweep(batch, model, dtype, precision, documents, limit, json_out, plot))
        return
    if serve is not None:
        _run_guarded(lambda: _serve_load(serve, server, documents, limit, max_new_tokens, json_out))
        return

    def go() -> None:
        try:
            ks = tuple(int(k) for k in fixed_k.split(",") if k.strip())
        except ValueError:
            raise InvalidOptionError(f"Invalid --fixed-k: expected comma-separated integers, got {fixed_k!r}.") from None
        several = tuple(p.strip() for p in precision.split(",") if p.strip()) if precision and "," in precision else None
        target = model if several else _model_arg(model, dtype, precision)
        from .models import resolve_model
        from .pipelines.bench import has_shipped_head

        head = has_shipped_head(resolve_model(target) if not several else resolve_model(None))
        report = run_bench(prompts or DEFAULT_PROMPTS, model=target, precisions=several,
                           configs=default_configs(ks, head=head), max_new_tokens=max_new_tokens, profile=profile,
                           outlines_reference=outlines_reference, llama_cpp=llama_cpp, limit=limit, workload=workload,
                           progress=lambda i, n: err.print(f"[dim]prompt {i}/{n} done[/]"))
        table = Table(title=f"{report['model']} ({report['precision']}): {report['prompts']} {workload} prompts, greedy, "
                            f"profile {report['profile']}")
        cols = {"config": "config", "tokens_per_second": "tok/s", "speedup_vs_target_only": "speedup",
                "prompt_pass_ms_mean": "prompt ms",
                "target_forwards_per_token": "fwd/token", "acceptance_by_kind": "accepted by kind",
                "constraint_ms_per_token_p50": "constraint ms/tok p50", "constraint_ms_per_token_p99": "p99",
                "constraint_share_of_step": "share", "head_acceptance_by_position": "head accepted by position",
                "head_cost_vs_target_step": "head cost", "identical_outputs": "identical",
                "field_accuracy": "fields right"}
        if several:
            cols["same_as_first_precision"] = f"= {several[0]} target-only"
        for c, header in cols.items():
            table.add_column(header, justify="left" if c in ("config", "acceptance_by_kind") else "right", no_wrap=True)
        for row in report["rows"]:
            cells = []
            for c in cols:
                v = row.get(c)
                if isinstance(v, dict):
                    v = " ".join(f"{k} {x:.2f}" for k, x in v.items())
                elif isinstance(v, list):
                    v = " ".join(f"{x:.2f}" for x in v)
                cells.append("-" if v is None else str(v))
            table.add_row(*cells)
        Console(width=max(180, Console().width)).print(table)
        if json_out:
            json_out.write_text(json.dumps(report, indent=2, default=str))
            err.print(f"figures written to {json_out}")
        if plot:
            err.print(f"plot written to {plot_trace(report, plot)}")

    _run_guarded(go)


@app.command("fuzz")
def fuzz_cmd(
    server: Optional[str] = typer.Option(None, "--server", help="A running server's URL (default: start one here)."),
    examples: int = typer.Option(1000, "--examples", help="Random requests to send."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Make the requests reproducible."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CONSTRAINED_SPEC_API_KEY"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Random requests against the server (hypothesis; needs the 'fuzz' extra): every answer must
    be a 2xx with a valid body or a 4xx with an error body, never a 5xx; exits 1 on a problem."""
    def go() -> None:
        from .pipelines.hostile import run_fuzz
        from .pipelines.serve_bench import given_server, local_server

        if examples < 1:
            raise InvalidOptionError(f"Invalid --examples: expected at least 1, got {examples}.")
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            raise InvalidOptionError("fuzz needs hypothesis: pip install 'constrained_spec[fuzz]'") from None
        with (local_server(4, 16) if server is None else given_server(server)) as url:
            report = run_fuzz(url, examples=examples, seed=seed, api_key=api_key, progress=err.print)
        _report(report, json_out)
        if report["problems"] or not report["healthy_after"]:
            raise typer.Exit(1)

    _run_guarded(go)


@app.command("soak")
def soak_cmd(
    minutes: float = typer.Option(10.0, "--minutes", help="How long to send traffic."),
    clients: int = typer.Option(16, "--clients", help="Concurrent clients."),
    server: Optional[str] = typer.Option(None, "--server", help="A running server's URL (default: start one here)."),
    pid: Optional[int] = typer.Option(None, "--pid", help="With --server: its process id, to read its memory."),
    hostile_share: float = typer.Option(0.5, "--hostile-share", help="Share of hostile requests (0..1)."),
    max_requests: int = typer.Option(100_000, "--max-requests", help="Stop after this many requests."),
    seed: int = typer.Option(0, "--seed"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Mixed valid and hostile traffic for minutes (pipelines.soak): reports 5xx (must be 0),
    valid answers, and the server's memory after warm-up and at the end; exits 1 on a problem."""
    def go() -> None:
        from .pipelines.soak import run_soak

        if minutes <= 0 or clients < 1 or not 0 <= hostile_share <= 1 or max_requests < 1:
            raise InvalidOptionError("Invalid soak options: --minutes > 0, --clients >= 1, --hostile-share in 0..1, "
                                     "--max-requests >= 1.")
        report = run_soak(minutes=minutes, clients=clients, url=server, pid=pid, hostile_share=hostile_share,
                          max_requests=max_requests, seed=seed, progress=err.print)
        _report(report, json_out)
        if report["problems"] or not report["healthy_after"]:
            raise typer.Exit(1)

    _run_guarded(go)


@app.command("drafter-data")
def drafter_data_cmd(
    out: Path = typer.Option(..., "--out", help="The JSONL file to write (a prompt and a schema per line)."),
    per_subset: int = typer.Option(40, "--per-subset", help="Prompts of each kind (generation, extraction) per subset."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="The JSONSchemaBench subsets (default: ../shared/data/jsonschemabench or $CONSTRAINED_SPEC_SCHEMA_DATA)."),
    seed: int = typer.Option(0, "--seed"),
    kinds: str = typer.Option("generation,extraction", "--kinds", help="The kinds of prompts written (generation, extraction or both, comma-separated); the repository's examples are extraction prompts."),
) -> None:
    """Write training prompts for train-drafter: generation and extraction prompts from every
    JSONSchemaBench subset except Glaiveai2K (kept for evaluation), and the repository's examples."""
    def go() -> None:
        from .pipelines.drafter_data import PROMPT_KINDS, training_prompts, write_jsonl

        if per_subset < 1:
            raise InvalidOptionError(f"Invalid --per-subset: expected at least 1, got {per_subset}.")
        chosen = tuple(k.strip() for k in kinds.split(",") if k.strip())
        if not chosen or any(k not in PROMPT_KINDS for k in chosen):
            raise InvalidOptionError(f"Invalid --kinds: expected a comma-separated subset of {', '.join(PROMPT_KINDS)}, "
                                     f"got {kinds!r}.")
        rows = training_prompts(data_dir, per_subset=per_subset, seed=seed, kinds=chosen)
        write_jsonl(rows, out)
        counts = {k: sum(r["kind"] == k for r in rows) for k in PROMPT_KINDS}
        err.print(f"{len(rows)} prompts ({counts['generation']} generation, {counts['extraction']} extraction) -> {out}")

    _run_guarded(go)


@app.command("train-drafter")
def train_drafter_cmd(
    data: Path = typer.Option(..., "--data", help="JSONL: {\"prompt\": ..., \"schema\": ...} or {\"prompt\": ..., \"regex\": ...} per line (see drafter-data)."),
    out: Path = typer.Option(..., "--out", help="Directory for the head (load it with draft=DIR / --draft DIR); checkpoints go there too."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model id or path; default: the embedded SmolLM2-135M-Instruct."),
    precision: Optional[str] = typer.Option(None, "--precision", help="The target's precision (as in json; default: native for the embedded model)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Stop training after this many minutes (the best head is kept)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Stop after this many optimizer steps."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Tokens the head can propose (the most used in the target's outputs, plus JSON punctuation)."),
    sampled: int = typer.Option(1, "--sampled", help="Sampled outputs per prompt, besides the greedy one."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Length limit of each training output."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N usable prompts only."),
    unroll: int = typer.Option(3, "--unroll", help="Training passes on the head's own states (EAGLE-3's training-time test)."),
    lr: float = typer.Option(5e-4, "--lr", help="AdamW learning rate."),
    resume: bool = typer.Option(True, "--resume/--fresh", help="Take up a checkpoint in --out from the same data and options."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Training outputs decoded at once in the batch engine (default 16; 1: one at a time)."),
    seed: int = typer.Option(0, "--seed"),
    corpus_only: bool = typer.Option(False, "--corpus-only", help="Only decode the prompts greedily and write the corpus of the target's outputs to --out (no head; no budget needed)."),
) -> None:
    """Train a grammar-masked draft head for the target on its own constrained outputs
    (on-policy distillation, EAGLE-3 style; see pipelines.train_drafter), and write the corpus
    of those outputs beside it (drafters.corpus)."""
    def go() -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from .models import load_model
        from .pipelines.train_drafter import DECODE_BATCH, TrainProgress, build_corpus, train_drafter

        if minutes is None and steps is None and not corpus_only:
            raise InvalidOptionError("Invalid training budget: give --minutes or --steps.")
        handle = load_model(target, precision=precision)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err) as bar:
            tasks: dict[str, Any] = {}

            def progress(p: TrainProgress) -> None:
                if p.phase not in tasks:
                    tasks[p.phase] = bar.add_task({"decode": "decoding", "train": "training"}[p.phase], total=p.total,
                                                  info="")
                info = "" if p.loss is None else (f"loss {p.loss:.3f}  held-out acceptance {p.agreement:.3f} (best {p.best:.3f})"
                                                  + (f", where lookup misses {p.hard:.3f}" if p.hard is not None else ""))
                bar.update(tasks[p.phase], completed=p.done, total=max(p.total, p.done), info=info)
                if not err.is_terminal and (p.loss is not None or p.done % 10 == 0 or p.done == p.total):
                    err.print(f"{p.phase} {p.done}/{p.total} {info}")  # a log file gets lines, not a bar

            if corpus_only:
                corpus = build_corpus(handle, data, out, max_new_tokens=max_new_tokens, limit=limit,
                                      batch=DECODE_BATCH if batch is None else batch, progress=progress)
                _report({"corpus_tokens": len(corpus), "out": str(out)}, None)
                return
            report = train_drafter(handle, data, out, minutes=minutes, steps=steps, draft_vocab=draft_vocab,
                                   sampled=sampled, max_new_tokens=max_new_tokens, limit=limit, seed=seed,
                                   unroll=unroll, lr=lr, resume=resume, batch=DECODE_BATCH if batch is None else batch,
                                   progress=progress)
        _report({k: v for k, v in dataclasses.asdict(report).items() if k != "losses"} | {"out": str(out)}, None)

    _run_guarded(go)


def _report(report: dict, json_out: Optional[Path]) -> None:
    """Print a report as JSON (and write it to ``json_out``)."""
    text = json.dumps(report, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    typer.echo(text)


@app.command("serve")
def serve_cmd(
    model: Optional[str] = ModelOpt,
    precision: Optional[str] = PrecisionOpt,
    dtype: Optional[str] = DtypeOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CONSTRAINED_SPEC_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health (or set $CONSTRAINED_SPEC_API_KEY)."),
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded at once (one target forward per step for all)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a slot; beyond it: 429 with Retry-After."),
    request_timeout: float = typer.Option(120.0, "--request-timeout", help="Seconds a request may take in all (504 past it)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="On SIGTERM: seconds to finish the requests in flight."),
    constraint_cache_mb: float = typer.Option(64.0, "--constraint-cache-mb", help="MiB of compiled constraints kept (least recently used dropped)."),
    kv_memory_mb: Optional[float] = typer.Option(None, "--kv-memory", help="MiB the KV cache may hold (default: half the machine's memory); a request waits for room, one that could never fit is a 400."),
    draft: Optional[str] = DraftOpt,
    drafter: str = DrafterOpt,
    profile: Optional[str] = ProfileOpt,
) -> None:
    """An OpenAI-compatible server for constrained generation that fails closed (needs the
    'server' extra: pip install 'constrained_spec\\[server]').

    Example: constrained-spec serve --port 8000, then with the openai client:
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(...)
    """
    def go() -> None:
        try:
            import uvicorn

            from .serving import ServerConfig, create_app
        except ImportError as e:
            raise InvalidOptionError(f"serve needs the server extra ({e.name} is missing): "
                                     "pip install 'constrained_spec[server]'") from None
        from .constraint import set_cache_bytes
        from .decoding import SpecOptions
        from .models import resolve_model
        from .serving.worker import limit_malloc_arenas

        limit_malloc_arenas()  # before any thread: see serving.worker

        for name, value in (("--max-batch", max_batch), ("--max-queue", max_queue), ("--port", port),
                            ("--constraint-cache-mb", constraint_cache_mb), ("--kv-memory", kv_memory_mb or 1)):
            if value < (0 if name in ("--max-queue", "--constraint-cache-mb") else 1):
                raise InvalidOptionError(f"Invalid {name}: {value}.")
        options = SpecOptions(drafter=drafter, profile=profile)  # type: ignore[arg-type]
        handle = resolve_model(_model_arg(model, dtype, precision))
        config = ServerConfig(max_batch=max_batch, max_queue=max_queue, request_timeout=request_timeout,
                              api_key=api_key or None, constraint_cache_bytes=int(constraint_cache_mb * (1 << 20)),
                              kv_memory=int(kv_memory_mb * (1 << 20)) if kv_memory_mb else None)
        set_cache_bytes(config.constraint_cache_bytes)  # the process-wide cache behind the app's own
        err.print(f"serving {handle.name} ({handle.precision}) on http://{host}:{port}/v1"
                  f"{' (API key required)' if api_key else ''}")
        uvicorn.run(create_app(handle, draft=draft, options=options, config=config), host=host, port=port,
                    log_level="warning",
                    timeout_graceful_shutdown=shutdown_timeout)

    _run_guarded(go)


def _counts(text: str, option: str) -> list[int]:
    """Comma-separated integers >= 1 (batch sizes, client counts), or ``InvalidOptionError``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InvalidOptionError(f"Invalid {option}: expected comma-separated integers >= 1, got {text!r}.")
    return values


def _neighbour_bench(limit: int, max_new_tokens: int, llama_cpp: bool, json_out: Optional[Path]) -> None:
    from .pipelines.neighbour_bench import NEIGHBOURS, run_neighbour_bench

    rows = run_neighbour_bench(limit, max_new_tokens, llama_cpp, progress=lambda m: err.print(f"[dim]{m}[/]"))
    table = Table(title=f"A request beside other processes ({limit} extraction prompts, {os.cpu_count()} cores; "
                        "seconds, and x its time alone)")
    table.add_column("config", no_wrap=True)
    for name in NEIGHBOURS:
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        ratios = r.ratios()
        table.add_row(r.config, *(f"{r.seconds[n]:.2f} s ({ratios[n]:.2f}x)" for n in NEIGHBOURS))
    Console(width=max(120, Console().width)).print(table)
    if json_out:
        json_out.write_text(json.dumps([r.as_dict() for r in rows], indent=2))
        err.print(f"figures written to {json_out}")


def _long_prompt_bench(tokens: int, json_out: Optional[Path], through_server: bool = True) -> None:
    from .pipelines.long_prompt_bench import run_long_prompt_bench, run_long_prompt_server

    progress = lambda m: err.print(f"[dim]{m}[/]")  # noqa: E731
    rows = run_long_prompt_bench(tokens, progress=progress)
    server = run_long_prompt_server(tokens, progress=progress) if through_server else None
    table = Table(title=f"A {rows[0].prompt_tokens}-token extraction prompt in the batch engine (embedded model, "
                        f"{os.cpu_count()} cores)")
    table.add_column("figure")
    for r in rows:
        table.add_column(r.mode, justify="right")
    lines = [
        ("resident memory idle / peak / after (MiB)", lambda r: f"{r.rss_idle_mib:.0f} / {r.rss_peak_mib:.0f} / {r.rss_after_mib:.0f}"),
        ("growth during the request (MiB)", lambda r: f"{r.growth_mib:.0f}"),
        ("KV cache at its peak (MiB)", lambda r: f"{r.kv_peak_mib:.0f}"),
        ("long request alone (s)", lambda r: f"{r.long_alone_s:.1f}"),
        ("long request with short ones beside it (s)", lambda r: f"{r.long_with_short_s:.1f} ({r.long_with_short_s / r.long_alone_s:.2f}x)"),
        ("short requests arriving 1 s after it (s each)", lambda r: " ".join(f"{s:.1f}" for s in r.short_s)),
        ("three schemas over the document: seconds each (output tokens)",
         lambda r: " ".join(f"{s:.1f} ({n})" for s, n in zip(r.reuse_s, r.reuse_tokens))),
        ("second and third against the first", lambda r: " ".join(f"{r.reuse_s[0] / s:.1f}x" for s in r.reuse_s[1:])),
        ("their time to the first token (s)", lambda r: " ".join(f"{s:.1f}" for s in r.reuse_first_token_s)),
        ("second and third against the first, to the first token",
         lambda r: " ".join(f"{r.reuse_first_token_s[0] / s:.1f}x" for s in r.reuse_first_token_s[1:])),
        ("valid outputs", lambda r: f"{r.valid}/{r.outputs}"),
    ]
    for name, cell in lines:
        table.add_row(name, *(cell(r) for r in rows))
    console = Console(width=max(120, Console().width))
    console.print(table)
    if server is not None:
        alone = rows[0].long_alone_s
        table = Table(title="The same long request through `constrained-spec serve` (defaults, one child process)")
        table.add_column("figure")
        table.add_column("through the server", justify="right")
        for name, value in [
            ("resident memory idle / peak / after (MiB)", f"{server.rss_idle_mib:.0f} / {server.rss_peak_mib:.0f} / {server.rss_after_mib:.0f}"),
            ("growth during the long requests (MiB)", f"{server.growth_mib:.0f}"),
            ("long request alone (s), against in process", f"{server.long_alone_s:.1f} ({server.long_alone_s / alone:.2f}x)"),
            ("again, document cached, short ones beside it (s)", f"{server.long_cached_with_short_s:.1f}"),
            ("short requests arriving 1 s after it (s each)", " ".join(f"{s:.1f}" for s in server.short_s)),
            ("valid outputs", f"{server.valid}/{server.outputs}" + (f" ({'; '.join(server.errors)})" if server.errors else "")),
        ]:
            table.add_row(name, value)
        console.print(table)
    if json_out:
        out = {"engine": [r.as_dict() for r in rows], "server": server.as_dict() if server else None}
        json_out.write_text(json.dumps(out, indent=2))
        err.print(f"figures written to {json_out}")


def _forward_profile(model: Optional[str], dtype: Optional[str], precision: Optional[str], ks_text: str,
                     json_out: Optional[Path]) -> None:
    from .models import resolve_model
    from .pipelines.forward_profile import PARTS, profile_forward

    ks = _counts(ks_text, "--forward-ks")
    precisions = [p.strip() for p in (precision or ("native,float32" if model is None and dtype is None else "")).split(",")
                  if p.strip()] or [None]
    rows = []
    for p in precisions:
        handle = resolve_model(_model_arg(model, dtype, p))
        rows += profile_forward(handle, p or str(next(handle.model.parameters()).dtype).removeprefix("torch."), ks)
    table = Table(title=f"Where a verify pass's time goes (after a {rows[0].context}-token prompt; ms per forward, "
                        "median; each part's share timed by hooks)")
    for header in ("precision", "k", "total ms", "ms/token", *PARTS, "conversions", "weights MB", "KV MB"):
        table.add_column(header, justify="left" if header == "precision" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r.precision, str(r.k), f"{r.total_ms:.1f}", f"{r.ms_per_token:.1f}",
                      *(f"{r.parts_ms[p]:.1f} ({r.parts_ms[p] / r.total_ms:.0%})" for p in PARTS),
                      f"{r.conversions_ms:.1f}", f"{r.weight_mb:.0f}", f"{r.kv_mb:.1f}")
    Console(width=max(180, Console().width)).print(table)
    if json_out:
        json_out.write_text(json.dumps([r.as_dict() for r in rows], indent=2))
        err.print(f"figures written to {json_out}")


def _serve_load(levels: str, server: Optional[str], documents: Optional[Path], limit: Optional[int],
                max_tokens: int, json_out: Optional[Path]) -> None:
    """``bench --serve``: the load test of ``pipelines.serve_bench``, printed as a table."""
    from .pipelines.serve_bench import DEFAULT_DOCUMENTS, run_serve_bench

    import os

    report = run_serve_bench(_counts(levels, "--serve"), url=server, documents=documents or DEFAULT_DOCUMENTS,
                             limit=limit, max_tokens=min(max_tokens, 128),
                             api_key=os.environ.get("CONSTRAINED_SPEC_API_KEY"),
                             progress=lambda line: err.print(f"[dim]{line}[/]"))
    table = Table(title=f"server load test: {report['documents']} extraction requests per row, streamed, greedy")
    cols = {"clients": "clients", "speculation": "speculation", "requests_per_second": "req/s",
            "output_tokens_per_second": "tok/s", "ttft_p50_s": "TTFT p50 s", "ttft_p99_s": "p99 s",
            "per_token_p50_ms": "ms/token p50", "per_token_p99_ms": "p99 ms", "errors": "errors", "valid": "valid"}
    for header in cols.values():
        table.add_column(header, justify="right", no_wrap=True)
    for row in report["rows"]:
        table.add_row(*["-" if row[c] is None else str(row[c]) for c in cols])
    Console(width=max(140, Console().width)).print(table)
    errors = [r["first_error"] for r in report["rows"] if r["first_error"]]
    if errors:
        err.print(f"[red]first error:[/] {errors[0]}")
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
        err.print(f"figures written to {json_out}")


def _batch_sweep(batch: str, model: Optional[str], dtype: Optional[str], precision: Optional[str],
                 documents: Optional[Path], limit: Optional[int], json_out: Optional[Path], plot: Optional[Path]) -> None:
    """``bench --batch``: the sweep of ``pipelines.batch_bench``, printed as a table."""
    from .pipelines.batch_bench import DEFAULT_DOCUMENTS, plot_sweep, run_batch_sweep

    report = run_batch_sweep(_counts(batch, "--batch"), model=_model_arg(model, dtype, precision), documents=documents or DEFAULT_DOCUMENTS,
                             limit=limit, progress=lambda line: err.print(f"[dim]{line}[/]"))
    table = Table(title=f"{report['model']}: {report['documents']} extraction documents, greedy, whole jobs "
                        "(latency: admission to last token)")
    cols = {"config": "config", "tokens_per_second": "tok/s", "decode_tokens_per_second": "decode tok/s",
            "prompt_pass_seconds": "prompt s", "latency_p50_s": "p50 s", "latency_p99_s": "p99 s",
            "target_forwards_per_token": "fwd/tok", "acceptance_by_kind": "accepted by kind",
            "kv_cache_mib": "KV MiB", "identical_to_per_document_target_only": "identical", "errors": "errors"}
    for header in cols.values():
        table.add_column(header, justify="left" if header in ("config", "accepted by kind") else "right", no_wrap=True)
    for row in report["rows"]:
        cells = [" ".join(f"{k} {x:.2f}" for k, x in v.items()) if isinstance(v, dict) else "-" if v is None else str(v)
                 for v in (row[c] for c in cols)]
        table.add_row(*cells)
    console = Console(width=max(180, Console().width))
    console.print(table)
    ratios = Table(title="speculative + prefix cache, as a multiple of")
    for header in ("batch", "target-only (job tok/s)", "target-only + prefix (decode tok/s)",
                   "latency p50 (vs target-only + prefix)"):
        ratios.add_column(header, justify="right")
    for r in report["ratios"]:
        ratios.add_row(str(r["batch_size"]), f"{r['job_vs_target_only']:.2f}x",
                       f"{r['decode_vs_target_only_prefix']:.2f}x", f"{r['latency_p50_vs_target_only_prefix']:.2f}x")
    console.print(ratios)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"figures written to {json_out}")
    if plot:
        err.print(f"plot written to {plot_sweep(report, plot)}")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except ModelLoadError as e:  # raised outside a command's guard, e.g. while importing
        err.print(f"[red]error:[/] {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
