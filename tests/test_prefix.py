"""Prefix caching: identical outputs with and without it, blocks keyed by the whole prefix,
bounded memory, and reuse that actually happens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, PrefixCache, decode
from constrained_spec.batching.engine import BatchEngine
from constrained_spec.decoding.prefix import shared_prefix_length
from constrained_spec.drafters import LookupDrafter
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parent.parent
SHARED = ("Extract the following fields from the document and answer with JSON.\n\nFields:\n"
          "- name (string): the person's full name, as written in the document\n"
          "- age (integer): the person's age in years, digits only\n"
          "- city (string): the city where the person lives or works now\n"
          "- occupation (string): what the person does for a living, in a few words\n\nDocument:\n")
DOCS = ["Maria Gonzalez is a 34-year-old architect who lives in Barcelona.",
        "At 52, Tom Okafor works as a harbour pilot in Rotterdam.",
        "Aisha Rahman (29) has been a software engineer in Oslo for years."]


@pytest.fixture(scope="module")
def setup(smol_tokenizer):
    target = tiny_llama(49152 + 64, seed=21, init=0.3)
    compiled = compile_constraint(ROOT / "schemas" / "person.json", smol_tokenizer)
    prompts = [smol_tokenizer(SHARED + d)["input_ids"] for d in DOCS]
    shared = shared_prefix_length(prompts[0], smol_tokenizer(SHARED)["input_ids"])
    return target, compiled, prompts, shared


def run(target, compiled, prompt, prefix_len, cache):
    m = compiled.matcher()
    return decode(target, m, prompt, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=40,
                  prefix_len=prefix_len, prefix_cache=cache)


def test_outputs_are_identical_with_and_without_the_cache(setup):
    target, compiled, prompts, shared = setup
    assert shared > 40 and all(p[:shared] == prompts[0][:shared] for p in prompts)
    cache = PrefixCache()
    for i, p in enumerate(prompts):
        cold = run(target, compiled, p, shared, None)
        warm = run(target, compiled, p, shared, cache)
        assert warm.tokens == cold.tokens and warm.finished == cold.finished
        assert warm.stats.prefix_cached_tokens == (shared if i else 0)  # the first request stored it
    assert cache.hits == 2 and len(cache) == 1


def test_the_prefix_is_keyed_by_its_tokens(setup):
    target, compiled, prompts, shared = setup
    cache = PrefixCache()
    run(target, compiled, prompts[0], shared, cache)
    other = [prompts[0][0] + 1] + prompts[1][1:]  # the same tokens but the first
    res = run(target, compiled, other, shared, cache)
    assert res.stats.prefix_cached_tokens == 0 and len(cache) == 2
    assert res.tokens == run(target, compiled, other, shared, None).tokens


def test_memory_is_bounded_least_recently_used_first(setup):
    target, compiled, prompts, shared = setup
    one = PrefixCache()
    run(target, compiled, prompts[0], shared, one)
    cache = PrefixCache(max_bytes=2 * one.bytes)
    variants = [[t + i for t in prompts[0][:1]] + p[1:] for i, p in enumerate(prompts)]  # 3 different prefixes
    for v in variants:
        run(target, compiled, v, shared, cache)
        assert cache.bytes <= cache.max_bytes and len(cache) <= 2
    assert run(target, compiled, variants[-1], shared, cache).stats.prefix_cached_tokens == shared  # most recent kept
    assert run(target, compiled, variants[0], shared, cache).stats.prefix_cached_tokens == 0  # least recent evicted


def test_engine_rows_share_the_prefix_and_match_single_runs(setup):
    target, compiled, prompts, shared = setup
    engine = BatchEngine(target, max_batch=3, prefix_cache=PrefixCache())
    reqs = []
    for p in prompts * 2:
        m = compiled.matcher()
        reqs.append(engine.submit(p, m, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=40,
                                  prefix_len=shared))
    list(engine.run())
    assert sum(r.result.stats.prefix_cached_tokens for r in reqs) == 5 * shared
    for p, r in zip(prompts * 2, reqs):
        assert r.result.tokens == run(target, compiled, p, shared, None).tokens


def test_shared_prefix_must_lead_the_prompt(smol):
    from constrained_spec import InvalidOptionError, generate_json

    with pytest.raises(InvalidOptionError, match="shared_prefix"):
        generate_json(smol, {"type": "boolean"}, "Is water wet?", shared_prefix="Is fire", max_new_tokens=4)


@pytest.mark.slow
def test_extract_with_and_without_prefix_cache_gives_the_same_records(smol):
    """The embedded model at its default (native) precision: the same records one by one and
    batched, with and without the cache, and the people prompts' shared template is reused."""
    import importlib.util

    from constrained_spec.pipelines.extract import extract

    spec = importlib.util.spec_from_file_location("people", ROOT / "examples" / "people.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    docs = [json.loads(line) for line in (ROOT / "constrained_spec" / "data" / "people.jsonl").read_text().splitlines()[:4]]
    smol.model._constrained_spec_prefix_cache = None  # start cold
    off = [r.to_record() for r in extract(mod.Person, docs, model=smol, batch_size=4, prefix_cache=False)]
    on = [r.to_record() for r in extract(mod.Person, docs, model=smol, batch_size=4)]
    single = [r.to_record() for r in extract(mod.Person, docs, model=smol)]
    strip = lambda recs: [json.dumps(r.get("value"), sort_keys=True) for r in recs]  # noqa: E731
    assert strip(on) == strip(off) == strip(single) and all("value" in r for r in on)
    assert smol.model._constrained_spec_prefix_cache.hits >= 3 + 4  # batched: 3 after the first; one by one: all 4
