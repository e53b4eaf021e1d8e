"""Where constrained_spec keeps files between runs: compiled indexes, converted model weights,
built kernels and the draft heads trained for model files."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import config

#: The variable that moves the cache (``RuntimeConfig.cache_dir``); tools set it for a scratch cache.
CACHE_ENV = config.variable("cache_dir")


def cache_dir() -> Path:
    """The cache root: ``$CONSTRAINED_SPEC_CACHE``, else ``$XDG_CACHE_HOME/constrained_spec``
    (``~/.cache/constrained_spec``). Read at each call, as tools point it elsewhere while a
    process runs. Nothing there is needed for correctness; deleting it costs the rebuilds, and the
    heads ``train-drafter`` kept there (``trained_head_dir``) their training."""
    return config.read("cache_dir") or config.default_cache_dir()


#: Bytes read from each of a model file's start, middle and end to name it (``model_file_identity``).
IDENTITY_SLICE = 1 << 20


def model_file_identity(path: Path) -> str:
    """A short name for a model file by what it holds, wherever it is kept: its size and a sha256
    of its first, middle and last MiB (a GGUF file's header and metadata, and tensor bytes that
    differ between fine-tunes of one base). Reading 3 MiB, not the gigabyte a full digest would;
    memoized while the file is unchanged (each request with ``draft=True`` asks)."""
    stat = path.stat()
    return _identity(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _identity(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for start in (0, max(0, size // 2 - IDENTITY_SLICE // 2), max(0, size - IDENTITY_SLICE)):
            f.seek(start)
            digest.update(f.read(IDENTITY_SLICE))
    return digest.hexdigest()[:24]


def trained_head_dir(model_file: Path) -> Path:
    """Where ``train-drafter`` keeps the head it trains for ``model_file`` when given no
    ``--out``, and where ``draft=True`` and auto look for it: ``<cache>/heads/<identity>``."""
    return cache_dir() / "heads" / model_file_identity(Path(model_file))
