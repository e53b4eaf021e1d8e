"""What a generation reports: its tokens, whether the constraint was satisfied, and its figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..drafters.base import DraftKind


@dataclass
class DecodeStats:
    """Figures of one generation. ``dataclasses.asdict`` gives a JSON-ready dict.

    Times are wall-clock seconds, per phase of a step: ``draft_seconds`` (proposing, the
    drafter's own matcher walks included), ``constraint_seconds`` (the masks along the draft
    path, applying them to the logits, committing the emitted tokens to the matcher),
    ``target_seconds`` (the target forward), ``verify_seconds`` (accept / reject and sampling).
    The rest of a step (KV-cache crop, drafter and K-policy updates) is in ``step_seconds`` only.
    """

    drafter: str = "none"
    backend: str = ""
    #: Schema keywords the backend relaxed (llguidance lenient mode); empty when all are enforced.
    relaxed: list[str] = field(default_factory=list)
    profile: str = ""
    k_policy: str = ""
    k_max: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    ks: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    #: Seconds since the request started, and output length, at the end of each step.
    step_ends: list[float] = field(default_factory=list)
    tokens_after_step: list[int] = field(default_factory=list)
    #: Per step: constraint seconds and the step's total seconds (for p50 / p99 and the share).
    constraint_step_seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    #: The prompt's passes: its shared prefix's (or its copy from the prefix cache) and the
    #: first step's pass, which carries the rest and verifies the first draft.
    prefill_seconds: float = 0.0
    #: Prompt tokens whose keys and values came from the prefix cache.
    prefix_cached_tokens: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    constraint_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    #: Output tokens over the whole request (prompt pass included).
    tokens_per_second: float = 0.0
    forwards_per_token: float = 0.0
    finished: bool = False
    #: Per drafter kind: drafted, accepted, and supplied (output tokens it provided; the
    #: target supplies every recovered or bonus token, under the kind "target").
    per_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per drafter kind: [examined, accepted] at each position of a run of that kind's tokens
    #: (0: a run's first token; examined: every token before it in the draft was accepted),
    #: for the acceptance per draft position.
    per_position: dict[str, list[list[int]]] = field(default_factory=dict)
    #: Per drafter kind that times itself (a learned head): seconds spent drafting.
    draft_seconds_by_kind: dict[str, float] = field(default_factory=dict)

    def count_kind(self, kind: str, drafted: int = 0, accepted: int = 0) -> None:
        """Add to one kind's counters (accepted tokens are also supplied tokens)."""
        row = self.per_kind.setdefault(kind, {"drafted": 0, "accepted": 0, "supplied": 0})
        row["drafted"] += drafted
        row["accepted"] += accepted
        row["supplied"] += accepted

    def count_position(self, kind: str, position: int, accepted: bool) -> None:
        """Count one drafted token at ``position`` of a run of ``kind``."""
        rows = self.per_position.setdefault(kind, [])
        while len(rows) <= position:
            rows.append([0, 0])
        rows[position][0] += 1
        rows[position][1] += int(accepted)

    def record_step(self, kinds: Sequence[str], accepted: int, target_token: bool, output_tokens: int, *,
                    draft_seconds: float, target_seconds: float, verify_seconds: float,
                    constraint_seconds: float, step_seconds: float, since_start: float) -> None:
        """Count one step: its drafted tokens (of ``kinds``), how many were ``accepted``, whether
        the target supplied a recovered or bonus token (not EOS), the output length after it,
        and the seconds of each phase (``since_start``: since the request started)."""
        self.target_forwards += 1
        self.drafted += len(kinds)
        self.accepted += accepted
        self.ks.append(len(kinds))
        self.accepted_per_step.append(accepted)
        run = 0
        for i, kind in enumerate(kinds):
            self.count_kind(kind, drafted=1, accepted=int(i < accepted))
            run = run + 1 if i and kinds[i - 1] == kind else 0
            if i <= accepted:  # examined: positions after the first rejection were never judged
                self.count_position(kind, run, i < accepted)
        if target_token:
            self.count_kind(DraftKind.TARGET, accepted=1)
        self.step_ends.append(since_start)
        self.tokens_after_step.append(output_tokens)
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds
        self.verify_seconds += verify_seconds
        self.constraint_seconds += constraint_seconds
        self.constraint_step_seconds.append(constraint_seconds)
        self.step_seconds.append(step_seconds)

    def finish(self) -> None:
        """Fill the derived ratios."""
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.tokens_per_second = self.output_tokens / self.total_seconds if self.total_seconds > 0 else 0.0
        self.forwards_per_token = self.target_forwards / self.output_tokens if self.output_tokens else 0.0


@dataclass
class DecodeResult:
    """Token ids generated (EOS not included), whether the constraint was satisfied, and stats."""

    tokens: list[int]
    finished: bool
    stats: DecodeStats
