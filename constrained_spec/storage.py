"""Where constrained_spec keeps files between runs: compiled indexes and converted model weights."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CONSTRAINED_SPEC_CACHE"


def cache_dir() -> Path:
    """The cache root: ``$CONSTRAINED_SPEC_CACHE``, else ``$XDG_CACHE_HOME/constrained_spec``
    (``~/.cache/constrained_spec``). Nothing there is needed for correctness; delete it freely."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "constrained_spec"
    )
    return Path(root)
