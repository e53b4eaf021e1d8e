"""Decoding, one request at a time: the verifier, the speculative decoder, the prompt-block
prefix cache (shared with the batch engine in ``constrained_spec.batching``), the figures, the
K policy and hardware profiles, and the options object."""

from .decoder import SpeculativeDecoder, StepPlan, decode
from .estimates import RecentEstimates, recent_estimates
from .prefix import PrefixCache, prefix_cache_for
from .kpolicy import AdaptiveK, FixedK, KPolicy, optimal_k
from .options import DrafterName, SpecOptions
from .profiles import K_MAX_PROFILES, detect_profile
from .stats import DecodeResult, DecodeStats
from .verifier import Verdict, verify_greedy, verify_sampled

__all__ = [
    "AdaptiveK", "DecodeResult", "DecodeStats", "DrafterName", "FixedK", "KPolicy", "K_MAX_PROFILES",
    "PrefixCache", "RecentEstimates", "SpecOptions", "SpeculativeDecoder", "StepPlan", "Verdict", "decode", "detect_profile",
    "optimal_k", "prefix_cache_for", "recent_estimates", "verify_greedy", "verify_sampled",
]
