"""Issues #22 / #21: attention past ``LONG_CONTEXT`` in float32 blocks over a float32 cache, against
float64 everywhere (the behaviour before, selected by moving the threshold out of reach), or
(``--compare fold``) those float32 blocks with GQA query heads folded into their key heads'
rows against one block per query head (``invariant.FOLD_QUERY_HEADS``), interleaved A B B A in
one process on a 3,900-token document.

Usage: python benchmarks/long_context_ab.py [--tokens 3900] [--compare float64|fold]

Per setting: the long extraction request alone in the batch engine (seconds, peak KV MiB), the
same request through ``generate_json`` target-only and auto (seconds), and three schemas over
the document, document first, with the prefix cache (seconds each; the second and third reuse
the document's blocks). Prints the medians side by side, the speedups, and whether every output
is the same under both settings.
"""

import argparse
import json
import statistics
import time

from constrained_spec import generate_json
from constrained_spec.batching import BatchEngine
from constrained_spec.bench.batch import Person
from constrained_spec.bench.long_prompt import DOCUMENT_FIRST_TEMPLATE, Contact, Job, _submit, long_document
from constrained_spec.decoding import PrefixCache
from constrained_spec.models import invariant
from constrained_spec.models.loading import load_model
from constrained_spec.pipelines.extract import DEFAULT_PROMPT_TEMPLATE, describe_fields

COMPARISONS = {
    "float64": {"float64 everywhere (before)": {"LONG_CONTEXT": 10**9},
                "float32 past LONG_CONTEXT (now)": {"LONG_CONTEXT": invariant.LONG_CONTEXT}},
    "fold": {"one block per query head (before)": {"FOLD_QUERY_HEADS": False},
             "query heads folded (now)": {"FOLD_QUERY_HEADS": True}},
}


def measure(handle, doc: str) -> tuple[dict[str, float], list[str]]:
    fig, outs = {}, []
    prompt = DEFAULT_PROMPT_TEMPLATE.format(fields=describe_fields(Person.model_json_schema()), text=doc)
    engine = BatchEngine(handle.model, max_batch=16, precision=handle.precision, prefix_cache=PrefixCache())
    t0 = time.perf_counter()
    req = _submit(engine, handle, Person, prompt)
    peak = 0.0
    while engine.busy:
        engine.step()
        peak = max(peak, engine.cache.allocated_bytes / 2**20)
    fig["engine: long request alone, s"] = time.perf_counter() - t0
    fig["engine: peak KV MiB"] = peak
    outs.append(handle.tokenizer.decode(req.result.tokens))
    for drafter in ("none", "auto"):
        t0 = time.perf_counter()
        try:
            out = json.dumps(generate_json(handle, Person, prompt, drafter=drafter, max_new_tokens=128).model_dump())
        except Exception as e:  # greedy identity covers errors too
            out = f"{type(e).__name__}: {getattr(e, 'partial_text', e)}"
        fig[f"generate_json {drafter}, s"] = time.perf_counter() - t0
        outs.append(out)
    engine = BatchEngine(handle.model, max_batch=16, precision=handle.precision, prefix_cache=PrefixCache())
    for i, schema in enumerate((Person, Contact, Job)):
        t0 = time.perf_counter()
        req = _submit(engine, handle, schema, DOCUMENT_FIRST_TEMPLATE.format(
            fields=describe_fields(schema.model_json_schema()), text=doc))
        list(engine.run())
        fig[f"schema {i + 1} over the document, s"] = time.perf_counter() - t0
        outs.append(handle.tokenizer.decode(req.result.tokens))
    return fig, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3900)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="float64")
    args = parser.parse_args()
    settings = COMPARISONS[args.compare]
    handle = load_model()
    doc = long_document(handle.tokenizer, args.tokens)
    names = list(settings)
    figs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    outputs: dict[str, list[list[str]]] = {n: [] for n in names}
    for name in (names[0], names[1], names[1], names[0]):
        for attribute, value in settings[name].items():
            setattr(invariant, attribute, value)
        fig, outs = measure(handle, doc)
        figs[name].append(fig)
        outputs[name].append(outs)
        print(name, {k: round(v, 2) for k, v in fig.items()}, flush=True)
    print(f"\n{'':40s} {names[0]:>28s} {names[1]:>32s}  ratio")
    for key in figs[names[0]][0]:
        a, b = (statistics.median(f[key] for f in figs[n]) for n in names)
        print(f"{key:40s} {a:28.2f} {b:32.2f}  {a / b:.2f}x")
    for n in names:
        fs = figs[n]
        print(f"{n}: schema 1 / schema 2 = {statistics.median(f['schema 1 over the document, s'] / f['schema 2 over the document, s'] for f in fs):.2f}x, "
              f"schema 1 / schema 3 = {statistics.median(f['schema 1 over the document, s'] / f['schema 3 over the document, s'] for f in fs):.2f}x")
    same = all(o == outputs[names[0]][0] for n in names for o in outputs[n])
    print("every output the same under both settings:", same)
    if not same:
        for n in names:
            print(n, outputs[n][0])


if __name__ == "__main__":
    main()
