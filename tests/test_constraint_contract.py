"""The backend contract: every backend's matcher behaves the same way on the same language.

Small languages over a hand-built vocabulary, checked by brute force: the language is
enumerated with Python's ``re`` over every byte string up to a length, so the allowed set of
every reachable state, its finality and its forced text are known exactly.

The one documented difference: where the next bytes are forced, llguidance allows only the
tokens of the forced text's canonical tokenization (after ``xaba`` in ``x(ab|ba){1,2}c`` the
text ``bc`` is forced: ``bc`` is allowed, ``b`` alone is not). Its mask is then a non-empty
subset of the brute-force set, and every token in it agrees with the forced bytes. The
decoder is exact either way: draft and verifier use the same matcher, so the target-only law
and the speculative law are both the backend's own token-level law.
"""

from __future__ import annotations

import itertools
import random
import re
import threading

import pytest
import torch

from constrained_spec import CompiledConstraint, ConstraintViolationError, Matcher, compile_constraint
from constrained_spec.constraint import TokenVocabulary

BACKENDS = ["outlines-core", "llguidance"]
EOS = 0
TOKENS = {1: b"a", 2: b"b", 3: b"ab", 4: b"c", 5: b"ba", 6: b"x", 7: b"bc", 8: b"cx", 9: b"xa", 10: b"-"}
VOCAB = TokenVocabulary.build(TOKENS, EOS, size=12)  # ids 11: a padding row, never allowed
PATTERNS = [r"[ab]{1,2}c?", r"x(ab|ba){1,2}c", r"(a|bc)x?[ab]{2}", r"a-[abc]{0,3}"]
ALPHABET = sorted({b for tok in TOKENS.values() for b in tok})
MAX_LEN = 7


def members(pattern: str) -> set[bytes]:
    """Every byte string of the language up to MAX_LEN (the patterns' languages are shorter)."""
    rx = re.compile(pattern.encode())
    out = set()
    for n in range(MAX_LEN + 1):
        for chars in itertools.product(ALPHABET, repeat=n):
            text = bytes(chars)
            if rx.fullmatch(text):
                out.add(text)
    return out


def expected(pattern: str, prefix: bytes) -> tuple[set[int], bool, bytes]:
    """(allowed token ids, final, forced bytes) after ``prefix``, by brute force."""
    langs = members(pattern)
    tails = [m[len(prefix):] for m in langs if m.startswith(prefix)]
    allowed = {t for t, b in TOKENS.items() if any(tail.startswith(b) for tail in tails)}
    final = b"" in tails
    if final:
        allowed.add(EOS)
    forced = b""
    if not final and tails:
        forced = bytes(c[0] for c in itertools.takewhile(lambda cs: len(set(cs)) == 1, zip(*tails)))
    return allowed, final, forced


def reachable(matcher: Matcher, depth: int = 6) -> list[tuple[list[int], int]]:
    """(token path, state) for every state reachable within ``depth`` tokens (breadth first)."""
    out, frontier = [], [([], matcher.initial_state)]
    for _ in range(depth + 1):
        nxt = []
        for path, state in frontier:
            out.append((path, state))
            for t in matcher.allowed_mask(state).nonzero().flatten().tolist():
                if t != EOS:
                    nxt.append((path + [t], matcher.next_state(state, t)))
        frontier = nxt
    return out


def text_of(path: list[int]) -> bytes:
    return b"".join(TOKENS[t] for t in path)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("pattern", PATTERNS)
def test_mask_is_exactly_the_tokens_that_continue_the_language(backend, pattern):
    m = compile_constraint(pattern, VOCAB, kind="regex", backend=backend).matcher()
    seen = canonical_only = 0
    for path, state in reachable(m):
        allowed, final, forced = expected(pattern, text_of(path))
        mask = m.allowed_mask(state)
        assert mask.shape == (VOCAB.size,) and not bool(mask[11])
        got = set(mask.nonzero().flatten().tolist())
        if backend == "llguidance" and forced and got != allowed:
            assert got and got < allowed, (pattern, text_of(path))
            assert all(forced.startswith(TOKENS[t]) or TOKENS[t].startswith(forced) for t in got)
            canonical_only += 1
        else:
            assert got == allowed, (backend, pattern, text_of(path))
        assert m.is_final(state) == final
        assert m.is_done(state) == (allowed == {EOS})
        assert m.forced_bytes(state) == forced, (backend, pattern, text_of(path))
        seen += 1
    assert seen > 10 and canonical_only < seen / 4


@pytest.mark.parametrize("pattern", PATTERNS)
def test_forced_text_is_forced(backend, pattern):
    """Wherever the matcher reports forced bytes, every allowed token agrees with them and EOS is out."""
    m = compile_constraint(pattern, VOCAB, kind="regex", backend=backend).matcher()
    forced_states = 0
    for _, state in reachable(m):
        forced = m.forced_bytes(state)
        if not forced:
            continue
        forced_states += 1
        for t in m.allowed_mask(state).nonzero().flatten().tolist():
            assert t != EOS
            b = TOKENS[t]
            assert b.startswith(forced) or forced.startswith(b)
    assert forced_states or pattern == r"[ab]{1,2}c?"


def random_path(m: Matcher, rng: random.Random, n: int) -> list[int]:
    state, path = m.initial_state, []
    for _ in range(n):
        choices = [t for t in m.allowed_mask(state).nonzero().flatten().tolist() if t != EOS]
        if not choices:
            break
        t = rng.choice(choices)
        path.append(t)
        state = m.next_state(state, t)
    return path


def masks_along(m: Matcher, path: list[int]) -> list[torch.Tensor]:
    """The cursor's mask (written into a fresh buffer) before each token of ``path`` and after the last."""
    out = []
    for t in path:
        out.append(m.fill_mask(torch.ones(VOCAB.size + 3, dtype=torch.bool)).clone())
        m.advance([t])
    out.append(m.fill_mask(torch.ones(VOCAB.size + 3, dtype=torch.bool)).clone())
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_rollback_then_advance_equals_a_fresh_matcher(backend, pattern):
    compiled = compile_constraint(pattern, VOCAB, kind="regex", backend=backend)
    rng = random.Random(1)
    for _ in range(20):
        probe = compiled.matcher()
        a = random_path(probe, rng, 6)
        m = compiled.matcher()
        m.advance(a)
        back = rng.randint(0, len(a))
        assert m.rollback(back) == m.state and m.num_tokens == len(a) - back
        kept = a[: len(a) - back]
        b = random_path(_at(compiled, kept), rng, 4)
        masks = masks_along(m, b)
        fresh = compiled.matcher()
        fresh.advance(kept)
        assert all(torch.equal(x, y) for x, y in zip(masks, masks_along(fresh, b)))
        assert m.is_final(m.state) == fresh.is_final(fresh.state)
        assert all(not bool(x[VOCAB.size:].any()) for x in masks)


def _at(compiled: CompiledConstraint, path: list[int]) -> Matcher:
    """A matcher whose initial lookahead starts after ``path`` (for drawing a continuation)."""
    m = compiled.matcher()
    m.advance(path)
    m.initial_state = m.state  # only for random_path's start
    return m


def test_advance_refuses_a_disallowed_token_and_commits_nothing(backend):
    m = compile_constraint(r"x(ab|ba){1,2}c", VOCAB, kind="regex", backend=backend).matcher()
    m.advance([6])
    with pytest.raises(ConstraintViolationError, match="not allowed"):
        m.advance([3, 4, 4])  # "ab" fine, "c" fine, a second "c" is not
    assert m.num_tokens == 1
    with pytest.raises(ConstraintViolationError):
        m.advance([EOS])  # EOS is never committed
    with pytest.raises(ValueError, match="rollback"):
        m.rollback(2)


def test_matchers_of_one_compiled_constraint_are_independent(backend):
    """Interleaved on one thread and run on two threads at once, two matchers of the same compiled
    constraint give exactly the masks each gives alone."""
    pattern = r"x(ab|ba){1,2}c"
    compiled = compile_constraint(pattern, VOCAB, kind="regex", backend=backend)
    rng = random.Random(2)
    paths = [random_path(compiled.matcher(), rng, 6) for _ in range(16)]
    alone = [masks_along(compiled.matcher(), p) for p in paths]
    # Interleaved: both cursors move in turns.
    m1, m2 = compiled.matcher(), compiled.matcher()
    for i in range(0, len(paths), 2):
        m1.reset()
        m2.reset()
        p1, p2 = paths[i], paths[i + 1]
        for j in range(max(len(p1), len(p2)) + 1):
            for m, p, ref in ((m1, p1, alone[i]), (m2, p2, alone[i + 1])):
                if j < len(ref):
                    assert torch.equal(m.fill_mask(torch.zeros(VOCAB.size, dtype=torch.bool)), ref[j][: VOCAB.size])
                if j < len(p):
                    m.advance([p[j]])
    # Two threads, each with its own matcher, many rounds.
    failures: list[str] = []

    def worker(offset: int) -> None:
        m = compiled.matcher()
        for round_ in range(30):
            k = (offset + round_) % len(paths)
            m.reset()
            got = masks_along(m, paths[k])
            if not all(torch.equal(x, y) for x, y in zip(got, alone[k])):
                failures.append(f"thread {offset} path {k}")

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_compiled_constraint_is_cached_and_shared(backend):
    a = compile_constraint(r"[ab]{1,2}c?", VOCAB, kind="regex", backend=backend)
    b = compile_constraint(r"[ab]{1,2}c?", VOCAB, kind="regex", backend=backend)
    assert a is b and a.backend == backend and a.kind == "regex"
    assert a.matcher() is not a.matcher()
    assert not hasattr(a, "next_state") and not hasattr(a, "allowed_mask")  # nothing decodes from it
