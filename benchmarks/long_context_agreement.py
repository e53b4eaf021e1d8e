"""How far a native model's settings move it from the float32 model over long contexts.

For every bench document (``constrained-spec bench documents``'s twelve package descriptions)
longer than ``--min-tokens``, the prompt without its last ``--tail`` tokens is fed as prompt rows
in the decoder's chunks and those ``--tail`` tokens as new rows (what decode and verify rows
read, the KV cache included), in one forward. Each position's top-1 token is compared with the
float32 model's (``precision="float32"``). Rows: the native model with the default settings,
then once per ``--env NAME=VALUE`` (a ``CONSTRAINED_SPEC_*`` variable set for that load).

    python benchmarks/long_context_agreement.py --env CONSTRAINED_SPEC_KV_CACHE=bfloat16
"""

from __future__ import annotations

import argparse
import os

import torch

from constrained_spec import load_model
from constrained_spec.api import encode_prompt
from constrained_spec.bench.documents import default_documents, document_prompt, facts_schema
from constrained_spec.decoding.prefix import prompt_chunks


def tail_logits(handle, ids: list[int], tail: int) -> torch.Tensor:
    """The logits of the last ``tail`` positions' next tokens, the rest fed as prompt chunks."""
    model = handle.model
    kwargs = {}
    if getattr(model, "batch_invariant", False):
        chunks = prompt_chunks(ids[:-tail])
        kwargs = dict(cache=model.new_cache(), use_cache=True, prompt_rows=[(c.start, c.length) for c in chunks])
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0, -tail:].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE: a row with this variable set")
    parser.add_argument("--tail", type=int, default=400, help="positions compared per document")
    parser.add_argument("--min-tokens", type=int, default=1200, help="documents shorter than this are left out")
    args = parser.parse_args()

    reference = load_model(precision="float32")
    schema = facts_schema()
    texts = [encode_prompt(reference, document_prompt(d, schema)) for d in default_documents(reference, schema)]
    texts = [t for t in texts if len(t) >= max(args.min_tokens, 2 * args.tail)]
    rows = {"native, default settings": load_model()}
    for item in args.env:
        name, _, value = item.partition("=")
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            rows[f"native, {item}"] = load_model()
        finally:
            os.environ.pop(name) if saved is None else os.environ.__setitem__(name, saved)
    differ = dict.fromkeys(rows, 0)
    for ids in texts:
        want = tail_logits(reference, ids, args.tail).argmax(-1)
        for label, handle in rows.items():
            differ[label] += int((tail_logits(handle, ids, args.tail).argmax(-1) != want).sum())
    total = args.tail * len(texts)
    print(f"{len(texts)} documents, the last {args.tail} positions of each: top-1 unlike the float32 model's")
    for label, n in differ.items():
        print(f"  {label}: {n} of {total}")


if __name__ == "__main__":
    main()
