"""Drafting from the target's own past outputs: an n-gram index of its constrained generations.

Where a value is neither forced by the grammar nor in the prompt, the target still writes it the
way it wrote similar values before: a small model's example objects, dates, e-mail addresses,
closing quotes and commas after a name follow a few habits. ``OutputCorpus`` indexes the
target's greedy outputs on training prompts (``train-drafter`` writes one beside the head it
trains, and the package ships one for the embedded model); ``CorpusDrafter`` continues the
request's output with the most frequent continuation of its longest suffix found in the corpus
(SuffixDecoding's idea, Oliaro et al. 2024), each token walked through the request's matcher.

Why besides the learned head: the index costs a dictionary-sized lookup per drafted token, not a
decoder layer, so it drafts wherever it has a match without a cost to repay; where prompt lookup
misses it agrees with the target about as often as the head does (see docs/drafters.md). Its draft is one-hot and verified like every other, so a
wrong or colliding match costs a rejected token, never a wrong output.

The index is written by hand because no library keeps a token n-gram table this small: per
order n (1..``max_order``), a sorted array of 64-bit hashes of every n tokens seen before a
token, with that next token and its count, searched with ``numpy.searchsorted``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..constraint import Matcher, State
from ..errors import ModelLoadError, TokenizerMismatchError
from .base import Draft, Drafter, DraftKind

CORPUS_FILE = "corpus.safetensors"
#: The longest suffix matched; longer ones are rare in a few hundred outputs and seldom better.
MAX_ORDER = 8
#: Candidates tried per match, most frequent first, until one the matcher allows.
MAX_CANDIDATES = 8
#: A proposal goes on past its first token only while the share of the chosen continuation
#: among the allowed ones stays at least this (the K policy trims the rest by confidence).
CHAIN_CONFIDENCE = 0.5
#: What a token's confidence counts beside its continuations' counts: one continuation not yet
#: seen. A share read off one or two outputs is not a certainty: a small corpus (a few dozen
#: outputs, from another kind of prompt) gave continuations seen once a confidence of 1, and the
#: K policy verified them as near-certain where they were all wrong (docs/drafters.md,
#: "A corpus from other prompts").
UNSEEN_CONTINUATIONS = 1
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: the hash is a polynomial in it, wrapping mod 2^64
#: The same hash in Python integers for one query (numpy scalars are slow for one-off arithmetic).
_BASE_INT = int(_BASE)
_MASK = (1 << 64) - 1


class OutputCorpus:
    """An n-gram index over token sequences (the target's outputs), for one tokenizer.

    Attributes:
        tokens: the sequences, concatenated, each followed by -1.
        tokenizer_fingerprint: ``TokenVocabulary.fingerprint`` of the tokenizer they are in.
        max_order: the longest n-gram indexed.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], tokenizer_fingerprint: str, *,
                 exclude: Sequence[int] = (), max_order: int = MAX_ORDER) -> None:
        """Index ``sequences``; tokens in ``exclude`` (EOS) are never a continuation."""
        flat: list[int] = []
        for seq in sequences:
            flat += [int(t) for t in seq] + [-1]
        self.tokens = np.asarray(flat, dtype=np.int64)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.max_order = max_order
        self._exclude = frozenset(int(t) for t in exclude)
        self._orders = _index(self.tokens, max_order, self._exclude)

    def __len__(self) -> int:
        """The number of tokens indexed (separators excluded)."""
        return int((self.tokens >= 0).sum())

    def continuations(self, suffix: Sequence[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Per order from the longest the suffix allows down to 1, where the corpus has the
        last n tokens of ``suffix``: (n, next tokens, their counts), most frequent first.
        Lazy: a drafter that takes the first order it can use searches no shorter one (inside
        auto it queries at every position another drafter leaves, ~2,000 times on 10
        generation prompts)."""
        hashes = []
        h, power = 0, 1
        for n in range(1, min(self.max_order, len(suffix)) + 1):
            h = (h + (int(suffix[-n]) + 1) * power) & _MASK
            power = (power * _BASE_INT) & _MASK
            hashes.append(h)
        for n in range(len(hashes), 0, -1):
            keys, nexts, counts = self._orders[n - 1]
            key = np.uint64(hashes[n - 1])
            lo = int(np.searchsorted(keys, key, "left"))
            if lo < len(keys) and keys[lo] == key:
                hi = int(np.searchsorted(keys, key, "right"))
                yield n, nexts[lo:hi], counts[lo:hi]

    def save(self, directory: str | Path) -> Path:
        """Write the corpus to ``directory/corpus.safetensors`` (the tokens and the fingerprint)."""
        import torch
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"tokenizer_fingerprint": self.tokenizer_fingerprint, "max_order": str(self.max_order),
                "exclude": json.dumps(sorted(self._exclude))}
        save_file({"tokens": torch.from_numpy(self.tokens.astype(np.int32))}, str(path / CORPUS_FILE), metadata=meta)
        return path / CORPUS_FILE

    @classmethod
    def load(cls, directory: str | Path, tokenizer_fingerprint: str) -> "OutputCorpus":
        """The corpus saved in ``directory``. Raises ``TokenizerMismatchError`` when it was
        written for another tokenizer, ``ModelLoadError`` when there is none or it is unreadable."""
        from safetensors import safe_open

        path = Path(directory) / CORPUS_FILE
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                tokens = f.get_tensor("tokens").astype(np.int64)
        except Exception as e:  # a missing file, a truncated one, another format: one clear error
            raise ModelLoadError(f"Invalid draft corpus {str(path)!r}: {e}.") from None
        if meta.get("tokenizer_fingerprint") != tokenizer_fingerprint:
            raise TokenizerMismatchError(
                f"The draft corpus in {str(path)!r} was written for another tokenizer than the target's; "
                "build one for this model with constrained-spec train-drafter.")
        bounds = np.flatnonzero(tokens < 0)
        sequences = np.split(tokens, bounds + 1)[:-1] if bounds.size else [tokens]
        return cls([s[s >= 0].tolist() for s in sequences], tokenizer_fingerprint,
                   exclude=json.loads(meta.get("exclude", "[]")), max_order=int(meta.get("max_order", MAX_ORDER)))


def has_corpus(directory: str | Path) -> bool:
    """Whether ``directory`` holds a saved corpus."""
    return (Path(directory) / CORPUS_FILE).is_file()


def _index(tokens: np.ndarray, max_order: int, exclude: frozenset[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per order n: (hash of the n tokens before a position, the token there, its count), sorted
    by hash and then by count, largest first; positions whose n tokens cross a sequence end, or
    whose token is a separator or excluded, are left out."""
    orders = []
    n_tok = tokens.size
    h = np.zeros(n_tok, dtype=np.uint64)
    valid = tokens >= 0
    if exclude:
        valid &= ~np.isin(tokens, np.fromiter(exclude, dtype=np.int64))
    power = np.uint64(1)
    clean = np.ones(n_tok, dtype=bool)  # the n tokens before position i lie inside one sequence
    with np.errstate(over="ignore"):
        for n in range(1, max_order + 1):
            prev = np.full(n_tok, -1, dtype=np.int64)
            if n < n_tok:
                prev[n:] = tokens[:-n]
            clean &= prev >= 0
            h = h + (prev + 1).astype(np.uint64) * power
            power = power * _BASE
            keep = clean & valid
            keys, nexts = h[keep], tokens[keep]
            if keys.size:
                order = np.lexsort((nexts, keys))
                keys, nexts = keys[order], nexts[order]
                start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
                counts = np.diff(np.r_[start, keys.size])
                keys, nexts = keys[start], nexts[start]
                order = np.lexsort((-counts, keys))
                keys, nexts, counts = keys[order], nexts[order], counts[order]
            else:
                counts = np.zeros(0, dtype=np.int64)
            orders.append((keys, nexts.astype(np.int64), counts.astype(np.int64)))
    return orders


class CorpusDrafter(Drafter):
    """Continues the output with the corpus's most frequent continuation of its longest suffix
    the corpus holds, cut where the matcher rejects (q one-hot: deterministic).

    At each position the longest matched order that has a continuation the matcher allows
    decides; the token's confidence is its count's share among the allowed continuations of that
    order and ``UNSEEN_CONTINUATIONS`` more (the K policy calibrates its acceptance per
    confidence bucket). The proposal goes on
    while that share is at least ``CHAIN_CONFIDENCE``. Only the output is matched, not the
    prompt: the corpus holds outputs.
    """

    name = DraftKind.CORPUS

    def __init__(self, corpus: OutputCorpus, matcher: Matcher) -> None:
        super().__init__(matcher)
        self.corpus = corpus
        self._output_start = 0

    def reset(self, prompt_ids: list[int]) -> None:
        """Remember where the output starts."""
        self._output_start = len(prompt_ids)

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Up to ``k`` tokens continuing the output's suffix as the corpus does."""
        output = context[self._output_start :]
        tokens: list[int] = []
        states = [state]
        confidence: list[float | None] = []
        while len(tokens) < k and output and not self.matcher.is_done(states[-1]):
            step = self._next(output, states[-1])
            if step is None:
                break
            token, nxt, conf = step
            if tokens and conf < CHAIN_CONFIDENCE:
                break
            tokens.append(token)
            states.append(nxt)
            confidence.append(conf)
            output = output + [token]
        return Draft(tokens, states, None, self.name, None, confidence or None)

    def _next(self, output: list[int], state: State) -> tuple[int, State, float] | None:
        """The continuation of the longest matched order the matcher allows, its state and
        confidence (its share, an unseen continuation counted)."""
        for _, nexts, counts in self.corpus.continuations(output):
            allowed: list[tuple[int, State, int]] = []
            for token, count in zip(nexts[:MAX_CANDIDATES].tolist(), counts[:MAX_CANDIDATES].tolist()):
                nxt = self.matcher.next_state(state, token)  # None for EOS too
                if nxt is not None:
                    allowed.append((token, nxt, count))
            if allowed:
                token, nxt, count = allowed[0]
                return token, nxt, count / (sum(c for _, _, c in allowed) + UNSEEN_CONTINUATIONS)
        return None


_LOADED: dict[tuple[str, str], OutputCorpus] = {}


def corpus_in(directory: str | Path, tokenizer_fingerprint: str) -> OutputCorpus | None:
    """The corpus saved in ``directory`` (None if it holds none), loaded once per process."""
    if not has_corpus(directory):
        return None
    key = (str(Path(directory).resolve()), tokenizer_fingerprint)
    if key not in _LOADED:
        _LOADED[key] = OutputCorpus.load(directory, tokenizer_fingerprint)
    return _LOADED[key]
