"""The constraint layer, one way through: schema -> backend -> ``CompiledConstraint`` -> ``Matcher``.

- ``schema``: load and normalize a JSON schema; the one walker over sub-schemas.
- ``layout``: where JSON whitespace may go.
- ``vocabulary``: the exact bytes of every token.
- ``outlines_core`` / ``llguidance``: the two backends, one module each; ``outlines_core_schema``:
  a schema as outlines-core's regex (refused by keyword and path where that regex would be wrong).
- ``limits``: what a schema or pattern may cost, checked before anything compiles it.
- ``cache``: an LRU bounded by bytes (compiled constraints differ in size by orders of magnitude).
- ``compile``: ``compile_constraint``, the cached front door every caller uses, and
  ``compile_checked`` (a request's constraint with the check of its output), in the same cache.
- ``base``: the interface: an immutable, shared ``CompiledConstraint`` and a per-request
  ``Matcher`` (``compiled.matcher()``), which is the only thing that decodes.
- ``masking``: a mask applied to logits, and the masked law.
- ``ecma_regex``: a schema's patterns as ECMA-262 reads them, for every engine that runs them.
- ``keywords``: unknown (most likely misspelled) schema keywords, reported as warnings.
"""

from .base import CompiledConstraint, Matcher, State
from .compile import (AUTO_BACKEND, BACKENDS, Backend, CheckedConstraint, Kind, cache_bytes, check_constraint,
                      clear_cache, compile_checked, compile_constraint, resolve_backend, set_cache_bytes)
from .limits import DEFAULT_LIMITS, ConstraintLimits
from .keywords import UnknownSchemaKeywordWarning
from .layout import DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS
from .llguidance import GuidanceCompiled, GuidanceMatcher
from .masking import apply_mask, masked_probs
from .outlines_core import OutlinesCompiled, OutlinesMatcher
from .outlines_core_schema import schema_to_regex
from .schema import JsonSchema, iter_subschemas, keyword_path, load_schema, map_subschemas
from .vocabulary import TokenVocabulary, vocabulary_of

__all__ = [
    "AUTO_BACKEND", "BACKENDS", "Backend", "CheckedConstraint", "CompiledConstraint", "ConstraintLimits", "DEFAULT_LIMITS", "DEFAULT_JSON_WHITESPACE", "GuidanceCompiled",
    "GuidanceMatcher", "JSON_LAYOUTS", "JsonSchema", "Kind", "Matcher", "OutlinesCompiled", "OutlinesMatcher",
    "State", "TokenVocabulary", "UnknownSchemaKeywordWarning", "apply_mask", "cache_bytes", "check_constraint", "clear_cache", "compile_checked", "compile_constraint", "iter_subschemas",
    "keyword_path", "load_schema", "map_subschemas", "masked_probs", "resolve_backend", "schema_to_regex", "set_cache_bytes",
    "vocabulary_of",
]
