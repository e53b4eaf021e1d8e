"""The JSON Schema Test Suite (draft 2020-12), required and format files, through the default
backend in strict and lenient mode (``tests/schema_suite.py`` runs it; ``python -m
tests.schema_suite`` prints the same figures for both backends).

What must hold for every schema that compiles: no invalid instance accepted (the constraint may
allow one only where the output check after decoding refuses it), and no valid instance refused
but the format cases docs/constraints.md lists. The compiled share may only grow.
"""

from __future__ import annotations

import json

import pytest

from tests.schema_suite import cases, documented_reject, format_cases, run_case, summarize

#: Groups compiled today (of 368: the required files but ``refRemote``); a floor, not a target.
COMPILED_AT_LEAST = {False: 175, True: 350}
FORMAT_COMPILED_AT_LEAST = {False: 12, True: 28}


def _check(outcomes: list, floor: int) -> dict:
    figures = summarize(outcomes)
    print(json.dumps(figures))
    false_accepts = [f"{o.case.name}: {a}" for o in outcomes for a in o.false_accepts]
    assert not false_accepts, false_accepts
    undocumented = [f"{o.case.name}: {r}" for o in outcomes for r in o.false_rejects if not documented_reject(o, r)]
    assert not undocumented, undocumented
    assert figures["undetermined"] == 0
    assert figures["compiled"] >= floor, figures
    return figures


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "lenient"])
def test_required_suite_on_the_default_backend(lenient: bool) -> None:
    outcomes = [run_case(c, backend="llguidance", lenient=lenient) for c in cases()]
    figures = _check(outcomes, COMPILED_AT_LEAST[lenient])
    if lenient:
        # Lenient mode relaxes keywords and checks them after decoding: the suite's invalid
        # instances of those keywords must be refused there, so some are caught.
        assert figures["caught_accepts"] > 0
    else:
        assert figures["caught_accepts"] == 0  # strict: the constraint itself refuses every invalid instance


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "lenient"])
def test_format_suite_returns_no_invalid_value(lenient: bool) -> None:
    """The grammar's formats are looser than the standard in places (a 30th of February, leap
    seconds at any minute, long hostnames): the output check after decoding refuses those."""
    outcomes = [run_case(c, backend="llguidance", lenient=lenient) for c in format_cases()]
    figures = _check(outcomes, FORMAT_COMPILED_AT_LEAST[lenient])
    assert figures["caught_accepts"] > 0
