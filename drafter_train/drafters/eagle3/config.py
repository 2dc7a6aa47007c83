"""The EAGLE-3 kind's typed config (eagle3_schema)."""

from __future__ import annotations

from dataclasses import dataclass

from drafter_train.config import check_field
from drafter_train.drafters.common.config import TargetFeaturesDrafterConfig


@dataclass
class Eagle3DrafterConfig(TargetFeaturesDrafterConfig):
    """`drafter=eagle3`: EAGLE-3 (arXiv 2503.01840), one decoder layer reading the target's own hidden states
    (drafters/eagle3.py). `path: new` builds a fresh one for the target; a folder continues a saved one. Empty
    target_layers: EAGLE-3's low/mid/high {2, L // 2, L - 3} for a target of L layers."""

    kind: str = "eagle3"
    # Training-time test: unrolled drafting steps per training position (step j consumes the drafter's own output
    # of step j - 1), weighted ttt_decay ** j.
    ttt_steps: int = 3
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.ttt_steps >= 1, "drafter.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        check_field(0 < self.ttt_decay <= 1, "drafter.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")
