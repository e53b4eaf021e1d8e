"""Send a generation to a running ``constrained-spec serve`` instead of loading the model here.

The command line's ``--server URL`` (or ``$CONSTRAINED_SPEC_SERVER``) uses it, so a shell loop
pays no model load per call. Standard library only: importing it loads no torch. The server
checks everything (schema, pattern, options) and answers errors that name the problem; they are
raised here as the same errors a local call raises.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from .errors import (
    ConstrainedSpecError, InvalidOptionError, InvalidRegexError, InvalidSchemaError, OutputValidationError,
    TokenLimitError,
)

ENV_SERVER = "CONSTRAINED_SPEC_SERVER"


class RemoteError(ConstrainedSpecError, RuntimeError):
    """The server could not be reached, or refused the request for a reason of its own."""


def schema_dict(schema: Any) -> dict[str, Any]:
    """A JSON schema from a pydantic class, a dict, JSON text or a file path (no model needed)."""
    if hasattr(schema, "model_json_schema"):  # closed as in-process decoding closes it
        from .constraint.schema import pydantic_schema

        return pydantic_schema(schema)
    if isinstance(schema, dict):
        return schema
    text = str(schema)
    if not text.lstrip().startswith("{") and Path(text).is_file():
        text = Path(text).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidSchemaError(f"Invalid schema: not a file, JSON text or pydantic class ({e}).") from None
    if not isinstance(value, dict):
        raise InvalidSchemaError("Invalid schema: expected a JSON object.")
    return value


def chat_body(prompt: str, *, constraint: dict[str, Any], temperature: float, seed: int | None,
              max_new_tokens: int, drafter: str, k_max: int | None, adaptive: bool, stream: bool) -> dict[str, Any]:
    """The chat-completions body for one prompt and constraint (``response_format`` or
    ``structured_outputs`` entries)."""
    speculative: dict[str, Any] = {"drafter": drafter, "adaptive": adaptive}
    if k_max is not None:
        speculative["k_max"] = k_max
    return {"model": "default", "messages": [{"role": "user", "content": prompt}], "temperature": temperature,
            "seed": seed, "max_tokens": max_new_tokens, "stream": stream, "speculative": speculative, **constraint}


def json_constraint(schema: dict[str, Any], lenient: bool) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": schema, "strict": not lenient}}}


def regex_constraint(pattern: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": pattern}}


def _open(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> Any:
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            error = json.loads(e.read())["error"]
        except Exception:
            error = {"message": f"HTTP {e.code} {e.reason}", "code": None, "param": None}
        raise _as_error(e.code, error) from None
    except urllib.error.URLError as e:
        raise RemoteError(f"No server answered at {url} ({e.reason}); start one with 'constrained-spec serve'.") from None


def _as_error(status: int, error: dict[str, Any]) -> ConstrainedSpecError:
    message, code, param = error.get("message", ""), error.get("code"), error.get("param") or ""
    if status == 400 and code in ("invalid_constraint", "invalid_schema", "constraint_too_large", "compile_timeout"):
        return InvalidRegexError(message) if "regex" in param else InvalidSchemaError(message)
    if status == 400:
        return InvalidOptionError(message)
    if code == "output_invalid":
        return OutputValidationError("", message)
    return RemoteError(f"The server answered {status}: {message}")


def generate(url: str, body: dict[str, Any], *, api_key: str | None = None,
             timeout: float = 600.0) -> tuple[str, dict[str, Any]]:
    """The whole answer: ``(text, the reply)`` (its ``usage`` and ``constrained_spec`` figures);
    ``TokenLimitError`` (with the partial text) when the token limit came first."""
    with _open(url, {**body, "stream": False}, api_key, timeout) as resp:
        reply = json.loads(resp.read())
    choice = reply["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "length":
        raise TokenLimitError(text, body.get("max_tokens") or 0)
    return text, reply


def stream(url: str, body: dict[str, Any], *, api_key: str | None = None, timeout: float = 600.0) -> Iterator[str]:
    """Text pieces as the server streams them; raises at the end as ``generate`` does."""
    with _open(url, {**body, "stream": True}, api_key, timeout) as resp:
        text = ""
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise _as_error(500, chunk["error"])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                text += piece
                if piece:
                    yield piece
                if choice.get("finish_reason") == "length":
                    raise TokenLimitError(text, body.get("max_tokens") or 0)
