"""Hardware and task profiles: the largest draft length K_max worth verifying in one target pass.

A verify pass over K + 1 tokens costs little more than over one where the accelerator is
under-used (large GPUs, small batches), so K_max grows with the hardware. Structured output
(json) has long forced or copied spans and the highest acceptance, so it gets the largest K.
"""

from __future__ import annotations

from typing import Literal

from .. import config
from ..errors import InvalidOptionError

Task = Literal["text", "code", "json", "chat"]
TASKS: tuple[str, ...] = ("text", "code", "json", "chat")
#: The variable that names the profile (``RuntimeConfig.profile``).
PROFILE_ENV = config.variable("profile")

K_MAX_PROFILES: dict[str, dict[str, int]] = {
    "a100-80gb": {"text": 4, "code": 3, "json": 6, "chat": 5},
    "h100-80gb": {"text": 5, "code": 5, "json": 8, "chat": 6},
    "h100-80gb-x8": {"text": 6, "code": 5, "json": 10, "chat": 7},
    "gb200-nvl72": {"text": 8, "code": 7, "json": 12, "chat": 9},
    # On a CPU, past 8 tokens each extra verified token costs a small share of a forward, and
    # forced and copied json spans are long and mostly accepted, so json drafts up to 20 pay;
    # for free text the formula peaks at K = 3-4 (docs/changelog.md has the fixed-K runs).
    "cpu": {"text": 4, "code": 4, "json": 20, "chat": 4},
}
assert tuple(sorted(K_MAX_PROFILES)) == config.HARDWARE_PROFILES, "config.HARDWARE_PROFILES names every profile"

#: Prior shape and r of the verify-cost curve t(K) = t0 (1 + r g(K)) by (profile, precision)
#: (``kpolicy.CURVE_SHAPES``); the adaptive policy refits both online. Each prior is the curve
#: measured for that pair: float32 on the CPU concave, native precision linear (each verified row
#: pays its share of the int4 kernel and attention), a Hopper GPU with CUDA graphs nearly flat
#: (see docs/performance.md).
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
    forced = config.read("profile")  # checked: an unknown name raises InvalidOptionError
    if forced:
        return forced
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
