"""The public entry points: ``generate_json`` and ``generate_regex``.

Everything is validated before decoding starts (options, schema or pattern, model, draft
tokenizer, prompt), so bad input raises a clear error and leaves nothing half-done. A schema
goes one way: loaded once, compiled once (cached), one matcher for the request.
"""

from __future__ import annotations

import itertools
import json
import regex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .constraint import CompiledConstraint, JsonSchema, Matcher, check_constraint, compile_constraint, load_schema
from .constraint.schema import closed_schema
from .constraint.validator import compiled_pattern, output_validator
from .decoding import DecodeStats, KPolicy, SpecOptions, SpeculativeDecoder, prefix_cache_for, recent_estimates
from .decoding.prefix import MIN_PREFIX, shared_prefix_length
from .drafters import Drafter, build_drafter
from .drafters.corpus import OutputCorpus, corpus_in, has_corpus
from .drafters.head import DraftHead, head_for, is_head_dir, shipped_head_dir
from .errors import (
    InvalidOptionError, InvalidPromptError, InvalidRegexError, OutputValidationError, RepetitionError, TokenizerMismatchError,
    TokenLimitError,
)
from .models import ModelHandle, check_same_tokenizer, resolve_model
from .storage import trained_head_dir

if TYPE_CHECKING:
    from .batching import BatchEngine, Request


def repetition_error(dec: SpeculativeDecoder, tokenizer: Any) -> RepetitionError:
    """The error of a request the repetition guard stopped: its text, the cycle and the copies."""
    assert dec.repetition is not None
    length, copies = dec.repetition
    return RepetitionError(tokenizer.decode(dec.output, skip_special_tokens=False),
                           tokenizer.decode(dec.output[-length:], skip_special_tokens=False), copies)


def check_prompt(prompt: Any) -> None:
    """``InvalidPromptError`` for a prompt that is not a string or holds only whitespace (no
    model needed: answered before one loads)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidPromptError(f"Invalid prompt: expected a non-empty string, got {prompt!r}.")


def encode_prompt(handle: ModelHandle, prompt: str) -> list[int]:
    """Token ids of ``prompt``, through the model's chat template when it has one."""
    check_prompt(prompt)
    if getattr(handle.tokenizer, "chat_template", None):
        return encode_chat(handle, [{"role": "user", "content": prompt}])
    return encode_text(handle, prompt)


def encode_chat(handle: ModelHandle, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) through the model's chat
    template, ready for the assistant's reply."""
    tok = handle.tokenizer
    if not getattr(tok, "chat_template", None):
        raise InvalidPromptError("Invalid messages: the model has no chat template; send a plain prompt instead.")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _fit(handle, tok(text, add_special_tokens=False)["input_ids"])


def chat_prefix_length(handle: ModelHandle, messages: list[dict[str, str]], ids: list[int]) -> int | None:
    """How many leading tokens of a conversation's ``ids`` every conversation that opens with
    the same system turns shares: those turns (or the default system prompt the template adds)
    and the opening of the next turn. None when there is no later turn, no chat template, or
    fewer than ``MIN_PREFIX`` tokens (not worth a block of their own)."""
    tok = handle.tokenizer
    system = list(itertools.takewhile(lambda m: m.get("role") == "system", messages))
    if len(system) == len(messages) or not getattr(tok, "chat_template", None):
        return None
    probe = tok.apply_chat_template(system + [{"role": "user", "content": ""}], tokenize=False)
    n = shared_prefix_length(ids, tok(probe, add_special_tokens=False)["input_ids"])
    return n if n >= MIN_PREFIX else None


def encode_text(handle: ModelHandle, text: str) -> list[int]:
    """Token ids of ``text`` as it is, without the chat template (a completion prompt)."""
    if not isinstance(text, str) or not text:
        raise InvalidPromptError(f"Invalid prompt: expected a non-empty string, got {text!r}.")
    return _fit(handle, handle.tokenizer(text)["input_ids"])


def _fit(handle: ModelHandle, ids: list[int]) -> list[int]:
    """``ids`` as a list, or ``InvalidPromptError`` when they leave no room in the context."""
    ctx = handle.context_length
    if ctx is not None and len(ids) >= ctx:
        raise InvalidPromptError(
            f"Invalid prompt: {len(ids)} tokens do not fit the model's context of {ctx} tokens. Shorten the prompt."
        )
    return list(ids)


class TextStream:
    """Text as the decoder accepts it; iterate to get the pieces (a step may add several tokens).

    After the iteration ends: ``text`` (the whole output), ``stats`` (set also when the iteration
    raised) and ``value`` (the parsed, validated result). Errors (token limit, validation) are
    raised at the end of the iteration, after every valid piece was yielded.
    """

    def __init__(self, decoder: SpeculativeDecoder, handle: ModelHandle, finish: Callable[[str], Any]) -> None:
        self._decoder = decoder
        self._handle = handle
        self._finish = finish
        self.text = ""
        self.stats: DecodeStats | None = None
        self.value: Any = None

    def __iter__(self) -> Iterator[str]:
        dec, tok = self._decoder, self._handle.tokenizer
        try:
            for _ in dec.run():
                text = tok.decode(dec.output, skip_special_tokens=False)
                if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                    continue
                if len(text) > len(self.text):
                    yield text[len(self.text):]
                    self.text = text
        finally:  # the figures so far, also when a step raised
            self.stats = dec.stats
        text = tok.decode(dec.output, skip_special_tokens=False)
        if len(text) > len(self.text):
            yield text[len(self.text):]
            self.text = text
        if dec.repetition is not None:
            raise repetition_error(dec, tok)
        if not dec.finished:
            raise TokenLimitError(text, dec.max_new_tokens)
        self.value = self._finish(text)


@dataclass
class RequestParts:
    """What one request decodes with, built from the options (the single-request path and the
    batch engine take the same parts): the prompt's ids, a fresh matcher, the drafter walking
    it, the K policy, and the hardware profile it was chosen for."""

    prompt_ids: list[int]
    matcher: Matcher
    drafter: Drafter | None
    k_policy: KPolicy
    profile: str
    #: Leading prompt tokens shared with other requests (None: no shared prefix named).
    prefix_len: int | None = None


@dataclass(frozen=True)
class DraftSource:
    """What a request drafts with besides the model-free drafters: a draft model (same
    tokenizer), a learned head for the target (``drafters.head``) and / or a corpus of the
    target's own outputs (``drafters.corpus``)."""

    model: ModelHandle | None = None
    head: DraftHead | None = None
    corpus: OutputCorpus | None = None


def prepare_request(handle: ModelHandle, draft: DraftSource | None, compiled: CompiledConstraint,
                    prompt: str, opts: SpecOptions, task: str, shared_prefix: str | None = None,
                    prompt_ids: list[int] | None = None, prefix_len: int | None = None) -> RequestParts:
    """Encode the prompt and build the request's matcher, drafter and K policy (every check
    that can fail before a forward). ``shared_prefix``: the leading text of ``prompt`` that
    other requests share (see ``decoding.prefix``); without one, a prompt put through the chat
    template shares the template's system part (``chat_prefix_length``). ``prompt_ids``: the
    prompt already encoded (a conversation, say; ``prefix_len`` then its shared tokens, if
    any); ``prompt`` is then only the text drafters copy from."""
    matcher = compiled.matcher()
    if prompt_ids is None:
        prompt_ids = encode_prompt(handle, prompt)
        if not shared_prefix:
            prefix_len = chat_prefix_length(handle, [{"role": "user", "content": prompt}], prompt_ids)
    if shared_prefix:
        if not isinstance(shared_prefix, str) or not prompt.startswith(shared_prefix):
            raise InvalidOptionError("Invalid shared_prefix: expected the leading text of the prompt.")
        prefix_len = shared_prefix_length(prompt_ids, encode_prompt(handle, shared_prefix))
    # Raises InvalidOptionError for drafter="model" without a draft model (still before any forward).
    drafter = build_drafter(opts.drafter_kind, matcher, handle.tokenizer,
                            draft_model=draft.model.model if draft and draft.model else None,
                            head=draft.head if draft else None, corpus=draft.corpus if draft else None,
                            temperature=opts.temperature, source_text=prompt)
    profile, k_max = opts.resolve_k_max(task)
    policy = opts.k_policy(k_max, profile=profile, precision=handle.precision, model=handle.name,
                           drafters=drafter.signature if drafter is not None else "",
                           estimates=recent_estimates(handle))
    return RequestParts(prompt_ids, matcher, drafter, policy, profile, prefix_len)


def submit_request(engine: BatchEngine, parts: RequestParts, opts: SpecOptions,
                   on_tokens: Callable[[list[int]], None] | None = None) -> Request:
    """Queue prepared parts on a batch engine with the request's options: the one place that
    maps options onto ``BatchEngine.submit``, so ``extract``, the server and the benches decode
    alike (a bench that left out ``max_repeats`` had run a loop to its token limit that
    ``extract`` stops)."""
    req = engine.submit(parts.prompt_ids, parts.matcher, drafter=parts.drafter, k_policy=parts.k_policy,
                        temperature=opts.temperature, seed=opts.seed, max_new_tokens=opts.max_new_tokens,
                        prefix_len=parts.prefix_len, max_repeats=opts.max_repeats, on_tokens=on_tokens)
    req.decoder.stats.profile = parts.profile
    return req


def resolve_draft(draft: Any, handle: ModelHandle, opts: SpecOptions) -> DraftSource | None:
    """What the request's drafter drafts with, checked against the target's tokenizer.

    ``draft``: None (for "auto" / "hybrid" the corpus of the target's outputs the package ships
    for this model, if any; for "head" the shipped head), True (the shipped head and corpus),
    False (nothing learned), a directory saved by ``train-drafter`` (its head and corpus), a
    ``DraftHead``, a ``DraftSource``, or a draft model in any form ``resolve_model`` takes
    (with the shipped corpus for "hybrid").

    Why "auto" takes the shipped corpus but not the shipped head unless asked: the corpus is
    free to ask (an index lookup per token), while asking the head where forced text, copies,
    lookup and the corpus have nothing costs a head step each time, more than its drafts there
    save on this CPU (README, "A learned draft head").
    """
    if isinstance(draft, DraftSource):
        return draft
    kind = opts.drafter_kind
    if draft is False or kind not in ("model", "head", "hybrid"):
        return None
    fingerprint = handle.vocabulary.fingerprint
    # A head trained here for this very file (train-drafter without --out) is drafted with by
    # auto as well; the package's own head only on request (docs/drafters.md: it measured
    # below auto without it on the embedded model).
    trained = trained_head_for(handle)
    found = trained or shipped_head_dir(handle.model, fingerprint)
    corpus = corpus_in(found, fingerprint) if found is not None and kind == "hybrid" else None
    if draft is None or draft is True:
        if kind == "model":
            return None
        wanted = draft is True or kind == "head" or trained is not None
        head = head_for(handle.model, fingerprint, found) if wanted and found is not None else None
        if head is None and draft is True:
            raise InvalidOptionError(f"Invalid draft: no draft head ships or was trained for {handle.name!r}; "
                                     "train one with constrained-spec train-drafter --target FILE (it is found "
                                     "for that file without a path) or pass a head's directory.")
        return DraftSource(head=head, corpus=corpus) if head is not None or corpus is not None else None
    if isinstance(draft, DraftHead):
        if draft.config.tokenizer_fingerprint != fingerprint:
            raise TokenizerMismatchError("Invalid draft: the draft head was trained for another tokenizer than the "
                                         "target's; train one with constrained-spec train-drafter.")
        return DraftSource(head=draft)
    if is_head_dir(draft) or (isinstance(draft, (str, Path)) and has_corpus(draft)):
        return DraftSource(head=head_for(handle.model, fingerprint, draft) if is_head_dir(draft) else None,
                           corpus=corpus_in(draft, fingerprint))
    draft_handle = resolve_model(draft, role="draft")
    check_same_tokenizer(handle, draft_handle)
    return DraftSource(model=draft_handle, corpus=corpus)


def trained_head_for(handle: ModelHandle) -> Path | None:
    """The head ``train-drafter`` trained for the handle's GGUF file and kept in the cache
    (``storage.trained_head_dir``), or None."""
    if handle.gguf_file is None or not Path(handle.gguf_file).is_file():
        return None
    path = trained_head_dir(handle.gguf_file)
    return path if is_head_dir(path) else None


def _start(model: Any, draft: Any, compile_for: Callable[[ModelHandle], CompiledConstraint], prompt: str,
           opts: SpecOptions, task: str, shared_prefix: str | None = None) -> tuple[ModelHandle, SpeculativeDecoder]:
    """Resolve the models, compile, encode the prompt and build the decoder: every check before any forward."""
    check_prompt(prompt)  # before the model loads
    handle = resolve_model(model)
    parts = prepare_request(handle, resolve_draft(draft, handle, opts), compile_for(handle), prompt, opts, task,
                            shared_prefix)
    dec = SpeculativeDecoder(handle.model, parts.matcher, parts.prompt_ids, drafter=parts.drafter,
                             k_policy=parts.k_policy, temperature=opts.temperature, seed=opts.seed,
                             max_new_tokens=opts.max_new_tokens, prefix_len=parts.prefix_len, max_repeats=opts.max_repeats,
                             prefix_cache=prefix_cache_for(handle.model) if opts.prefix_cache else None)
    dec.stats.profile = parts.profile
    return handle, dec


def _generate(handle: ModelHandle, dec: SpeculativeDecoder, finish: Callable[[str], Any], *, stream: bool,
              return_stats: bool) -> Any:
    text_stream = TextStream(dec, handle, finish)
    if stream:
        return text_stream
    for _ in text_stream:
        pass
    return (text_stream.value, text_stream.stats) if return_stats else text_stream.value


def generate_json(
    model: Any,
    schema: Any,
    prompt: str,
    *,
    draft: Any = None,
    options: SpecOptions | None = None,
    stream: bool = False,
    return_stats: bool = False,
    shared_prefix: str | None = None,
    **option_values: Any,
) -> Any:
    """Generate a JSON value that validates against ``schema``.

    Args:
        model: a ``ModelHandle``, a model id or local path, a ``(model, tokenizer)`` pair, or
            None for the embedded SmolLM2-135M-Instruct.
        schema: a JSON schema (dict, JSON text or file path), a pydantic model class, or a
            ``JsonSchema`` from ``load_schema``.
        prompt: the user message; it goes through the model's chat template when it has one.
            The schema is not added to it: say in the prompt what to extract.
        draft: what "auto" drafts with besides forced text, copies and lookup: None (the
            corpus of the model's own outputs the package ships for it, if any;
            ``drafter="head"`` then takes the shipped head), True (the shipped draft head and
            corpus), False (nothing learned), a directory from ``constrained-spec
            train-drafter`` (its head and corpus), or a draft model with the same tokenizer for
            ``drafter="model"`` / ``"hybrid"`` (same forms as ``model``).
        options: a ``SpecOptions``; keyword arguments override its fields. The options:
            ``drafter`` ("auto"), ``k_max``, ``adaptive``, ``profile``, ``temperature`` (0:
            greedy), ``seed``, ``max_new_tokens`` (512), ``backend`` ("auto"), ``lenient``,
            ``whitespace`` ("canonical"), ``closed`` (True: objects take their declared keys
            only); see ``SpecOptions``. An unknown name raises
            ``InvalidOptionError``.
        stream: return a ``TextStream`` that yields the text as tokens are accepted; its
            ``value`` and ``stats`` are set once it is exhausted.
        return_stats: also return a ``DecodeStats``.
        shared_prefix: the leading text of ``prompt`` that other requests share (an instruction
            template, a system text): a cut between prompt chunks where it ends, so with
            ``prefix_cache`` on (the default) its keys are kept as a block for the next request
            that starts with it even when it is shorter than a chunk (``decoding.prefix``).
            The output is the same with or without the cache.

    Returns:
        The parsed value (a pydantic instance when ``schema`` is a pydantic class), or
        ``(value, stats)`` with ``return_stats=True``, or a ``TextStream``.

    Raises:
        InvalidOptionError: an option has a bad value or an unknown name (before decoding).
        InvalidSchemaError: the schema is invalid, unreadable or over a limit (before decoding).
        UnsupportedSchemaFeatureError: a keyword the backend cannot enforce, named with its path.
        InvalidPromptError: the prompt is empty or does not fit the context (before decoding).
        TokenizerMismatchError: the draft has another tokenizer (before decoding).
        ModelLoadError: the model could not be loaded.
        TokenLimitError: ``max_new_tokens`` ran out; it carries the partial text.
        OutputValidationError: the output failed validation. A value that breaks the schema is
            never returned.
    """
    opts = SpecOptions.build(options, **option_values)
    loaded = load_schema(schema)
    decoded = decoded_schema(loaded, opts)
    # Refused now, before a model loads, wherever the refusal needs no vocabulary.
    check_constraint(decoded, kind="json", backend=opts.backend, lenient=opts.lenient, whitespace=opts.whitespace)
    compile_for = lambda h: compile_constraint(  # noqa: E731
        decoded, h.tokenizer, kind="json", backend=opts.backend, lenient=opts.lenient, whitespace=opts.whitespace)
    handle, dec = _start(model, draft, compile_for, prompt, opts, task="json", shared_prefix=shared_prefix)
    finish = lambda text: validate_json_output(text, loaded)  # noqa: E731
    return _generate(handle, dec, finish, stream=stream, return_stats=return_stats)


def decoded_schema(loaded: JsonSchema, opts: SpecOptions) -> JsonSchema:
    """The schema a request decodes with: ``loaded`` with its objects closed to their declared
    keys where ``opts.closed`` (outputs are still validated against ``loaded`` as written)."""
    return closed_schema(loaded, opts.closed)


def validate_json_output(text: str, schema: dict | JsonSchema, model_cls: type | None = None) -> Any:
    """Parse and validate generated JSON against the original schema (and the pydantic class);
    never returns an invalid value: raises ``OutputValidationError`` instead (a key twice in
    one object included, which ``json.loads`` would hide by keeping the last value)."""
    if isinstance(schema, JsonSchema):
        schema, model_cls = schema.schema, model_cls or schema.model_cls
    try:
        value = json.loads(text, object_pairs_hook=_dict_refusing_duplicates)
    except json.JSONDecodeError as e:
        raise OutputValidationError(text, f"not JSON ({e})") from None
    except _DuplicateKey:
        key, where = _first_duplicate_key(json.loads(text, object_pairs_hook=_Pairs))
        raise OutputValidationError(text, f"at {where or '/'}: key {key!r} appears more than once in one object "
                                          "(JSON parsers keep one of the values and lose the other)") from None
    errors = sorted(output_validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        where = "/" + "/".join(str(p) for p in errors[0].absolute_path)
        raise OutputValidationError(text, f"at {where}: {errors[0].message}")
    if model_cls is not None:
        from pydantic import ValidationError

        try:
            return model_cls.model_validate(value)
        except ValidationError as e:
            raise OutputValidationError(text, str(e).splitlines()[0]) from None
    return value


class _DuplicateKey(Exception):
    """An object of the output has a key twice (raised while parsing; its path is found apart)."""


def _dict_refusing_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys, so a value would be lost without a word and the
    # schema check after parsing would never see it (JSON Schema cannot forbid duplicate keys).
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _DuplicateKey
    return value


class _Pairs(list):
    """A parsed object as its list of ``(key, value)`` pairs, in order, duplicates kept."""


def _first_duplicate_key(tree: Any, path: str = "") -> tuple[str, str] | None:
    """``(key, JSON pointer of its object)`` of the first repeated key in ``tree`` (parsed with
    ``_Pairs`` for objects), depth first in document order; None when there is none."""
    if isinstance(tree, _Pairs):
        seen: set[str] = set()
        for key, child in tree:
            if key in seen:
                return key, path
            seen.add(key)
            found = _first_duplicate_key(child, f"{path}/{_pointer_token(key)}")
            if found:
                return found
    elif isinstance(tree, list):
        for i, child in enumerate(tree):
            if found := _first_duplicate_key(child, f"{path}/{i}"):
                return found
    return None


def _pointer_token(key: str) -> str:
    """``key`` escaped as one JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def generate_regex(
    model: Any,
    pattern: str,
    prompt: str,
    *,
    draft: Any = None,
    options: SpecOptions | None = None,
    stream: bool = False,
    return_stats: bool = False,
    shared_prefix: str | None = None,
    **option_values: Any,
) -> Any:
    """Generate a string that fully matches ``pattern``; arguments as in ``generate_json``
    (``whitespace`` and ``lenient`` do not apply to a regex).

    Returns the string, ``(string, stats)`` with ``return_stats=True``, or a ``TextStream``
    with ``stream=True``.
    """
    opts = SpecOptions.build(options, **option_values)
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {pattern!r}.")
    try:
        checker = compiled_pattern(pattern)  # the regex package: Unicode classes as llguidance reads them
    except regex.error as e:
        raise InvalidRegexError(f"Invalid regex {pattern!r}: it does not compile ({e}).") from None
    check_constraint(pattern, kind="regex", backend=opts.backend)  # before a model loads

    def finish(text: str) -> str:
        if not checker.fullmatch(text):
            raise OutputValidationError(text, f"does not fully match {pattern!r}")
        return text

    compile_for = lambda h: compile_constraint(pattern, h.tokenizer, kind="regex", backend=opts.backend)  # noqa: E731
    handle, dec = _start(model, draft, compile_for, prompt, opts, task="text", shared_prefix=shared_prefix)
    return _generate(handle, dec, finish, stream=stream, return_stats=return_stats)
