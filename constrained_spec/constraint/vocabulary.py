"""The exact bytes of every token of a tokenizer: what both backends build their automata over."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import InvalidTokenizerError
from .tables import (library_versions, memoized_digest, pack_bytes, pack_ints, per_object, read_tables, unpack_bytes,
                     unpack_ints, write_tables)


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class TokenVocabulary:
    """The exact bytes of every ordinary token of a tokenizer, and its EOS id.

    Special and added tokens (chat markers and the like) are left out, so the constraint never
    allows them; only ``eos_token_id`` is kept, and only in final states.
    """

    token_bytes: Mapping[int, bytes]
    eos_token_id: int
    #: One past the largest token id; logits may be wider (padding rows), never narrower.
    size: int
    fingerprint: str = field(default="", compare=False)

    @staticmethod
    def build(token_bytes: Mapping[int, bytes], eos_token_id: int, size: int | None = None) -> "TokenVocabulary":
        """A vocabulary from explicit token bytes (tests and custom tokenizers use this)."""
        size = size if size is not None else max([eos_token_id, *token_bytes]) + 1
        h = hashlib.sha256(f"eos={eos_token_id};size={size};".encode())
        for tid in sorted(token_bytes):
            h.update(tid.to_bytes(4, "little") + len(token_bytes[tid]).to_bytes(2, "little") + token_bytes[tid])
        return TokenVocabulary(dict(token_bytes), eos_token_id, size, h.hexdigest()[:32])

    @staticmethod
    def from_tokenizer(tokenizer: Any) -> "TokenVocabulary":
        """Read token bytes from a Hugging Face tokenizer (byte-level BPE, SentencePiece or plain)."""
        eos = tokenizer.eos_token_id
        if eos is None:
            raise InvalidTokenizerError(
                "Invalid tokenizer: expected an eos_token_id, got None. Set tokenizer.eos_token first."
            )
        vocab: dict[str, int] = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        byte_decoder = _byte_level_decoder()
        byte_level = any("Ġ" in t for t in vocab) and all(
            all(ch in byte_decoder for ch in t) for t in list(vocab)[:2000] if vocab[t] not in special
        )
        token_bytes: dict[int, bytes] = {}
        for tok, tid in vocab.items():
            if tid in special:
                continue
            if byte_level:
                try:
                    token_bytes[tid] = bytes(byte_decoder[ch] for ch in tok)
                except KeyError:
                    continue
            else:
                m = _SPM_BYTE.match(tok)
                if m:
                    token_bytes[tid] = bytes([int(m.group(1), 16)])
                else:
                    token_bytes[tid] = tok.replace("▁", " ").encode("utf-8")
        token_bytes = {t: b for t, b in token_bytes.items() if b}
        size = max(len(tokenizer), max(vocab.values()) + 1)
        return TokenVocabulary.build(token_bytes, eos, size)

    def single_byte_tokens(self) -> dict[int, int]:
        """byte -> the first token id that is exactly that one byte (EOS excluded)."""
        table: dict[int, int] = {}
        for tid, b in self.token_bytes.items():
            if len(b) == 1 and tid != self.eos_token_id:
                table.setdefault(b[0], tid)
        return table


#: What ``TokenVocabulary.from_tokenizer`` runs on, so part of its stored table's key.
VOCABULARY_LIBRARIES = ("constrained_spec", "transformers", "tokenizers")

_VOCAB_CACHE: dict[int, tuple[Callable[[], Any], TokenVocabulary]] = {}


def vocabulary_of(tokenizer: Any) -> TokenVocabulary:
    """The ``TokenVocabulary`` of a Hugging Face tokenizer (memoized per object, and kept on disk
    for a fast tokenizer: ``stored_vocabulary``), or the vocabulary itself when one is given."""
    if isinstance(tokenizer, TokenVocabulary):
        return tokenizer
    return per_object(_VOCAB_CACHE, tokenizer, lambda: stored_vocabulary(tokenizer))


def stored_vocabulary(tokenizer: Any) -> TokenVocabulary:
    """``TokenVocabulary.from_tokenizer(tokenizer)``, read from the disk cache when it holds this
    tokenizer's (``constraint.tables``), else built and stored: a new process then skips the
    build, seconds on a large vocabulary (docs/json-output.md)."""
    digest = memoized_digest(tokenizer)
    if digest is None:
        return TokenVocabulary.from_tokenizer(tokenizer)
    key = f"{digest};{library_versions(*VOCABULARY_LIBRARIES)}"
    sections = read_tables("vocabulary", key)
    if sections is not None:
        try:
            return _vocabulary_from(sections)
        except (ValueError, KeyError, TypeError):
            pass  # sections that do not fit together: rebuilt below
    vocab = TokenVocabulary.from_tokenizer(tokenizer)
    write_tables("vocabulary", key, _vocabulary_sections(vocab))
    return vocab


def _vocabulary_sections(vocab: TokenVocabulary) -> dict[str, bytes]:
    ids = list(vocab.token_bytes)
    lengths, blob = pack_bytes([vocab.token_bytes[t] for t in ids])
    meta = json.dumps({"eos": vocab.eos_token_id, "size": vocab.size, "fingerprint": vocab.fingerprint}).encode()
    return {"meta": meta, "ids": pack_ints(ids), "lengths": lengths, "bytes": blob}


def _vocabulary_from(sections: dict[str, bytes]) -> TokenVocabulary:
    """The vocabulary ``_vocabulary_sections`` stored; ValueError when its sections disagree."""
    meta = json.loads(sections["meta"])
    ids = unpack_ints(sections["ids"])
    items = unpack_bytes(sections["lengths"], sections["bytes"])
    if len(ids) != len(items):
        raise ValueError("as many ids as tokens expected")
    # The stored fingerprint is the one the build computed; the file's checksum vouches for it.
    return TokenVocabulary(dict(zip(ids, items)), int(meta["eos"]), int(meta["size"]), str(meta["fingerprint"]))
