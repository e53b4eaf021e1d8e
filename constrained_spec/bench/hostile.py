"""Hostile and random traffic for a running server, and the one check of every answer.

``HOSTILE``: the kinds of bad request an attacker (or a confused client) sends: malformed bodies,
wrong types, other engines' fields, invalid, unsatisfiable and costly constraints, remote and
file ``$ref``, bad regexes, out-of-range options, prompts over the context, oversized and
over-nested bodies. Each must be answered with a 4xx and OpenAI's error body.

``check_answer``: what any answer must be: a 2xx whose body is valid for the constraint the
request asked for (or says ``valid: false`` with ``finish_reason: "length"``), or a 4xx with an
error body; never a 5xx, never a connection error. ``request_strategy`` (needs ``hypothesis``)
draws random requests, mostly wrong, some valid, for the fuzz test and ``constrained-spec fuzz``;
``constrained-spec soak`` mixes both kinds for minutes (``bench.soak``).

Standard library HTTP only: clients cost little next to the server they test.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

#: A schema and a prompt the embedded model answers in a few dozen tokens.
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Extract the person as JSON: Maria Gonzalez is a 34-year-old architect who lives in Barcelona."


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, **extra}


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _deep_body(depth: int) -> bytes:
    inner = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    return ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "deep", "schema": ' + inner + "}}}").encode()


def _schema(schema: Any, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


#: name -> the raw body (bytes) or a request object; every one must get a 4xx with an error body.
HOSTILE: dict[str, bytes | dict[str, Any]] = {
    "not json": b"{not json",
    "empty body": b"",
    "json array body": b"[1, 2, 3]",
    "json string body": b'"hello"',
    "invalid utf-8": b'{"messages": "\xff\xfe"}',
    "no messages": {"model": "default"},
    "empty messages": _chat(messages=[]),
    "message without role": _chat(messages=[{"content": "hi"}]),
    "unknown role": _chat(messages=[{"role": "wizard", "content": "hi"}]),
    "content of the wrong type": _chat(messages=[{"role": "user", "content": 42}]),
    "temperature as a string": _chat(temperature="hot"),
    "negative temperature": _chat(temperature=-1),
    "temperature past 2": _chat(temperature=9),
    "max_tokens zero": _chat(max_tokens=0),
    "max_tokens past the context": _chat(max_tokens=10_000_000),
    "n above one": _chat(n=3),
    "top_p below one": _chat(top_p=0.5),
    "penalties": _chat(presence_penalty=1.0),
    "logprobs": _chat(logprobs=True),
    "vllm guided_json": _chat(guided_json=PERSON),
    "sglang regex field": _chat(regex="[a-z]+"),
    "schema one level too high": _chat(response_format={"type": "json_schema", "schema": PERSON}),
    "json_schema without schema": _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    "unknown response_format type": _chat(response_format={"type": "yaml"}),
    "two constraints": _chat(response_format=_schema(PERSON), structured_outputs={"regex": "a+"}),
    "structured_outputs.grammar": _chat(structured_outputs={"grammar": "root ::= 'a'"}),
    "invalid schema": _chat(response_format=_schema({"type": "nonsense"})),
    "schema not an object": _chat(response_format=_schema([1, 2])),
    "unsatisfiable schema": _chat(response_format=_schema({"type": "string", "minLength": 5, "maxLength": 2})),
    "keyword strict mode cannot enforce": _chat(response_format=_schema(
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})),
    "remote $ref": _chat(response_format=_schema({"$ref": "https://example.com/schema.json"})),
    "file $ref": _chat(response_format=_schema({"$ref": "file:///etc/passwd"})),
    "dangling local $ref": _chat(response_format=_schema({"$ref": "#/$defs/missing"})),
    "schema nested 80 deep": _chat(response_format=_schema(_nested_schema(80))),
    "body nested 5,000 deep": _deep_body(5000),
    "schema over 64 KiB": _chat(response_format=_schema({"type": "string", "description": "x" * (70 << 10)})),
    "regex that does not compile": _chat(structured_outputs={"regex": "(unclosed"}),
    "regex matching nothing": _chat(structured_outputs={"regex": "[^\\s\\S]"}),
    "regex a{1000000}": _chat(structured_outputs={"regex": "a{1000000}"}),
    "regex (a{1000}){1000}": _chat(structured_outputs={"regex": "(a{1000}){1000}"}),
    "schema pattern a{100000}": _chat(response_format=_schema({"type": "string", "pattern": "^a{100000}$"})),
    "regex needing a character no token spells": _chat(structured_outputs={"regex": "\U00040000"}),
    "a dead end after the first token": _chat(structured_outputs={"regex": "ab\U00040000"}),
    "empty choice": _chat(structured_outputs={"choice": []}),
    "stop with a constraint": _chat(response_format=_schema(PERSON), stop=["}"]),
    "unknown drafter": _chat(speculative={"drafter": "oracle"}),
    "k_max out of range": _chat(speculative={"k_max": 10_000}),
    "prompt over the context": _chat(messages=[{"role": "user", "content": "word " * 10_000}]),
    "unknown model": _chat(model="gpt-9"),
    "body over the size limit": b'{"messages": [{"role": "user", "content": "' + b"x" * (3 << 20) + b'"}]}',
}

#: Valid requests mixed into the soak: each must come back 200 and valid.
VALID: list[dict[str, Any]] = [
    _chat(temperature=0, max_tokens=48, response_format=_schema(PERSON)),
    _chat(temperature=0, max_tokens=24, structured_outputs={"regex": "[A-Z][a-z]+ [A-Z][a-z]+"}),
    _chat(temperature=0, max_tokens=8, structured_outputs={"choice": ["architect", "pilot", "teacher"]}),
    _chat(temperature=0.7, seed=3, max_tokens=48, response_format=_schema(PERSON)),
    _chat(temperature=0, max_tokens=48, stream=True, response_format=_schema(PERSON)),
]


@dataclass
class Answer:
    """What came back for one request: the status (0: no HTTP reply at all), the parsed body or
    stream events, and the raw text when it was not JSON."""

    status: int
    body: Any = None
    events: list[Any] | None = None
    raw: str = ""
    error: str | None = None


def send(url: str, request: bytes | dict[str, Any], *, api_key: str | None = None, timeout: float = 300) -> Answer:
    """POST ``request`` (raw bytes or an object) to ``url``'s chat completions route."""
    data = request if isinstance(request, bytes) else json.dumps(request).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read().decode("utf-8", errors="replace")
            kind = resp.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, raw, kind = e.code, e.read().decode("utf-8", errors="replace"), e.headers.get("content-type", "")
    except Exception as e:  # a reset or a time-out: no HTTP answer at all
        return Answer(0, error=f"{type(e).__name__}: {e}")
    if "text/event-stream" in kind:
        events = [json.loads(line[5:]) for line in raw.splitlines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
        return Answer(status, events=events, raw=raw)
    try:
        return Answer(status, body=json.loads(raw), raw=raw)
    except ValueError:
        return Answer(status, raw=raw)


def _constraint_of(request: Any) -> tuple[str, Any] | None:
    """("json", schema) or ("regex", pattern) the request asked for, None for free text or a
    request that cannot be read (it must then have been refused)."""
    if not isinstance(request, dict):
        return None
    rf, so = request.get("response_format"), request.get("structured_outputs")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
        return "json", rf["json_schema"].get("schema")
    if isinstance(rf, dict) and rf.get("type") == "json_object":
        return "json", {"type": "object"}
    if isinstance(so, dict):
        if "json" in so:
            schema = so["json"]
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    return None
            return "json", schema
        if isinstance(so.get("regex"), str):
            return "regex", so["regex"]
        if isinstance(so.get("choice"), list):
            return "regex", "|".join(re.escape(str(c)) for c in so["choice"])
    return None


def _is_error_body(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"]) and "type" in err


def check_answer(request: Any, answer: Answer) -> str | None:
    """None when the answer is acceptable for ``request``, else what is wrong with it."""
    if answer.status == 0:
        return f"no HTTP answer ({answer.error})"
    if answer.status >= 500:
        return f"server error {answer.status}: {answer.raw[:300]}"
    if 400 <= answer.status < 500:
        return None if _is_error_body(answer.body) else f"{answer.status} without an error body: {answer.raw[:300]}"
    if not 200 <= answer.status < 300:
        return f"unexpected status {answer.status}"
    if answer.events is not None:
        if any(_is_error_body(e) for e in answer.events):
            bad = next(e for e in answer.events if _is_error_body(e))
            if bad["error"].get("type") == "server_error":
                return f"a server error inside the stream: {bad['error']['message'][:300]}"
            return None
        text = "".join((c.get("delta") or {}).get("content") or "" for e in answer.events for c in e.get("choices", []))
        last = next((e for e in reversed(answer.events) if e.get("choices")), {})
        finish = last["choices"][0].get("finish_reason") if last else None
        ext = last.get("constrained_spec", {}) if last else {}
    else:
        body = answer.body
        if not isinstance(body, dict) or not body.get("choices"):
            return f"a 2xx without choices: {answer.raw[:300]}"
        choice = body["choices"][0]
        text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
        finish, ext = choice.get("finish_reason"), body.get("constrained_spec", {})
    if not isinstance(text, str):
        return "a 2xx without text"
    valid = ext.get("valid")
    if finish == "stop" and valid is not True:
        return f"finish_reason stop but valid is {valid!r}"
    if finish == "length":
        return None if valid is False else "finish_reason length but valid is not false"
    constraint = _constraint_of(request)
    if constraint is None:
        return None
    kind, spec = constraint
    if kind == "json":
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError:
            return f"valid: true but not JSON: {text[:200]!r}"
        try:
            jsonschema.validate(value, spec)
        except jsonschema.ValidationError as e:
            return f"valid: true but breaks the schema: {e.message[:200]}"
        except Exception as e:  # an invalid or unresolvable schema should have been refused
            return f"a 2xx for a schema jsonschema cannot use ({type(e).__name__}: {str(e)[:200]})"
    else:
        try:
            pattern = re.compile(spec)
        except (re.error, RecursionError, OverflowError):
            return None  # the backend's syntax only: its matcher enforced it
        if not pattern.fullmatch(text):
            return f"valid: true but does not match the pattern: {text[:200]!r}"
    return None


def healthy(url: str, timeout: float = 30) -> bool:
    """Whether ``GET /health`` answers ``status: ok``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return json.loads(resp.read()).get("status") == "ok"
    except Exception:
        return False


# --------------------------------------------------------------------------------------------
# Random requests (hypothesis)
# --------------------------------------------------------------------------------------------

def request_strategy() -> Any:
    """A hypothesis strategy of request bodies: mostly well-formed OpenAI requests with some
    field wrong (type, range, unknown name), random schemas and patterns, and now and then a
    raw byte string. Valid ones ask for at most 8 tokens, so a run stays short."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                        st.text(max_size=20))
    json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                               max_leaves=12)
    messages = st.one_of(
        st.just([{"role": "user", "content": PROMPT}]),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                        "content": st.one_of(st.text(max_size=40), scalars)}), max_size=3),
        json_values,
    )
    unknown_fields = st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=2)
    return st.one_of(st.builds(_assemble, messages, _constraint_strategy(st, json_values),
                               _options_strategy(st, scalars, json_values), unknown_fields, st.booleans()),
                     st.binary(max_size=64))


def _schema_strategy(st: Any, json_values: Any) -> Any:
    """Random schemas, some of them invalid or refused: leaves of every type with random
    keywords, refs near and far, nested in objects, arrays, ``anyOf`` and ``oneOf``."""
    leaf_schemas = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
        st.fixed_dictionaries({"type": st.just("string")}, optional={
            "minLength": st.integers(-2, 50), "maxLength": st.integers(-2, 50), "pattern": st.text(max_size=12),
            "format": st.sampled_from(["date", "email", "uuid", "nonsense"]), "enum": st.lists(st.text(max_size=6),
                                                                                                 max_size=3)}),
        st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
            "minimum": st.integers(-100, 100), "maximum": st.integers(-100, 100),
            "multipleOf": st.integers(-2, 5)}),
        st.fixed_dictionaries({"const": json_values}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/x", "http://h/s.json", "#", "file:///etc/passwd"])}),
        json_values,
    )
    return st.recursive(leaf_schemas, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3)},
                              optional={"required": st.lists(st.text(max_size=6), max_size=3),
                                        "additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner},
                              optional={"minItems": st.integers(-1, 5), "maxItems": st.integers(-1, 5),
                                        "uniqueItems": st.booleans()}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"oneOf": st.lists(inner, max_size=3)}),
    ), max_leaves=6)


def _constraint_strategy(st: Any, json_values: Any) -> Any:
    """A request's constraint fields: none, a schema or pattern in each way a request can give
    one, a choice, or random values where they go."""
    schemas = _schema_strategy(st, json_values)
    patterns = st.one_of(st.text(alphabet="ab()[]{}|*+?.^$\\-0123456789,:dws", max_size=16),
                         st.sampled_from([r"[a-z]{1,8}", r"\d{2,4}", "(ab|cd)+", "a{3}b?", "[A-Z][a-z]+"]))
    return st.one_of(
        st.just({}),
        st.builds(lambda s, strict: {"response_format": _schema(s, strict)}, schemas, st.booleans()),
        st.builds(lambda s: {"structured_outputs": {"json": s}}, schemas),
        st.builds(lambda p: {"structured_outputs": {"regex": p}}, patterns),
        st.builds(lambda c: {"structured_outputs": {"choice": c}}, st.lists(st.text(max_size=6), max_size=4)),
        st.builds(lambda rf: {"response_format": rf}, json_values),
        st.builds(lambda so: {"structured_outputs": so}, json_values),
    )


def _options_strategy(st: Any, scalars: Any, json_values: Any) -> Any:
    """A request's other fields, each absent, in range, out of range or of the wrong type."""
    return st.fixed_dictionaries({}, optional={
        "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), scalars),
        "max_tokens": st.one_of(st.integers(1, 8), st.integers(-5, 0), scalars),
        "seed": st.one_of(st.integers(0, 2**31), scalars),
        "stream": st.booleans(),
        "stop": st.one_of(st.lists(st.text(max_size=3), max_size=2), scalars),
        "top_p": st.one_of(st.just(1.0), st.floats(0, 2, allow_nan=False)),
        "n": st.integers(0, 3),
        "speculative": st.one_of(st.fixed_dictionaries({}, optional={
            "drafter": st.sampled_from(["none", "lookup", "grammar", "hybrid", "auto", "model", "x"]),
            "k_max": st.integers(-1, 80), "adaptive": st.booleans()}), json_values),
        "model": st.sampled_from(["default", "other", ""]),
    })


def _assemble(msgs: Any, cons: dict[str, Any], opts: dict[str, Any], extra: dict[str, Any],
              with_extra: bool) -> dict[str, Any]:
    """One request body from its drawn parts."""
    body = {"messages": msgs, **cons, **opts, **(extra if with_extra else {})}
    tokens = body.get("max_tokens", 9)
    if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and tokens > 8:
        body["max_tokens"] = 8  # keep every accepted request short (wrong values stay wrong)
    return body


def run_fuzz(url: str, *, examples: int = 1000, seed: int | None = None, api_key: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Send ``examples`` random requests (``request_strategy``) to the server at ``url`` and
    check every answer; returns the count, the problems found and whether the server is
    healthy afterwards. Needs ``hypothesis`` (the ``fuzz`` extra)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed

    problems: list[tuple[Any, str]] = []
    sent = [0]

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request_strategy())
    def probe(request: Any) -> None:
        sent[0] += 1
        problem = check_answer(request, send(url, request, api_key=api_key))
        if problem is not None:
            problems.append((request, problem))
        if progress and sent[0] % 100 == 0:
            progress(f"{sent[0]} requests, {len(problems)} problems")

    (fixed_seed(seed)(probe) if seed is not None else probe)()
    return {"examples": sent[0], "problems": len(problems),
            "first_problems": [{"request": repr(r)[:500], "problem": p} for r, p in problems[:10]],
            "healthy_after": healthy(url)}
