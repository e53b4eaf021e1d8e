"""Decoding: the verifier, the speculative decoder, its figures, the K policy and hardware
profiles, the options object, and target-only batched decoding."""

from .batched import SPECULATION_MAX_BATCH, decode_batch
from .decoder import SpeculativeDecoder, decode
from .kpolicy import AdaptiveK, FixedK, KPolicy, optimal_k
from .options import DrafterName, SpecOptions
from .profiles import K_MAX_PROFILES, detect_profile
from .stats import DecodeResult, DecodeStats
from .verifier import Verdict, verify_greedy, verify_sampled

__all__ = [
    "AdaptiveK", "DecodeResult", "DecodeStats", "DrafterName", "FixedK", "KPolicy", "K_MAX_PROFILES",
    "SPECULATION_MAX_BATCH", "SpecOptions", "SpeculativeDecoder", "Verdict", "decode", "decode_batch",
    "detect_profile", "optimal_k", "verify_greedy", "verify_sampled",
]
