"""Long documents, one request each: the harness of ``constrained-spec bench documents``.

For extraction over documents the prompt is most of the job, so this bench reports what a long
prompt costs: prompt tokens per second (over the time to first token), the time to first token
(overall and per length bucket) and the whole-request time, beside the output speed after the
first token, field accuracy, agreement with target-only and schema validity.

The documents are real and on every machine the tests run on: the long descriptions (the body of
``METADATA``) of packages the project's test install always has, images and HTML stripped,
picked to spread over 500-4,500 prompt tokens. The schema asks for facts whose truth is in the
same ``METADATA``'s headers (name, summary, language classifiers, licence), so the fields are
scored without hand labels.

Rows, side by side in one run and interleaved document by document: native target-only and auto
(greedy), then llama.cpp on the same GGUF file (its grammar path, and its plain decoding for as
many tokens as target-only emitted), with a context large enough for the longest prompt. Every
request starts cold: our prefix cache is off and llama.cpp's is reset, so each pays for its whole
prompt, as the first request over a new document does. More rows (the path before a change, say)
are ``DocConfig`` entries in ``configs``.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from ..api import encode_prompt, generate_json, validate_json_output
from ..constraint import JsonSchema, load_schema
from ..errors import ConstrainedSpecError, InvalidPromptError
from ..models import ModelHandle, resolve_model
from ..pipelines.extract import describe_fields
from .long_prompt import DOCUMENT_FIRST_TEMPLATE

#: Packages of the project's install and its test extra (and what they always pull in), in a
#: fixed order; those whose description falls in the range are candidates.
DEFAULT_PACKAGES: tuple[str, ...] = (
    "transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "torch", "numpy", "sympy",
    "outlines", "outlines_core", "llguidance", "jsonschema", "regex", "pydantic", "pydantic_core",
    "annotated-types", "gguf", "typer", "rich", "matplotlib", "pytest", "scipy", "hypothesis", "fastapi",
    "starlette", "uvicorn", "sse-starlette", "ray", "mkdocs", "mkdocs-material", "mkdocstrings", "openai",
)
#: How many documents the bench picks.
DOCUMENTS = 12
#: Prompt tokens (the document, the instruction and the chat template) a document may take.
TOKEN_RANGE = (500, 4500)
#: Upper edges of the time-to-first-token buckets, in prompt tokens (the last one takes the rest).
BUCKETS: tuple[tuple[str, int], ...] = (("500-1.5k", 1500), ("1.5k-3k", 3000), ("3k-4.5k", 4500))
#: The row "identical" compares with; llama.cpp's rows are named as in ``bench single``.
BASELINE = "native target-only"
LLAMA_GRAMMAR = "llama.cpp grammar (reference)"
LLAMA_PLAIN = "llama.cpp, no grammar, same length (reference)"


class PackageFacts(BaseModel):
    """What a package description states; each field's truth is in the package's METADATA headers."""

    # No other keys: a small model otherwise goes on with fields of its own and no one scores them.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the package's name, as installed with pip")
    summary: str = Field(description="what the package does, in one sentence")
    language: str = Field(description="the main programming language it is for")
    license: str = Field(description="its licence, e.g. MIT or Apache-2.0; empty if the document names none")


def facts_schema() -> JsonSchema:
    """``PackageFacts`` as a JSON schema (values come back as dicts, scored as such)."""
    return load_schema(PackageFacts.model_json_schema())


@dataclass(frozen=True)
class PackageDocument:
    """One package's description, its truth from the headers and, once picked, its prompt tokens.
    ``truth``: ``name``, ``summary`` (or None), ``language`` (the classifiers' languages, or
    None) and ``license`` (None where the headers name none or the text never mentions one)."""

    name: str
    version: str
    text: str
    truth: dict[str, Any]
    tokens: int = 0


# --------------------------------------------------------------------------------------------
# The documents
# --------------------------------------------------------------------------------------------

_NOISE = (
    (re.compile(r"<!--.*?-->", re.S), ""),  # HTML comments
    (re.compile(r"\[!\[[^\]]*\]\([^)]*\)\]\([^)]*\)"), ""),  # linked badges
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # markdown images
    (re.compile(r"^\.\. (?:\|[^|]*\| )?image::.*\n(?:[ \t]+:[\w-]+:.*\n)*", re.M), ""),  # reST images
    (re.compile(r"`([^`<]+?)\s*<[^>`]+>`_{1,2}"), r"\1"),  # a reST link keeps its words, not its URL
    (re.compile(r"<[^>\n]+>"), ""),  # HTML tags (their text stays)
    (re.compile(r"\[([^\]\n]+)\]\((?:[^()\s]|\([^)\s]*\))*\)"), r"\1"),  # a link keeps its words, not its URL
    (re.compile(r"\n[ \t]*(?:\n[ \t]*){2,}"), "\n\n"),  # runs of blank lines
)


def clean_description(text: str) -> str:
    """A description as prose: images, badges, HTML tags and link targets removed, the words kept."""
    for pattern, repl in _NOISE:
        text = pattern.sub(repl, text)
    return text.strip()


def header_truth(meta: Any, text: str) -> dict[str, Any]:
    """The facts the METADATA headers state (see ``PackageDocument``)."""
    classifiers = meta.get_all("Classifier") or []
    languages = sorted({c.split("::")[1].strip() for c in classifiers if c.startswith("Programming Language ::")})
    header = (meta.get("License") or "").strip()
    licence = (meta.get("License-Expression")
               or (header if header and "\n" not in header and len(header) <= 60 else None)
               or " ".join(c.rsplit("::", 1)[-1].strip() for c in classifiers if c.startswith("License ::")))
    # A licence the text never mentions cannot be extracted from it: not scored.
    mentioned = re.search(r"licen[cs]e", text, re.I) is not None
    return {"name": meta["Name"], "summary": meta.get("Summary") or None, "language": languages or None,
            "license": licence if licence and mentioned else None}


def package_document(name: str) -> PackageDocument | None:
    """The installed package's cleaned description and truth; None if it is not installed or has none."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    meta = dist.metadata
    body = meta.get_payload() or meta.get("Description") or ""  # type: ignore[attr-defined]
    text = clean_description(str(body))
    if not text:
        return None
    return PackageDocument(meta["Name"], meta["Version"], text, header_truth(meta, text))


def installed_documents(packages: Iterable[str] = DEFAULT_PACKAGES) -> list[PackageDocument]:
    """Each of ``packages`` that is installed and has a description, in the order given."""
    return [d for d in map(package_document, packages) if d is not None]


def pick_documents(candidates: Iterable[PackageDocument], count: Callable[[PackageDocument], int], *,
                   n: int = DOCUMENTS, token_range: tuple[int, int] = TOKEN_RANGE) -> list[PackageDocument]:
    """Up to ``n`` documents whose ``count`` (prompt tokens) is within ``token_range``, spread
    over it: for each of ``n`` evenly spaced lengths, the nearest candidate not yet taken (ties
    by name). Deterministic for a given set of candidates; sorted by length, ``tokens`` set."""
    lo, hi = token_range
    inside = sorted(((t, d) for d in candidates if lo <= (t := count(d)) <= hi), key=lambda p: (p[0], p[1].name))
    picked: list[tuple[int, PackageDocument]] = []
    for i in range(n):
        if not inside:
            break
        target = lo + (hi - lo) * (i + 0.5) / n
        j = min(range(len(inside)), key=lambda k: (abs(inside[k][0] - target), inside[k][1].name))
        picked.append(inside.pop(j))
    return [replace(d, tokens=t) for t, d in sorted(picked, key=lambda p: (p[0], p[1].name))]


def document_prompt(doc: PackageDocument, schema: JsonSchema | None = None) -> str:
    """The request's prompt: the document first, then the extraction instruction and the fields
    (the long-prompt bench's template, fields as ``extract`` lists them)."""
    fields = describe_fields((schema or facts_schema()).schema)
    return DOCUMENT_FIRST_TEMPLATE.format(text=doc.text, fields=fields)


# --------------------------------------------------------------------------------------------
# Scoring against the headers
# --------------------------------------------------------------------------------------------

_STOP = frozenset("the and for with from into that this your are its our you can all any".split())
_LICENCE_FAMILIES = (
    ("apache", r"\bapache"), ("mit", r"\bmit\b"), ("bsd", r"\b0?bsd"), ("lgpl", r"\blgpl|lesser general public"),
    ("gpl", r"\bgpl|(?<!lesser )general public licen"), ("mpl", r"\bmpl\b|mozilla public"), ("isc", r"\bisc\b"),
    ("psf", r"\bpsf\b|python software foundation"), ("unlicense", r"\bunlicense"), ("cc0", r"\bcc0\b"),
)


def package_key(name: str) -> str:
    """A package name as pip compares them (PEP 503: case and runs of ``-_.`` do not matter)."""
    return re.sub(r"[-_.]+", "-", name.strip().strip("`'\"")).casefold()


def _content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.casefold()) if len(w) > 2 and w not in _STOP}


def licence_families(text: str) -> set[str]:
    """The licence families a licence text or SPDX expression names ("Apache-2.0 AND MIT": apache, mit)."""
    low = text.casefold()
    return {name for name, pattern in _LICENCE_FAMILIES if re.search(pattern, low)}


def field_right(name: str, got: Any, truth: Any) -> bool:
    """Whether one extracted field agrees with its truth, leniently: the name as pip compares
    names; the summary when it holds at least half of the header summary's content words; the
    language when it names one of the classifiers' languages; the licence when it names one of
    the header licence's families."""
    if not isinstance(got, str):
        return False
    if name == "name":
        return package_key(got) == package_key(truth)
    if name == "summary":
        want = _content_words(truth)
        return bool(want) and len(want & _content_words(got)) >= len(want) / 2
    if name == "language":
        return any(re.search(rf"(?<!\w){re.escape(lang.casefold())}(?!\w)", got.casefold()) for lang in truth)
    if name == "license":
        return bool(licence_families(got) & licence_families(truth))
    raise ValueError(f"Invalid field: expected one of {list(PackageFacts.model_fields)}, got {name!r}.")


def score_facts(value: Any, truth: dict[str, Any]) -> tuple[int, int]:
    """``(right, total)`` over the fields that have a truth; a missing or unparsed value is wrong."""
    got = value if isinstance(value, dict) else {}
    fields = [k for k, v in truth.items() if v]
    return sum(field_right(k, got.get(k), truth[k]) for k in fields), len(fields)


# --------------------------------------------------------------------------------------------
# The rows
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DocConfig:
    """One native row: ``generate_json``'s drafter and draft, and any other options (``options``:
    keyword overrides, e.g. to select the path before a change as a row of its own); ``model``:
    the handle this row runs on where it is not the bench's (the same file loaded otherwise)."""

    name: str
    drafter: str
    draft: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    model: ModelHandle | None = None


def default_configs() -> list[DocConfig]:
    """Target-only (the baseline, first) and auto, the default a new user gets."""
    return [DocConfig(BASELINE, "none"), DocConfig("native auto", "auto")]


def runtime_config_rows(handle: ModelHandle, overrides: Iterable[str]) -> list[DocConfig]:
    """The default rows, then target-only and auto again on the same native model (the embedded
    one, or the same GGUF file) loaded with each of ``overrides``: ``RuntimeConfig`` fields as
    ``field=value`` pairs joined by commas (e.g. ``prompt_linears=dense,prompt_attention=bfloat16``,
    values as the variables take them): the path before a change side by side with the current
    one, in one run."""
    from ..config import RuntimeConfig
    from ..models import load_model
    from ..models.loading import DEFAULT_MODEL_NAME

    embedded = handle.native_precision is not None and handle.name.startswith(DEFAULT_MODEL_NAME)
    if handle.native_precision is None or not (embedded or handle.gguf_file is not None):
        raise ValueError("Invalid --row-config: it compares settings of a model at native precision (the embedded "
                         "one or a GGUF file).")
    configs = default_configs()
    for text in overrides:
        pairs = dict(pair.split("=", 1) for pair in text.split(",") if "=" in pair)
        if not pairs or len(pairs) != len(text.split(",")):
            raise ValueError(f"Invalid --row-config {text!r}: expected field=value pairs joined by commas.")
        try:
            config = dataclasses.replace(RuntimeConfig.from_env(), **pairs)
        except TypeError as e:
            raise ValueError(f"Invalid --row-config {text!r}: {e}") from None
        other = (load_model(precision=handle.native_precision, config=config) if embedded
                 else load_model(str(handle.gguf_file), config=config))
        configs += [DocConfig(f"{c.name}, {text}", c.drafter, c.draft, c.options, other) for c in default_configs()]
    return configs


@dataclass
class Run:
    """One request's outcome: its value (parsed, or None), whether it validated, and its times.
    ``first_token_s``: from the request to its first piece of text; ``prompt_pass_s``: the
    engine's own prompt-pass time (None where it does not say); ``error``: why an invalid
    output failed (the error's kind)."""

    value: Any
    text: str
    valid: bool
    prompt_tokens: int
    output_tokens: int
    first_token_s: float
    seconds: float
    prompt_pass_s: float | None = None
    error: str | None = None

    @property
    def key(self) -> Any:
        """What "identical" compares: the parsed value, or the text where it did not parse."""
        return self.value if self.value is not None else ("text", self.text)


@dataclass
class DocRow:
    """One row's runs, document by document."""

    name: str
    runs: list[Run] = field(default_factory=list)
    identical: int = 0
    fields_right: int = 0
    fields_total: int = 0

    def add(self, run: Run, baseline: Run, truth: dict[str, Any]) -> None:
        """Fold one document's run in, compared with the baseline's run on it."""
        self.runs.append(run)
        self.identical += run.key == baseline.key
        right, total = score_facts(run.value, truth)
        self.fields_right += right
        self.fields_total += total

    def summary(self) -> dict[str, Any]:
        """The row printed and written with ``--json``."""
        runs, n = self.runs, len(self.runs)
        first = sum(r.first_token_s for r in runs)
        after = sum(r.seconds - r.first_token_s for r in runs)
        passes = [r.prompt_pass_s for r in runs]
        return {
            "config": self.name,
            "documents": n,
            "prompt_tokens": sum(r.prompt_tokens for r in runs),
            "prompt_tokens_per_second": round(sum(r.prompt_tokens for r in runs) / first, 1) if first else None,
            "first_token_s_mean": round(first / n, 3) if n else None,
            "first_token_s_by_bucket": self._by_bucket(),
            "whole_request_s": round(sum(r.seconds for r in runs), 2),
            "prompt_pass_s": round(sum(passes), 2) if n and None not in passes else None,  # type: ignore[arg-type]
            "output_tokens": sum(r.output_tokens for r in runs),
            "output_tokens_per_second_after_first": round(sum(max(r.output_tokens - 1, 0) for r in runs) / after, 1)
            if after > 0 else None,
            "field_accuracy": f"{self.fields_right}/{self.fields_total}" if self.fields_total else None,
            "identical_to_target_only": f"{self.identical}/{n}",
            "valid": f"{sum(r.valid for r in runs)}/{n}",
        }

    def _by_bucket(self) -> dict[str, float | None]:
        """Mean time to first token per prompt-length bucket (None: no document in it)."""
        edges = [edge for _, edge in BUCKETS[:-1]]
        times: dict[str, list[float]] = {name: [] for name, _ in BUCKETS}
        for r in self.runs:
            times[BUCKETS[bisect.bisect_left(edges, r.prompt_tokens)][0]].append(r.first_token_s)
        return {name: round(sum(t) / len(t), 3) if t else None for name, t in times.items()}


def _native_run(handle: ModelHandle, schema: JsonSchema, config: DocConfig, prompt: str,
                max_new_tokens: int) -> Run:
    """One native request, streamed so its first piece of text is timed from the caller's side."""
    t0 = time.perf_counter()
    stream = generate_json(config.model or handle, schema, prompt, drafter=config.drafter,  # type: ignore[arg-type]
                           draft=config.draft,
                           max_new_tokens=max_new_tokens, stream=True,
                           **{"prefix_cache": False, **config.options})
    first, error = None, None
    try:
        for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        value = stream.value
    except ConstrainedSpecError as e:  # a token limit, a loop, a failed validation: timed, counted invalid
        value, error = None, type(e).__name__
    seconds = time.perf_counter() - t0
    stats = stream.stats
    assert stats is not None  # set once the iteration ran, also where it raised
    return Run(value, stream.text, error is None, stats.prompt_tokens, stats.output_tokens,
               seconds if first is None else first, seconds, stats.prefill_seconds, error)


class LlamaCppDocuments:
    """llama.cpp's two rows on the model's GGUF file, in a worker process of its own
    (``bench.single.LlamaCppWorker``): the grammar path and plain decoding for the same length,
    on the very prompt ids our decoder starts from, timed by the worker (first piece of text,
    prompt evaluation) and from here (the whole request, round trip included)."""

    def __init__(self, handle: ModelHandle, schema: JsonSchema, n_ctx: int) -> None:
        from .single import LlamaCppWorker

        self.handle, self.schema = handle, schema
        self.worker = LlamaCppWorker(str(handle.gguf_file), os.cpu_count() or 1, n_ctx)
        self.grammar = self.worker.ask({"op": "grammar", "schema": schema.schema})["id"]  # built outside the timings

    def runs(self, ids: list[int], max_new_tokens: int, same_length: int) -> dict[str, Run]:
        """Both rows' runs on one prompt (``same_length``: the plain row's token budget)."""
        return {LLAMA_GRAMMAR: self._run(ids, self.grammar, max_new_tokens),
                LLAMA_PLAIN: self._run(ids, None, max(same_length, 1))}

    def _run(self, ids: list[int], grammar: int | None, max_tokens: int) -> Run:
        t0 = time.perf_counter()
        reply = self.worker.ask({"op": "generate", "grammar": grammar, "ids": ids, "max_tokens": max_tokens,
                                 "timings": True})
        seconds = time.perf_counter() - t0
        text = reply["text"]
        try:
            value, error = validate_json_output(text, self.schema), None
        except ConstrainedSpecError as e:
            value, error = _json_or_none(text), type(e).__name__
        tokens = len(self.handle.tokenizer(text, add_special_tokens=False)["input_ids"])
        first = reply.get("first_token_s")
        return Run(value, text, error is None, len(ids), tokens, seconds if first is None else first, seconds,
                   reply.get("prompt_eval_s"), error)

    def close(self) -> None:
        """End the worker."""
        self.worker.close()


def _json_or_none(text: str) -> Any:
    """The text parsed as JSON, or None where it is not JSON (cut off, or no JSON at all)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _llama_cpp(handle: ModelHandle, schema: JsonSchema, n_ctx: int, notes: list[str]) -> LlamaCppDocuments | None:
    """llama.cpp's rows where they can run; otherwise None, with the reason in ``notes``."""
    if handle.gguf_file is None:
        notes.append("No llama.cpp rows: the model was not loaded from a GGUF file.")
    elif importlib.util.find_spec("llama_cpp") is None:
        notes.append("No llama.cpp rows: llama-cpp-python is not installed.")
    else:
        try:
            return LlamaCppDocuments(handle, schema, n_ctx)
        except RuntimeError as e:  # it could not even load and warm up: no rows, and say why
            notes.append(f"No llama.cpp rows: {e}")
    return None


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def default_documents(handle: ModelHandle, schema: JsonSchema | None = None, n: int = DOCUMENTS) -> list[PackageDocument]:
    """The installed packages' descriptions picked for this model's tokenizer (``pick_documents``)."""
    schema = schema or facts_schema()

    def count(doc: PackageDocument) -> int:
        try:
            return len(encode_prompt(handle, document_prompt(doc, schema)))
        except InvalidPromptError:  # longer than the model's context: out of any range
            return sys.maxsize

    return pick_documents(installed_documents(), count, n=n)


def run_documents_bench(
    model: Any = None,
    *,
    configs: list[DocConfig] | None = None,
    documents: list[PackageDocument] | None = None,
    limit: int | None = None,
    max_new_tokens: int = 128,
    llama_cpp: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every row on every document (the first ``limit`` of ``documents``, default the picked
    package descriptions, shortest first); returns the report (``DocRow.summary`` per row, the
    documents, notes). ``configs``: the native rows, the first one the baseline "identical"
    compares with (default: target-only and auto)."""
    handle = resolve_model(model)
    schema = facts_schema()
    configs = configs or default_configs()
    picked = documents if documents is not None else default_documents(handle, schema)
    notes = [] if documents is not None or len(picked) >= DOCUMENTS else [
        f"Only {len(picked)} installed package descriptions fall within {TOKEN_RANGE[0]}-{TOKEN_RANGE[1]} prompt tokens."]
    docs = picked[:limit]
    if not docs:
        raise ValueError("Invalid documents: none to run (no installed package description fits the range).")
    prompts = [document_prompt(d, schema) for d in docs]
    ids = [encode_prompt(handle, p) for p in prompts]
    rows = {c.name: DocRow(c.name) for c in configs}
    llama = _llama_cpp(handle, schema, _context_for(max(map(len, ids)) + max_new_tokens), notes) if llama_cpp else None
    if llama is not None:
        rows.update({name: DocRow(name) for name in (LLAMA_GRAMMAR, LLAMA_PLAIN)})
    _warm_up(handle, schema, configs)
    try:
        for i, doc in enumerate(docs):
            _one_document(i, doc, prompts[i], ids[i], handle, schema, configs, rows, llama, max_new_tokens, notes)
            if progress is not None:
                progress(f"document {i + 1}/{len(docs)} ({doc.name}, {len(ids[i])} prompt tokens) done")
    finally:
        if llama is not None:
            llama.close()
    return _report(handle, docs, ids, rows, max_new_tokens, notes, configs)


def _context_for(tokens: int) -> int:
    """llama.cpp's context: room for ``tokens``, rounded up to a multiple of 256."""
    return -(-(tokens + 8) // 256) * 256


def _warm_up(handle: ModelHandle, schema: JsonSchema, configs: list[DocConfig]) -> None:
    """Compile the schema and run each row once on a short prompt, so no row pays first-call costs."""
    for config in configs:
        try:
            generate_json(config.model or handle, schema, "The package foo is a MIT-licensed Python library for bars.",
                          drafter=config.drafter, draft=config.draft, max_new_tokens=48,  # type: ignore[arg-type]
                          **{"prefix_cache": False, **config.options})
        except ConstrainedSpecError:
            pass  # a warm-up cut short has warmed up all the same


def _one_document(i: int, doc: PackageDocument, prompt: str, ids: list[int], handle: ModelHandle,
                  schema: JsonSchema, configs: list[DocConfig], rows: dict[str, DocRow],
                  llama: LlamaCppDocuments | None, max_new_tokens: int, notes: list[str]) -> None:
    """Every row on one document; the native rows take turns going first (rotated per document),
    so a warm cache or a slow start does not always favour the same one."""
    shift = i % len(configs)
    runs = {c.name: _native_run(handle, schema, c, prompt, max_new_tokens) for c in configs[shift:] + configs[:shift]}
    if len(ids) != runs[configs[0].name].prompt_tokens:
        notes.append(f"{doc.name}: the decoder saw {runs[configs[0].name].prompt_tokens} prompt tokens, not {len(ids)}.")
    base = runs[configs[0].name]
    if llama is not None:
        try:
            runs.update(llama.runs(ids, max_new_tokens, base.output_tokens))
        except RuntimeError as e:  # its worker failed: these rows leave the document out
            notes.append(f"llama.cpp on {doc.name}: {e}")
    for name, run in runs.items():
        rows[name].add(run, base, doc.truth)


def _report(handle: ModelHandle, docs: list[PackageDocument], ids: list[list[int]], rows: dict[str, DocRow],
            max_new_tokens: int, notes: list[str], configs: list[DocConfig]) -> dict[str, Any]:
    """The figures, the documents and each native row's values (an invalid one: its error and text)."""
    lengths = [len(i) for i in ids]
    return {
        "model": handle.name,
        "precision": handle.precision,
        "gguf_file": str(handle.gguf_file) if handle.gguf_file else None,
        "documents": [{"package": d.name, "version": d.version, "prompt_tokens": n} for d, n in zip(docs, lengths)],
        "prompt_tokens": {"min": min(lengths), "max": max(lengths), "total": sum(lengths)},
        "max_new_tokens": max_new_tokens,
        "threads": os.cpu_count(),
        "rows": [row.summary() for row in rows.values()],
        "outputs": {c.name: {d.name: r.value if r.valid else {"error": r.error, "text": r.text}
                             for d, r in zip(docs, rows[c.name].runs)} for c in configs},
        "notes": notes,
    }
