"""constrained_spec: fast, exact structured output from a speculative decoder with one shared constraint.

The packages follow the data flow, and imports go one way:
constraint (schema -> backend -> CompiledConstraint -> per-request Matcher) -> drafters ->
decoding (verifier, decoder, K policy, options) -> api -> pipelines -> cli.

Importing the package is light (no torch): the public names below load their modules on first
use, so ``constrained-spec --help`` and argument errors answer at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ConstrainedSpecError,
    ConstraintViolationError,
    DeadEndError,
    InvalidOptionError,
    InvalidPromptError,
    InvalidRegexError,
    InvalidSchemaError,
    InvalidTokenizerError,
    KVMemoryError,
    ModelLoadError,
    OutputValidationError,
    RepetitionError,
    TokenLimitError,
    TokenizerMismatchError,
    UnsupportedSchemaFeatureError,
)

#: Public name -> the module that defines it (imported on first access).
_LAZY: dict[str, str] = {
    **dict.fromkeys((
        "TextStream", "generate_json", "generate_regex", "validate_json_output",
    ), ".api"),
    **dict.fromkeys((
        "CompiledConstraint", "JsonSchema", "Matcher", "TokenVocabulary", "compile_constraint",
        "load_schema",
    ), ".constraint"),
    **dict.fromkeys((
        "AdaptiveK", "DecodeResult", "DecodeStats", "FixedK", "KPolicy", "K_MAX_PROFILES", "SpecOptions",
        "SpeculativeDecoder", "decode", "detect_profile", "optimal_k",
    ), ".decoding"),
    **dict.fromkeys((
        "CopyDrafter", "DRAFTER_NAMES", "Draft", "Drafter", "GrammarDrafter", "HybridDrafter",
        "LookupDrafter", "ModelDrafter",
    ), ".drafters"),
    **dict.fromkeys((
        "ModelHandle", "load_model",
    ), ".models"),
    **dict.fromkeys((
        "DEFAULT_PROMPT_TEMPLATE", "ExtractionResult", "extract",
    ), ".pipelines.extract"),
}

__version__ = "0.1.0"

__all__ = sorted([
    "AdaptiveK", "CompiledConstraint", "ConstrainedSpecError", "ConstraintViolationError", "CopyDrafter",
    "DEFAULT_PROMPT_TEMPLATE", "DRAFTER_NAMES", "DeadEndError", "DecodeResult", "DecodeStats", "Draft", "Drafter",
    "ExtractionResult", "FixedK", "GrammarDrafter", "HybridDrafter", "InvalidOptionError", "InvalidPromptError",
    "InvalidRegexError", "InvalidSchemaError", "InvalidTokenizerError", "JsonSchema", "KPolicy", "KVMemoryError", "K_MAX_PROFILES",
    "LookupDrafter", "Matcher", "ModelDrafter", "ModelHandle", "ModelLoadError", "OutputValidationError",
    "RepetitionError", "SpecOptions", "SpeculativeDecoder", "TextStream", "TokenLimitError", "TokenVocabulary",
    "TokenizerMismatchError", "UnsupportedSchemaFeatureError", "compile_constraint", "decode", "detect_profile",
    "extract", "generate_json", "generate_regex", "load_model", "load_schema", "optimal_k", "validate_json_output",
])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'constrained_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # the eager imports, for type checkers and IDEs
    from .api import TextStream, generate_json, generate_regex, validate_json_output
    from .constraint import CompiledConstraint, JsonSchema, Matcher, TokenVocabulary, compile_constraint, load_schema
    from .decoding import (
        K_MAX_PROFILES, AdaptiveK, DecodeResult, DecodeStats, FixedK, KPolicy, SpecOptions, SpeculativeDecoder, decode,
        detect_profile, optimal_k,
    )
    from .drafters import (
        DRAFTER_NAMES, CopyDrafter, Draft, Drafter, GrammarDrafter, HybridDrafter, LookupDrafter, ModelDrafter,
    )
    from .models import ModelHandle, load_model
    from .pipelines.extract import DEFAULT_PROMPT_TEMPLATE, ExtractionResult, extract
