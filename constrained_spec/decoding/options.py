"""``SpecOptions``: every decoding and constraint option of a request, validated in one place.

``generate_json``, ``generate_regex``, ``extract`` and the command line all build one (from
keyword arguments, the convenient form) or accept one (``options=``), so a typo such as
``temprature=0.7`` is refused the same way everywhere, naming the option and the closest
known name.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Literal

from ..constraint import BACKENDS, DEFAULT_JSON_WHITESPACE, JSON_LAYOUTS
from ..drafters import DRAFTER_NAMES
from ..drafters.base import DraftKind
from ..drafters.order import COSTLY_KINDS
from ..errors import InvalidOptionError
from .estimates import RecentEstimates
from .kpolicy import AdaptiveK, FixedK, KPolicy
from .profiles import K_MAX_PROFILES, k_max_for, verify_cost_prior

DrafterName = Literal["none", "model", "head", "lookup", "grammar", "hybrid", "auto"]


@dataclass(frozen=True)
class SpecOptions:
    """Decoding and constraint options of one request (or of every request of a run).

    Attributes:
        drafter: "none" (target-only), "model" (a draft LM; needs ``draft=``), "head" (a
            learned draft head over the target's features; the shipped one or ``draft=DIR``),
            "lookup" (prompt lookup), "grammar" (text the constraint forces), "hybrid" (forced
            text, then a copy from the prompt, then lookup, then the corpus of the target's own
            outputs the package ships for it, then the head and the draft model when
            ``draft=`` names them), "auto" (= hybrid).
        k_max: the most tokens verified per step; None: from the hardware / task profile.
        adaptive: choose K each step from online acceptance and cost estimates (else K = k_max).
        profile: hardware profile for K_max ("cpu", "a100-80gb", "h100-80gb", "h100-80gb-x8",
            "gb200-nvl72"); None: ``$CONSTRAINED_SPEC_PROFILE`` or detected from the device.
        temperature: 0 for greedy; above 0, exact sampling from the masked target law.
        seed: makes sampling reproducible: the same seed, prompt and options give the same output.
        max_new_tokens: the generation limit; reaching it first raises ``TokenLimitError``.
        backend: the constraint backend: "auto" (llguidance), "llguidance" or "outlines-core".
        lenient: llguidance only: relax keywords it cannot enforce instead of refusing them (named
            in ``stats.relaxed``; the output is still validated against the full schema).
        whitespace: the JSON layout: "canonical" (``json.dumps`` style, the default), "flexible",
            "compact", "indented", or a whitespace regex (``constraint.layout``).
        closed: objects that declare ``properties`` and say nothing of others take their
            declared keys only, as xgrammar's strict mode, llama.cpp's converter and OpenAI's
            strict schemas read them (``constraint.schema.close_objects``); every output still
            validates against the schema as written. False: the standard's reading, where a
            model may add keys of its own (docs/json-output.md measures what they cost).
        prefix_cache: reuse the keys and values of a shared prompt prefix that earlier requests
            on the same model computed (``decoding.prefix``; outputs are identical either way).
        max_repeats: stop a request whose output ends in this many copies of one token cycle
            with the constraint in the same state after each (a loop that would run to the
            token limit) with ``RepetitionError``; 0 turns the guard off.

    Raises ``InvalidOptionError`` (a ``ValueError``) naming the option when a value is bad.

    Policies from production practice and where they stand here: speculation is *not* switched
    off in batches (the batch engine speculates per row; forced and copied drafts cost a few rows
    of a forward that runs anyway) nor for short outputs, because it pays even there (see
    docs/benchmarks.md); the adaptive policy drops to K = 0 on its own when drafts stop landing.
    """

    drafter: DrafterName = "auto"
    k_max: int | None = None
    adaptive: bool = True
    profile: str | None = None
    temperature: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 512
    backend: str = "auto"
    lenient: bool = False
    whitespace: str = DEFAULT_JSON_WHITESPACE
    closed: bool = True
    prefix_cache: bool = True
    max_repeats: int = 8

    def __new__(cls, *args: Any, **values: Any) -> "SpecOptions":
        # The generated __init__ would answer a misspelled name with a bare TypeError; answer it
        # as keyword arguments of generate_json are answered, naming the closest option.
        _check_names(values)
        if args:
            raise InvalidOptionError(f"Invalid options: SpecOptions takes keyword arguments only, got {len(args)} "
                                     "positional; write e.g. SpecOptions(temperature=0.7).")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTER_NAMES:
            raise InvalidOptionError(
                f"Invalid drafter: expected one of {', '.join(map(repr, DRAFTER_NAMES))}, got {self.drafter!r}.")
        if self.k_max is not None and (not _is_int(self.k_max) or self.k_max < 0):
            raise InvalidOptionError(f"Invalid k_max: expected an integer >= 0 or None, got {self.k_max!r}.")
        if not isinstance(self.adaptive, bool):
            raise InvalidOptionError(f"Invalid adaptive: expected True or False, got {self.adaptive!r}.")
        if not _is_int(self.max_repeats) or self.max_repeats < 0:
            raise InvalidOptionError(f"Invalid max_repeats: expected an integer >= 0 (0: off), got {self.max_repeats!r}.")
        if not isinstance(self.prefix_cache, bool):
            raise InvalidOptionError(f"Invalid prefix_cache: expected True or False, got {self.prefix_cache!r}.")
        if self.profile is not None and self.profile not in K_MAX_PROFILES:
            raise InvalidOptionError(f"Invalid profile: expected one of {sorted(K_MAX_PROFILES)}, got {self.profile!r}.")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise InvalidOptionError(f"Invalid temperature: expected a finite number >= 0, got {self.temperature!r}.")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidOptionError(f"Invalid seed: expected an integer or None, got {self.seed!r}.")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidOptionError(f"Invalid max_new_tokens: expected an integer >= 1, got {self.max_new_tokens!r}.")
        if self.backend not in BACKENDS:
            raise InvalidOptionError(f"Invalid backend: expected one of {list(BACKENDS)}, got {self.backend!r}.")
        if not isinstance(self.lenient, bool):
            raise InvalidOptionError(f"Invalid lenient: expected True or False, got {self.lenient!r}.")
        if not isinstance(self.closed, bool):
            raise InvalidOptionError(f"Invalid closed: expected True or False, got {self.closed!r}.")
        if not isinstance(self.whitespace, str):
            raise InvalidOptionError(
                f"Invalid whitespace: expected one of {sorted(JSON_LAYOUTS)} or a regex, got {self.whitespace!r}.")
        object.__setattr__(self, "temperature", float(self.temperature))

    @classmethod
    def build(cls, options: "SpecOptions | None" = None, **overrides: Any) -> "SpecOptions":
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name raises
        ``InvalidOptionError`` naming it and the closest known option."""
        if options is not None and not isinstance(options, SpecOptions):
            raise InvalidOptionError(f"Invalid options: expected a SpecOptions, got {type(options).__name__}.")
        _check_names(overrides)
        return dataclasses.replace(options or cls(), **overrides)

    @property
    def drafter_kind(self) -> str:
        """The drafter actually built ("auto" is "hybrid")."""
        return "hybrid" if self.drafter == "auto" else self.drafter

    def resolve_k_max(self, task: str) -> tuple[str, int]:
        """``(profile, K_max)`` for a task ("json", "text", ...): ``k_max`` if given, else the
        profile's (0 when there is no drafter)."""
        profile, profile_k = k_max_for(self.profile, task)
        if self.drafter == "none":
            return profile, 0
        return profile, self.k_max if self.k_max is not None else profile_k

    def k_policy(self, k_max: int, *, profile: str = "cpu", precision: str = "float32", model: str = "",
                 drafters: str = "", estimates: RecentEstimates | None = None) -> KPolicy:
        """A fresh K policy for one request, capped at ``k_max`` (from ``resolve_k_max``); its
        cost prior is the profile's for the model's ``precision``, and it learns from earlier
        requests in ``estimates`` (the model handle's: ``recent_estimates(handle)``; None: from
        none) on the same ``model`` and precision (its acceptance estimates, from those with
        the same ``drafters`` too: ``Drafter.signature``)."""
        if self.drafter == "none" or not self.adaptive:
            return FixedK(k_max)
        # A seeded sampled request must not depend on timings or on earlier requests.
        deterministic = self.seed is not None and self.temperature > 0
        shape, r = verify_cost_prior(profile, precision)
        costly = self.drafter in COSTLY_KINDS
        return AdaptiveK(k_max, costly_draft=costly, costly_kind=DraftKind(self.drafter) if costly else DraftKind.MODEL,
                         deterministic=deterministic,
                         cost_prior=r, cost_shape=shape, cost_key=f"{model}:{precision}",
                         history_key=f"{model}:{precision}:{drafters}", recent=estimates)


def _check_names(values: dict[str, Any]) -> None:
    """``InvalidOptionError`` naming the first unknown option in ``values`` and the closest known one."""
    names = [f.name for f in dataclasses.fields(SpecOptions)]
    for name in values:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise InvalidOptionError(f"Invalid option {name!r}: expected one of {', '.join(names)}.{hint}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
