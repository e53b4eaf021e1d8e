"""Per-tokenizer tables kept on disk, so a new process does not rebuild them on its first request.

The first constraint compiled over a tokenizer builds tables from its whole vocabulary: the
``TokenVocabulary`` (every token's bytes, and its fingerprint) and llguidance's token table (its
bytes for every id, which ids are special). Both are pure functions of the tokenizer and of the
libraries that build them, and on a large vocabulary they cost seconds in every new process
(docs/json-output.md has the figures). So they are built once and stored under
``storage.cache_dir() / "tables"``, keyed by ``tokenizer_digest`` (an exact digest of what they are
built from) and the versions of the libraries that built them.

A file holds named byte sections behind a header that repeats its key and the SHA-256 of the
sections: a truncated, corrupt or foreign file is read as absent (and rebuilt by the caller),
never misread. Files are written to a private name and renamed into place, so a reader never
sees a half-written one; nothing here is needed for correctness.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from ..storage import cache_dir

#: Part of every key: bump when what a file holds, or how a table is built, changes.
TABLES_FORMAT = 1
_MAGIC = b"CSTABLE1"
_HEADER_LEN = 4  # bytes of the header's length, after the magic

T = TypeVar("T")


def per_object(memo: dict[int, tuple[Callable[[], Any], T]], obj: Any, build: Callable[[], T]) -> T:
    """``build()``, memoized per live object in ``memo``. Keyed by ``id(obj)`` with a weak reference
    beside it: an id is reused once its object is collected, and must not return the value built
    for the dead one; the entry goes with the object (one without weak references is held)."""
    key = id(obj)
    hit = memo.get(key)
    if hit is not None and hit[0]() is obj:
        return hit[1]
    value = build()

    def drop(dead: Any) -> None:
        if memo.get(key, (None,))[0] is dead:  # not a newer object's entry under the same id
            memo.pop(key, None)

    try:
        ref: Callable[[], Any] = weakref.ref(obj, drop)
    except TypeError:
        ref = lambda: obj  # noqa: E731 - held, so its id is never reused
    memo[key] = (ref, value)
    return value


_DIGESTS: dict[int, tuple[Callable[[], Any], str | None]] = {}


def memoized_digest(tokenizer: Any) -> str | None:
    """``tokenizer_digest``, computed once per tokenizer object (the vocabulary and llguidance's
    table both need it on a new process's first compile)."""
    return per_object(_DIGESTS, tokenizer, lambda: tokenizer_digest(tokenizer))


def library_versions(*names: str) -> str:
    """``name=version`` of each installed distribution (``?`` where absent), for a key: tables a
    library built are stale once it changes."""
    parts = []
    for name in names:
        try:
            parts.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name}=?")
    return ";".join(parts)


def tokenizer_digest(tokenizer: Any) -> str | None:
    """An exact digest of what the per-tokenizer tables of a fast (Rust-backed) Hugging Face
    tokenizer are built from; None for any other tokenizer (its tables are not stored).

    It covers every token's text by id (added tokens too) and each added token's options, the
    backend's normalizer, pre-tokenizer, decoder and post-processor, the model's type and options,
    and what ``TokenVocabulary.from_tokenizer`` reads besides (EOS, special ids, length). It leaves
    out only the merges, which decide how text is split, never a token's bytes: tokenizing is
    always done by the live tokenizer, never from a table. Ids are read one by one because that
    is faster than serializing the whole tokenizer (docs/json-output.md).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "id_to_token"):
        return None
    n = backend.get_vocab_size(with_added_tokens=True)
    h = hashlib.sha256(f"{TABLES_FORMAT};{type(tokenizer).__name__};n={n};len={len(tokenizer)};"
                       f"eos={tokenizer.eos_token_id};".encode())
    texts = [backend.id_to_token(i) for i in range(n)]
    # "\0" ends a token's text ("\1\0" an id without one), so no two vocabularies join alike.
    h.update("".join("\1\0" if t is None else t + "\0" for t in texts).encode("utf-8", "surrogatepass"))
    added = sorted((tid, repr(tok)) for tid, tok in backend.get_added_tokens_decoder().items())
    special = sorted(getattr(tokenizer, "all_special_ids", []) or [])
    added_ids = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    model = backend.model
    options = {k: getattr(model, k) for k in dir(model) if not k.startswith("_")
               and isinstance(getattr(model, k, None), (str, int, float, bool, type(None)))}
    parts = {part: (None if getattr(backend, part, None) is None else getattr(backend, part).__getstate__().decode())
             for part in ("normalizer", "pre_tokenizer", "decoder", "post_processor")}
    h.update(json.dumps([added, special, added_ids, type(model).__name__, options, parts], sort_keys=True,
                        default=repr).encode())
    return h.hexdigest()


def table_path(kind: str, key: str) -> Path:
    """Where the ``kind`` tables of ``key`` are kept."""
    name = hashlib.sha256(f"{TABLES_FORMAT}\0{kind}\0{key}".encode()).hexdigest()[:40]
    return cache_dir() / "tables" / f"{kind}-{name}.bin"


def read_tables(kind: str, key: str) -> dict[str, bytes] | None:
    """The sections stored for (``kind``, ``key``); None when there is no file, or it is truncated,
    corrupt or another key's (the caller then builds and writes them again)."""
    try:
        data = table_path(kind, key).read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(_MAGIC):
            return None
        start = len(_MAGIC) + _HEADER_LEN
        header_len = int.from_bytes(data[len(_MAGIC):start], "little")
        header = json.loads(data[start:start + header_len])
        payload = memoryview(data)[start + header_len:]
        if (header.get("format") != TABLES_FORMAT or header.get("kind") != kind or header.get("key") != key
                or sum(n for _, n in header["sections"]) != len(payload)
                or hashlib.sha256(payload).hexdigest() != header["sha256"]):
            return None
        sections, at = {}, 0
        for name, n in header["sections"]:
            sections[name] = bytes(payload[at:at + n])
            at += n
        return sections
    except (ValueError, KeyError, TypeError):  # unreadable header: as absent
        return None


def write_tables(kind: str, key: str, sections: Mapping[str, bytes]) -> None:
    """Store ``sections`` for (``kind``, ``key``), atomically; a failure to write is ignored (the
    tables are rebuilt next time)."""
    path = table_path(kind, key)
    payload = b"".join(sections.values())
    header = json.dumps({"format": TABLES_FORMAT, "kind": kind, "key": key,
                         "sections": [[name, len(b)] for name, b in sections.items()],
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_MAGIC + len(header).to_bytes(_HEADER_LEN, "little") + header + payload)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def pack_bytes(items: Sequence[bytes]) -> tuple[bytes, bytes]:
    """(little-endian uint32 lengths, the items joined): a list of byte strings as two sections."""
    return np.fromiter(map(len, items), dtype="<u4", count=len(items)).tobytes(), b"".join(items)


def unpack_bytes(lengths: bytes, blob: bytes) -> list[bytes]:
    """The inverse of ``pack_bytes``; ValueError when the sections do not fit together."""
    lens = np.frombuffer(lengths, dtype="<u4").astype(np.int64)
    ends = np.cumsum(lens)
    if (int(ends[-1]) if len(ends) else 0) != len(blob):
        raise ValueError("the lengths do not add up to the bytes stored")
    return [blob[s:e] for s, e in zip((ends - lens).tolist(), ends.tolist())]


def pack_ints(values: Sequence[int]) -> bytes:
    """Little-endian int64s (ids; -1 where there is none)."""
    return np.asarray(list(values), dtype="<i8").tobytes()


def unpack_ints(data: bytes) -> list[int]:
    """The inverse of ``pack_ints``."""
    return np.frombuffer(data, dtype="<i8").tolist()


def prepare_tables(tokenizer: Any) -> None:
    """Read (or build and store) every per-tokenizer table of ``tokenizer`` now, and build
    llguidance's tokenizer from them, so the first ``compile_constraint`` costs what later ones
    do. Meant for model load: with the tables on disk the part that stays is llguidance's own
    (its token trie and mask slices; docs/json-output.md has the figures)."""
    from .llguidance import lltokenizer
    from .vocabulary import vocabulary_of

    lltokenizer(tokenizer, vocabulary_of(tokenizer))
