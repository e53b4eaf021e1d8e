"""Extraction pipelines: one schema, many documents, typed records out.

A document that fails (token limit, validation, a prompt too long) is recorded with its error
kind and message and never stops the run; results come back in input order. An empty (or
whitespace-only) document is such a failure, refused before any model work: the template around
it is still a prompt, and the model would answer it with an invented record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..api import decoded_schema, generate_json, prepare_request, repetition_error, resolve_draft, submit_request, validate_json_output
from ..constraint import JsonSchema, check_constraint, compile_constraint, load_schema
from ..batching import BatchEngine, Request
from ..decoding import DecodeStats, SpecOptions
from ..errors import ConstrainedSpecError, InvalidOptionError, InvalidPromptError, InvalidSchemaError, TokenLimitError
from ..models import resolve_model

#: The prompt of each document. ``{fields}`` lists the schema's fields with their types and
#: descriptions (so ``Field(description=...)`` reaches the model), ``{text}`` is the document,
#: ``{schema}`` the JSON schema itself. Override it with ``prompt_template=``.
DEFAULT_PROMPT_TEMPLATE = (
    "Extract the following fields from the document and answer with JSON.\n\n"
    "Fields:\n{fields}\n\n"
    "Document:\n{text}"
)


@dataclass
class ExtractionResult:
    """One document's outcome: ``value`` (validated) or ``error`` ({"kind", "message"}), and stats."""

    id: str
    value: Any = None
    error: dict[str, str] | None = None
    stats: dict[str, Any] | None = None
    #: Every figure of the decode (``DecodeStats``), for benchmarks; not part of the record.
    decode_stats: DecodeStats | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """True when the document produced a valid value."""
        return self.error is None

    def to_record(self) -> dict[str, Any]:
        """The JSON line written by the command line."""
        if self.error is not None:
            return {"id": self.id, "error": self.error}
        value = self.value.model_dump(mode="json") if hasattr(self.value, "model_dump") else self.value
        return {"id": self.id, "value": value, "stats": self.stats}


def _error_result(doc_id: str, error: ConstrainedSpecError, stats: DecodeStats | None = None) -> ExtractionResult:
    """A document's failure as its record: the error's kind (its class name) and message."""
    return ExtractionResult(doc_id, error={"kind": type(error).__name__, "message": str(error)}, decode_stats=stats)


def empty_document_error(doc_id: str, text: str) -> InvalidPromptError | None:
    """The refusal of a document with nothing in it (empty or whitespace only), else None.

    Checked on the document, not the prompt: the template's own words around an empty document
    make a non-empty prompt, which the model would answer with an invented record."""
    if text.strip():
        return None
    return InvalidPromptError(f"Invalid document {doc_id!r}: it is empty (or only whitespace); nothing to extract.")


def describe_fields(schema: dict) -> str:
    """One line per top-level property: name, type, whether required, and its description."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    defs = schema.get("$defs") or schema.get("definitions") or {}
    lines = []
    for name, sub in props.items():
        if isinstance(sub, dict) and "$ref" in sub:
            sub = {**defs.get(sub["$ref"].rsplit("/", 1)[-1], {}), **{k: v for k, v in sub.items() if k != "$ref"}}
        sub = sub if isinstance(sub, dict) else {}
        kind = sub.get("type") or ("one of " + ", ".join(map(json.dumps, sub["enum"])) if "enum" in sub else "value")
        if isinstance(kind, list):
            kind = " or ".join(kind)
        desc = sub.get("description") or sub.get("title") or ""
        lines.append(f"- {name} ({kind}{', required' if name in required else ''}){': ' + desc if desc else ''}")
    return "\n".join(lines) if lines else json.dumps(schema)


def iter_documents(documents: Iterable[Any]) -> Iterator[tuple[str, str]]:
    """``(id, text)`` pairs from texts, ``{"id", "text"}`` records, or ``(id, text)`` tuples."""
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            yield str(i), doc
        elif isinstance(doc, dict):
            if "text" not in doc:
                raise ValueError(f"Invalid document #{i}: expected a 'text' field, got keys {sorted(doc)}.")
            yield str(doc.get("id", i)), _text(doc["text"])
        elif isinstance(doc, tuple) and len(doc) == 2:
            yield str(doc[0]), _text(doc[1])
        else:
            raise ValueError(f"Invalid document #{i}: expected a string, a dict with 'text', or (id, text).")


def read_documents(path: Path | str) -> Iterator[tuple[str, str]]:
    """Documents from a JSONL file (``{"id", "text"}`` per line) or a folder (one file each, named by id)."""
    path = Path(path)
    if path.is_dir():
        for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")):
            yield file.stem, file.read_text(errors="replace")
        return
    if not path.is_file():
        raise FileNotFoundError(f"Invalid input: {path} is neither a JSONL file nor a folder.")
    with path.open() as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"Invalid input: {path} line {n} is not JSON ({e}).") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"Invalid input: {path} line {n} needs an object with 'id' and 'text'.")
            yield str(record.get("id", n)), _text(record["text"])


def _text(value: Any) -> str:
    """A document's text; a missing one (None, JSON null) is empty, not the word "None"."""
    return "" if value is None else str(value)


def extract(
    schema: Any,
    documents: Iterable[Any],
    *,
    model: Any = None,
    draft: Any = None,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    batch_size: int = 1,
    engine: BatchEngine | None = None,
    server: str | None = None,
    api_key: str | None = None,
    options: SpecOptions | None = None,
    **option_values: Any,
) -> Iterator[ExtractionResult]:
    """Extract one record per document, in order; a failing document yields an error result.

    Args:
        schema: a pydantic model class (values come back as instances) or a JSON schema.
        documents: texts, ``{"id", "text"}`` records or ``(id, text)`` pairs. An empty or
            whitespace-only text yields an ``InvalidPromptError`` record naming its id, on every
            path, before any model work (never a value the model invented).
        model: as in ``generate_json``; loaded once for the whole run.
        draft: as in ``generate_json``.
        prompt_template: ``str.format`` template with ``{text}``, ``{fields}``, ``{schema}``.
        batch_size: documents decoded together. 1: each document alone (``generate_json``);
            above 1, the batch engine (``batching.engine``): one target forward per step for up
            to ``batch_size`` documents, each speculating with its own drafter and K, a finished
            document's slot taken at once by the next. Greedy records equal the one-by-one ones
            with a batch-invariant model (native precision, the CPU default).
        engine: a ``BatchEngine`` on the same model to run on instead of a new one (kept across
            calls, its K estimates and cost fit stay warm; its ``max_batch`` rows decode at once
            and its prefix cache is used); ``batch_size`` is then ignored.
        server: send each document to a running ``constrained-spec serve`` at this URL
            instead (``batch_size`` requests in flight at once, so the server batches them);
            ``model`` and ``draft`` are then the server's, and the records are validated here.
        api_key: the server's key, with ``server``.
        options: a ``SpecOptions``, as in ``generate_json``; checked here, before any document,
            on both paths.
        **option_values: keyword overrides of its fields.
    """
    opts = SpecOptions.build(options, **option_values)
    loaded = load_schema(schema)  # bad schemas fail here, before any document
    # Unsupported or unsatisfiable too, before a model loads (wherever no vocabulary decides it).
    check_constraint(decoded_schema(loaded, opts), kind="json", backend=opts.backend, lenient=opts.lenient,
                     whitespace=opts.whitespace)
    _check_template_and_batch(prompt_template, batch_size)
    prompts, shared = _prompts(loaded, documents, prompt_template)
    if server is not None:
        yield from _extract_remote(loaded, prompts, server, api_key, batch_size, opts)
        return
    handle = resolve_model(model)
    draft_source = resolve_draft(draft, handle, opts)
    if engine is not None and engine.target is not handle.model:
        raise InvalidOptionError("Invalid engine: it runs another model than the one given.")
    if batch_size > 1 or engine is not None:
        yield from _extract_batched(loaded, prompts, handle, draft_source, opts, shared,
                                    engine or BatchEngine(handle.model, max_batch=batch_size, precision=handle.precision,
                                                          profile=opts.profile, prefix_cache=opts.prefix_cache))
        return
    yield from _extract_one_by_one(loaded, prompts, handle, draft_source, opts, shared)


def _check_template_and_batch(prompt_template: str, batch_size: Any) -> None:
    """Refuse a template without ``{text}`` and a batch size that is not a positive integer."""
    if "{text}" not in prompt_template:
        raise InvalidOptionError("Invalid prompt_template: it must contain '{text}' where the document goes.")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidOptionError(f"Invalid batch_size: expected an integer >= 1, got {batch_size!r}.")


def _prompts(loaded: JsonSchema, documents: Iterable[Any],
             prompt_template: str) -> tuple[Iterator[tuple[str, str | InvalidPromptError]], str | None]:
    """(each document's id and prompt, or the refusal of an empty one, read lazily; every
    prompt's shared prefix, or None)."""
    fields = describe_fields(loaded.schema)
    schema_text = json.dumps(loaded.schema)
    prompts = ((doc_id, empty_document_error(doc_id, text)
                or prompt_template.format(text=text, fields=fields, schema=schema_text))
               for doc_id, text in iter_documents(documents))
    # The template's text before the document is every prompt's shared prefix: computed once,
    # then reused from the prefix cache (decoding.prefix).
    seam = "\x00document\x00"
    shared = prompt_template.format(text=seam, fields=fields, schema=schema_text).split(seam)[0] or None
    return prompts, shared


def _extract_one_by_one(loaded: JsonSchema, prompts: Iterable[tuple[str, str | InvalidPromptError]], handle: Any,
                        draft: Any, opts: SpecOptions, shared: str | None) -> Iterator[ExtractionResult]:
    """Every document alone through ``generate_json``; a document that fails yields its error."""
    for doc_id, prompt in prompts:
        if isinstance(prompt, InvalidPromptError):
            yield _error_result(doc_id, prompt)
            continue
        try:
            value, stats = generate_json(handle, loaded, prompt, draft=draft or False, options=opts, return_stats=True,
                                         shared_prefix=shared)
        except InvalidSchemaError:
            raise
        except ConstrainedSpecError as e:
            yield _error_result(doc_id, e)
            continue
        yield ExtractionResult(doc_id, value=value, stats=_brief(stats), decode_stats=stats)


def _extract_batched(loaded: JsonSchema, prompts: Iterable[tuple[str, str | InvalidPromptError]], handle: Any,
                     draft: Any, opts: SpecOptions, shared: str | None, engine: BatchEngine) -> Iterator[ExtractionResult]:
    """Every document through ``engine``, ``max_batch`` rows at once; documents are read as
    slots free up (at most ``max_batch`` wait), results come out in input order."""
    compiled = compile_constraint(decoded_schema(loaded, opts), handle.tokenizer, kind="json", backend=opts.backend,  # type: ignore[arg-type]
                                  lenient=opts.lenient, whitespace=opts.whitespace)
    batch_size = engine.max_batch
    order: deque[tuple[str, Request | ExtractionResult]] = deque()
    documents = iter(prompts)
    more = True
    while True:
        while more and len(engine.waiting) < batch_size:
            item = next(documents, None)
            if item is None:
                more = False
                break
            doc_id, prompt = item
            if isinstance(prompt, InvalidPromptError):
                order.append((doc_id, _error_result(doc_id, prompt)))
                continue
            try:
                parts = prepare_request(handle, draft, compiled, prompt, opts, "json", shared)
            except ConstrainedSpecError as e:
                order.append((doc_id, _error_result(doc_id, e)))
                continue
            req = submit_request(engine, parts, opts)
            order.append((doc_id, req))
        while order and (isinstance(order[0][1], ExtractionResult) or order[0][1].done):
            doc_id, item = order.popleft()
            yield item if isinstance(item, ExtractionResult) else _engine_result(doc_id, item, handle, loaded, opts)
        if not engine.busy:
            if not more and not order:
                return
            continue
        engine.step()


def _extract_remote(loaded: JsonSchema, prompts: Iterable[tuple[str, str | InvalidPromptError]], url: str,
                    api_key: str | None,
                    in_flight: int, opts: SpecOptions) -> Iterator[ExtractionResult]:
    """Every document as a request to a running server, ``in_flight`` at once, in input order."""
    from concurrent.futures import ThreadPoolExecutor

    from .. import remote

    constraint = remote.json_constraint(loaded.schema, opts.lenient)

    def one(item: tuple[str, str | InvalidPromptError]) -> ExtractionResult:
        doc_id, prompt = item
        if isinstance(prompt, InvalidPromptError):  # never sent: the server would answer the template
            return _error_result(doc_id, prompt)
        body = remote.chat_body(prompt, constraint=constraint, temperature=opts.temperature, seed=opts.seed,
                                max_new_tokens=opts.max_new_tokens, drafter=opts.drafter, k_max=opts.k_max,
                                adaptive=opts.adaptive, stream=False)
        t0 = time.perf_counter()
        try:
            text, reply = remote.generate(url, body, api_key=api_key)
            value = validate_json_output(text, loaded)
        except remote.RemoteError:
            raise  # the server, not the document: stop the run
        except ConstrainedSpecError as e:
            return _error_result(doc_id, e)
        seconds = time.perf_counter() - t0
        ext, tokens = reply.get("constrained_spec", {}), reply["usage"]["completion_tokens"]
        return ExtractionResult(doc_id, value=value, stats={
            "output_tokens": tokens, "target_forwards": ext.get("target_forwards"),
            "acceptance_rate": ext.get("acceptance_rate"), "tokens_per_second": round(tokens / seconds, 4),
            "total_seconds": round(seconds, 4), "drafter": ext.get("drafter")})

    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        yield from pool.map(one, prompts)


def _engine_result(doc_id: str, req: Request, handle: Any, loaded: JsonSchema, opts: SpecOptions) -> ExtractionResult:
    """A finished engine request as a validated record or an error record."""
    if req.error is not None and not isinstance(req.error, ConstrainedSpecError):
        raise req.error  # a bug, not a document's failure: do not hide it in a record
    res = req.result
    text = handle.tokenizer.decode(res.tokens, skip_special_tokens=False)
    try:
        if req.error is not None:
            raise req.error
        if req.decoder.repetition is not None:
            raise repetition_error(req.decoder, handle.tokenizer)
        if not res.finished:
            raise TokenLimitError(text, opts.max_new_tokens)
        value = validate_json_output(text, loaded)
    except ConstrainedSpecError as e:
        return _error_result(doc_id, e, res.stats)
    return ExtractionResult(doc_id, value=value, stats=_brief(res.stats), decode_stats=res.stats)


def _brief(stats: Any) -> dict[str, Any]:
    """The per-document figures worth keeping in an output line."""
    s = dataclasses.asdict(stats)
    keep = ("output_tokens", "target_forwards", "acceptance_rate", "tokens_per_second", "total_seconds", "drafter")
    return {k: (round(s[k], 4) if isinstance(s[k], float) else s[k]) for k in keep}


def cut_to_complete_lines(path: Path) -> list[bytes]:
    """The whole lines of a JSONL file, after cutting off a trailing partial line (what a kill
    in the middle of a write leaves) so that appending after it stays valid JSONL."""
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with path.open("r+b") as fh:
            fh.truncate(len(complete))
    return complete.splitlines()


class JsonlWriter:
    """Appends one JSON line per record, each with a single ``write`` call on an ``O_APPEND``
    descriptor and an fsync, so a killed run leaves whole lines only.

    With ``resume=True`` the ids already in the file are read into ``done_ids`` (and a trailing
    partial line, from a crash in the middle of a write on a filesystem that allows it, is cut
    off); without it the file is started anew.
    """

    def __init__(self, path: Path | str, *, resume: bool = False) -> None:
        self.path = Path(path)
        self.done_ids: set[str] = set()
        if resume and self.path.exists():
            for line in cut_to_complete_lines(self.path):
                try:
                    self.done_ids.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, flags, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as one line."""
        line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode()
        os.write(self._fd, line)
        os.fsync(self._fd)
        self.done_ids.add(str(record["id"]))

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


@dataclass
class Summary:
    """Running totals of an extraction run."""

    documents: int = 0
    failed: int = 0
    failures_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    output_tokens: int = 0
    target_forwards: float = 0.0
    accepted_rate_sum: float = 0.0
    #: Wall-clock start of the run: tokens/s is over real elapsed time, so per-document and
    #: batched runs (whose per-document times overlap) compare fairly.
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, result: ExtractionResult) -> None:
        """Count one result."""
        self.documents += 1
        if result.error is not None:
            self.failed += 1
            kind = result.error["kind"]
            self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1
            return
        st = result.stats or {}
        self.output_tokens += st.get("output_tokens", 0)
        self.target_forwards += st.get("target_forwards", 0)
        self.accepted_rate_sum += st.get("acceptance_rate", 0.0)

    @property
    def seconds(self) -> float:
        """Wall-clock seconds since the run started."""
        return time.perf_counter() - self.started

    def progress_line(self) -> str:
        """Short figures for the progress bar."""
        ok = self.documents - self.failed
        seconds = self.seconds
        tps = self.output_tokens / seconds if seconds else 0.0
        acc = self.accepted_rate_sum / ok if ok else 0.0
        return f"{tps:.1f} tok/s, acceptance {acc:.2f}, {self.failed} failed"

    def as_dict(self) -> dict[str, Any]:
        """Totals and derived figures."""
        ok = self.documents - self.failed
        return {
            "documents": self.documents,
            "succeeded": ok,
            "failed": self.failed,
            "failures_by_kind": dict(self.failures_by_kind),
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.output_tokens / self.seconds, 2) if self.seconds else 0.0,
            "target_forwards_per_token": round(self.target_forwards / self.output_tokens, 3) if self.output_tokens else None,
            "mean_acceptance_rate": round(self.accepted_rate_sum / ok, 3) if ok else None,
        }
