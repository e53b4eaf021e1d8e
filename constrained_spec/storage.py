"""Where constrained_spec keeps files between runs: compiled indexes, converted model weights and
built kernels."""

from __future__ import annotations

from pathlib import Path

from . import config

#: The variable that moves the cache (``RuntimeConfig.cache_dir``); tools set it for a scratch cache.
CACHE_ENV = config.variable("cache_dir")


def cache_dir() -> Path:
    """The cache root: ``$CONSTRAINED_SPEC_CACHE``, else ``$XDG_CACHE_HOME/constrained_spec``
    (``~/.cache/constrained_spec``). Read at each call, as tools point it elsewhere while a
    process runs. Nothing there is needed for correctness; delete it freely."""
    return config.read("cache_dir") or config.default_cache_dir()
