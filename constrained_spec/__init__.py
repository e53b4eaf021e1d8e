"""constrained_spec: fast, exact structured output from a speculative decoder with one shared constraint.

Data flow: constraint -> drafters -> verifier -> decoder -> api -> cli.
"""

from .api import DRAFTERS, SpecOptions, TextStream, generate_json, generate_regex, validate_json_output
from .constraint import Constraint, TokenVocabulary, compile_regex, load_schema, schema_to_regex
from .decoder import DecodeResult, DecodeStats, SpeculativeDecoder, decode
from .kpolicy import AdaptiveK, FixedK, optimal_k
from .profiles import K_MAX_PROFILES, detect_profile
from .drafters import Draft, Drafter, LookupDrafter, ModelDrafter
from .errors import (
    ConstrainedSpecError,
    InvalidPromptError,
    InvalidRegexError,
    InvalidSchemaError,
    ModelLoadError,
    OutputValidationError,
    TokenizerMismatchError,
    TokenLimitError,
    UnsupportedSchemaFeatureError,
)
from .models import ModelHandle, load_model
from .extract import DEFAULT_PROMPT_TEMPLATE, ExtractionResult, extract  # noqa: E402  (rebinds the name to the function)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS", "AdaptiveK", "K_MAX_PROFILES", "detect_profile", "Constraint", "ConstrainedSpecError", "DecodeResult", "DecodeStats", "Draft", "Drafter",
    "FixedK", "InvalidPromptError", "InvalidRegexError", "InvalidSchemaError", "LookupDrafter", "ModelDrafter",
    "ModelHandle", "ModelLoadError", "OutputValidationError", "SpecOptions", "TextStream", "SpeculativeDecoder",
    "TokenLimitError", "TokenVocabulary", "TokenizerMismatchError", "UnsupportedSchemaFeatureError",
    "compile_regex", "extract", "ExtractionResult", "DEFAULT_PROMPT_TEMPLATE", "optimal_k", "decode", "generate_json", "generate_regex", "load_model", "load_schema",
    "schema_to_regex", "validate_json_output",
]
