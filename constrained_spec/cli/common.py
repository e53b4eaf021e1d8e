"""What every command shares: the Typer app, the options, and turning errors into exit codes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from ..errors import (
    ConstrainedSpecError, InvalidOptionError, InvalidSchemaError, OutputValidationError, TokenLimitError,
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

ModelOpt = typer.Option(None, "--model", "-m", help="A GGUF file (run at its own precision), a model id or a local folder; default: the embedded SmolLM2-135M-Instruct.")
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
PrecisionOpt = typer.Option(None, "--precision", help="native (a GGUF file's weights as stored, on the CPU kernels; the CPU default), float32, bfloat16 (the GPU default), or int8 / int4 (a float checkpoint quantized at load).")
WhitespaceOpt = typer.Option("canonical", "--whitespace", help="JSON layout: canonical (json.dumps style), flexible, compact, indented, or a whitespace regex.")
ClosedOpt = typer.Option(True, "--closed/--open", help="Objects that say nothing of other keys take their declared keys only (--closed, the default) or any key the schema allows (--open).")
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


def _options(**values: Any) -> Any:
    """The command's ``SpecOptions``, validated in the one place every caller uses."""
    from ..decoding import SpecOptions

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

    from .. import remote

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
    from ..models import load_model

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


def _report(report: dict, json_out: Optional[Path]) -> None:
    """Print a report as JSON (and write it to ``json_out``)."""
    text = json.dumps(report, indent=2)
    if json_out is not None:
        json_out.write_text(text + "\n")
    typer.echo(text)



def _counts(text: str, option: str) -> list[int]:
    """Comma-separated integers >= 1 (batch sizes, client counts), or ``InvalidOptionError``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise InvalidOptionError(f"Invalid {option}: expected comma-separated integers >= 1, got {text!r}.")
    return values
