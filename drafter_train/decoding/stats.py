"""Counters behind the headline numbers; the README defines each, and this is the only place they are computed.

tau                      = tokens_generated / target_forward_passes   (every target forward counts, prefill included)
acceptance_rate          = accepted draft tokens / proposed draft tokens
per_position_acceptance  = [P(draft i accepted | drafts 1..i-1 accepted)] for i = 1..draft_len
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Counts for one or many decoded sequences (add them with `merge`)."""

    draft_len: int = 0
    tokens_generated: int = 0
    target_forward_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    # reached[i]: verify steps in which draft i+1 was proposed and drafts 1..i were all accepted.
    reached: list[int] = field(default_factory=list)
    # accepted_at[i]: verify steps in which draft i+1 was accepted.
    accepted_at: list[int] = field(default_factory=list)
    # Wall-clock seconds spent in the drafter's proposals and in the target's verification passes, and the number of
    # proposals (where the time of a speculative step goes).
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposals: int = 0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.draft_len
        self.accepted_at = self.accepted_at or [0] * self.draft_len

    def record_step(self, proposed: int, accepted: int) -> None:
        """One verify pass that checked `proposed` drafts and kept the first `accepted`."""
        self.proposed += proposed
        self.accepted += accepted
        for i in range(min(accepted + 1, proposed)):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "DecodeStats") -> None:
        for name in ("tokens_generated", "target_forward_passes", "proposed", "accepted", "draft_seconds",
                     "verify_seconds", "proposals"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]

    @property
    def tau(self) -> float:
        return self.tokens_generated / max(self.target_forward_passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "target_forward_passes": self.target_forward_passes,
            "tokens_generated": self.tokens_generated,
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "proposals": self.proposals,
            "drafter_ms_per_proposal": 1000 * self.draft_seconds / max(self.proposals, 1),
            "verify_ms_per_step": 1000 * self.verify_seconds / max(self.proposals, 1),
        }
