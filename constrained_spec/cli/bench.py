"""``bench`` and ``coverage``: the commands behind the harnesses of ``constrained_spec.bench``.

``constrained-spec bench WORKLOAD`` runs one harness, one subcommand each: ``single``, ``batch``,
``serve``, ``long-prompt``, ``documents``, ``neighbour``, ``profile`` and ``coverage`` (also the
top-level ``coverage``). ``constrained-spec bench`` alone runs ``single``, and the flags of the older
one-command form (``bench --batch 1,4``, ``bench --serve 8``, ...) are still accepted, hidden from
``--help``: they reach the same harness with the same arguments, so no script breaks.
The figures these commands print are kept in the docs (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import InvalidOptionError
from .common import app, _counts, DtypeOpt, err, _model_arg, ModelOpt, ProfileOpt, _run_guarded

bench_app = typer.Typer(
    invoke_without_command=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bench_app, name="bench")

JsonOpt = typer.Option(None, "--json", help="Also write the figures to this file.")
PrecisionsOpt = typer.Option(None, "--precision", help="One precision, or several side by side in one run: float32,int8,int4,native (native: a GGUF file's own; native-exact: the embedded model's).")
DocumentsOpt = typer.Option(None, "--documents", help="JSONL of {id, text, expected?}; default: the 64 people documents shipped in the package.")
LimitOpt = typer.Option(None, "--limit", help="Only the first N prompts or documents.")
LlamaCppOpt = typer.Option(True, "--llama-cpp/--no-llama-cpp", help="Include llama.cpp on the model's GGUF file as reference rows, with and without its grammar (where llama-cpp-python is installed).")


# --------------------------------------------------------------------------------------------
# The workloads: each runs its harness and prints its table (shared by both command forms).
# --------------------------------------------------------------------------------------------

def _single(*, prompts: Optional[Path], limit: Optional[int], model: Optional[str], fixed_k: str,
            max_new_tokens: int, profile: Optional[str], dtype: Optional[str], precision: Optional[str],
            outlines_reference: bool, llama_cpp: bool, json_out: Optional[Path], plot: Optional[Path],
            workload: str) -> None:
    """Target-only against every drafter and K policy (``bench.single``)."""
    from ..bench.single import DEFAULT_PROMPTS, default_configs, has_shipped_head, plot_trace, run_bench
    from ..models import resolve_model

    try:
        ks = tuple(int(k) for k in fixed_k.split(",") if k.strip())
    except ValueError:
        raise InvalidOptionError(f"Invalid --fixed-k: expected comma-separated integers, got {fixed_k!r}.") from None
    several = tuple(p.strip() for p in precision.split(",") if p.strip()) if precision and "," in precision else None
    target = model if several else _model_arg(model, dtype, precision)
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
            "draft_cost_vs_target_step": "draft cost", "identical_outputs": "identical",
            "field_accuracy": "fields right"}
    if several:
        cols["same_as_first_precision"] = f"= {several[0]} target-only"
    _print_rows(table, report["rows"], cols)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"figures written to {json_out}")
    if plot:
        err.print(f"plot written to {plot_trace(report, plot)}")


def _print_rows(table: Table, rows: list[dict[str, Any]], cols: dict[str, str]) -> None:
    """Print ``rows`` in ``table`` under ``cols`` (key -> header): dicts as "key value" pairs,
    lists as values, missing as "-"."""
    for c, header in cols.items():
        table.add_column(header, justify="left" if c in ("config", "acceptance_by_kind") else "right", no_wrap=True)
    for row in rows:
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


def _drafts(*, model: Optional[str], drafts: str, prompts: Optional[Path], workload: str, limit: Optional[int],
            max_new_tokens: int, llama_cpp: bool, json_out: Optional[Path]) -> None:
    """Each draft candidate alone and inside auto (``bench.drafts``)."""
    from ..bench.drafts import parse_candidates, run_drafts_bench
    from ..bench.single import DEFAULT_PROMPTS

    candidates = parse_candidates(drafts, model)
    report = run_drafts_bench(model, candidates, prompts=prompts or DEFAULT_PROMPTS, workload=workload, limit=limit,
                              max_new_tokens=max_new_tokens, llama_cpp=llama_cpp,
                              progress=lambda i, n: err.print(f"[dim]prompt {i}/{n} done[/]"))
    table = Table(title=f"{report['model']}: {report['prompts']} {workload} prompts, greedy, "
                        f"{max_new_tokens} tokens at most")
    _print_rows(table, report["rows"], {
        "config": "config", "tokens_per_second": "tok/s", "speedup_vs_target_only": "vs target-only",
        "vs_auto_alone": "vs auto alone", "acceptance_by_kind": "accepted by kind",
        "draft_ms_per_token": "draft ms/token", "draft_cost_vs_target_step": "vs a target step",
        "identical_outputs": "identical"})
    Console().print(report["verdict"])
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"figures written to {json_out}")


def _self_draft(*, model: Optional[str], prompts: Optional[Path], workload: str, limit: Optional[int],
                max_new_tokens: int, json_out: Optional[Path]) -> None:
    """The target's layer sets as its draft (``bench.self_draft``)."""
    from ..bench.self_draft import run_self_draft_bench
    from ..bench.single import DEFAULT_PROMPTS

    if limit is not None and limit < 1:
        raise InvalidOptionError(f"Invalid --limit: expected at least 1, got {limit}.")
    report = run_self_draft_bench(model, workload=workload, prompts=prompts or DEFAULT_PROMPTS, limit=limit,
                                  max_new_tokens=max_new_tokens,
                                  progress=lambda i, n: err.print(f"[dim]prompt {i}/{n} done[/]"))
    table = Table(title=f"{report['model']}: its own layers as its draft, {report['prompts']} {workload} prompts, "
                        "greedy, first draft token over the whole model's cache")
    _print_rows(table, report["rows"], {
        "layers": "layers run", "cost": "of a step", "agreement": "first token agrees", "positions": "positions",
        "best_k": "best K", "bound_vs_target_only": "bound vs target-only"})
    Console().print(report["verdict"])
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"figures written to {json_out}")


def _batch(*, sizes: str, model: Optional[str], dtype: Optional[str], precision: Optional[str],
           documents: Optional[Path], limit: Optional[int], json_out: Optional[Path], plot: Optional[Path]) -> None:
    """Whole extraction jobs by batch size (``bench.batch``)."""
    from ..bench.batch import DEFAULT_DOCUMENTS, plot_sweep, run_batch_sweep

    report = run_batch_sweep(_counts(sizes, "--batch"), model=_model_arg(model, dtype, precision),
                             documents=documents or DEFAULT_DOCUMENTS,
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


def _serve(*, clients: str, server: Optional[str], documents: Optional[Path], limit: Optional[int],
           max_tokens: int, json_out: Optional[Path]) -> None:
    """Concurrent streamed clients against a server, speculation on and off (``bench.serve``)."""
    from ..bench.serve import DEFAULT_DOCUMENTS, run_serve_bench

    report = run_serve_bench(_counts(clients, "--serve"), url=server, documents=documents or DEFAULT_DOCUMENTS,
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


def _long_prompt(*, tokens: int, through_server: bool, json_out: Optional[Path]) -> None:
    """A long document beside short requests, and one document under three schemas (``bench.long_prompt``)."""
    from ..bench.long_prompt import run_long_prompt_bench, run_long_prompt_server

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
        ("valid outputs", lambda r: f"{r.valid}/{r.outputs}" + (f" ({r.stopped} stopped by the repetition guard)" if r.stopped else "")),
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
            ("valid outputs", f"{server.valid}/{server.outputs}"
             + (f" ({server.stopped} stopped by the repetition guard)" if server.stopped else "")
             + (f" ({'; '.join(server.errors)})" if server.errors else "")),
        ]:
            table.add_row(name, value)
        console.print(table)
    if json_out:
        out = {"engine": [r.as_dict() for r in rows], "server": server.as_dict() if server else None}
        json_out.write_text(json.dumps(out, indent=2))
        err.print(f"figures written to {json_out}")


def _neighbour(*, limit: int, max_new_tokens: int, llama_cpp: bool, json_out: Optional[Path]) -> None:
    """A request's time beside a busy core and beside another torch process (``bench.neighbour``)."""
    from ..bench.neighbour import NEIGHBOURS, run_neighbour_bench

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


def _profile(*, model: Optional[str], dtype: Optional[str], precision: Optional[str], ks_text: str,
             json_out: Optional[Path]) -> None:
    """Where a verify pass's time goes, part by part (``bench.forward_profile``)."""
    from ..models import resolve_model
    from ..bench.forward_profile import PARTS, profile_forward

    ks = _counts(ks_text, "--forward-ks")
    precisions = [p.strip() for p in (precision or ("native,float32" if model is None and dtype is None else "")).split(",")
                  if p.strip()] or [None]
    rows = []
    for p in precisions:
        handle = resolve_model(_model_arg(model, dtype, p))
        rows += profile_forward(handle, p or handle.precision, ks)
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


def _documents(*, model: Optional[str], limit: Optional[int], max_new_tokens: int, llama_cpp: bool,
               row_configs: list[str], json_out: Optional[Path]) -> None:
    """Long documents, one request each: prompt speed, time to first token, whole requests (``bench.documents``)."""
    from ..bench.documents import BUCKETS, run_documents_bench, runtime_config_rows
    from ..models import resolve_model

    handle = resolve_model(model) if row_configs else model  # the rows' loads need the handle's kind
    configs = runtime_config_rows(handle, row_configs) if row_configs else None
    report = run_documents_bench(handle, configs=configs, limit=limit, max_new_tokens=max_new_tokens,
                                 llama_cpp=llama_cpp, progress=lambda line: err.print(f"[dim]{line}[/]"))
    tokens = report["prompt_tokens"]
    table = Table(title=f"{report['model']}: {len(report['documents'])} package descriptions ({tokens['min']}-"
                        f"{tokens['max']} prompt tokens, {tokens['total']} in all), one request each, cold, greedy, "
                        f"{report['threads']} cores")
    cols = {"config": "config", "prompt_tokens_per_second": "prompt tok/s", "first_token_s_mean": "first token s",
            **{f"bucket {name}": name for name, _ in BUCKETS}, "whole_request_s": "whole s",
            "output_tokens_per_second_after_first": "out tok/s after first", "field_accuracy": "fields right",
            "identical_to_target_only": "identical", "valid": "valid"}
    for c, header in cols.items():
        table.add_column(header, justify="left" if c == "config" else "right", no_wrap=True)
    for row in report["rows"]:
        values = {**row, **{f"bucket {k}": v for k, v in row["first_token_s_by_bucket"].items()}}
        table.add_row(*("-" if values.get(c) is None else str(values[c]) for c in cols))
    console = Console(width=max(200, Console().width))
    console.print(table)
    console.print("documents: " + ", ".join(f"{d['package']} {d['version']} ({d['prompt_tokens']})"
                                            for d in report["documents"]))
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    if json_out:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        err.print(f"figures written to {json_out}")


def _coverage(*, corpus: Path, sample: Optional[int], timeout_s: float, subset: Optional[list[str]],
              backend: list[str], lenient: bool, generate: int, model: Optional[str],
              json_out: Optional[Path]) -> None:
    """Compile coverage of a schema corpus per backend (``bench.coverage``)."""
    from ..bench.coverage import run_coverage
    from ..models import resolve_model

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


# --------------------------------------------------------------------------------------------
# ``constrained-spec bench WORKLOAD``
# --------------------------------------------------------------------------------------------

@bench_app.command("single")
def single_cmd(
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {id, schema, prompt}; default: the extraction prompts shipped in the package."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N prompts."),
    model: Optional[str] = ModelOpt,
    fixed_k: str = typer.Option("4,8,12,16,20", "--fixed-k", help="Comma-separated fixed K values to compare with adaptive K ('' for none)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    profile: Optional[str] = ProfileOpt,
    dtype: Optional[str] = DtypeOpt,
    precision: Optional[str] = PrecisionsOpt,
    outlines_reference: bool = typer.Option(True, "--outlines/--no-outlines", help="Include outlines' transformers generator as a reference row."),
    llama_cpp: bool = LlamaCppOpt,
    workload: str = typer.Option("extraction", "--workload", help="extraction (the shipped prompts or --prompts) or generation (example objects for held-out Glaiveai2K schemas, never trained on)."),
    json_out: Optional[Path] = JsonOpt,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of tokens over time and K per step."),
) -> None:
    """One request at a time: target-only against every drafter and K policy, with outlines and llama.cpp as reference rows.

    Example: constrained-spec bench single --json bench-results.json --plot bench.png
    """
    _run_guarded(lambda: _single(prompts=prompts, limit=limit, model=model, fixed_k=fixed_k,
                                 max_new_tokens=max_new_tokens, profile=profile, dtype=dtype, precision=precision,
                                 outlines_reference=outlines_reference, llama_cpp=llama_cpp, json_out=json_out,
                                 plot=plot, workload=workload))


@bench_app.command("batch")
def batch_cmd(
    sizes: str = typer.Argument(..., help="Comma-separated batch sizes, e.g. 1,4,16,64."),
    model: Optional[str] = ModelOpt,
    dtype: Optional[str] = DtypeOpt,
    precision: Optional[str] = typer.Option(None, "--precision", help="native, float32, bfloat16, int8 or int4 (default: the model's)."),
    documents: Optional[Path] = DocumentsOpt,
    limit: Optional[int] = LimitOpt,
    json_out: Optional[Path] = JsonOpt,
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of tokens/s against batch size."),
) -> None:
    """Whole extraction jobs by batch size: batched target-only with and without the prefix cache, and batched speculation.

    Example: constrained-spec bench batch 1,4,16,64 --plot batch.png
    """
    _run_guarded(lambda: _batch(sizes=sizes, model=model, dtype=dtype, precision=precision, documents=documents,
                                limit=limit, json_out=json_out, plot=plot))


@bench_app.command("serve")
def serve_cmd(
    clients: str = typer.Argument(..., help="Comma-separated client counts, e.g. 1,8,32."),
    server: Optional[str] = typer.Option(None, "--server", help="Load-test the server at this URL instead of starting one (its key from $CONSTRAINED_SPEC_API_KEY)."),
    documents: Optional[Path] = DocumentsOpt,
    limit: Optional[int] = LimitOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Per request; at most 128."),
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """Server load test: streamed extraction requests from concurrent clients, speculation off and on.

    Example: constrained-spec bench serve 1,8,32
    """
    _run_guarded(lambda: _serve(clients=clients, server=server, documents=documents, limit=limit,
                                max_tokens=max_new_tokens, json_out=json_out))


@bench_app.command("long-prompt")
def long_prompt_cmd(
    tokens: int = typer.Argument(..., min=64, help="The document's length in tokens, e.g. 3900."),
    through_server: bool = typer.Option(True, "--server/--no-server", help="Also measure through a `serve` child process."),
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """A long document in the batch engine, chunked against one-step prefill: memory, the stall of short requests beside it, three schemas over one document; then the same through `serve`.

    Example: constrained-spec bench long-prompt 3900 --json long.json
    """
    _run_guarded(lambda: _long_prompt(tokens=tokens, through_server=through_server, json_out=json_out))


@bench_app.command("neighbour")
def neighbour_cmd(
    limit: int = typer.Option(3, "--limit", help="The first N extraction prompts."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    llama_cpp: bool = LlamaCppOpt,
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """A request's time alone, beside one busy core and beside another torch process, with the thread governor and with fixed threads.

    Example: constrained-spec bench neighbour
    """
    _run_guarded(lambda: _neighbour(limit=limit, max_new_tokens=max_new_tokens, llama_cpp=llama_cpp, json_out=json_out))


@bench_app.command("profile")
def profile_cmd(
    model: Optional[str] = ModelOpt,
    dtype: Optional[str] = DtypeOpt,
    precision: Optional[str] = typer.Option(None, "--precision", help="Comma-separated precisions to profile (default for the embedded model: native,float32)."),
    ks: str = typer.Option("1,4,12,21", "--ks", "--forward-ks", help="The new tokens per verify pass."),
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """Where a target forward's time goes (output projection, linears, attention, norms, other) for verify passes of each size.

    Example: constrained-spec bench profile --precision native
    """
    _run_guarded(lambda: _profile(model=model, dtype=dtype, precision=precision, ks_text=ks, json_out=json_out))


@bench_app.command("drafts")
def drafts_cmd(
    drafts: str = typer.Option(..., "--draft", help="Comma-separated candidates: draft models (GGUF files or ids, the target's tokenizer) and heads ('head': the target's own; or a directory from train-drafter)."),
    model: Optional[str] = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {id, schema, prompt}: your own prompts; default: the extraction prompts shipped in the package."),
    workload: str = typer.Option("extraction", "--workload", help="extraction (--prompts) or generation (example objects for held-out Glaiveai2K schemas)."),
    limit: Optional[int] = LimitOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    llama_cpp: bool = LlamaCppOpt,
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """Which draft to use: each candidate alone and inside auto, against target-only, auto alone and llama.cpp, with each draft's cost per drafted token and a verdict.

    Example: constrained-spec bench drafts --model target.gguf --draft draft.gguf --workload generation --limit 10
    """
    _run_guarded(lambda: _drafts(model=model, drafts=drafts, prompts=prompts, workload=workload, limit=limit,
                                 max_new_tokens=max_new_tokens, llama_cpp=llama_cpp, json_out=json_out))


@bench_app.command("self-draft")
def self_draft_cmd(
    model: Optional[str] = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of {id, schema, prompt} for --workload extraction; default: the extraction prompts shipped in the package."),
    workload: str = typer.Option("generation", "--workload", help="generation (example objects for held-out Glaiveai2K schemas) or extraction (--prompts)."),
    limit: Optional[int] = typer.Option(4, "--limit", help="Only the first N prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """Whether the target's own layers could pay as its draft: for sets of its layers (early exits, middle layers skipped), how often the set's first draft token is the target's own, and the speedup over target-only that bounds.

    Example: constrained-spec bench self-draft --model target.gguf --limit 4
    """
    _run_guarded(lambda: _self_draft(model=model, prompts=prompts, workload=workload, limit=limit,
                                     max_new_tokens=max_new_tokens, json_out=json_out))


@bench_app.command("documents")
def documents_cmd(
    model: Optional[str] = ModelOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N documents (the shortest)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    llama_cpp: bool = LlamaCppOpt,
    row_configs: Optional[list[str]] = typer.Option(
        None, "--row-config",
        help="Also run target-only and auto on the same native model (the embedded one or --model's GGUF file) "
             "loaded with these runtime settings, as "
             "field=value pairs joined by commas (repeatable; e.g. prompt_linears=dense,prompt_attention=auto: "
             "the prompt path before int8 prompt rows)."),
    json_out: Optional[Path] = JsonOpt,
) -> None:
    """Long documents (12 installed packages' descriptions, 500-4,500 prompt tokens), one request each: prompt tokens/s, time to first token and whole-request time, native against llama.cpp on the same GGUF file.

    Example: constrained-spec bench documents --row-config prompt_linears=dense --json documents.json
    """
    _run_guarded(lambda: _documents(model=model, limit=limit, max_new_tokens=max_new_tokens, llama_cpp=llama_cpp,
                                    row_configs=list(row_configs or []), json_out=json_out))


_CORPUS_HELP = "Folder of <Subset>.jsonl schemas (+ valid_instances/), e.g. ../shared/data/jsonschemabench."


def _coverage_command(name: str, target: typer.Typer, example: str) -> None:
    """Register the coverage command (top level and under ``bench``: one definition)."""

    @target.command(name)
    def coverage_cmd(
        corpus: Path = typer.Argument(..., help=_CORPUS_HELP),
        sample: Optional[int] = typer.Option(None, "--sample", help="Schemas per subset (seeded random sample); default all."),
        timeout_s: float = typer.Option(10.0, "--timeout", help="Per-schema compile limit in seconds."),
        subset: Optional[list[str]] = typer.Option(None, "--subset", help="Only these subsets (repeatable)."),
        backend: list[str] = typer.Option(["outlines-core", "llguidance"], "--backend", help="Backends to measure (repeatable)."),
        lenient: bool = typer.Option(False, "--lenient", help="llguidance: relax unimplemented keywords (listed) instead of refusing."),
        generate: int = typer.Option(0, "--generate", help="Also generate with the model for this many compiled schemas; report schema-valid %."),
        model: Optional[str] = ModelOpt,
        json_out: Optional[Path] = JsonOpt,
    ) -> None:
        _run_guarded(lambda: _coverage(corpus=corpus, sample=sample, timeout_s=timeout_s, subset=subset,
                                       backend=backend, lenient=lenient, generate=generate, model=model,
                                       json_out=json_out))

    coverage_cmd.__doc__ = ("Compile coverage, compile time and refusal reasons per subset; valid instances checked "
                            f"against each constraint.\n\n    Example: {example}\n    ")


# Registered here, before ``bench``'s group, so the top-level ``--help`` keeps its order.
_coverage_command("coverage", app, "constrained-spec coverage ../shared/data/jsonschemabench --sample 50 --timeout 10")
_coverage_command("coverage", bench_app, "constrained-spec bench coverage ../shared/data/jsonschemabench --sample 50")


# --------------------------------------------------------------------------------------------
# ``constrained-spec bench [OLD FLAGS]``: the one-command form, kept so no script breaks.
# --------------------------------------------------------------------------------------------

def _hidden(default: Any, *names: str, **kw: Any) -> Any:
    return typer.Option(default, *names, hidden=True, **kw)


@bench_app.callback()
def bench_cmd(
    ctx: typer.Context,
    prompts: Optional[Path] = _hidden(None, "--prompts"),
    limit: Optional[int] = _hidden(None, "--limit"),
    model: Optional[str] = _hidden(None, "--model", "-m"),
    fixed_k: str = _hidden("4,8,12,16,20", "--fixed-k"),
    max_new_tokens: int = _hidden(256, "--max-new-tokens"),
    profile: Optional[str] = _hidden(None, "--profile"),
    dtype: Optional[str] = _hidden(None, "--dtype"),
    precision: Optional[str] = _hidden(None, "--precision"),
    outlines_reference: bool = _hidden(True, "--outlines/--no-outlines"),
    llama_cpp: bool = _hidden(True, "--llama-cpp/--no-llama-cpp"),
    json_out: Optional[Path] = _hidden(None, "--json"),
    plot: Optional[Path] = _hidden(None, "--plot"),
    batch: Optional[str] = _hidden(None, "--batch"),
    documents: Optional[Path] = _hidden(None, "--documents"),
    serve: Optional[str] = _hidden(None, "--serve"),
    # NOTE: declared twice, as in the one-command form: the flag below (--server/--no-server)
    # is the one click binds, so a URL goes to `bench serve --server URL`.
    server: Optional[str] = _hidden(None, "--server"),
    workload: str = _hidden("extraction", "--workload"),
    profile_forward: bool = _hidden(False, "--profile-forward"),
    forward_ks: str = _hidden("1,4,12,21", "--forward-ks"),
    neighbour: bool = _hidden(False, "--neighbour"),
    long_prompt: Optional[int] = _hidden(None, "--long-prompt", min=64),
    long_server: bool = _hidden(True, "--server/--no-server"),
) -> None:
    """Benchmarks, one subcommand per workload, each measured side by side in one run.

    Without a subcommand: the same as `bench single`. Example: constrained-spec bench batch 1,4,16,64
    """
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]
        if given:
            err.print(f"[red]error:[/] give {', '.join(given)} after the subcommand: "
                      f"constrained-spec bench {ctx.invoked_subcommand} {given[0]} ...")
            raise typer.Exit(2)
        return
    # The mode flags, in the order the one-command form checked them.
    if profile_forward:
        _run_guarded(lambda: _profile(model=model, dtype=dtype, precision=precision, ks_text=forward_ks,
                                      json_out=json_out))
    elif neighbour:
        _run_guarded(lambda: _neighbour(limit=limit or 3, max_new_tokens=max_new_tokens, llama_cpp=llama_cpp,
                                        json_out=json_out))
    elif long_prompt is not None:
        _run_guarded(lambda: _long_prompt(tokens=long_prompt, through_server=long_server, json_out=json_out))
    elif batch is not None:
        _run_guarded(lambda: _batch(sizes=batch, model=model, dtype=dtype, precision=precision, documents=documents,
                                    limit=limit, json_out=json_out, plot=plot))
    elif serve is not None:
        _run_guarded(lambda: _serve(clients=serve, server=server, documents=documents, limit=limit,
                                    max_tokens=max_new_tokens, json_out=json_out))
    else:
        _run_guarded(lambda: _single(prompts=prompts, limit=limit, model=model, fixed_k=fixed_k,
                                     max_new_tokens=max_new_tokens, profile=profile, dtype=dtype,
                                     precision=precision, outlines_reference=outlines_reference,
                                     llama_cpp=llama_cpp, json_out=json_out, plot=plot, workload=workload))
