"""The exact bytes of every token of a tokenizer: what both backends build their automata over."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidTokenizerError


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


_VOCAB_CACHE: dict[int, TokenVocabulary] = {}


def vocabulary_of(tokenizer: Any) -> TokenVocabulary:
    """The ``TokenVocabulary`` of a Hugging Face tokenizer (memoized per object), or the
    vocabulary itself when one is given."""
    if isinstance(tokenizer, TokenVocabulary):
        return tokenizer
    key = id(tokenizer)
    vocab = _VOCAB_CACHE.get(key)
    if vocab is None:
        vocab = _VOCAB_CACHE[key] = TokenVocabulary.from_tokenizer(tokenizer)
    return vocab
