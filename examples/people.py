"""A pydantic extraction over a small folder of documents (examples/documents/).

Run: python examples/people.py
Or from the command line:
    constrained-spec extract --schema examples/people.py:Person --input examples/documents --output people.jsonl
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from constrained_spec import extract, load_model
from constrained_spec.pipelines.extract import read_documents


class Person(BaseModel):
    name: str = Field(description="the person's full name")
    age: int = Field(description="age in years")
    city: str = Field(description="the city where the person lives")
    occupation: str = Field(description="their job, in a few words")


if __name__ == "__main__":
    model = load_model()  # the embedded SmolLM2-135M-Instruct
    docs = read_documents(Path(__file__).parent / "documents")
    for result in extract(Person, docs, model=model):
        if result.ok:
            print(result.id, result.value, f"{result.stats['tokens_per_second']:.0f} tok/s")
        else:
            print(result.id, "failed:", result.error["kind"], result.error["message"][:80])
