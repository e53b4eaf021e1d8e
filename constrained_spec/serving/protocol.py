"""OpenAI-style request bodies, read strictly: what a request asks for, or a 400 naming the problem.

Fail closed: every object is parsed with unknown fields forbidden, so a constraint field this
server does not know (``guided_json``, a misspelt ``json_schema`` key, a schema one level too
high in ``response_format``) is refused with HTTP 400 naming it, never ignored. Options that
would change the output law in a way the exact verifier cannot honour (``top_p`` < 1, penalties,
``n`` > 1, logprobs) are refused the same way, and so is an empty (or whitespace-only) user
message or prompt, which the model would otherwise answer with invented content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..constraint.limits import json_depth_and_values

#: Largest request body (bytes) and largest schema or pattern (bytes of its JSON text).
MAX_BODY_BYTES = 1 << 20
MAX_CONSTRAINT_BYTES = 64 << 10
#: How deeply a request body's JSON may nest: a schema's own limit (``ConstraintLimits``, 64)
#: plus the request's levels around it, so the schema's check names the schema's limit.
MAX_BODY_DEPTH = 96


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["json_schema", "json_object", "text"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's field names: exactly one of them."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None


class Speculative(_Strict):
    drafter: Literal["none", "model", "lookup", "grammar", "hybrid", "auto"] | None = None
    k_max: int | None = Field(default=None, ge=0, le=64)
    adaptive: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class _Common(_Strict):
    model: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    speculative: Speculative | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool | None = None


@dataclass(frozen=True)
class ConstraintSpec:
    """The constraint a request asked for: a schema (``kind="json"``) or a pattern (``"regex"``).
    ``lenient``: relax keywords the backend cannot enforce (a non-strict schema); the output is
    still validated against the full schema. ``closed``: objects that leave
    ``additionalProperties`` out take the declared keys only (``strict: true``, as OpenAI's
    strict mode emits them; ``constraint.schema.close_objects``)."""

    kind: Literal["json", "regex"]
    source: Any
    lenient: bool = False
    param: str = "response_format"
    closed: bool = False


#: A request without a constraint: any text, ended by the model's EOS or the token limit.
FREE_TEXT = ConstraintSpec("regex", r"[\s\S]*", param="")


@dataclass
class Parsed:
    """What a request asks for, checked."""

    constraint: ConstraintSpec
    model: str | None
    messages: list[dict[str, str]] | None
    prompt: str | None
    temperature: float
    seed: int | None
    max_tokens: int | None
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    speculative: dict[str, Any] = field(default_factory=dict)

    @property
    def source_text(self) -> str:
        """The request's text (what copy drafts copy from)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or [])


def parse_body(raw: bytes, kind: Literal["chat", "completion"]) -> Parsed:
    """Read and check a request body; raises ``ApiError`` (400 / 413) naming the problem."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"Request body of {len(raw)} bytes is over the limit of {MAX_BODY_BYTES} bytes.",
                       code="body_too_large")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"Request body is not JSON: {e}.", code="invalid_json") from None
    except RecursionError:  # the parser's own recursion limit, well past MAX_BODY_DEPTH
        raise ApiError(400, f"Request body nests deeper than the limit of {MAX_BODY_DEPTH} levels.",
                       code="too_deep") from None
    if json_depth_and_values(data, stop_depth=MAX_BODY_DEPTH)[0] > MAX_BODY_DEPTH:
        raise ApiError(400, f"Request body nests deeper than the limit of {MAX_BODY_DEPTH} levels.", code="too_deep")
    if not isinstance(data, dict):
        raise ApiError(400, "Request body must be a JSON object.", code="invalid_json")
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    return _check(req)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"Unknown field '{path}': this server refuses fields it does not know rather than "
                             "ignore them (a misplaced constraint would otherwise go unenforced).",
                        param=path, code="unknown_field")
    return ApiError(400, f"Invalid '{path}': {err['msg']}.", param=path, code="invalid_value")


def _check(req: ChatRequest | CompletionRequest) -> Parsed:
    refuse = [("n", req.n not in (None, 1), "n > 1 is not supported: send one request per completion"),
              ("top_p", req.top_p not in (None, 1), "top_p < 1 is not supported: exact speculative sampling here "
               "samples the full masked target distribution (use temperature)"),
              ("presence_penalty", bool(req.presence_penalty), "penalties are not supported"),
              ("frequency_penalty", bool(req.frequency_penalty), "penalties are not supported"),
              ("logprobs", bool(req.logprobs), "logprobs are not supported")]
    if isinstance(req, ChatRequest):
        refuse.append(("top_logprobs", bool(req.top_logprobs), "logprobs are not supported"))
    else:
        refuse.append(("echo", bool(req.echo), "echo is not supported"))
    for param, bad, why in refuse:
        if bad:
            raise ApiError(400, f"Unsupported '{param}': {why}.", param=param, code="unsupported_parameter")
    constraint = _constraint(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stop and constraint is not FREE_TEXT:
        raise ApiError(400, "Unsupported 'stop' with a constraint: stopping at a stop sequence could end the output "
                            "outside the constraint's language. Put the end into the schema or pattern instead.",
                       param="stop", code="unsupported_parameter")
    if any(not s for s in stop):
        raise ApiError(400, "Invalid 'stop': stop sequences must be non-empty strings.", param="stop")
    max_tokens = req.max_tokens
    messages = prompt = None
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in req.messages]
        for i, m in enumerate(messages):
            # The chat template around an empty turn is still a prompt, and the model would answer
            # it with invented content; refuse it as generate_json refuses an empty prompt.
            if m["role"] == "user" and not m["content"].strip():
                raise ApiError(400, f"Invalid 'messages[{i}].content': the user message is empty (or only "
                                    "whitespace); there is nothing to answer.", param=f"messages[{i}].content",
                               code="empty_prompt")
    else:
        if isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise ApiError(400, "Unsupported 'prompt': send one prompt per request.", param="prompt",
                               code="unsupported_parameter")
            prompt = req.prompt[0]
        else:
            prompt = req.prompt
        if not prompt.strip():
            raise ApiError(400, "Invalid 'prompt': it is empty (or only whitespace); there is nothing to complete.",
                           param="prompt", code="empty_prompt")
    spec = req.speculative.model_dump(exclude_none=True) if req.speculative else {}
    return Parsed(constraint, req.model, messages, prompt, float(req.temperature if req.temperature is not None else 1.0),
                  req.seed, max_tokens, req.stream, bool(req.stream_options and req.stream_options.include_usage),
                  stop, spec)


def _constraint(req: ChatRequest | CompletionRequest) -> ConstraintSpec:
    found: list[ConstraintSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ApiError(400, "Invalid 'response_format': type 'json_schema' needs a 'json_schema' object with "
                                "its 'schema'.", param="response_format.json_schema", code="invalid_value")
        strict = rf.json_schema.strict is True
        found.append(ConstraintSpec("json", rf.json_schema.schema_, lenient=not strict, closed=strict,
                                    param="response_format.json_schema.schema"))
    elif rf is not None and rf.type == "json_object":
        if rf.json_schema is not None:
            raise ApiError(400, "Invalid 'response_format': type 'json_object' takes no 'json_schema' (use type "
                                "'json_schema').", param="response_format.json_schema", code="invalid_value")
        found.append(ConstraintSpec("json", {"type": "object"}, param="response_format"))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice") if getattr(so, k) is not None]
        if len(given) != 1:
            raise ApiError(400, "Invalid 'structured_outputs': give exactly one of 'json', 'regex', 'choice'.",
                           param="structured_outputs", code="invalid_value")
        if so.regex is not None:
            found.append(ConstraintSpec("regex", so.regex, param="structured_outputs.regex"))
        elif so.choice is not None:
            if not so.choice or any(not isinstance(c, str) or not c for c in so.choice):
                raise ApiError(400, "Invalid 'structured_outputs.choice': expected a non-empty list of non-empty "
                                    "strings.", param="structured_outputs.choice", code="invalid_value")
            found.append(ConstraintSpec("regex", "|".join(f"(?:{re.escape(c)})" for c in so.choice),
                                        param="structured_outputs.choice"))
        else:
            schema = so.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ApiError(400, f"Invalid 'structured_outputs.json': not JSON ({e}).",
                                   param="structured_outputs.json", code="invalid_schema") from None
            found.append(ConstraintSpec("json", schema, param="structured_outputs.json"))
    if len(found) > 1:
        raise ApiError(400, "Conflicting constraints: give either 'response_format' or 'structured_outputs', not both.",
                       param="structured_outputs", code="invalid_value")
    if not found:
        return FREE_TEXT
    spec = found[0]
    if len(json.dumps(spec.source)) > MAX_CONSTRAINT_BYTES:
        raise ApiError(400, f"'{spec.param}' is over the limit of {MAX_CONSTRAINT_BYTES} bytes.", param=spec.param,
                       code="constraint_too_large")
    return spec
