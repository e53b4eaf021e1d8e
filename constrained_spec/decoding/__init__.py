"""Decoding: the verifier, the speculative decoder, the batch engine and its row cache, their
figures, the K policy and hardware profiles, and the options object."""

from .decoder import SpeculativeDecoder, StepPlan, decode
from .engine import BatchEngine, Request
from .prefix import PrefixCache, prefix_cache_for
from .rowcache import RowCache
from .kpolicy import AdaptiveK, FixedK, KPolicy, optimal_k
from .options import DrafterName, SpecOptions
from .profiles import K_MAX_PROFILES, detect_profile
from .stats import DecodeResult, DecodeStats
from .verifier import Verdict, verify_greedy, verify_sampled

__all__ = [
    "AdaptiveK", "BatchEngine", "DecodeResult", "DecodeStats", "DrafterName", "FixedK", "KPolicy", "K_MAX_PROFILES",
    "PrefixCache", "Request", "RowCache", "SpecOptions", "SpeculativeDecoder", "StepPlan", "Verdict", "decode", "detect_profile",
    "optimal_k", "prefix_cache_for", "verify_greedy", "verify_sampled",
]
