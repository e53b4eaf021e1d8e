"""The OpenAI-compatible server, started for real (uvicorn on a free port) and called with the
official ``openai`` client: constrained answers, streaming, and every refusal it must make."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
try:  # the HTTP client the openai package brings (httpx2 in openai 3.x, httpx before)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
openai = pytest.importorskip("openai")
import uvicorn  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from constrained_spec import generate_json  # noqa: E402
from constrained_spec.serving import ServerConfig, create_app  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "test-key"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Extract the person as JSON: Maria Gonzalez is a 34-year-old architect who lives in Barcelona."


class Person(BaseModel):
    name: str
    age: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, app) -> None:
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(smol):
    srv = _Server(create_app(smol, config=ServerConfig(max_batch=4, max_queue=2, api_key=KEY, request_timeout=60)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, max_tokens=64, **kw)


def test_json_schema_answer_equals_in_process_greedy_output(client, smol):
    reply = _chat(client, response_format={"type": "json_schema",
                                           "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert value == generate_json(smol, PERSON, PROMPT, temperature=0, max_new_tokens=64)
    ext = reply.model_extra["constrained_spec"]
    assert ext["valid"] is True and ext["constraint"] == "json" and ext["target_forwards"] >= 1
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 10


def test_conversations_sharing_a_system_prompt_share_its_keys(client, smol):
    """The system turn (and the template around it) is the request's shared prefix: computed for
    the first conversation, taken from the prefix cache by the next."""
    system = {"role": "system", "content": "You extract people from short documents. Answer with one JSON "
                                           "object holding the person's name and age, nothing else."}
    docs = ["Tom Okafor (52) is a harbour pilot in Rotterdam.", "Aisha Rahman, 29, writes software in Oslo."]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    replies = [client.chat.completions.create(model="default", messages=[system, {"role": "user", "content": d}],
                                              temperature=0, max_tokens=48, response_format=fmt) for d in docs]
    cached = [r.model_extra["constrained_spec"]["prefix_cached_tokens"] for r in replies]
    assert cached[1] >= 16 and cached[1] >= cached[0]  # the second one reused the system turn's keys
    from constrained_spec.api import chat_prefix_length, encode_chat

    messages = [system, {"role": "user", "content": docs[1]}]
    ids = encode_chat(smol, messages)
    assert cached[1] == chat_prefix_length(smol, messages, ids)
    assert smol.tokenizer.decode(ids[: cached[1]]).endswith("<|im_start|>user")  # the system turn, the next opening


def test_pydantic_model_through_the_clients_parse_helper(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    reply = parse(model="default", messages=[{"role": "user", "content": PROMPT}], response_format=Person,
                  temperature=0, max_tokens=64)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and person.age >= 0


def test_json_object_regex_and_choice(client):
    obj = _chat(client, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    phone = _chat(client, extra_body={"structured_outputs": {"regex": r"\+1-\d{3}-\d{4}"}})
    assert re.fullmatch(r"\+1-\d{3}-\d{4}", phone.choices[0].message.content)
    pick = _chat(client, extra_body={"structured_outputs": {"choice": ["architect", "pilot", "baker"]}})
    assert pick.choices[0].message.content in ("architect", "pilot", "baker")


def test_stream_concatenates_to_the_whole_answer(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = _chat(client, response_format=fmt, seed=7).choices[0].message.content
    chunks = list(_chat(client, response_format=fmt, seed=7, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_endpoint_and_the_token_limit(client):
    reply = client.completions.create(model="default", prompt="The numbers: ", temperature=0, max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{20}"}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.model_extra["constrained_spec"]["valid"] is False


@pytest.mark.parametrize("kw, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON, "strictly": True}}},
     "response_format.json_schema.strictly", "Unknown field"),
    ({"response_format": {"type": "json_schema", "schema": PERSON}}, "response_format.schema", "Unknown field"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= 'a'"}}}, "structured_outputs.grammar", "Unknown field"),
    ({"extra_body": {"guided_json": PERSON}}, "guided_json", "Unknown field"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex", "regex"),
    ({"extra_body": {"structured_outputs": {"regex": "[^\\s\\S]"}}}, "structured_outputs.regex", "matches nothing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}},
     "response_format.json_schema.schema", "format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "nonsense"),
    ({"n": 2}, "n", "n > 1"),
    ({"top_p": 0.5}, "top_p", "top_p"),
    ({"stop": ["}"], "response_format": {"type": "json_object"}}, "stop", "stop"),
    ({"extra_body": {"speculative": {"drafter": "psychic"}}}, "speculative.drafter", "drafter"),
    ({"extra_body": {"speculative": {"drafter": "model"}}}, "speculative.drafter", "draft"),
])
def test_bad_requests_are_400_naming_the_problem(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kw)
    err = info.value.body
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err


def test_prompt_longer_than_the_context_is_400(client, smol):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "word " * 9000}],
                                       max_tokens=8)
    assert info.value.body["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_key_required_except_for_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data]


def test_metrics_count_requests_and_tokens(server, client):
    _chat(client, response_format={"type": "json_object"})
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert re.search(r'constrained_spec_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text)
    assert re.search(r"constrained_spec_output_tokens_total [1-9]", text)
    assert "constrained_spec_queue_depth" in text and "constrained_spec_time_to_first_token_seconds_bucket" in text
    # The request is done: its KV rows are given back (batching.cache); its prompt's block, if
    # it had a full chunk, stays in the prefix cache.
    assert re.search(r"constrained_spec_kv_cache_bytes 0\.0", text)
    assert re.search(r"constrained_spec_prefix_cache_bytes \d", text)


def test_full_queue_is_429_and_a_disconnect_frees_the_slot(server):
    """Capacity is max_batch 4 + max_queue 2: six long streams fill it, the seventh is refused;
    closing the streams cancels their rows, after which requests are served again."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "default", "messages": [{"role": "user", "content": "Count upwards forever."}],
            "max_tokens": 400, "temperature": 0, "stream": True,
            "structured_outputs": {"regex": "[0-9 ]+"}}
    clients = [httpx.Client(timeout=60) for _ in range(6)]
    streams = [c.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) for c in clients]
    responses = [s.__enter__() for s in streams]
    try:
        for r in responses:
            assert r.status_code == 200
            next(r.iter_lines())  # the server holds the request now
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "queue_full"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["decoding"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.2)
    assert health["decoding"] == 0 and health["waiting"] == 0, health


def test_command_line_sends_to_a_running_server(server, smol, monkeypatch):
    """``--server`` gives what the in-process command gives, and bad input still exits 2."""
    from typer.testing import CliRunner

    from constrained_spec.cli import app

    monkeypatch.setenv("CONSTRAINED_SPEC_API_KEY", KEY)
    runner = CliRunner()
    schema = json.dumps(PERSON)
    remote = runner.invoke(app, ["json", schema, "--prompt", PROMPT, "--max-new-tokens", "64", "--server", server.url])
    assert remote.exit_code == 0, remote.output
    assert json.loads(remote.stdout) == generate_json(smol, PERSON, PROMPT, max_new_tokens=64)
    phone = runner.invoke(app, ["regex", r"[0-9]{3}-[0-9]{4}", "--prompt", "A phone extension:", "--server", server.url])
    assert phone.exit_code == 0 and re.fullmatch(r"[0-9]{3}-[0-9]{4}\n", phone.stdout), phone.output
    bad = runner.invoke(app, ["regex", "(unclosed", "--prompt", "x", "--server", server.url])
    assert bad.exit_code == 2 and "regex" in bad.output.lower()
    short = runner.invoke(app, ["regex", "[0-9]{30}", "--prompt", "Digits:", "--max-new-tokens", "3", "--server",
                                server.url])
    assert short.exit_code == 1 and "generation failed" in short.output


def test_load_test_against_the_running_server(server):
    from constrained_spec.bench.serve import run_serve_bench

    report = run_serve_bench([3], url=server.url, api_key=KEY, limit=4, max_tokens=96)
    assert [(r["clients"], r["speculation"]) for r in report["rows"]] == [(3, "off"), (3, "on")]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["valid"] == "4/4", row
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["output_tokens_per_second"] > 0


def test_extract_through_the_server_equals_local_extract(server, smol):
    from constrained_spec.pipelines.extract import extract

    docs = [{"id": "maria", "text": "Maria Gonzalez is a 34-year-old architect who lives in Barcelona."},
            {"id": "tom", "text": "At 52, Tom Okafor works as a harbour pilot in Rotterdam."},
            {"id": "short", "text": "Lars Nilsen, 61, boat repairer in Bergen."}]
    local = [r.to_record() for r in extract(Person, docs, model=smol, max_new_tokens=64)]
    remote = list(extract(Person, docs, server=server.url, api_key=KEY, batch_size=3, max_new_tokens=64))
    assert [r.id for r in remote] == ["maria", "tom", "short"]
    assert [r.to_record().get("value") for r in remote] == [r.get("value") for r in local]
    limited = list(extract(Person, docs[:1], server=server.url, api_key=KEY, max_new_tokens=3))
    assert limited[0].error["kind"] == "TokenLimitError"


def test_free_text_honours_stop_and_bodies_are_limited(server, client):
    reply = client.chat.completions.create(model="default", temperature=0, max_tokens=40, stop=[","],
                                           messages=[{"role": "user", "content": "Name three colors, comma separated."}])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and "," not in choice.message.content
    assert reply.model_extra["constrained_spec"]["stopped"] == "stop sequence ','"
    big = httpx.post(server.url + "/v1/chat/completions", content=b"x" * (2 << 20),
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"


def test_a_draft_model_serves_the_model_drafter_with_identical_greedy_output(smol):
    srv = _Server(create_app(smol, draft=smol, config=ServerConfig(max_batch=2)))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        drafted = _chat(client, response_format=fmt, extra_body={"speculative": {"drafter": "model", "k_max": 4}})
        plain = _chat(client, response_format=fmt, extra_body={"speculative": {"drafter": "none"}})
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        ext = drafted.model_extra["constrained_spec"]
        assert ext["drafter"] == "model" and ext["acceptance_by_kind"].get("model", 0) > 0.5
    finally:
        srv.stop()


def test_a_request_that_could_never_fit_the_kv_memory_is_a_400_naming_it(smol):
    """With --kv-memory below what one request needs, the request is refused before it queues,
    with the figures and the option to change; a small one still runs."""
    srv = _Server(create_app(smol, config=ServerConfig(max_batch=2, kv_memory=24 << 20)))  # 24 MiB: 256 positions
    body = {"model": "default", "messages": [{"role": "user", "content": "Is water wet?"}],
            "temperature": 0, "structured_outputs": {"regex": "(yes|no)"}}
    try:
        big = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 1000}, timeout=30)
        assert big.status_code == 400, big.text
        err = big.json()["error"]
        assert err["code"] == "kv_memory_exceeded" and err["param"] == "max_tokens" and "--kv-memory" in err["message"]
        ok = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
    finally:
        srv.stop()


def test_a_non_streaming_client_that_goes_away_frees_its_row(smol):
    """600 digits take ~20 s here; the client gives up after 1 s and its row must be gone
    within a few seconds (the handler notices the disconnect and cancels it). The repetition
    guard is off so the digits cannot end the request early."""
    from constrained_spec.decoding import SpecOptions

    srv = _Server(create_app(smol, options=SpecOptions(max_repeats=0), config=ServerConfig(max_batch=2)))
    body = {"model": "default", "messages": [{"role": "user", "content": "Count upwards forever."}],
            "max_tokens": 600, "temperature": 0, "structured_outputs": {"regex": "[0-9 ]{600}"},
            "speculative": {"drafter": "none"}}  # one token per forward: ~20 s if it ran to the end
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=1.0)
        t0 = time.time()
        while time.time() - t0 < 6:
            health = httpx.get(srv.url + "/health").json()
            if health["decoding"] == 0 and health["waiting"] == 0:
                break
            time.sleep(0.1)
        assert health["decoding"] == 0 and health["waiting"] == 0, health
    finally:
        srv.stop()


def test_request_timeout_is_504_and_frees_the_row(smol):
    from constrained_spec.decoding import SpecOptions

    srv = _Server(create_app(smol, options=SpecOptions(max_repeats=0),
                             config=ServerConfig(max_batch=2, request_timeout=1.0)))
    body = {"model": "default", "messages": [{"role": "user", "content": "Digits."}], "max_tokens": 600,
            "temperature": 0, "structured_outputs": {"regex": "[0-9 ]{600}"}, "speculative": {"drafter": "none"}}
    try:
        reply = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
        deadline = time.time() + 5
        while httpx.get(srv.url + "/health").json()["decoding"] and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(srv.url + "/health").json()["decoding"] == 0
    finally:
        srv.stop()


def test_sigterm_finishes_the_request_in_flight_then_exits(tmp_path):
    """The real command: SIGTERM while a request decodes; the request still gets its whole
    answer, and then the process exits."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "constrained_spec.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.time() < deadline and proc.poll() is None, "server did not start"
                time.sleep(0.2)
        body = {"model": "default", "prompt": "Count: 1 2 3", "temperature": 0, "max_tokens": 120,
                "structured_outputs": {"regex": "( [0-9]+){1,120}"}, "speculative": {"drafter": "none"}}
        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault(
            "reply", httpx.post(url + "/v1/completions", json=body, timeout=120)))
        thread.start()
        time.sleep(1.0)  # the request is decoding
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
        reply = result["reply"]
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"].strip(), reply.text
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained
    finally:
        if proc.poll() is None:
            proc.kill()


def _post_raw(server, body: bytes, chunked: bool = False, pace: float = 0.0) -> tuple[int, dict]:
    """POST with the standard library's client, which writes the whole body before it reads the
    reply (as most clients do): a server that answered and closed early would reset it. ``pace``:
    seconds between 64 KiB pieces, a slow client (the reply is ready long before the body is sent)."""
    import http.client

    def pieces():
        for i in range(0, len(body), 65536):
            if pace:
                time.sleep(pace)
            yield body[i:i + 65536]

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if not chunked:
        headers["Content-Length"] = str(len(body))
    try:
        conn.request("POST", "/v1/chat/completions", body=pieces(), headers=headers, encode_chunked=chunked)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_far_over_the_limit_gets_a_413_with_the_error_body(server, chunked):
    status, body = _post_raw(server, b"x" * (20 << 20), chunked=chunked, pace=0.001)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_hostile_constraints_are_refused_naming_the_limit(server):
    deep_body = ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
                 '"json_schema": {"name": "x", "schema": ' + '{"items": ' * 5000 + "{}" + "}" * 5000 + "}}}")
    status, body = _post_raw(server, deep_body.encode())
    assert status == 400 and "nests deeper" in body["error"]["message"]
    schema: dict = {"type": "integer"}
    for _ in range(80):  # fits the body's depth, not the schema's
        schema = {"type": "array", "items": schema}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              "max_schema_depth"),
             ({"structured_outputs": {"regex": "a{1000000}"}}, "max_repeat"),
             ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "max_regex_expanded"),
             ({"structured_outputs": {"json": {"type": "string", "pattern": "^(ab){99999}$"}}}, "max_repeat")]
    for extra, limit in cases:
        request = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}
        status, body = _post_raw(server, json.dumps(request).encode())
        assert status == 400 and limit in body["error"]["message"], (limit, body)
        assert body["error"]["code"] == "invalid_constraint"


def test_a_strict_schema_decodes_its_declared_keys_only_and_a_non_strict_one_as_written(smol):
    """``strict: true`` follows OpenAI's strict mode, whose outputs carry the declared keys only:
    an object that leaves ``additionalProperties`` out is closed (OpenAI refuses such a schema;
    we take the evident intent). Without ``strict`` the schema is decoded as written."""
    from constrained_spec.constraint import DEFAULT_LIMITS
    from constrained_spec.decoding import SpecOptions
    from constrained_spec.serving.app import _compile
    from constrained_spec.serving.protocol import parse_body

    open_person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    extra = '{"name": "Ana", "age": 3, "city": "Oslo"}'
    ids = smol.tokenizer(extra, add_special_tokens=False)["input_ids"]
    for strict, takes_extra in ((True, False), (False, True)):
        body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": open_person, "strict": strict}}}
        spec = parse_body(json.dumps(body).encode(), "chat").constraint
        compiled = _compile(spec, smol, SpecOptions(), DEFAULT_LIMITS)
        m = compiled.compiled.matcher()
        states = m.walk(m.state, ids)
        assert (len(states) == len(ids) + 1 and m.is_done(states[-1])) is takes_extra, strict
        assert (compiled.schema.schema.get("additionalProperties") is False) is strict


def test_the_server_keeps_its_constraints_in_the_one_cache_under_its_bound(smol):
    """The server has no cache of its own: ``create_app`` bounds the constraint package's one
    cache with ``constraint_cache_bytes``, a repeated request finds its entry there (the same
    object: nothing loaded or compiled again), what it holds counts in ``cache_bytes()``, and the
    one eviction policy drops the least recently used request's entry past the bound."""
    from constrained_spec.constraint import DEFAULT_LIMITS, cache_bytes, clear_cache, set_cache_bytes
    from constrained_spec.decoding import SpecOptions
    from constrained_spec.serving.app import _compile
    from constrained_spec.serving.protocol import parse_body

    def spec(schema: dict):
        body = {"messages": [{"role": "user", "content": PROMPT}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        return parse_body(json.dumps(body).encode(), "chat").constraint

    person, other = spec(PERSON), spec({"type": "array", "items": {"type": "integer"}})
    _, bound = cache_bytes()
    try:
        clear_cache()
        create_app(smol, config=ServerConfig(constraint_cache_bytes=64 << 20))
        assert cache_bytes() == (0, 64 << 20)
        first = _compile(person, smol, SpecOptions(), DEFAULT_LIMITS)
        assert _compile(person, smol, SpecOptions(), DEFAULT_LIMITS) is first
        assert cache_bytes()[0] >= first.nbytes > first.compiled.nbytes
        create_app(smol, config=ServerConfig(constraint_cache_bytes=0))  # keeps only the latest entry
        _compile(other, smol, SpecOptions(), DEFAULT_LIMITS)
        again = _compile(person, smol, SpecOptions(), DEFAULT_LIMITS)
        assert again is not first and again.compiled.pattern == first.compiled.pattern
    finally:
        set_cache_bytes(bound)
        clear_cache()
