"""What a new user trips over in extraction and serving: empty documents are error records (never
an invented record), ``extract --output`` does not silently overwrite earlier records, the
server's refusals speak its own fields, and ``/v1/models`` names the model with an id a client
can send back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from constrained_spec.cli import app
from constrained_spec.pipelines.extract import extract

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
PERSON_SCHEMA = str(ROOT / "schemas" / "person.json")
MARIA = "Maria Gonzalez is a 34-year-old architect who lives in Barcelona."
UNIQUE_TAGS = {"type": "object", "required": ["tags"],
               "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}


class Person(BaseModel):
    name: str
    age: int


def _assert_empty_document_error(result, doc_id: str) -> None:
    """An error record naming the document, of the kind an empty prompt gets, with no value."""
    assert not result.ok and result.value is None, result
    assert result.error["kind"] == "InvalidPromptError", result.error
    assert f"Invalid document {doc_id!r}" in result.error["message"] and "empty" in result.error["message"]
    assert result.to_record() == {"id": doc_id, "error": result.error}


# -- 1. empty documents ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [1, 3])
def test_empty_and_whitespace_documents_are_error_records_not_invented_data(smol, batch_size):
    docs = ["", "   \n", {"id": "maria", "text": MARIA}, ("tab", "\t")]
    results = list(extract(Person, docs, model=smol, batch_size=batch_size, max_new_tokens=40))
    assert [r.id for r in results] == ["0", "1", "maria", "tab"]
    for r in (results[0], results[1], results[3]):
        _assert_empty_document_error(r, r.id)
        assert r.decode_stats is None  # refused before any model work
    assert results[2].ok and results[2].value.name.startswith("Maria")


def test_a_template_that_renders_only_whitespace_around_an_empty_document_is_refused(smol):
    results = list(extract(Person, [{"id": "blank", "text": " "}], model=smol, prompt_template="  {text}\n"))
    _assert_empty_document_error(results[0], "blank")


def test_cli_empty_file_in_a_folder_and_empty_jsonl_text_are_error_lines(smol, tmp_path, monkeypatch):
    """Only empty documents: every line an error, and the model never decodes (exit 1: documents failed)."""
    from constrained_spec.pipelines import extract as pipeline

    def no_decoding(*args, **kwargs):
        raise AssertionError("an empty document reached the decoder")

    monkeypatch.setattr(pipeline, "generate_json", no_decoding)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "empty.txt").write_text("")
    (folder / "blank.txt").write_text("  \n\n")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"id": "e", "text": ""}) + "\n" + json.dumps({"id": "n", "text": None}) + "\n")
    for source, ids in ((folder, ["blank", "empty"]), (jsonl, ["e", "n"])):
        out = tmp_path / f"{source.name}.out.jsonl"
        res = CliRunner().invoke(app, ["extract", "--schema", PERSON_SCHEMA, "--input", str(source),
                                       "--output", str(out), "--max-new-tokens", "32"])
        assert res.exit_code == 1, res.output
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["id"] for x in lines] == ids
        for line in lines:
            assert "value" not in line and line["error"]["kind"] == "InvalidPromptError", line
            assert f"'{line['id']}'" in line["error"]["message"] and "empty" in line["error"]["message"]


# -- 2. extract does not silently overwrite ---------------------------------------------------------

def _no_model_load(monkeypatch) -> None:
    """Fail the test if a model is loaded: refusals of the output come before it."""
    from constrained_spec.pipelines import extract as pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(pipeline, "resolve_model", refuse)


def test_cli_refuses_an_output_file_that_holds_records(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": MARIA}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old", "value": {"name": "Ana", "age": 3}}\n')
    args = ["extract", "--schema", PERSON_SCHEMA, "--input", str(docs), "--output", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "--resume" in res.output and "--overwrite" in res.output and "out.jsonl" in res.output
    assert out.read_text() == '{"id": "old", "value": {"name": "Ana", "age": 3}}\n'  # untouched
    both = CliRunner().invoke(app, args + ["--resume", "--overwrite"])
    assert both.exit_code == 2 and "--resume" in both.output and "--overwrite" in both.output, both.output
    folder = tmp_path / "a-folder"
    folder.mkdir()
    not_a_file = CliRunner().invoke(app, args[:-1] + [str(folder)])
    assert not_a_file.exit_code == 2 and "folder" in not_a_file.output, not_a_file.output


def test_cli_overwrite_replaces_the_file_and_an_empty_file_is_overwritten_silently(smol, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "new", "text": " "}) + "\n")  # an error line, no decoding
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old", "value": {"name": "Ana", "age": 3}}\n')
    args = ["extract", "--schema", PERSON_SCHEMA, "--input", str(docs), "--output", str(out)]
    res = CliRunner().invoke(app, args + ["--overwrite"])
    assert res.exit_code == 1, res.output  # the document failed; the file was replaced
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["new"]
    out.write_text("")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["new"]


def test_ray_output_folder_with_parts_is_refused_before_ray_starts_and_overwrite_clears_it(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import ray

    from constrained_spec.errors import InvalidOptionError
    from constrained_spec.pipelines.distributed import prepare_output_folder

    def no_ray(*args, **kwargs):
        raise AssertionError("ray started before the output was checked")

    monkeypatch.setattr(ray, "init", no_ray)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": MARIA}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-0.parquet").write_bytes(b"PAR1")
    (out / "notes.txt").write_text("mine")
    args = ["extract", "--engine", "ray", "--schema", PERSON_SCHEMA, "--input", str(docs), "--output", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--resume" in res.output and "--overwrite" in res.output, res.output
    both = CliRunner().invoke(app, args + ["--resume", "--overwrite"])
    assert both.exit_code == 2 and "together" in both.output, both.output
    with pytest.raises(InvalidOptionError, match="--overwrite"):
        prepare_output_folder(out, "parquet", resume=False, overwrite=False)
    assert prepare_output_folder(out, "parquet", resume=False, overwrite=True) == set()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only the result parts go


def test_ray_empty_documents_are_error_rows(smol):
    """The actor's own pass over a batch (``_Extractor``, in this process): empty texts are error rows."""
    import numpy as np

    pytest.importorskip("pyarrow")
    from constrained_spec.pipelines.distributed import _Extractor

    actor = _Extractor(Person, None, None, "Document: {text}", {"max_new_tokens": 32}, 2, "id", "text", None)
    table = actor({"id": np.array(["e", "w"]), "text": np.array(["", " \n "])})
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["e", "w"]
    for r in rows:
        assert r["value"] is None and r["error_kind"] == "InvalidPromptError", r
        assert f"'{r['id']}'" in r["error_message"] and "empty" in r["error_message"]


# -- server: 1 (empty user content), 3 (refusals in the server's fields), 4 (model id) -------------

@pytest.fixture(scope="module")
def server(smol):
    pytest.importorskip("fastapi")
    from constrained_spec.serving import ServerConfig, create_app
    from tests.test_server import _Server

    srv = _Server(create_app(smol, config=ServerConfig(max_batch=2, max_queue=2, request_timeout=60)))
    yield srv
    srv.stop()


def _post(server, path: str, body: dict):
    from tests.test_server import httpx

    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": " \n\t"}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "  "}]}], "messages[0].content"),
])
def test_server_refuses_an_empty_user_message_with_a_400(server, messages, param):
    reply = _post(server, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "empty" in error["message"], error


def test_server_refuses_a_whitespace_completion_prompt(server):
    reply = _post(server, "/v1/completions", {"prompt": "  \n", "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text


def test_extract_through_a_server_records_empty_documents_as_errors(server):
    results = list(extract(Person, [{"id": "blank", "text": "  "}, ""], server=server.url, max_new_tokens=32))
    _assert_empty_document_error(results[0], "blank")
    _assert_empty_document_error(results[1], "1")


@pytest.mark.parametrize("constraint, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": UNIQUE_TAGS, "strict": True}}},
     '"strict": false'),
    ({"structured_outputs": {"json": UNIQUE_TAGS}}, '"strict": false'),
])
def test_a_refused_keyword_is_explained_in_the_servers_fields_not_python_options(server, constraint, says):
    reply = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tags: a, b"}],
                                                   "max_tokens": 16, **constraint})
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "uniqueItems" in message and says in message, message
    assert "lenient" not in message and "OutputValidationError" not in message, message


def test_models_lists_a_short_id_that_a_request_can_send_back(server):
    from tests.test_server import httpx

    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["SmolLM2-135M-Instruct"], listed
    for model in ("SmolLM2-135M-Instruct", "default"):
        reply = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "SmolLM2-135M-Instruct"
    missing = _post(server, "/v1/chat/completions", {"model": "gpt-9", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert missing.status_code == 404 and "'SmolLM2-135M-Instruct'" in missing.json()["error"]["message"]
