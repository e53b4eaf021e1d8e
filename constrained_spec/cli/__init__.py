"""The ``constrained-spec`` command line, one module per command group: ``generate`` (json,
regex, demo), ``extract``, ``bench`` (bench, coverage), ``server`` (serve, fuzz, soak) and
``drafter`` (drafter-data, train-drafter); ``common`` holds the Typer app and what they share.

Exit codes: 0 success; 2 bad usage or bad input (invalid schema, pattern, prompt, option);
1 generation failure (token limit reached, output failed validation).
"""

from __future__ import annotations

import sys

from ..errors import ModelLoadError
# Each module registers its commands on ``app``, in the order ``--help`` lists them.
from . import generate, extract, bench, server, drafter  # noqa: F401, I001
from .common import app, err

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except ModelLoadError as e:  # raised outside a command's guard, e.g. while importing
        err.print(f"[red]error:[/] {e}")
        sys.exit(2)
