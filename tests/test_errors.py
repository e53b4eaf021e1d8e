"""Bad input gets a clear error before any model forward; nothing is left half-done."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from constrained_spec import (
    InvalidOptionError, InvalidPromptError, InvalidRegexError, InvalidSchemaError, ModelHandle, TokenizerMismatchError,
    TokenLimitError, UnsupportedSchemaFeatureError, generate_json, generate_regex,
)
from tests.conftest import tiny_llama

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


class CountingHandle:
    """A tiny target over the real tokenizer that counts forward passes."""

    def __init__(self, tokenizer, context=64):
        self.model = tiny_llama(49152, seed=1, dtype=__import__("torch").float32, context=context)
        self.calls = 0
        self.model.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))
        self.handle = ModelHandle(self.model, tokenizer, "tiny")


@pytest.fixture
def tiny(smol_tokenizer):
    return CountingHandle(smol_tokenizer)


def other_tokenizer():
    vocab = {"[EOS]": 0, "a": 1, "b": 2, "{": 3, "}": 4, '"': 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[EOS]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]")


@pytest.mark.parametrize("schema, match", [
    ({"type": "nonsense"}, "Invalid schema at /type"),
    ('{"type": "object", ', "does not parse"),
    ("no/such/schema.json", "no such file"),
    ([1, 2], "expected a JSON object"),
])
def test_invalid_schema(tiny, schema, match):
    with pytest.raises(InvalidSchemaError, match=match):
        generate_json(tiny.handle, schema, "hello")
    assert tiny.calls == 0


@pytest.mark.parametrize("backend, schema, keyword, path", [
    ("outlines-core", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
     "/properties/tags"),
    ("outlines-core", {"type": "integer", "minimum": 3}, "minimum", "/"),
    ("outlines-core", {"anyOf": [{"type": "string", "format": "hostname"}]}, "format", "/anyOf/0"),
    ("outlines-core", {"$defs": {"x": {"not": {"type": "null"}}}, "$ref": "#/$defs/x"}, "not", "/$defs/x"),
    ("llguidance", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "uniqueItems",
     "/properties/tags"),
    ("llguidance", {"$defs": {"x": {"not": {"type": "null"}}}, "$ref": "#/$defs/x"}, "not", "/$defs/x"),
])
def test_unsupported_feature_is_named(tiny, backend, schema, keyword, path):
    with pytest.raises(UnsupportedSchemaFeatureError) as err:
        generate_json(tiny.handle, schema, "hello", backend=backend)
    assert err.value.keyword == keyword and err.value.path == path
    assert repr(keyword) in str(err.value) and path in str(err.value)
    assert tiny.calls == 0


@pytest.mark.parametrize("pattern, match", [("a(", "does not compile"), (r"[^\s\S]", "matches nothing"), ("", "non-empty")])
def test_bad_regex(tiny, pattern, match):
    with pytest.raises(InvalidRegexError, match=match):
        generate_regex(tiny.handle, pattern, "hello")
    assert tiny.calls == 0


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(tiny, prompt):
    with pytest.raises(InvalidPromptError, match="non-empty"):
        generate_json(tiny.handle, SCHEMA, prompt)
    assert tiny.calls == 0


def test_prompt_longer_than_context(tiny):
    with pytest.raises(InvalidPromptError, match="context of 64 tokens"):
        generate_json(tiny.handle, SCHEMA, "word " * 200)
    assert tiny.calls == 0


def test_mismatched_draft_tokenizer(tiny):
    draft = ModelHandle(tiny_llama(6, seed=2), other_tokenizer(), "other")
    with pytest.raises(TokenizerMismatchError, match="tokenizer differs"):
        generate_json(tiny.handle, SCHEMA, "hello", draft=draft)
    assert tiny.calls == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"drafter": "magic"}, "Invalid drafter"),
    ({"drafter": "model"}, "needs a draft model"),
    ({"k_max": -1}, "Invalid k_max"),
    ({"max_new_tokens": 0}, "Invalid max_new_tokens"),
    ({"temperature": -0.5}, "Invalid temperature"),
])
def test_bad_options(tiny, kwargs, match):
    assert issubclass(InvalidOptionError, ValueError)  # callers catching ValueError still catch it
    with pytest.raises(InvalidOptionError, match=match):
        generate_json(tiny.handle, SCHEMA, "hello", **kwargs)
    assert tiny.calls == 0


def test_token_limit_keeps_partial_text(tiny):
    with pytest.raises(TokenLimitError) as err:
        generate_json(tiny.handle, SCHEMA, "hello", max_new_tokens=3)
    assert err.value.partial_text.startswith("{")
    assert err.value.max_new_tokens == 3
    assert "max_new_tokens=3" in str(err.value)


def test_a_character_no_token_can_spell_is_refused_or_a_dead_end(smol):
    """llguidance's mask allows a byte token for U+40000 that its matcher then refuses (SmolLM2
    has no token for the byte 0xF1): at the start that is a pattern matching nothing; later a
    DeadEndError with the same partial text for every drafter, never a ConstraintViolationError."""
    from constrained_spec import DeadEndError, InvalidRegexError, generate_regex

    with pytest.raises(InvalidRegexError, match="matches nothing"):
        generate_regex(smol, "\U00040000", "x")
    partial = set()
    for drafter in ("none", "lookup", "auto"):
        with pytest.raises(DeadEndError) as info:
            generate_regex(smol, "ab\U00040000", "ab ab ab", drafter=drafter, max_new_tokens=8)
        partial.add(info.value.partial_text)
    assert partial == {"ab"}
