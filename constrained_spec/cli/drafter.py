"""drafter-data and train-drafter: a learned draft for a target model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import typer

from ..errors import InvalidOptionError
from .common import app, err, _report, _run_guarded


@app.command("drafter-data")
def drafter_data_cmd(
    out: Path = typer.Option(..., "--out", help="The JSONL file to write (a prompt and a schema per line)."),
    per_subset: int = typer.Option(40, "--per-subset", help="Prompts of each kind (generation, extraction) per subset."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="The JSONSchemaBench subsets (default: ../shared/data/jsonschemabench or $CONSTRAINED_SPEC_SCHEMA_DATA)."),
    seed: int = typer.Option(0, "--seed"),
    kinds: str = typer.Option("generation,extraction", "--kinds", help="The kinds of prompts written (generation, extraction or both, comma-separated); the repository's examples are extraction prompts."),
) -> None:
    """Write training prompts for train-drafter: generation and extraction prompts from every
    JSONSchemaBench subset except Glaiveai2K (kept for evaluation), with their schemas' valid
    instances as references, and the repository's examples."""
    def go() -> None:
        from ..pipelines.drafter_data import PROMPT_KINDS, training_prompts, write_jsonl

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
    data: Optional[Path] = typer.Option(None, "--data", help="JSONL: {\"prompt\": ..., \"schema\": ...} or {\"prompt\": ..., \"regex\": ...} per line (see drafter-data); default: drafter-data's prompts from the JSONSchemaBench subsets except Glaiveai2K, written into the head's directory."),
    out: Optional[Path] = typer.Option(None, "--out", help="Directory for the head (load it with draft=DIR / --draft DIR); checkpoints go there too. Default for a GGUF --target: the cache, where draft=True and auto find it for that file."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model id or path; default: the embedded SmolLM2-135M-Instruct."),
    precision: Optional[str] = typer.Option(None, "--precision", help="The target's precision (as in json; default: native for the embedded model)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="The run's budget once the model is loaded: about half reads or decodes the data (its lines in a seeded random order), the rest trains; the best head is kept."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Stop after this many optimizer steps."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Tokens the head can propose (the most used in the target's outputs, plus JSON punctuation)."),
    sampled: int = typer.Option(1, "--sampled", help="Sampled outputs per prompt, besides the greedy one."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Length limit of each training output."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N usable prompts only."),
    unroll: int = typer.Option(3, "--unroll", help="Training passes on the head's own states (EAGLE-3's training-time test)."),
    lr: float = typer.Option(5e-4, "--lr", help="AdamW learning rate."),
    resume: bool = typer.Option(True, "--resume/--fresh", help="Take up a checkpoint in --out from the same data and options."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Training outputs decoded at once in the batch engine (default 16; 1: one at a time)."),
    references: Optional[int] = typer.Option(None, "--references", help="Answers read per prompt line that has \"references\" (default 4; 0: decode every line): one target forward reads a whole answer, where decoding pays one per step."),
    seed: int = typer.Option(0, "--seed"),
    corpus_only: bool = typer.Option(False, "--corpus-only", help="Only decode the prompts greedily and write the corpus of the target's outputs to --out (no head; no budget needed)."),
) -> None:
    """Train a grammar-masked draft head for the target on its own masked law, along its
    constrained outputs and the data's references (EAGLE-3 style; see pipelines.train_drafter),
    and write the corpus of the decoded outputs beside it (drafters.corpus)."""
    def go() -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from ..models import load_model
        from ..pipelines.train_drafter import DECODE_BATCH, REFERENCES, TrainProgress, build_corpus, train_drafter

        if minutes is None and steps is None and not corpus_only:
            raise InvalidOptionError("Invalid training budget: give --minutes or --steps.")
        handle = load_model(target, precision=precision)
        where = _head_dir(handle, out)
        prompts = data if data is not None else _default_data(where)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err) as bar:
            tasks: dict[str, Any] = {}

            def progress(p: TrainProgress) -> None:
                if p.phase not in tasks:
                    tasks[p.phase] = bar.add_task({"decode": "decoding", "references": "reading references",
                                                   "train": "training"}[p.phase], total=p.total,
                                                   info="")
                info = "" if p.loss is None else (f"loss {p.loss:.3f}  held-out acceptance {p.agreement:.3f} (best {p.best:.3f})"
                                                  + (f", where lookup misses {p.hard:.3f}" if p.hard is not None else ""))
                bar.update(tasks[p.phase], completed=p.done, total=max(p.total, p.done), info=info)
                if not err.is_terminal and (p.loss is not None or p.done % 10 == 0 or p.done == p.total):
                    err.print(f"{p.phase} {p.done}/{p.total} {info}")  # a log file gets lines, not a bar

            if corpus_only:
                corpus = build_corpus(handle, prompts, where, max_new_tokens=max_new_tokens, limit=limit,
                                      batch=DECODE_BATCH if batch is None else batch, progress=progress)
                _report({"corpus_tokens": len(corpus), "out": str(where)}, None)
                return
            report = train_drafter(handle, prompts, where, minutes=minutes, steps=steps, draft_vocab=draft_vocab,
                                   sampled=sampled, max_new_tokens=max_new_tokens, limit=limit, seed=seed,
                                   unroll=unroll, lr=lr, resume=resume, batch=DECODE_BATCH if batch is None else batch,
                                   references=REFERENCES if references is None else references, progress=progress)
        _report({k: v for k, v in dataclasses.asdict(report).items() if k != "losses"} | {"out": str(where)}, None)

    _run_guarded(go)


def _head_dir(handle: Any, out: Optional[Path]) -> Path:
    """``--out``, or for a GGUF target the cache directory named by the file's identity, where
    ``draft=True`` and auto find the head for that file (``storage.trained_head_dir``)."""
    from ..storage import trained_head_dir

    if out is not None:
        return out
    if handle.gguf_file is None:
        raise InvalidOptionError("Invalid --out: give the directory to save the head in (only a GGUF file's head "
                                 "has a home in the cache).")
    return trained_head_dir(handle.gguf_file)


def _default_data(where: Path) -> Path:
    """drafter-data's training prompts (every JSONSchemaBench subset but the held-out
    Glaiveai2K, and the repository's examples), written to ``where/data.jsonl`` once."""
    from ..pipelines.drafter_data import default_data_dir, training_prompts, write_jsonl

    path = where / "data.jsonl"
    if path.is_file():
        return path
    source = default_data_dir()
    if not source.is_dir():
        raise InvalidOptionError(f"Invalid --data: none given and no JSONSchemaBench subsets at {str(source)!r} "
                                 "(set $CONSTRAINED_SPEC_SCHEMA_DATA, or write prompts with drafter-data).")
    return write_jsonl(training_prompts(source), path)
