"""json, regex and demo: one constrained generation from the command line."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from .common import AdaptiveOpt, app, BackendOpt, DrafterOpt, DraftOpt, DtypeOpt, err, EXAMPLE_PROMPT, _generate_and_print, KOpt, LenientOpt, MaxOpt, _model_arg, ModelOpt, _options, PrecisionOpt, _print_stats, ProfileOpt, _prompt_text, PromptOpt, _remote_and_print, _run_guarded, _schema_arg, SeedOpt, ServerOpt, StatsOpt, StreamOpt, TempOpt, WhitespaceOpt, ClosedOpt


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
    closed: bool = ClosedOpt,
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
        from .. import remote

        _run_guarded(lambda: _remote_and_print(
            server, remote.json_constraint(remote.schema_dict(_schema_arg(schema)), lenient), text,
            lambda t: render(json.loads(t)), stream=stream, stats=stats, temperature=temperature, seed=seed,
            max_new_tokens=max_new_tokens, drafter=drafter, k_max=k_max, adaptive=adaptive))
        return
    def run() -> None:
        from ..constraint import check_constraint, load_schema
        from ..constraint.schema import closed_schema

        target = load_schema(_schema_arg(schema))
        # First, before the models' libraries import and --dtype / --precision load the model.
        check_constraint(closed_schema(target, closed), kind="json", backend=backend, lenient=lenient,
                         whitespace=whitespace)
        options = _options(drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                           k_max=k_max, profile=profile, adaptive=adaptive, backend=backend, lenient=lenient,
                           whitespace=whitespace, closed=closed)
        from ..api import generate_json  # after the check: it imports the models' libraries

        _generate_and_print(generate_json, target, text, render, stream=stream, stats=stats,
                            model=_model_arg(model, dtype, precision), draft=draft, options=options)

    _run_guarded(run)


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
        from .. import remote

        _run_guarded(lambda: _remote_and_print(
            server, remote.regex_constraint(pattern), text, str, stream=stream, stats=stats, temperature=temperature,
            seed=seed, max_new_tokens=max_new_tokens, drafter=drafter, k_max=k_max, adaptive=adaptive))
        return
    def run() -> None:
        from ..constraint import check_constraint

        # First, before the models' libraries import and --dtype / --precision load the model.
        check_constraint(pattern, kind="regex", backend=backend)
        options = _options(drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                           k_max=k_max, profile=profile, adaptive=adaptive, backend=backend)
        from ..api import generate_regex  # after the check: it imports the models' libraries

        _generate_and_print(generate_regex, pattern, text, str, stream=stream, stats=stats,
                            model=_model_arg(model, dtype, precision), draft=draft, options=options)

    _run_guarded(run)


@app.command("demo")
def demo_cmd() -> None:
    """The main job in one command: generate_json on the embedded model, target-only and speculative.

    Prints the extracted object and the speed figures of both runs.
    """
    from ..api import generate_json

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                       "occupation": {"type": "string"}},
        "required": ["name", "age", "city", "occupation"],
    }

    def go() -> None:
        # Both runs once untimed, on the schema, prompt and paths they time: a one-time cost (a
        # kernel built on first use, a scripted loop compiled, first allocations) that a warm-up
        # elsewhere missed would land in whichever run came first and falsify the speedup.
        for drafter in ("none", "auto"):
            generate_json(None, schema, EXAMPLE_PROMPT, drafter=drafter)
        base, s0 = generate_json(None, schema, EXAMPLE_PROMPT, drafter="none", return_stats=True)
        value, s1 = generate_json(None, schema, EXAMPLE_PROMPT, drafter="auto", return_stats=True)
        print(json.dumps(value, ensure_ascii=False, indent=2))
        for label, st in (("target-only", s0), ("speculative", s1)):
            err.print(f"[bold]{label}[/]", end=": ")
            _print_stats(st)
        err.print(f"speedup {s1.tokens_per_second / s0.tokens_per_second:.2f}x; identical output: {value == base}")

    _run_guarded(go)
