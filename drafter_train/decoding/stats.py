"""Counters behind the headline numbers; docs/evaluate.md ("Definitions") defines each, and this is the only place
they are computed.

tau                      = tokens_generated / target_forward_passes   (every target forward counts, prefill included)
acceptance_rate          = accepted draft tokens / proposed draft tokens
per_position_acceptance  = [P(draft i accepted | drafts 1..i-1 accepted)] for i = 1..draft_len (0.0 where never tested)
per_position_tested[i]   = verify steps that tested draft i (its denominator)
draft_len                = the most drafts one verify pass can accept along a path (a chain's length, a tree's depth,
                           or the longest lookup chain ahead of a tree)
accepted_length_histogram[m] = verify steps that accepted exactly m drafts

Draft trees: "proposed" counts every node the target verified (a tree of total_tokens nodes proposes total_tokens
drafts per step, so alpha is the share of verified draft tokens that were kept), "accepted" the nodes of the accepted
path, and position i is depth i: per_position_acceptance[i] = P(a depth-i node accepted | the path reached depth
i - 1 at a node that has children). A chain is the tree with one node per depth: every number is the chain's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
    # Every drafter call, also those that proposed nothing (draft exit declined, lookup found no match): what the
    # drafter costs per target step.
    drafter_call_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposals: int = 0
    # eval.lookup: proposals made by prompt lookup ahead of the drafter, and their accepted drafts.
    lookup_proposals: int = 0
    lookup_accepted: int = 0
    # accepted_hist[m]: verify steps that accepted exactly m drafts (m = 0..draft_len).
    accepted_hist: list[int] = field(default_factory=list)
    # Draft tokens the largest proposal holds (a chain: draft_len; a topk tree: its total_tokens; 0: not tracked) ...
    max_nodes: int = -1
    # ... and accepted_within[n - 1]: drafts the steps would have accepted had each proposal been cut to its first n
    # draft tokens (a chain's first n drafts; a topk tree's n best nodes, which are the tree of total_tokens = n).
    # Exact per step under greedy verification; what calibration predicts smaller trees from.
    accepted_within: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.draft_len
        self.accepted_at = self.accepted_at or [0] * self.draft_len
        self.accepted_hist = self.accepted_hist or [0] * (self.draft_len + 1)
        self.max_nodes = self.draft_len if self.max_nodes < 0 else self.max_nodes
        self.accepted_within = self.accepted_within or [0] * self.max_nodes

    def record_step(self, proposed: int, accepted: int, tested: Optional[int] = None,
                    path: Optional[list[int]] = None) -> None:
        """One verify pass that checked `proposed` drafts and kept `accepted` of them: a chain's first `accepted`,
        or a tree path (`path`: its node indices) whose end was tested at `tested` depths (the depth of the
        deepest node the verifier looked at: one more than `accepted` unless the path ends in a leaf)."""
        tested = min(accepted + 1, proposed) if tested is None else tested
        path = range(accepted) if path is None else path
        self.proposed += proposed
        self.accepted += accepted
        self.accepted_hist[accepted] += 1
        for i in range(tested):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1
        for node in path:
            for n in range(node, self.max_nodes):
                self.accepted_within[n] += 1

    def merge(self, other: "DecodeStats") -> None:
        for name in ("tokens_generated", "target_forward_passes", "proposed", "accepted", "draft_seconds",
                     "verify_seconds", "proposals", "lookup_proposals", "lookup_accepted", "drafter_call_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("reached", "accepted_at", "accepted_hist", "accepted_within"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])

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
            # per_position_acceptance's denominators: verify steps that tested draft position i (0: never tested,
            # and the acceptance there reads 0.0), and the deepest position any step tested.
            "per_position_tested": list(self.reached),
            "deepest_tested_position": max((i + 1 for i, r in enumerate(self.reached) if r), default=0),
            "target_forward_passes": self.target_forward_passes,
            "tokens_generated": self.tokens_generated,
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "proposals": self.proposals,
            "lookup_proposals": self.lookup_proposals,
            "lookup_accepted": self.lookup_accepted,
            "drafter_ms_per_proposal": 1000 * self.draft_seconds / max(self.proposals, 1),
            # over every step after the prefill (each asks the drafter once)
            "drafter_ms_per_step": 1000 * self.drafter_call_seconds / max(self.target_forward_passes - 1, 1),
            "verify_ms_per_step": 1000 * self.verify_seconds / max(self.proposals, 1),
            "draft_tokens_per_step": self.proposed / max(self.proposals, 1),
            "accepted_length_histogram": self.accepted_hist,
        }
