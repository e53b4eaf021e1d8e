"""bench and coverage: the benchmark harnesses of ``constrained_spec.bench``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import InvalidOptionError
from .common import app, _counts, DtypeOpt, err, _model_arg, ModelOpt, ProfileOpt, _run_guarded


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
    from ..bench.coverage import run_coverage
    from ..models import resolve_model

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
    from ..bench.single import DEFAULT_PROMPTS, default_configs, plot_trace, run_bench

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
        from ..models import resolve_model
        from ..bench.single import has_shipped_head

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



def _neighbour_bench(limit: int, max_new_tokens: int, llama_cpp: bool, json_out: Optional[Path]) -> None:
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


def _long_prompt_bench(tokens: int, json_out: Optional[Path], through_server: bool = True) -> None:
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


def _forward_profile(model: Optional[str], dtype: Optional[str], precision: Optional[str], ks_text: str,
                     json_out: Optional[Path]) -> None:
    from ..models import resolve_model
    from ..bench.forward_profile import PARTS, profile_forward

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
    """``bench --serve``: the load test of ``bench.serve``, printed as a table."""
    from ..bench.serve import DEFAULT_DOCUMENTS, run_serve_bench

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
    """``bench --batch``: the sweep of ``bench.batch``, printed as a table."""
    from ..bench.batch import DEFAULT_DOCUMENTS, plot_sweep, run_batch_sweep

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
