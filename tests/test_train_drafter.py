"""The train-drafter command on the embedded model, end to end in a few steps: its data (no
held-out schema in it), a head saved that ``draft=DIR`` loads, greedy output unchanged with it,
a resumed run, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from constrained_spec.cli import app
from constrained_spec.pipelines.drafter_data import HELD_OUT_SUBSET, generation_workload, training_prompts

runner = CliRunner()
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="JSONSchemaBench data not present")


@needs_data
def test_training_prompts_never_use_the_held_out_subset_and_have_both_kinds():
    rows = training_prompts(DATA, per_subset=2)
    assert rows and not any(r["id"].startswith(HELD_OUT_SUBSET + "/") for r in rows)
    assert {r["kind"] for r in rows} == {"generation", "extraction"}
    held = generation_workload(DATA, limit=3)
    assert len(held) == 3 and all(r["id"].startswith(HELD_OUT_SUBSET + "/") for r in held)
    assert not {json.dumps(r["schema"], sort_keys=True) for r in held} & {json.dumps(r["schema"], sort_keys=True) for r in rows}


@needs_data
def test_training_prompts_carry_their_schemas_valid_instances_as_references():
    """A generation prompt's references are its schema's valid instances, an extraction prompt's
    the one instance its document describes; every one is valid against the schema; the
    held-out prompts carry none."""
    import jsonschema

    from constrained_spec.pipelines.drafter_data import describe

    rows = [r for r in training_prompts(DATA, per_subset=3) if not r["id"].startswith("repo/")]
    with_refs = [r for r in rows if r.get("references")]
    assert len(with_refs) >= len(rows) * 0.8
    for r in with_refs:
        for answer in r["references"]:
            jsonschema.validate(answer, r["schema"])
        if r["kind"] == "extraction":
            assert len(r["references"]) == 1 and "\n".join(describe(r["references"][0]))[:200] in r["prompt"]
    assert any(len(r["references"]) > 1 for r in with_refs if r["kind"] == "generation")
    assert not any("references" in r for r in generation_workload(DATA, limit=3))


def test_train_drafter_saves_a_head_that_draft_dir_loads(smol, tmp_path):
    from constrained_spec import generate_json

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "Write a realistic example JSON object for this JSON schema: "
                       '{"type":"object","properties":{"city":{"type":"string"},"rooms":{"type":"integer"}}}',
             "schema": {"type": "object", "properties": {"city": {"type": "string"}, "rooms": {"type": "integer"}},
                        "required": ["city", "rooms"]}},
            {"prompt": "Give a US phone number.", "regex": r"\(\d{3}\) \d{3}-\d{4}"},
            {"prompt": "broken", "schema": {"type": "nonsense"}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "head"
    args = ["train-drafter", "--data", str(data), "--out", str(out), "--steps", "4", "--max-new-tokens", "24",
            "--draft-vocab", "600"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout[res.stdout.index("{"):])
    assert report["steps"] == 4 and report["sequences"] >= 2 and 0 < report["draft_vocab"] <= 600
    assert (out / "head.safetensors").is_file() and (out / "checkpoint.pt").is_file()
    from constrained_spec.drafters.corpus import OutputCorpus

    corpus = OutputCorpus.load(out, smol.vocabulary.fingerprint)  # the decoded outputs, indexed beside the head
    assert len(corpus) > 0 and (corpus.tokens < 0).sum() >= report["sequences"]  # greedy and sampled outputs
    schema, prompt = rows[0]["schema"], "A flat in Lyon with 3 rooms, as JSON."
    ref = generate_json(smol, schema, prompt, drafter="none", max_new_tokens=40)
    value, stats = generate_json(smol, schema, prompt, draft=str(out), return_stats=True, max_new_tokens=40)
    assert value == ref
    head_only, st = generate_json(smol, schema, prompt, drafter="head", draft=str(out), return_stats=True,
                                  max_new_tokens=40)
    assert head_only == ref and st.per_kind.get("head", {}).get("drafted", 0) > 0
    again = runner.invoke(app, args)  # resumed: the decoded outputs and the checkpoint are reused
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout[again.stdout.index("{"):])["decode_seconds"] < report["decode_seconds"]


def test_train_drafter_corpus_only_writes_the_greedy_outputs_corpus(smol, tmp_path):
    from constrained_spec import generate_regex
    from constrained_spec.drafters.corpus import OutputCorpus

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "Give a US phone number.", "regex": r"\(\d{3}\) \d{3}-\d{4}"},
            {"prompt": "Write an example person as JSON.",
             "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["train-drafter", "--data", str(data), "--out", str(tmp_path / "c"), "--corpus-only",
                              "--max-new-tokens", "24"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "c" / "head.safetensors").exists()
    corpus = OutputCorpus.load(tmp_path / "c", smol.vocabulary.fingerprint)
    ends = np.flatnonzero(corpus.tokens < 0)
    sequences = [s[:-1].tolist() for s in np.split(corpus.tokens, ends + 1)[:-1]]  # each ends in -1
    assert len(sequences) == 2  # one greedy output per prompt, nothing sampled
    phone = generate_regex(smol, rows[0]["regex"], rows[0]["prompt"], drafter="none", max_new_tokens=24)
    assert smol.tokenizer.decode(sequences[0], skip_special_tokens=True) == phone
    assert json.loads(res.stdout[res.stdout.index("{"):])["corpus_tokens"] == len(corpus)


def test_train_drafter_reads_a_lines_references_instead_of_decoding_it(smol, tmp_path):
    """A line with references is read (its outputs are the references, the one the schema
    refuses skipped); with --references 0 it is decoded like a line without."""
    import torch

    data = tmp_path / "data.jsonl"
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "rooms": {"type": "integer"}},
              "required": ["city", "rooms"]}
    rows = [{"prompt": "Write an example flat as JSON.", "schema": schema,
             "references": [{"city": "Lyon", "rooms": 3}, {"town": "Lyon"}, {"city": "Oslo", "rooms": 12}]},
            {"prompt": "Give a US phone number.", "regex": r"\(\d{3}\) \d{3}-\d{4}", "references": ["(555) 123-4567"]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["train-drafter", "--data", str(data), "--steps", "2", "--max-new-tokens", "24", "--sampled", "0"]
    res = runner.invoke(app, args + ["--out", str(tmp_path / "read")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout[res.stdout.index("{"):])["skipped"] == ["line 1: reference 2 is not accepted by its "
                                                                         "json constraint"]
    saved = torch.load(tmp_path / "read" / "outputs.pt", weights_only=False)["outputs"]
    texts = [(i, smol.tokenizer.decode(toks)) for i, toks, _, _ in saved]
    assert [(i, json.loads(t) if i == 0 else t) for i, t in texts] == [
        (0, {"city": "Lyon", "rooms": 3}), (0, {"city": "Oslo", "rooms": 12}), (1, "(555) 123-4567")]
    res = runner.invoke(app, args + ["--out", str(tmp_path / "decoded"), "--references", "0"])
    assert res.exit_code == 0, res.output
    saved = torch.load(tmp_path / "decoded" / "outputs.pt", weights_only=False)["outputs"]
    assert sorted(i for i, *_ in saved) == [0, 1]  # one greedy output each
    res = runner.invoke(app, args + ["--out", str(tmp_path / "x"), "--references", "-1"])
    assert res.exit_code == 2 and "Invalid references" in res.output


@needs_data
def test_drafter_data_writes_the_kinds_asked(tmp_path):
    res = runner.invoke(app, ["drafter-data", "--out", str(tmp_path / "g.jsonl"), "--per-subset", "2", "--kinds", "generation"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert rows and {r["kind"] for r in rows} == {"generation"}  # the repository's examples are extraction
    both = training_prompts(DATA, per_subset=2)
    assert [r for r in both if r["kind"] == "generation"] == rows  # the same schemas either way
    res = runner.invoke(app, ["drafter-data", "--out", str(tmp_path / "x.jsonl"), "--kinds", "summaries"])
    assert res.exit_code == 2 and "Invalid --kinds" in res.output


def test_train_drafter_refuses_bad_input(tmp_path):
    res = runner.invoke(app, ["train-drafter", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--minutes or --steps" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    res = runner.invoke(app, ["train-drafter", "--data", str(bad), "--out", str(tmp_path / "o"), "--steps", "1"])
    assert res.exit_code == 2 and "one of \"schema\" or \"regex\"" in res.output
    res = runner.invoke(app, ["json", '{"type": "boolean"}', "--prompt", "hi", "--drafter", "head", "--draft", "none"])
    assert res.exit_code == 2 and "'head' needs a draft head" in res.output
