"""Hardware and task profiles: the largest draft length K_max worth verifying in one target pass.

A verify pass over K + 1 tokens costs little more than over one where the accelerator is
under-used (large GPUs, small batches), so K_max grows with the hardware. Structured output
(json) has long forced or copied spans and the highest acceptance, so it gets the largest K.
"""

from __future__ import annotations

import os
from typing import Literal

from ..errors import InvalidOptionError

Task = Literal["text", "code", "json", "chat"]
TASKS: tuple[str, ...] = ("text", "code", "json", "chat")
PROFILE_ENV = "CONSTRAINED_SPEC_PROFILE"

K_MAX_PROFILES: dict[str, dict[str, int]] = {
    "a100-80gb": {"text": 4, "code": 3, "json": 6, "chat": 5},
    "h100-80gb": {"text": 5, "code": 5, "json": 8, "chat": 6},
    "h100-80gb-x8": {"text": 6, "code": 5, "json": 10, "chat": 7},
    "gb200-nvl72": {"text": 8, "code": 7, "json": 12, "chat": 9},
    # Measured on a 2-core CPU with SmolLM2-135M (float32): a forward over 1, 8, 12, 16, 20, 24
    # new tokens takes about 31, 55, 60, 63, 66, 70 ms once the vocabulary rows of single-token
    # states are skipped, so past 8 tokens each extra verified token costs ~0.02 of a forward.
    # Forced and copied json spans are accepted ~90% of the time and often run past 12 tokens
    # (`"INV-2291", "vendor": "`), so json drafts up to 20 pay (bench: fixed K 12 / 16 / 20 gave
    # 2.87x / 2.99x / 3.04x); the adaptive policy trims the unlikely tail of each draft. For free
    # text, where lookup or a draft model lands ~40-50%, the formula peaks at K = 3-4.
    "cpu": {"text": 4, "code": 4, "json": 20, "chat": 4},
}

#: Prior shape and r of the verify-cost curve t(K) = t0 (1 + r g(K)) by (profile, precision)
#: (``kpolicy.CURVE_SHAPES``); the adaptive policy refits both online. Measured on the 2-core CPU
#: with SmolLM2-135M: float32 after a 100-token prompt, t0 58 ms, K = 8 / 16 / 24 at 87 / 101 /
#: 112 ms (concave, r ~0.2); native (the scripted layer loop, Intel Xeon with AMX, 2026-12-04,
#: after a 300-token prompt, the last row's logits, medians of 12, twice): 1 / 2 / 4 / 8 / 12 /
#: 16 / 21 new tokens at 13.6 / 15.3 / 18.4 / 27.8 / 36.6 / 43.7 / 60.7 ms: linear, +0.12 /
#: 0.12 / 0.15 / 0.15 / 0.15 / 0.17 of a pass per token (the int4 kernel and the float64
#: attention pay per row; before the loop was scripted, 84 / 108 / 206 / 266 ms for 1 / 4 / 12 /
#: 21 on a slower machine, r ~0.11: the forward's fixed part shrank). A Hopper GPU
#: (an H200, bfloat16, batch-invariant, CUDA graphs, SmolLM2-135M's shapes after a 300-token
#: context, ``benchmarks/gpu_graphs.py``): 1 / 4 / 12 / 21 new tokens at 5.12 / 5.63 / 5.94 /
#: 5.86 ms, nearly flat (concave, r ~0.04).
VERIFY_COST_PRIORS: dict[tuple[str, str], tuple[str, float]] = {("cpu", "float32"): ("concave", 0.25),
                                                                ("cpu", "native"): ("linear", 0.15),
                                                                ("cpu", "native-exact"): ("linear", 0.15),
                                                                ("h100-80gb", "bfloat16"): ("concave", 0.04)}
DEFAULT_VERIFY_COST = ("concave", 0.25)


def verify_cost_prior(profile: str, precision: str) -> tuple[str, float]:
    """The verify-cost curve's prior shape and r for a profile and a model precision (concave,
    0.25 if unmeasured)."""
    return VERIFY_COST_PRIORS.get((profile, precision), DEFAULT_VERIFY_COST)


def detect_profile() -> str:
    """The profile of this machine: from ``$CONSTRAINED_SPEC_PROFILE``, else the CUDA device name and count."""
    forced = os.environ.get(PROFILE_ENV)
    if forced:
        return validate_profile(forced)
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        name = torch.cuda.get_device_name(0).upper()
        count = torch.cuda.device_count()
    except Exception:  # a broken CUDA install must not stop CPU decoding
        return "cpu"
    return profile_for_device(name, count)


def profile_for_device(name: str, count: int = 1) -> str:
    """Map a device name (e.g. ``"NVIDIA H100 80GB HBM3"``) and count to a profile."""
    name = name.upper()
    if "GB200" in name or "B200" in name:
        return "gb200-nvl72"
    if "H100" in name or "H200" in name or "H800" in name:  # Hopper parts share the H100 figures
        return "h100-80gb-x8" if count >= 8 else "h100-80gb"
    if "A100" in name or "A800" in name:
        return "a100-80gb"
    return "a100-80gb"  # an unknown GPU: the most conservative accelerator profile


def validate_profile(profile: str) -> str:
    """Return ``profile`` if known, else raise ``InvalidOptionError`` listing the known ones."""
    if profile not in K_MAX_PROFILES:
        raise InvalidOptionError(f"Invalid profile: expected one of {sorted(K_MAX_PROFILES)}, got {profile!r}.")
    return profile


def k_max_for(profile: str | None, task: str) -> tuple[str, int]:
    """``(profile, K_max)`` for a task; ``profile=None`` detects it."""
    if task not in TASKS:
        raise InvalidOptionError(f"Invalid task: expected one of {list(TASKS)}, got {task!r}.")
    name = validate_profile(profile) if profile is not None else detect_profile()
    return name, K_MAX_PROFILES[name][task]
