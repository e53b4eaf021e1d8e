"""Building the drafter a request asks for by name, wired to the request's matcher."""

from __future__ import annotations

from typing import Any

from ..constraint import Matcher, vocabulary_of
from ..errors import InvalidOptionError
from .base import Drafter
from .copy import CopyDrafter
from .corpus import CorpusDrafter
from .grammar import GrammarDrafter
from .head import HeadDrafter
from .hybrid import HybridDrafter
from .lookup import LookupDrafter, structural_tokens
from .model import ModelDrafter

#: Drafter names a request may ask for; "auto" means "hybrid".
DRAFTER_NAMES: tuple[str, ...] = ("none", "model", "head", "lookup", "grammar", "hybrid", "auto")


def build_drafter(name: str, matcher: Matcher, tokenizer: Any, *, draft_model: Any = None, head: Any = None,
                  corpus: Any = None, temperature: float = 0.0, source_text: str | None = None) -> Drafter | None:
    """The drafter called ``name`` for one request (None for "none").

    Args:
        name: one of ``DRAFTER_NAMES`` ("auto" is "hybrid": forced text, then a copy from the
            prompt, then lookup, then the ``corpus`` of the target's outputs, the learned
            ``head`` and ``draft_model`` when given).
        matcher: the request's matcher; every part walks it.
        tokenizer: the target's Hugging Face tokenizer (to tokenize forced and copied text).
        draft_model: a causal LM with the same tokenizer, for "model" (required) and "hybrid".
        head: a ``DraftHead`` for the target, for "head" (required) and "hybrid" (None or
            False: none).
        corpus: an ``OutputCorpus`` of the target's outputs, for "hybrid" (None: none).
        temperature: the draft model's sampling temperature (0: its argmax, q one-hot).
        source_text: the text a copy drafter copies from (the user's prompt, not the chat template).
    """
    if name == "auto":
        name = "hybrid"
    if name not in DRAFTER_NAMES:
        raise InvalidOptionError(f"Invalid drafter: expected one of {', '.join(map(repr, DRAFTER_NAMES))}, got {name!r}.")
    if name == "none":
        return None
    model = ModelDrafter(draft_model, matcher, temperature=temperature) if draft_model is not None else None
    if name == "model":
        if model is None:
            raise InvalidOptionError("Invalid drafter: 'model' needs a draft model; pass draft=... or use drafter='hybrid'.")
        return model
    head_drafter = HeadDrafter(head, matcher, temperature=temperature) if head not in (None, False) else None
    if name == "head":
        if head_drafter is None:
            raise InvalidOptionError("Invalid drafter: 'head' needs a draft head; pass draft=DIR (from "
                                     "constrained-spec train-drafter) or use drafter='auto'.")
        return head_drafter
    if name == "lookup":
        return LookupDrafter(matcher)
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    grammar = GrammarDrafter(matcher, tokenize)
    if name == "grammar":
        return grammar
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    # Free drafts first (forced text, a copy from the prompt, lookup, the target's past
    # outputs: ranked per position by their acceptance), because they cost nothing and
    # lookup's spans are usually right where they exist (see docs/drafters.md); then the head,
    # which drafts each token only where its acceptance at its confidence pays for its cost;
    # a draft model last.
    parts: list[Drafter | None] = [
        grammar,
        CopyDrafter(matcher, tokenize, decode, source=source_text),
        LookupDrafter(matcher, ignore=structural_tokens(vocabulary_of(tokenizer))),
        CorpusDrafter(corpus, matcher) if corpus is not None else None,
        head_drafter,
        model,
    ]
    return HybridDrafter([p for p in parts if p is not None])
