"""The long-document bench (``constrained-spec bench documents``): its documents are picked
deterministically within the token range, its scorer agrees with the METADATA headers (and
catches wrong answers), llama.cpp's rows get their timings from the worker, and a short run
fills every row's figures with valid outputs."""

from __future__ import annotations

import json
import os
import random
from email.message import Message
from types import SimpleNamespace

import pytest

from constrained_spec.bench.documents import (
    BUCKETS, DOCUMENTS, LLAMA_GRAMMAR, LLAMA_PLAIN, TOKEN_RANGE, LlamaCppDocuments, PackageDocument, clean_description,
    default_documents, document_prompt, facts_schema, field_right, header_truth, licence_families, pick_documents,
    run_documents_bench, score_facts)


def _doc(name: str, text: str = "", **truth) -> PackageDocument:
    return PackageDocument(name, "1.0", text or f"{name} is a package.", {"name": name, **truth})


# --------------------------------------------------------------------------------------------
# The documents
# --------------------------------------------------------------------------------------------

def test_clean_description_keeps_the_words_and_drops_images_html_and_urls():
    text = ("<p align='center'><img src='logo.png'></p>\n[![CI](https://b/ci.svg)](https://ci)\n"
            "![diagram](d.png)\nRead the [guide](https://x.org/guide) or the `forum <https://f.org>`__.\n\n\n\n"
            ".. image:: https://x/badge.svg\n   :target: https://x\n   :alt: badge\nThe <b>fast</b> one.<!-- hidden -->")
    assert clean_description(text) == "Read the guide or the forum.\n\nThe fast one."


def test_the_picker_spreads_over_the_range_deterministically():
    lengths = {f"p{n}": n for n in (100, 450, 600, 900, 1200, 1600, 2000, 2500, 2900, 3100, 3500, 4000, 4400, 4600, 9000)}
    candidates = [_doc(name) for name in lengths]
    count = lambda d: lengths[d.name]  # noqa: E731
    three = pick_documents(candidates, count, n=3)
    # The lengths nearest 1167, 2500 and 3833 (a third of the range each), shortest first.
    assert [(d.name, d.tokens) for d in three] == [("p1200", 1200), ("p2500", 2500), ("p4000", 4000)]
    shuffled = candidates[:]
    random.Random(0).shuffle(shuffled)
    assert pick_documents(shuffled, count, n=3) == three
    every = pick_documents(candidates, count, n=DOCUMENTS)
    assert [d.tokens for d in every] == sorted(n for n in lengths.values() if TOKEN_RANGE[0] <= n <= TOKEN_RANGE[1])
    # Ties go to the name, so equal lengths never depend on the input order.
    tied = [_doc("b"), _doc("a")]
    assert [d.name for d in pick_documents(tied, lambda d: 1000, n=1)] == ["a"]


@pytest.mark.slow
def test_the_installed_descriptions_fill_every_bucket(smol):
    docs = default_documents(smol)
    assert docs == default_documents(smol)
    assert len(docs) == DOCUMENTS, [d.name for d in docs]  # the test install has enough long descriptions
    assert all(TOKEN_RANGE[0] <= d.tokens <= TOKEN_RANGE[1] for d in docs)
    assert [d.tokens for d in docs] == sorted(d.tokens for d in docs)
    edges = [0] + [edge for _, edge in BUCKETS]
    for lo, hi in zip(edges, edges[1:]):
        assert any(lo < d.tokens <= hi for d in docs), (lo, hi)
    assert all(d.version and d.truth["name"] == d.name for d in docs)
    prompt = document_prompt(docs[0])
    assert prompt.startswith("Document:\n" + docs[0].text[:50]) and prompt.rstrip().endswith("names none")


# --------------------------------------------------------------------------------------------
# The scorer
# --------------------------------------------------------------------------------------------

TRUTH = {"name": "sse-starlette", "summary": "SSE plugin for Starlette", "language": ["Python"],
         "license": "BSD-3-Clause"}


def test_the_scorer_accepts_right_answers_in_other_words_and_catches_wrong_ones():
    right = {"name": "SSE_Starlette", "summary": "A Server-Sent Events (SSE) plugin for Starlette apps.",
             "language": "Python 3", "license": "BSD 3-Clause License"}
    assert score_facts(right, TRUTH) == (4, 4)
    wrong = {"name": "starlette", "summary": "A web framework for Python.", "language": "Rust", "license": "MIT"}
    assert score_facts(wrong, TRUTH) == (0, 4)
    assert score_facts(None, TRUTH) == (0, 4)  # no value (an invalid output): every field wrong
    assert score_facts({"name": 7}, {**TRUTH, "license": None, "language": None}) == (0, 2)  # only fields with a truth
    assert not field_right("language", "C++", ["Python"]) and field_right("language", "C and Python", ["C", "Python"])


def test_licence_families_read_spdx_expressions_and_names():
    assert licence_families("Apache-2.0 AND BSD-2-Clause AND MIT") == {"apache", "bsd", "mit"}
    assert licence_families("GNU Lesser General Public License v3") == {"lgpl"}
    assert licence_families("GPL-3.0-or-later") == {"gpl"}
    assert licence_families("Use as permitted by the terms") == set()


def test_header_truth_reads_the_headers_and_scores_a_licence_only_where_the_text_names_one():
    meta = Message()
    meta["Name"] = "Demo_Pkg"
    meta["Summary"] = "Demonstrates things"
    meta["License"] = "Copyright (c) 2001 Someone\nAll rights reserved.\n"  # a whole licence text: not a name
    for c in ("License :: OSI Approved :: BSD License", "Programming Language :: Python :: 3",
              "Programming Language :: Rust", "Programming Language :: Python :: Implementation :: CPython"):
        meta["Classifier"] = c
    assert header_truth(meta, "Released under a BSD licence.") == {
        "name": "Demo_Pkg", "summary": "Demonstrates things", "language": ["Python", "Rust"], "license": "BSD License"}
    assert header_truth(meta, "No word about terms.")["license"] is None
    meta["License-Expression"] = "MIT"
    assert header_truth(meta, "MIT license.")["license"] == "MIT"


# --------------------------------------------------------------------------------------------
# llama.cpp's rows, with a stand-in llama_cpp module (no build needed)
# --------------------------------------------------------------------------------------------

FAKE = '''
class LlamaGrammar:
    @staticmethod
    def from_json_schema(text, verbose=False):
        return text

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, verbose):
        self.n_ctx = n_ctx
    def reset(self):
        pass
    def __call__(self, ids, max_tokens, temperature, grammar=None, stream=False):
        text = ('{"name": "demo", "summary": "s", "language": "Python", "license": "MIT"}' if grammar
                else f"n_ctx={self.n_ctx} max_tokens={max_tokens}")
        pieces = [text[:5], text[5:]]
        if stream:
            return ({"choices": [{"text": p}]} for p in pieces)
        return {"choices": [{"text": text}]}
'''


def test_llama_cpp_rows_take_the_context_size_and_time_the_first_token(tmp_path, monkeypatch, smol_tokenizer):
    (tmp_path / "llama_cpp.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    handle = SimpleNamespace(gguf_file=tmp_path / "model.gguf", tokenizer=smol_tokenizer)
    rows = LlamaCppDocuments(handle, facts_schema(), n_ctx=5120)  # type: ignore[arg-type]
    try:
        runs = rows.runs([1, 2, 3], max_new_tokens=64, same_length=9)
    finally:
        rows.close()
    grammar, plain = runs[LLAMA_GRAMMAR], runs[LLAMA_PLAIN]
    assert grammar.valid and grammar.value["license"] == "MIT" and grammar.prompt_tokens == 3
    assert not plain.valid and plain.value is None and plain.error == "OutputValidationError"
    assert plain.text == "n_ctx=5120 max_tokens=9"
    for run in runs.values():
        assert 0 < run.first_token_s <= run.seconds and run.output_tokens > 0
        assert run.prompt_pass_s is None  # the stand-in has no prompt-evaluation timer


# --------------------------------------------------------------------------------------------
# A short run
# --------------------------------------------------------------------------------------------

SHORT = [
    _doc("quickjson", "quickjson is a small Python library that parses JSON documents twice as fast as the standard "
         "library's json module. It is written in Python and released under the MIT license.",
         summary="Fast JSON parsing for Python", language=["Python"], license="MIT"),
    _doc("tinyhttp", "tinyhttp is an HTTP client for Python with connection pooling and retries. Install it with "
         "pip install tinyhttp. Licensed under the Apache License 2.0.",
         summary="A small HTTP client with pooling and retries", language=["Python"], license="Apache-2.0"),
]


@pytest.mark.slow
def test_a_short_run_fills_every_row_with_valid_outputs(smol):
    report = run_documents_bench(smol, documents=SHORT, llama_cpp=False, max_new_tokens=96)
    assert [d["package"] for d in report["documents"]] == ["quickjson", "tinyhttp"]
    assert [r["config"] for r in report["rows"]] == ["native target-only", "native auto"]
    for row in report["rows"]:
        assert all(v is not None for k, v in row.items() if k != "first_token_s_by_bucket"), row
        assert row["valid"] == "2/2" and row["identical_to_target_only"] == "2/2", row  # greedy identity
        assert row["prompt_tokens"] == sum(d["prompt_tokens"] for d in report["documents"])
        assert 0 < row["first_token_s_mean"] * 2 <= row["whole_request_s"] + 0.01
        assert row["first_token_s_by_bucket"]["500-1.5k"] == row["first_token_s_mean"]  # short ones: the first bucket
        assert row["prompt_tokens_per_second"] > 0 and row["output_tokens_per_second_after_first"] > 0
    assert set(report["outputs"]["native auto"]) == {"quickjson", "tinyhttp"}
    assert report["notes"] == []
    json.dumps(report)  # --json writes it as is


def test_the_command_prints_every_row_and_writes_the_report(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from constrained_spec.bench import documents
    from constrained_spec.cli import app

    row = {"config": "native auto", "prompt_tokens_per_second": 812.5, "first_token_s_mean": 1.25,
           "first_token_s_by_bucket": {"500-1.5k": 0.9, "1.5k-3k": None, "3k-4.5k": 3.1}, "whole_request_s": 9.5,
           "output_tokens_per_second_after_first": 41.0, "field_accuracy": "5/8", "identical_to_target_only": "2/2",
           "valid": "2/2"}
    report = {"model": "M", "documents": [{"package": "rich", "version": "15.0.0", "prompt_tokens": 3210}],
              "prompt_tokens": {"min": 3210, "max": 3210, "total": 3210}, "threads": 2, "rows": [row],
              "notes": ["Only 1 installed package descriptions fall within 500-4500 prompt tokens."]}
    calls = []
    monkeypatch.setattr(documents, "run_documents_bench", lambda *a, **k: calls.append((a, k)) or report)
    out = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["bench", "documents", "--limit", "2", "--max-new-tokens", "64", "--no-llama-cpp",
                                   "--model", "m.gguf", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (args, kwargs), = calls
    assert args == ("m.gguf",) and (kwargs["limit"], kwargs["max_new_tokens"], kwargs["llama_cpp"]) == (2, 64, False)
    for cell in ("native auto", "812.5", "1.25", "0.9", "3.1", "9.5", "41.0", "5/8", "rich 15.0.0 (3210)", "Only 1"):
        assert cell in res.output, cell
    assert json.loads(out.read_text()) == report


def test_row_configs_load_the_embedded_model_otherwise_and_refuse_what_is_not_a_setting(smol):
    """``--row-config``: target-only and auto again on the embedded model loaded with the given
    settings (here float32 prompt attention: no bfloat16 attention on any layer), after the
    default rows; text that is not ``field=value`` pairs of a setting is refused by name."""
    from constrained_spec.bench.documents import BASELINE, runtime_config_rows

    configs = runtime_config_rows(smol, ["prompt_attention=float32"])
    assert [c.name for c in configs] == [BASELINE, "native auto", f"{BASELINE}, prompt_attention=float32",
                                         "native auto, prompt_attention=float32"]
    assert configs[0].model is None and configs[2].model is configs[3].model is not smol
    attention = [m for m in configs[2].model.model.modules() if type(m).__name__.endswith("Attention")]
    assert attention and all(getattr(m, "prompt_attention_dtype", None) is None for m in attention)
    for bad in ("prompt_attention", "no_such_field=1", "prompt_attention=float16"):
        with pytest.raises(ValueError, match="row-config|prompt attention"):
            runtime_config_rows(smol, [bad])
