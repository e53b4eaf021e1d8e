"""The official JSON Schema Test Suite (draft 2020-12) through our constraints.

For each test group (one schema and its instances) and each backend and mode: does the schema
compile, and if it does, which instances does the whole pipeline accept? An instance is
accepted when some serialization of it is in the constraint's language (keys in any order,
numbers in any spelling: ``bench.instances``) and the output check after decoding
(``validate_json_output``) passes it. Counted against the suite's verdict:

- a false accept: an invalid instance the pipeline accepts (must never happen);
- a caught accept: an invalid instance the constraint allows but the output check refuses
  (the user gets an ``OutputValidationError``, never the value);
- a false reject: a valid instance the pipeline refuses.

The suite's files are vendored under ``tests/data/json_schema_test_suite`` (MIT; the LICENSE
and the commit are there). Run ``python -m tests.schema_suite`` for the table of both backends
in both modes, ``--format`` for the optional format files.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

SUITE = Path(__file__).parent / "data" / "json_schema_test_suite" / "draft2020-12"
#: Files left out: ``refRemote`` needs the suite's HTTP server of remote schemas.
SKIPPED_FILES = frozenset({"refRemote.json"})
#: Byte tokens 0-255 and EOS: tokenization cannot hide a language difference.
EOS = 256


@lru_cache(maxsize=1)
def byte_vocabulary() -> Any:
    """A vocabulary of one token per byte and an EOS token."""
    from constrained_spec.constraint.vocabulary import TokenVocabulary

    return TokenVocabulary.build({i: bytes([i]) for i in range(256)}, EOS)


class StateSearch:
    """The byte matcher interface ``bench.instances`` searches with (consume, rollback,
    accepting), over any backend's ``Matcher``: a stack of its states."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.states = [matcher.initial_state]

    def reset(self) -> None:
        self.states = [self.matcher.initial_state]

    def try_consume_tokens(self, tokens: list[int]) -> int:
        for n, token in enumerate(tokens):
            state = self.matcher.next_state(self.states[-1], token)
            if state is None:
                return n
            self.states.append(state)
        return len(tokens)

    def rollback(self, n: int) -> None:
        del self.states[len(self.states) - n:]

    def is_accepting(self) -> bool:
        return self.matcher.is_final(self.states[-1])


@dataclass
class Case:
    """One suite group: where it comes from, its schema and its instances."""

    file: str
    description: str
    schema: Any
    tests: list[dict]

    @property
    def name(self) -> str:
        return f"{self.file}: {self.description}"


@dataclass
class Outcome:
    """What one backend and mode made of one group."""

    case: Case
    compiled: bool
    refusal: str = ""
    false_accepts: list[str] = field(default_factory=list)
    caught_accepts: list[str] = field(default_factory=list)
    false_rejects: list[str] = field(default_factory=list)
    undetermined: list[str] = field(default_factory=list)


def cases(directory: Path = SUITE) -> Iterator[Case]:
    """Every group of the suite's files in ``directory`` (not its subfolders), in file order."""
    for path in sorted(directory.glob("*.json")):
        if path.name in SKIPPED_FILES:
            continue
        for group in json.loads(path.read_text()):
            yield Case(path.name, group["description"], group["schema"], group["tests"])


def format_cases() -> Iterator[Case]:
    """The optional format groups (``optional/format``), where the standard's formats are tested."""
    yield from cases(SUITE / "optional" / "format")


#: The required file in which ``format`` is an annotation only: we assert formats (the
#: constraint enforces them), so its "invalid ... is only an annotation" instances are refused,
#: as docs/constraints.md says.
FORMAT_ANNOTATION_FILE = "format.json"
#: Valid format values the grammar refuses (docs/constraints.md lists them), by file and test.
KNOWN_FORMAT_REJECTS = frozenset({
    ("email.json", "a quoted string with a space in the local part is valid"),
    ("email.json", "a quoted string with a double dot in the local part is valid"),
    ("email.json", "a quoted string with a @ in the local part is valid"),
    ("email.json", "an IPv6-address-literal after the @ is valid"),
    ("ipv6.json", "mixed format with the ipv4 section as decimal octets"),
    ("ipv6.json", "mixed format with double colons between the sections"),
    ("ipv6.json", "mixed format with leading double colons (ipv4-mapped ipv6 address)"),
    ("ipv6.json", "a long valid ipv6"),
    ("iri.json", "an IPvFuture host with an uppercase version letter is valid"),
})


def documented_reject(outcome: "Outcome", label: str) -> bool:
    """Whether a false reject is one docs/constraints.md lists."""
    test = label.split(": ", 1)[0]
    return outcome.case.file == FORMAT_ANNOTATION_FILE or (outcome.case.file, test) in KNOWN_FORMAT_REJECTS


def refusal_reason(error: Exception) -> str:
    """A short reason for a table: the error's class and the keyword it names, or the kind of
    refusal its message starts with ("Invalid schema", "Unsatisfiable schema")."""
    keyword = getattr(error, "keyword", None)
    if keyword:
        return f"{type(error).__name__}({keyword})"
    return f"{type(error).__name__}({str(error).split(':', 1)[0]})"


def run_case(case: Case, *, backend: str, lenient: bool) -> Outcome:
    """Compile ``case``'s schema on ``backend`` and judge each of its instances."""
    from constrained_spec.api import validate_json_output
    from constrained_spec.bench.instances import search_serialization
    from constrained_spec.constraint import compile_constraint, load_schema
    from constrained_spec.errors import ConstrainedSpecError, OutputValidationError

    try:
        loaded = load_schema(case.schema)
        compiled = compile_constraint(loaded, byte_vocabulary(), backend=backend, lenient=lenient)
    except ConstrainedSpecError as error:
        return Outcome(case, compiled=False, refusal=refusal_reason(error))
    outcome = Outcome(case, compiled=True)
    for test in case.tests:
        label = f"{test['description']}: {json.dumps(test['data'])[:80]}"
        found = search_serialization(StateSearch(compiled.matcher()), test["data"])
        passed = False
        if found.found is not None:
            try:
                validate_json_output(found.found, loaded)
                passed = True
            except OutputValidationError:
                if not test["valid"]:
                    outcome.caught_accepts.append(label)
        elif not found.complete:
            outcome.undetermined.append(label)
            continue
        if passed and not test["valid"]:
            outcome.false_accepts.append(label)
        elif not passed and test["valid"]:
            outcome.false_rejects.append(label)
    return outcome


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """The figures of one backend and mode over a set of groups."""
    compiled = [o for o in outcomes if o.compiled]
    return {
        "groups": len(outcomes),
        "compiled": len(compiled),
        "instances": sum(len(o.case.tests) for o in compiled),
        "false_accepts": sum(len(o.false_accepts) for o in compiled),
        "caught_accepts": sum(len(o.caught_accepts) for o in compiled),
        "false_rejects": sum(len(o.false_rejects) for o in compiled),
        "undocumented_false_rejects": sum(not documented_reject(o, r) for o in compiled for r in o.false_rejects),
        "undetermined": sum(len(o.undetermined) for o in compiled),
        "refused": dict(Counter(o.refusal for o in outcomes if not o.compiled).most_common()),
    }


def main() -> None:
    """Print the suite's figures for both backends, strict and lenient."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", action="store_true", help="the optional format files instead of the required ones")
    parser.add_argument("--backend", action="append", help="llguidance and/or outlines-core (default both)")
    parser.add_argument("--details", action="store_true", help="list every false accept and false reject")
    args = parser.parse_args()
    groups = list(format_cases() if args.format else cases())
    for backend in args.backend or ["llguidance", "outlines-core"]:
        for lenient in (False, True):
            if lenient and backend == "outlines-core":
                continue  # lenient is llguidance's mode only
            outcomes = [run_case(c, backend=backend, lenient=lenient) for c in groups]
            mode = "lenient" if lenient else "strict"
            print(f"{backend} {mode}: {json.dumps(summarize(outcomes))}")
            if args.details:
                for o in outcomes:
                    for kind in ("false_accepts", "false_rejects", "caught_accepts", "undetermined"):
                        for label in getattr(o, kind):
                            print(f"  {kind[:-1]}: {o.case.name}: {label}")


if __name__ == "__main__":
    main()
