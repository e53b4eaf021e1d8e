"""The bench's llama.cpp reference row runs in a worker process: its replies come back in order,
and a crash there costs the row (a RuntimeError the bench skips), never the bench's process.
A stand-in ``llama_cpp`` module plays llama.cpp, so the test needs no build of it."""

from __future__ import annotations

import os

import pytest

from constrained_spec.bench.single import LlamaCppWorker

FAKE = '''
import os

class LlamaGrammar:
    @staticmethod
    def from_json_schema(text, verbose=False):
        if "bad" in text:
            raise ValueError("cannot build a grammar")
        return text

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, verbose):
        if model_path == "crash-on-load":
            os._exit(139)
    def reset(self):
        pass
    def __call__(self, ids, max_tokens, temperature, grammar=None):
        if ids == [666]:
            os._exit(139)  # as a segfault in a kernel ends the process
        return {"choices": [{"text": f"{grammar}|{len(ids)}|{max_tokens}"}]}
'''


@pytest.fixture()
def fake_llama(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def test_requests_round_trip_and_errors_come_back_as_errors(fake_llama):
    worker = LlamaCppWorker("model.gguf", 1)
    try:
        g0 = worker.ask({"op": "grammar", "schema": {"type": "integer"}})["id"]
        g1 = worker.ask({"op": "grammar", "schema": {"type": "string"}})["id"]
        assert (g0, g1) == (0, 1)
        assert worker.ask({"op": "generate", "grammar": g1, "ids": [1, 2, 3], "max_tokens": 7})["text"] == \
            '{"type": "string"}|3|7'
        with pytest.raises(RuntimeError, match="cannot build a grammar"):
            worker.ask({"op": "grammar", "schema": {"type": "bad"}})
        # The worker goes on after an error.
        assert worker.ask({"op": "generate", "grammar": g0, "ids": [5], "max_tokens": 2})["text"] == \
            '{"type": "integer"}|1|2'
    finally:
        worker.close()


def test_a_crash_in_the_worker_is_an_error_here_not_a_crash(fake_llama):
    worker = LlamaCppWorker("model.gguf", 1)
    g = worker.ask({"op": "grammar", "schema": {"type": "integer"}})["id"]
    with pytest.raises(RuntimeError, match="ended"):
        worker.ask({"op": "generate", "grammar": g, "ids": [666], "max_tokens": 2})
    with pytest.raises(RuntimeError, match="ended"):  # and every later call says so too
        worker.ask({"op": "generate", "grammar": g, "ids": [1], "max_tokens": 2})
    with pytest.raises(RuntimeError, match="ended"):
        LlamaCppWorker("crash-on-load", 1)
