"""The public entry points: ``generate_json`` and ``generate_regex``.

Everything is validated before decoding starts (schema, pattern, prompt, draft tokenizer,
options), so bad input raises a clear error and leaves nothing half-done.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from .backends import AUTO_BACKEND, Backend, GuidanceConstraint, compile_constraint
from .constraint import DEFAULT_JSON_WHITESPACE, Constraint, load_schema, schema_to_regex, vocabulary_of
from .decoder import DecodeStats, make_decoder
from .drafters import (
    CopyDrafter,
    Drafter,
    GrammarDrafter,
    HybridDrafter,
    LookupDrafter,
    ModelDrafter,
    structural_tokens,
)
from .errors import InvalidPromptError, OutputValidationError, TokenLimitError
from .kpolicy import AdaptiveK, FixedK, KPolicy
from .models import ModelHandle, check_same_tokenizer, resolve_model
from .profiles import k_max_for

DrafterName = Literal["none", "model", "lookup", "grammar", "hybrid", "auto"]

DRAFTERS = ("none", "model", "lookup", "grammar", "hybrid", "auto")


@dataclass(frozen=True)
class SpecOptions:
    """Speculation options, validated once. ``k_max`` comes from the hardware / task profile
    unless given; ``adaptive`` picks K per step within it (else K = k_max every step).

    Policies from production practice and where they stand here: speculation is switched off
    for batches above ``batched.SPECULATION_MAX_BATCH`` (8) in ``extract``; it is *not* switched
    off for short outputs, because measurement says it pays even there (the 34-token demo
    extraction: 1.65x), and the adaptive policy already drops to K = 0 on its own when drafts
    stop landing. Loaded models are warmed up once (``models.warm_up``).
    """

    drafter: str
    k_max: int
    temperature: float
    seed: int | None
    max_new_tokens: int
    profile: str = "cpu"
    adaptive: bool = True

    @staticmethod
    def build(drafter: str, draft: Any, k_max: int | None, temperature: float, seed: int | None,
              max_new_tokens: int, *, task: str = "json", profile: str | None = None,
              adaptive: bool = True) -> "SpecOptions":
        """Resolve ``auto`` and defaults; raise ``ValueError`` naming the bad option."""
        if drafter not in DRAFTERS:
            raise ValueError(f"Invalid drafter: expected one of {', '.join(map(repr, DRAFTERS))}, got {drafter!r}.")
        if drafter == "model" and draft is None:
            raise ValueError("Invalid drafter: 'model' needs a draft model; pass draft=... or use drafter='hybrid'.")
        if drafter == "auto":
            drafter = "hybrid"  # forced text, then lookup, then the draft model when given
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"Invalid max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}.")
        profile, profile_k = k_max_for(profile, task)
        if k_max is None:
            k_max = profile_k if drafter != "none" else 0
        if not isinstance(k_max, int) or k_max < 0:
            raise ValueError(f"Invalid k_max: expected an integer >= 0, got {k_max!r}.")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"Invalid temperature: expected a number >= 0, got {temperature!r}.")
        return SpecOptions(drafter, k_max, float(temperature), seed, max_new_tokens, profile, adaptive)

    def k_policy(self) -> KPolicy:
        """The K policy for one request."""
        if self.drafter == "none" or not self.adaptive:
            return FixedK(self.k_max if self.drafter != "none" else 0)
        return AdaptiveK(self.k_max, costly_draft=self.drafter == "model")


def encode_prompt(handle: ModelHandle, prompt: str) -> list[int]:
    """Token ids of ``prompt``, through the model's chat template when it has one."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidPromptError(f"Invalid prompt: expected a non-empty string, got {prompt!r}.")
    tok = handle.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(prompt)["input_ids"]
    ctx = handle.context_length
    if ctx is not None and len(ids) >= ctx:
        raise InvalidPromptError(
            f"Invalid prompt: {len(ids)} tokens do not fit the model's context of {ctx} tokens. Shorten the prompt."
        )
    return list(ids)


def _make_drafter(opts: SpecOptions, target: ModelHandle, draft: Any, constraint: Constraint,
                  prompt: str | None = None) -> Drafter | None:
    model_drafter = None
    if draft is not None and opts.drafter in ("model", "hybrid"):
        draft_handle = resolve_model(draft, role="draft")
        check_same_tokenizer(target, draft_handle)
        model_drafter = ModelDrafter(draft_handle.model, constraint, temperature=opts.temperature)
    tok = target.tokenizer
    if opts.drafter == "model":
        return model_drafter
    if opts.drafter == "lookup":
        return LookupDrafter(constraint)
    if opts.drafter in ("grammar", "hybrid"):
        grammar = GrammarDrafter(constraint, lambda text: tok(text, add_special_tokens=False)["input_ids"])
        if opts.drafter == "grammar":
            return grammar
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
        lookup = LookupDrafter(constraint, ignore=structural_tokens(vocabulary_of(tok)))
        parts: list[Any] = [grammar, CopyDrafter(constraint, grammar.tokenize, decode, grammar, source=prompt), lookup]
        return HybridDrafter(parts + ([model_drafter] if model_drafter is not None else []))
    return None


class TextStream:
    """Text as the decoder accepts it; iterate to get the pieces (a step may add several tokens).

    After the iteration ends: ``text`` (the whole output), ``stats`` and ``value`` (the parsed,
    validated result). Errors (token limit, validation) are raised at the end of the iteration,
    after every valid piece was yielded.
    """

    def __init__(self, pieces: Iterator[str], finish: Callable[[str], Any]) -> None:
        self._pieces = pieces
        self._finish = finish
        self.text = ""
        self.stats: DecodeStats | None = None
        self.value: Any = None

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self.text += piece
            yield piece
        self.value = self._finish(self.text)


def _stream(
    model: Any,
    constraint_for: Callable[[ModelHandle], Constraint],
    prompt: str,
    *,
    draft: Any,
    drafter: str,
    temperature: float,
    seed: int | None,
    max_new_tokens: int,
    k_max: int | None,
    task: str,
    profile: str | None,
    adaptive: bool,
    on_stats: Callable[[DecodeStats], None],
) -> Iterator[str]:
    """Validate everything, compile, then decode, yielding text pieces; raise ``TokenLimitError`` at the end."""
    opts = SpecOptions.build(drafter, draft, k_max, temperature, seed, max_new_tokens,
                             task=task, profile=profile, adaptive=adaptive)
    handle = resolve_model(model)
    compiled = constraint_for(handle)
    constraint = compiled.for_request()
    prompt_ids = encode_prompt(handle, prompt)
    dec = make_decoder(
        handle.model,
        constraint,
        prompt_ids,
        drafter=_make_drafter(opts, handle, draft, constraint, prompt),
        k_policy=opts.k_policy(),
        temperature=opts.temperature,
        seed=opts.seed,
        max_new_tokens=opts.max_new_tokens,
    )
    dec.stats.profile = opts.profile
    dec.stats.k_max = opts.k_max
    dec.stats.backend = "llguidance" if isinstance(compiled, GuidanceConstraint) else "outlines-core"
    dec.stats.relaxed = list(getattr(compiled, "warnings", []))
    return _pieces(handle, dec, opts, on_stats)


def _pieces(handle: ModelHandle, dec: Any, opts: SpecOptions, on_stats: Callable[[DecodeStats], None]) -> Iterator[str]:
    tok = handle.tokenizer
    shown = ""
    for _ in dec.run():
        text = tok.decode(dec.output, skip_special_tokens=False)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        if len(text) > len(shown):
            yield text[len(shown):]
            shown = text
    text = tok.decode(dec.output, skip_special_tokens=False)
    if len(text) > len(shown):
        yield text[len(shown):]
    on_stats(dec.stats)
    if not dec.finished:
        raise TokenLimitError(text, opts.max_new_tokens)


def _run(model: Any, constraint_for: Callable[[ModelHandle], Constraint], prompt: str, **options: Any) -> tuple[str, DecodeStats]:
    """Decode to the end; the text and the stats, or a clear error."""
    box: list[DecodeStats] = []
    text = "".join(_stream(model, constraint_for, prompt, on_stats=box.append, **options))
    return text, box[0]


def generate_json(
    model: Any,
    schema: Any,
    prompt: str,
    *,
    draft: Any = None,
    drafter: DrafterName = "auto",
    temperature: float = 0.0,
    seed: int | None = None,
    max_new_tokens: int = 512,
    k_max: int | None = None,
    whitespace: str = DEFAULT_JSON_WHITESPACE,
    profile: str | None = None,
    adaptive: bool = True,
    backend: Backend = "auto",
    lenient: bool = False,
    stream: bool = False,
    return_stats: bool = False,
) -> Any:
    """Generate a JSON value that validates against ``schema``.

    Args:
        model: a ``ModelHandle``, a model id or local path, a ``(model, tokenizer)`` pair, or
            None for the embedded SmolLM2-135M-Instruct.
        schema: a JSON schema (dict, JSON text or file path) or a pydantic model class.
        prompt: the user message; it goes through the model's chat template when it has one.
            The schema is not added to it: say in the prompt what to extract.
        draft: the draft model for ``drafter="model"`` (same forms as ``model``).
        drafter: "none" (target-only), "model", "lookup" (prompt lookup), "grammar" (text the
            constraint forces), "hybrid" (forced text, then lookup, then the draft model when
            given) or "auto" (= hybrid).
        temperature: 0 for greedy; above 0, exact sampling from the masked target distribution.
        seed: makes sampling reproducible.
        max_new_tokens: the generation limit; reaching it first raises ``TokenLimitError``
            carrying the partial text.
        k_max: the most tokens verified per step; default from the hardware / task profile.
        whitespace: the JSON layout: "canonical" (``json.dumps`` style, the default),
            "flexible", "compact", or a whitespace regex (see ``JSON_LAYOUTS``).
        profile: hardware profile for K_max ("cpu", "a100-80gb", "h100-80gb", "h100-80gb-x8",
            "gb200-nvl72"); default ``$CONSTRAINED_SPEC_PROFILE`` or detected from the device.
        adaptive: choose K each step from online acceptance and cost estimates (else K = k_max).
        backend: "outlines-core", "llguidance" or "auto" (see ``backends.AUTO_BACKEND``).
        lenient: llguidance only: relax keywords it cannot enforce instead of refusing them;
            the relaxed ones are listed in ``stats.relaxed`` and the output is still validated
            against the full schema (a violation raises ``OutputValidationError``).
        stream: return a ``TextStream`` that yields the text as tokens are accepted; its
            ``value`` and ``stats`` are set once it is exhausted.
        return_stats: also return a ``DecodeStats``.

    Returns:
        The parsed value (a pydantic instance when ``schema`` is a pydantic class), or
        ``(value, stats)`` with ``return_stats=True``, or a ``TextStream``.
    """
    schema_dict, model_cls = load_schema(schema)
    if (AUTO_BACKEND if backend == "auto" else backend) == "outlines-core":
        schema_to_regex(schema_dict, whitespace)  # refuse unsupported keywords before loading a model
    options = dict(draft=draft, drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                   k_max=k_max, task="json", profile=profile, adaptive=adaptive)
    finish = lambda text: validate_json_output(text, schema_dict, model_cls)  # noqa: E731
    constraint_for = lambda h: compile_constraint(  # noqa: E731
        schema_dict, h.tokenizer, kind="json", backend=backend, lenient=lenient, whitespace=whitespace)
    if stream:
        return _text_stream(model, constraint_for, prompt, finish, options)
    text, stats = _run(model, constraint_for, prompt, **options)
    value = finish(text)
    return (value, stats) if return_stats else value


def _text_stream(model: Any, constraint_for: Callable[[ModelHandle], Constraint], prompt: str,
                 finish: Callable[[str], Any], options: dict[str, Any]) -> TextStream:
    """A ``TextStream``; input is validated now, before the caller iterates."""
    holder: list[TextStream] = []
    pieces = _stream(model, constraint_for, prompt, on_stats=lambda st: setattr(holder[0], "stats", st), **options)
    holder.append(TextStream(pieces, finish))
    return holder[0]


def validate_json_output(text: str, schema: dict, model_cls: type | None = None) -> Any:
    """Parse and validate generated JSON against the original schema; never returns an invalid value."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OutputValidationError(text, f"not JSON ({e})") from None
    errors = sorted(jsonschema.validators.validator_for(schema)(schema).iter_errors(value), key=lambda e: list(e.path))
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


def generate_regex(
    model: Any,
    pattern: str,
    prompt: str,
    *,
    draft: Any = None,
    drafter: DrafterName = "auto",
    temperature: float = 0.0,
    seed: int | None = None,
    max_new_tokens: int = 512,
    k_max: int | None = None,
    profile: str | None = None,
    adaptive: bool = True,
    backend: Backend = "auto",
    stream: bool = False,
    return_stats: bool = False,
) -> Any:
    """Generate a string that fully matches ``pattern``; options as in ``generate_json``.

    Returns the string, ``(string, stats)`` with ``return_stats=True``, or a ``TextStream``
    with ``stream=True``.
    """
    from .errors import InvalidRegexError

    if not isinstance(pattern, str) or not pattern:
        raise InvalidRegexError(f"Invalid regex: expected a non-empty string, got {pattern!r}.")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise InvalidRegexError(f"Invalid regex {pattern!r}: it does not compile ({e}).") from None
    options = dict(draft=draft, drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                   k_max=k_max, task="text", profile=profile, adaptive=adaptive)

    def finish(text: str) -> str:
        if not compiled.fullmatch(text):
            raise OutputValidationError(text, f"does not fully match {pattern!r}")
        return text

    constraint_for = lambda h: compile_constraint(pattern, h.tokenizer, kind="regex", backend=backend)  # noqa: E731
    if stream:
        return _text_stream(model, constraint_for, prompt, finish, options)
    text, stats = _run(model, constraint_for, prompt, **options)
    return (finish(text), stats) if return_stats else finish(text)
