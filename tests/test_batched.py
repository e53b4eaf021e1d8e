"""The batch engine's target-only rows and extract's batched path give the same greedy outputs as
the per-document path."""

from __future__ import annotations

import json
from pathlib import Path

from constrained_spec import ModelHandle
from constrained_spec.constraint import compile_constraint, load_schema
from constrained_spec.decoding import decode
from constrained_spec.batching import BatchEngine
from constrained_spec.pipelines.extract import extract
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Maria Gonzalez, 34, architect in Barcelona.", "Tom Okafor (52) is a harbour pilot in Rotterdam.",
         "Aisha, 29, Oslo.", "Lars Nilsen turned 61 last spring and still lives in Bergen, repairing boats."]


def test_batch_equals_per_document(smol):
    schema, _ = load_schema(ROOT / "schemas" / "person.json")
    constraint = compile_constraint(schema, smol.vocabulary, backend="outlines-core")
    target = tiny_llama(49152 + 64, seed=41, init=0.3)
    prompts = [smol.tokenizer(t)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    engine = BatchEngine(target, max_batch=len(prompts))
    batch = [engine.submit(p, constraint.matcher(), max_new_tokens=40) for p in prompts]
    list(engine.run())
    for p, req in zip(prompts, batch):
        alone = decode(target, constraint.matcher(), p, max_new_tokens=40)
        assert req.result.tokens == alone.tokens
        assert req.result.finished == alone.finished


def test_extract_batched_equals_per_document(smol):
    handle = ModelHandle(tiny_llama(49152, seed=42, init=0.3), smol.tokenizer, "tiny")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "c"]}
    docs = [{"id": f"d{i}", "text": TEXTS[i % 4] + " #" + str(i)} for i in range(10)]
    one = [r.to_record() for r in extract(schema, docs, model=handle, drafter="none", max_new_tokens=24)]
    many = [r.to_record() for r in extract(schema, docs, model=handle, batch_size=4, max_new_tokens=24)]
    strip = lambda recs: [json.dumps({k: v for k, v in r.items() if k != "stats"}, sort_keys=True) for r in recs]  # noqa: E731
    assert strip(one) == strip(many)
    assert any("value" in r for r in many)


def test_speculative_batch_on_the_embedded_model_equals_per_document_target_only(smol):
    """The shipped people documents at batch 4 with the default drafters (rows of different
    lengths on different shelves, verifying different numbers of drafts each step) give the
    records of per-document target-only decoding, every one."""
    from constrained_spec.bench.batch import Person, load_documents

    docs = load_documents(limit=16)
    one = [r.to_record().get("value") for r in extract(Person, docs, model=smol, drafter="none", prefix_cache=False,
                                                       max_new_tokens=128)]
    engine = BatchEngine(smol.model, max_batch=4, precision=smol.precision)
    many = [r.to_record().get("value") for r in extract(Person, docs, model=smol, batch_size=4, engine=engine,
                                                        max_new_tokens=128)]
    assert many == one
    assert sum(v is not None for v in one) >= 14
