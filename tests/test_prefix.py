"""Prefix caching: identical outputs with and without it, blocks keyed by the whole prefix,
bounded memory, and reuse that actually happens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from constrained_spec.constraint import compile_constraint
from constrained_spec.decoding import FixedK, PrefixCache, decode
from constrained_spec.decoding.engine import BatchEngine
from constrained_spec.decoding.prefix import BLOCK
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
    return target, compiled, prompts


def run(target, compiled, prompt, cache):
    m = compiled.matcher()
    return decode(target, m, prompt, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=40, prefix_cache=cache)


def test_outputs_are_identical_with_and_without_the_cache(setup):
    target, compiled, prompts = setup
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    assert shared > 2 * BLOCK  # the prompts span several blocks, and share the first ones
    cache = PrefixCache()
    for round_ in range(2):
        for p in prompts:
            cold = run(target, compiled, p, None)
            warm = run(target, compiled, p, cache)
            assert warm.tokens == cold.tokens and warm.finished == cold.finished
            if round_:  # the whole prompt's blocks were stored in round 0
                assert warm.stats.prefix_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
    assert cache.hits > 0 and len(cache) > 0


def test_blocks_are_keyed_by_the_whole_prefix(setup):
    target, compiled, prompts = setup
    cache = PrefixCache()
    a = prompts[0]
    run(target, compiled, a, cache)
    b = [a[0] + 1] + a[1:]  # the same blocks after the first token, which differs
    res = run(target, compiled, b, cache)
    assert res.stats.prefix_cached_tokens == 0
    assert res.tokens == run(target, compiled, b, None).tokens


def test_memory_is_bounded_least_recently_used_first(setup):
    target, compiled, prompts = setup
    one = PrefixCache()
    run(target, compiled, prompts[0], one)
    per_block = one.bytes // len(one)
    cache = PrefixCache(max_bytes=3 * per_block)
    for p in prompts:
        run(target, compiled, p, cache)
        assert cache.bytes <= cache.max_bytes and len(cache) <= 3
    # The last prompt's blocks are the most recent: a rerun reuses them.
    assert run(target, compiled, prompts[-1], cache).stats.prefix_cached_tokens == 3 * BLOCK


def test_engine_rows_share_prefix_blocks_and_match_single_runs(setup):
    target, compiled, prompts = setup
    engine = BatchEngine(target, max_batch=3, prefix_cache=PrefixCache())
    reqs = []
    for p in prompts * 2:
        m = compiled.matcher()
        reqs.append(engine.submit(p, m, drafter=LookupDrafter(m), k_policy=FixedK(4), max_new_tokens=40))
    list(engine.run())
    assert sum(r.result.stats.prefix_cached_tokens for r in reqs) >= 5 * 2 * BLOCK
    for p, r in zip(prompts * 2, reqs):
        assert r.result.tokens == run(target, compiled, p, None).tokens


@pytest.mark.slow
def test_extract_with_and_without_prefix_cache_gives_the_same_records(smol):
    """The embedded model at its default (native) precision, batched: the same records, and the
    people prompts' shared template is reused."""
    import importlib.util

    from constrained_spec.pipelines.extract import extract

    spec = importlib.util.spec_from_file_location("people", ROOT / "examples" / "people.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    docs = [json.loads(line) for line in (ROOT / "benchmarks" / "people.jsonl").read_text().splitlines()[:4]]
    smol.model._constrained_spec_prefix_cache = None  # start cold
    off = [r.to_record() for r in extract(mod.Person, docs, model=smol, batch_size=4, prefix_cache=False)]
    on = [r.to_record() for r in extract(mod.Person, docs, model=smol, batch_size=4)]
    strip = lambda recs: [json.dumps(r.get("value"), sort_keys=True) for r in recs]  # noqa: E731
    assert strip(on) == strip(off) and all("value" in r for r in on)
    assert smol.model._constrained_spec_prefix_cache.hits >= 3
