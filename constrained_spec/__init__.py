"""constrained_spec: fast, exact structured output from a speculative decoder with one shared constraint.

The packages follow the data flow, and imports go one way:
constraint (schema -> backend -> CompiledConstraint -> per-request Matcher) -> drafters ->
decoding (verifier, decoder, K policy, options) -> api -> pipelines -> cli.
"""

from .api import TextStream, generate_json, generate_regex, validate_json_output
from .constraint import (
    CompiledConstraint,
    JsonSchema,
    Matcher,
    TokenVocabulary,
    compile_constraint,
    load_schema,
)
from .decoding import (
    K_MAX_PROFILES,
    AdaptiveK,
    DecodeResult,
    DecodeStats,
    FixedK,
    KPolicy,
    SpecOptions,
    SpeculativeDecoder,
    decode,
    detect_profile,
    optimal_k,
)
from .drafters import (
    DRAFTER_NAMES,
    CopyDrafter,
    Draft,
    Drafter,
    GrammarDrafter,
    HybridDrafter,
    LookupDrafter,
    ModelDrafter,
)
from .errors import (
    ConstrainedSpecError,
    ConstraintViolationError,
    DeadEndError,
    InvalidOptionError,
    InvalidPromptError,
    InvalidRegexError,
    InvalidSchemaError,
    InvalidTokenizerError,
    ModelLoadError,
    OutputValidationError,
    RepetitionError,
    TokenizerMismatchError,
    TokenLimitError,
    UnsupportedSchemaFeatureError,
)
from .models import ModelHandle, load_model
from .pipelines.extract import DEFAULT_PROMPT_TEMPLATE, ExtractionResult, extract

__version__ = "0.1.0"

__all__ = sorted([
    "AdaptiveK", "CompiledConstraint", "ConstrainedSpecError", "ConstraintViolationError", "CopyDrafter",
    "DEFAULT_PROMPT_TEMPLATE", "DRAFTER_NAMES", "DeadEndError", "DecodeResult", "DecodeStats", "Draft", "Drafter",
    "ExtractionResult", "FixedK", "GrammarDrafter", "HybridDrafter", "InvalidOptionError", "InvalidPromptError",
    "InvalidRegexError", "InvalidSchemaError", "InvalidTokenizerError", "JsonSchema", "KPolicy", "K_MAX_PROFILES",
    "LookupDrafter", "Matcher", "ModelDrafter", "ModelHandle", "ModelLoadError", "OutputValidationError",
    "RepetitionError", "SpecOptions", "SpeculativeDecoder", "TextStream", "TokenLimitError", "TokenVocabulary",
    "TokenizerMismatchError", "UnsupportedSchemaFeatureError", "compile_constraint", "decode", "detect_profile",
    "extract", "generate_json", "generate_regex", "load_model", "load_schema", "optimal_k", "validate_json_output",
])
