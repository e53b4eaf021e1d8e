"""Side-by-side benchmark: target-only vs every drafter and K policy, plus outlines and llama.cpp
as references (``constrained-spec bench single``; figures in docs/performance.md and docs/drafters.md).

All configurations run in one process, interleaved prompt by prompt, so machine noise hits them
alike; figures are reported as ratios against target-only decoding measured in the same run.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..api import encode_prompt, generate_json
from ..constraint import JsonSchema, compile_constraint, load_schema, schema_to_regex
from ..decoding import DecodeStats
from ..errors import ConstrainedSpecError, InvalidOptionError
from ..models import ModelHandle, resolve_model
from .quality import field_accuracy

#: The extraction prompts shipped with the package (schemas inline), so an installed wheel runs them.
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "extraction.jsonl"
BASELINE = "target-only"
DEFAULT_CONFIG = "hybrid, adaptive K (auto)"


@dataclass(frozen=True)
class BenchConfig:
    """One row: a drafter and a K policy (``k_max=None``: the profile's cap)."""

    name: str
    drafter: str
    k_max: int | None = None
    adaptive: bool = True
    #: ``draft=`` of the request: None (auto's default: the shipped corpus where the model has
    #: one), True for the shipped head as well, False for no learned draft.
    draft: Any = None


#: Output tokens of a configuration's warm-up run: enough for the prompt pass, decode steps and
#: verify passes of several lengths.
WARM_UP_TOKENS = 24
HEAD_CONFIG = "auto + shipped head (draft=True)"
NO_LEARNED_CONFIG = "auto, nothing learned (draft=False)"


def default_configs(fixed_ks: tuple[int, ...] = (4, 8, 12, 16, 20), *, head: bool = False) -> list[BenchConfig]:
    """Target-only, each drafter alone, hybrid at fixed K values, and hybrid adaptive (the
    default); with ``head`` (the model ships a head and a corpus) also the head alone, auto
    with the head, and auto without either (``draft=False``)."""
    return [
        BenchConfig(BASELINE, "none"),
        BenchConfig("lookup", "lookup"),
        BenchConfig("grammar", "grammar"),
        *([BenchConfig("head", "head")] if head else []),
        *[BenchConfig(f"hybrid, fixed K={k}", "hybrid", k, adaptive=False) for k in fixed_ks],
        *([BenchConfig(HEAD_CONFIG, "hybrid", draft=True), BenchConfig(NO_LEARNED_CONFIG, "hybrid", draft=False)]
          if head else []),
        BenchConfig(DEFAULT_CONFIG, "hybrid"),
    ]


@dataclass
class ConfigFigures:
    """Aggregate figures of one configuration over all prompts."""

    name: str
    output_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    constraint_seconds: float = 0.0
    #: Constraint seconds per output token, one entry per step (its time over its tokens).
    constraint_per_token: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    identical: int = 0
    prompts: int = 0
    fields_right: int = 0
    fields_total: int = 0
    #: Seconds of the passes that carried the prompts (the first step of each request).
    prompt_seconds: float = 0.0
    per_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    per_position: dict[str, list[list[int]]] = field(default_factory=dict)
    draft_seconds_by_kind: dict[str, float] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)
    traces: list[DecodeStats] = field(default_factory=list)

    def add_value(self, value: Any, baseline_value: Any, expected: dict[str, Any] | None) -> None:
        """Count one output: equal to the baseline's? how many expected fields right?"""
        self.prompts += 1
        self.identical += value == baseline_value
        if expected:
            right, total = field_accuracy(value, expected)
            self.fields_right += right
            self.fields_total += total

    def add(self, stats: DecodeStats, seconds: float, value: Any, baseline_value: Any,
            expected: dict[str, Any] | None = None) -> None:
        """Fold one generation in."""
        self.add_value(value, baseline_value, expected)
        self.seconds += seconds
        self.prompt_seconds += stats.prefill_seconds
        self.output_tokens += stats.output_tokens
        self.target_forwards += stats.target_forwards
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.constraint_seconds += stats.constraint_seconds
        self.step_seconds += sum(stats.step_seconds)
        emitted = [b - a for a, b in zip([0, *stats.tokens_after_step], stats.tokens_after_step)]
        self.constraint_per_token += [c / n for c, n in zip(stats.constraint_step_seconds, emitted) if n]
        self.outputs.append(value)
        self.traces.append(stats)
        for kind, row in stats.per_kind.items():
            mine = self.per_kind.setdefault(kind, {"drafted": 0, "accepted": 0, "supplied": 0})
            for key in mine:
                mine[key] += row[key]
        for kind, rows in stats.per_position.items():
            acc = self.per_position.setdefault(kind, [])
            for j, (n, a) in enumerate(rows):
                if j == len(acc):
                    acc.append([0, 0])
                acc[j][0] += n
                acc[j][1] += a
        for kind, seconds in stats.draft_seconds_by_kind.items():
            self.draft_seconds_by_kind[kind] = self.draft_seconds_by_kind.get(kind, 0.0) + seconds

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second (prefill included)."""
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def draft_ms_per_token(self, kinds: dict[str, dict[str, int]]) -> float | None:
        """Milliseconds per drafted token of the costly drafters (a draft model, a head) in
        ``kinds``, their catch-up on the context included; None without one."""
        costly = [k for k in ("model", "head") if k in kinds and self.draft_seconds_by_kind.get(k)]
        if not costly:
            return None
        seconds = sum(self.draft_seconds_by_kind[k] for k in costly)
        return round(1000 * seconds / sum(kinds[k]["drafted"] for k in costly), 2)

    def summary(self, baseline: "ConfigFigures") -> dict[str, Any]:
        """The row printed and written with ``--json``."""
        tps = self.tokens_per_second
        kinds = {k: r for k, r in self.per_kind.items() if k != "target" and r["drafted"]}
        return {
            "config": self.name,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "prompt_pass_ms_mean": round(1000 * self.prompt_seconds / self.prompts, 1)
            if self.prompt_seconds and self.prompts else None,
            "tokens_per_second": round(tps, 2),
            "speedup_vs_target_only": round(tps / baseline.tokens_per_second, 3) if baseline.tokens_per_second else None,
            "target_forwards_per_token": round(self.target_forwards / self.output_tokens, 3) if self.target_forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "acceptance_by_kind": {k: round(r["accepted"] / r["drafted"], 3) for k, r in kinds.items()} or None,
            "share_of_output_by_kind": {k: round(r["supplied"] / self.output_tokens, 3)
                                        for k, r in self.per_kind.items()} if self.per_kind and self.output_tokens else None,
            "constraint_ms_per_token": round(1000 * self.constraint_seconds / self.output_tokens, 3)
            if self.target_forwards and self.output_tokens else None,
            "constraint_ms_per_token_p50": _pct_ms(self.constraint_per_token, 0.5),
            "constraint_ms_per_token_p99": _pct_ms(self.constraint_per_token, 0.99),
            "constraint_share_of_step": round(self.constraint_seconds / self.step_seconds, 4) if self.step_seconds else None,
            "head_acceptance_by_position": [round(a / n, 3) for n, a in self.per_position.get("head", []) if n][:6]
            or None,
            "draft_ms_per_token": self.draft_ms_per_token(kinds),
            "identical_outputs": f"{self.identical}/{self.prompts}",
            "field_accuracy": f"{self.fields_right}/{self.fields_total}" if self.fields_total else None,
        }


def _pct_ms(values: list[float], q: float) -> float | None:
    """The q-quantile of ``values`` (seconds) in milliseconds."""
    return round(1000 * float(np.quantile(values, q)), 3) if values else None


def has_shipped_head(handle: ModelHandle) -> bool:
    """Whether the package ships a draft head for this model."""
    from ..drafters.head import shipped_head_dir

    return shipped_head_dir(handle.model, handle.vocabulary.fingerprint) is not None


def load_prompts(path: Path | str = DEFAULT_PROMPTS, limit: int | None = None) -> list[dict[str, Any]]:
    """Benchmark items: ``{"id", "schema", "prompt"}`` per JSONL line; ``schema`` is a schema
    object, or a file path (relative to the JSONL file or its ``../schemas`` folder).
    ``limit`` keeps the first that many."""
    path = Path(path)
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    for item in items:
        if isinstance(item["schema"], str):
            sp = Path(item["schema"])
            for candidate in (sp, path.parent / sp, path.parent.parent / "schemas" / sp):
                if candidate.is_file():
                    sp = candidate
                    break
            item["schema"] = str(sp)
    return items


#: A reference row: given the schema, the chat-formatted prompt text and its token ids, compile
#: whatever it needs (outside the timing) and return the call to time, which returns text.
Reference = Callable[[JsonSchema, str, list[int], int], Callable[[], str]]


def outlines_row(handle: ModelHandle, max_new_tokens: int) -> Reference:
    """outlines' own transformers generator over the very same regex (same language, same layout)."""
    import outlines
    from outlines.types import Regex

    model = outlines.from_transformers(handle.model, handle.tokenizer)

    def prepare(schema: JsonSchema, text: str, ids: list[int], tokens: int) -> Callable[[], str]:
        gen = outlines.Generator(model, Regex(schema_to_regex(schema.schema)))
        gen(text, max_new_tokens=2, do_sample=False)  # compile its own index outside the timing
        return lambda: gen(text, max_new_tokens=max_new_tokens, do_sample=False)

    return prepare


def llama_cpp_rows(gguf_file: Path, max_new_tokens: int) -> dict[str, Reference]:
    """llama.cpp (llama-cpp-python) on the very GGUF file our model was loaded from, as stored:
    its grammar path, with the grammar llama.cpp builds from the JSON schema, and its plain
    decoding with no grammar at all, asked for as many tokens as our target-only run emitted (so
    both rows decode the same length); empty where llama-cpp-python is not installed. The same
    prompt token ids; its prompt cache is reset before each call (no reuse). It runs in a process
    of its own (``bench.llama_cpp_worker``), so a crash there costs the rows, not the run."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {}
    try:
        worker = LlamaCppWorker(str(gguf_file), os.cpu_count() or 1)
    except RuntimeError as e:  # it could not even load and warm up: no row, and say why
        print(f"No llama.cpp rows: {e}", file=sys.stderr)
        return {}

    def grammar(schema: JsonSchema, text: str, ids: list[int], tokens: int) -> Callable[[], str]:
        grammar = worker.ask({"op": "grammar", "schema": schema.schema})["id"]
        return lambda: worker.ask({"op": "generate", "grammar": grammar, "ids": ids, "max_tokens": max_new_tokens})["text"]

    def plain(schema: JsonSchema, text: str, ids: list[int], tokens: int) -> Callable[[], str]:
        return lambda: worker.ask({"op": "generate", "grammar": None, "ids": ids, "max_tokens": tokens})["text"]

    return {"llama.cpp grammar (reference)": grammar, "llama.cpp, no grammar, same length (reference)": plain}


class LlamaCppWorker:
    """The bench's end of ``bench.llama_cpp_worker``: one process, asked one request at a time."""

    def __init__(self, model_path: str, n_threads: int, n_ctx: int | None = None) -> None:
        from . import llama_cpp_worker

        # ``n_ctx``: llama.cpp's context in tokens (None: the worker's default, 4096).
        args = [sys.executable, llama_cpp_worker.__file__, model_path, str(n_threads)] + ([str(n_ctx)] if n_ctx else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        atexit.register(self.close)
        self._read()  # "ready": the model is loaded and warm

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply; a reply with an error raises RuntimeError."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._ended() from None
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"llama.cpp: {reply['error']}")
        return reply

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._ended()
        return json.loads(line)

    def _ended(self) -> RuntimeError:
        return RuntimeError(f"llama.cpp's worker process ended (exit code {self.proc.wait()}).")

    def close(self) -> None:
        """End the worker process."""
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=10)


def run_bench(
    prompts: Path | str = DEFAULT_PROMPTS,
    *,
    model: Any = None,
    configs: list[BenchConfig] | None = None,
    max_new_tokens: int = 256,
    profile: str | None = None,
    outlines_reference: bool = True,
    llama_cpp: bool = True,
    limit: int | None = None,
    precisions: tuple[str, ...] | None = None,
    workload: str = "extraction",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run every configuration on every prompt (the first ``limit``); return the figures (see
    ``ConfigFigures.summary``).

    ``precisions`` (e.g. ``("float32", "native")``) loads the embedded model once per precision and
    runs every configuration on each, interleaved prompt by prompt; speedups are against the
    first precision's target-only row, and "identical" compares each row with the target-only
    output of its own precision (greedy identity holds within a precision).

    Reference rows, timed on the same prompts: outlines' transformers generator
    (``outlines_reference``) and, for the embedded model where llama-cpp-python is installed,
    llama.cpp's grammar path (``llama_cpp``). "field_accuracy" counts the extracted fields that
    equal the prompt's ``expected`` values (``bench.quality``).
    """
    handles = _handles(model, precisions)
    labels = list(handles)
    handle = handles[labels[0]]
    items = workload_items(workload, prompts, limit)
    configs = configs or default_configs(head=has_shipped_head(handle))
    figures = {_label(labels, p, c): ConfigFigures(_label(labels, p, c)) for p in labels for c in configs}
    references = _references(handle, max_new_tokens, outlines_reference, llama_cpp)
    _warm_up(handles, configs, items[0], profile)
    profile_used = _run_prompts(items, handles, configs, figures, references, profile=profile,
                                max_new_tokens=max_new_tokens, progress=progress)
    baseline = figures[_label(labels, labels[0], configs[0])]
    rows, one_step_ms = _summary_rows(figures, baseline, references, len(labels) > 1)
    default = figures.get(_label(labels, labels[-1], configs[-1])) or list(figures.values())[-1]
    return {
        "model": handle.name if len(labels) == 1 else handle.name.split(" (")[0],  # without the precision
        "dtype": ", ".join(labels),
        "precision": ", ".join(labels),
        "profile": profile_used,
        "prompts": len(items),
        "workload": workload,
        "one_token_target_step_ms": round(one_step_ms, 2) if one_step_ms else None,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
        "outputs": {item["id"]: default.outputs[j] for j, item in enumerate(items)},
        "trace": _trace(baseline, default, items),
    }


def _handles(model: Any, precisions: tuple[str, ...] | None) -> dict[str, ModelHandle]:
    """The model once per precision (the embedded model's), or as given, keyed by precision."""
    if precisions:
        from ..models import load_model

        return {p: load_model(model, precision=p) for p in precisions}
    h = resolve_model(model)
    return {h.precision: h}


def workload_items(workload: str, prompts: Path | str, limit: int | None) -> list[dict[str, Any]]:
    """The prompts of ``workload``: the extraction prompts, or held-out schemas to generate from."""
    if workload == "generation":  # held-out schemas (Glaiveai2K): never seen by a trained head
        from ..pipelines.drafter_data import generation_workload

        items = generation_workload(limit=limit or 20)
        if not items:
            raise InvalidOptionError("Invalid workload: no Glaiveai2K schemas found (set $CONSTRAINED_SPEC_SCHEMA_DATA).")
        return items
    if workload == "extraction":
        return load_prompts(prompts, limit)
    raise InvalidOptionError(f"Invalid workload: expected 'extraction' or 'generation', got {workload!r}.")


def _run_prompts(items: list[dict[str, Any]], handles: dict[str, ModelHandle], configs: list[BenchConfig],
                 figures: dict[str, ConfigFigures], references: dict[str, tuple[Reference, ConfigFigures]], *,
                 profile: str | None, max_new_tokens: int, progress: Callable[[int, int], None] | None) -> str | None:
    """Time every configuration at every precision, then the references, on each prompt in
    turn, adding each run to its row's figures; the profile the last run used."""
    labels = list(handles)
    handle = handles[labels[0]]
    profile_used = None
    runs_order = [(p, c) for p in labels for c in configs]
    for i, item in enumerate(items):
        schema = load_schema(item["schema"])
        compile_constraint(schema, handle.tokenizer)  # compile outside the timings
        # The configurations take turns going first (rotated per prompt), so a slow start or a
        # warm cache does not always favour the same row.
        shift = i % len(runs_order)
        runs = {_label(labels, precision, config): _timed_run(handles[precision], config, schema, item["prompt"],
                                                              profile, max_new_tokens)
                for precision, config in runs_order[shift:] + runs_order[:shift]}
        profile_used = list(runs.values())[-1][0].profile  # the last run's
        for precision in labels:
            base_value = runs[_label(labels, precision, configs[0])][2]
            for config in configs:
                figures[_label(labels, precision, config)].add(*runs[_label(labels, precision, config)], base_value,
                                                               item.get("expected"))
        base = runs[_label(labels, labels[0], configs[0])]
        _time_references(references, handle, schema, item, base[2], base[0].output_tokens)
        if progress is not None:
            progress(i + 1, len(items))
    return profile_used


def _label(labels: list[str], precision: str, config: BenchConfig) -> str:
    """A row's name: the configuration's, with its precision when several are compared."""
    return config.name if len(labels) == 1 else f"{precision}: {config.name}"


def _references(handle: ModelHandle, max_new_tokens: int, outlines_reference: bool,
                llama_cpp: bool) -> dict[str, tuple[Reference, ConfigFigures]]:
    """The outside engines' rows that can run here, each with its figures."""
    references: dict[str, tuple[Reference, ConfigFigures]] = {}
    if outlines_reference:
        name = "outlines + transformers (reference)"
        references[name] = (outlines_row(handle, max_new_tokens), ConfigFigures(name))
    if llama_cpp and handle.gguf_file is not None:
        for name, row in llama_cpp_rows(handle.gguf_file, max_new_tokens).items():
            references[name] = (row, ConfigFigures(name))
    return references


def _warm_up(handles: dict[str, ModelHandle], configs: list[BenchConfig], item: dict[str, Any],
             profile: str | None) -> None:
    """Run every configuration once on the first prompt and its schema, untimed, so that no row
    pays a one-time cost (a kernel built on first use, a scripted loop compiled for a shape, the
    first allocations): a warm-up on another schema or path left them to whichever row ran first."""
    schema = load_schema(item["schema"])
    for h in handles.values():
        for config in configs:
            _timed_run(h, config, schema, item["prompt"], profile, WARM_UP_TOKENS)


def _timed_run(handle: ModelHandle, config: BenchConfig, schema: JsonSchema, prompt: str, profile: str | None,
               max_new_tokens: int) -> tuple[DecodeStats, float, Any]:
    """(statistics, seconds, value) of one configuration on one prompt."""
    t0 = time.perf_counter()
    stream = generate_json(handle, schema, prompt, drafter=config.drafter,  # type: ignore[arg-type]
                           draft=config.draft, k_max=config.k_max, adaptive=config.adaptive,
                           profile=profile, max_new_tokens=max_new_tokens, stream=True)
    try:
        for _ in stream:
            pass
        value = stream.value
    except ConstrainedSpecError as e:
        # A generation that ends in an error (the token limit, a loop) is timed too and
        # compared by its text: greedy identity holds for errors as well.
        value = {"error": type(e).__name__, "text": stream.text}
    stats = stream.stats or stream._decoder.stats  # an error inside a step leaves the figures there
    return stats, time.perf_counter() - t0, value


def _time_references(references: dict[str, tuple[Reference, ConfigFigures]], handle: ModelHandle,
                     schema: JsonSchema, item: dict[str, Any], base_value: Any, base_tokens: int) -> None:
    """Time each outside engine on the prompt, compared with target-only's value (``base_value``,
    ``base_tokens`` long). They get the token ids our decoder starts from (through the chat
    template where the model has one; a base model's prompt as written)."""
    tok = handle.tokenizer
    text = (tok.apply_chat_template([{"role": "user", "content": item["prompt"]}], add_generation_prompt=True,
                                    tokenize=False) if getattr(tok, "chat_template", None) else item["prompt"])
    ids = encode_prompt(handle, item["prompt"])
    for prepare, row in references.values():
        try:
            call = prepare(schema, text, ids, base_tokens)
            t0 = time.perf_counter()
            out = call()
        except Exception:  # noqa: BLE001  (an outside engine that cannot take this schema: not counted)
            continue
        row.seconds += time.perf_counter() - t0
        row.output_tokens += len(handle.tokenizer(out, add_special_tokens=False)["input_ids"])
        try:
            value = json.loads(out)
        except json.JSONDecodeError:
            value = None  # cut off at the token limit: counts as different and wrong
        row.add_value(value, base_value, item.get("expected"))


def _summary_rows(figures: dict[str, ConfigFigures], baseline: ConfigFigures,
                  references: dict[str, tuple[Reference, ConfigFigures]],
                  several_precisions: bool) -> tuple[list[dict[str, Any]], float | None]:
    """Every row's summary against ``baseline``, and the median one-token target step in ms."""
    rows = [f.summary(baseline) for f in figures.values()]
    if several_precisions:  # greedy agreement across precisions: each row against the first precision's target-only
        for row, fig in zip(rows, figures.values()):
            row["same_as_first_precision"] = f"{sum(a == b for a, b in zip(fig.outputs, baseline.outputs))}/{fig.prompts}"
    rows += [row.summary(baseline) for _, row in references.values()]
    # A one-token target step (target-only, after each prompt's pass): what a draft token's cost is weighed against.
    steps = [t for st in baseline.traces for t in st.step_seconds[1:]]
    one_step_ms = 1000 * float(np.median(steps)) if steps else None
    for row in rows:
        ms = row.get("draft_ms_per_token")
        row["draft_cost_vs_target_step"] = round(ms / one_step_ms, 3) if ms and one_step_ms else None
    return rows, one_step_ms


def _trace(baseline: ConfigFigures, spec: ConfigFigures, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step timeline of the longest prompt, target-only vs the default configuration."""
    j = max(range(len(items)), key=lambda i: spec.traces[i].output_tokens)

    def timeline(stats: DecodeStats) -> dict[str, list[float]]:
        return {"seconds": [round(t, 4) for t in stats.step_ends], "tokens": stats.tokens_after_step,
                "k": stats.ks, "accepted": stats.accepted_per_step}

    return {"prompt": items[j]["id"], baseline.name: timeline(baseline.traces[j]), spec.name: timeline(spec.traces[j])}


def plot_trace(report: dict[str, Any], path: Path | str) -> Path:
    """PNG: output tokens over time (target-only vs default) and K per step of the default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = report["trace"]
    names = [n for n in trace if n != "prompt"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5))
    for name in names:
        ax1.step(trace[name]["seconds"], trace[name]["tokens"], where="post", label=name)
    ax1.set_xlabel("seconds since the request started")
    ax1.set_ylabel("output tokens")
    ax1.set_title(f"{report['model']} ({report['dtype']}), prompt {trace['prompt']}: tokens over time")
    ax1.legend()
    spec = trace[names[-1]]
    steps = list(range(1, len(spec["k"]) + 1))
    ax2.bar(steps, spec["k"], color="#bbbbbb", label="K verified")
    ax2.bar(steps, spec["accepted"], color="#2a7ab9", label="accepted")
    ax2.set_xlabel("speculative step")
    ax2.set_ylabel("tokens")
    ax2.set_title(f"{names[-1]}: K and accepted tokens per step")
    ax2.legend()
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path | str) -> Path:
    """Write a matplotlib figure as a PNG and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
