"""The NAR (SpecDec Spec-Drafter) kind's typed config (nar_schema)."""

from __future__ import annotations

from dataclasses import dataclass

from drafter_train.config import check_field
from drafter_train.drafters.ar.config import ARDrafterConfig


@dataclass
class NARDrafterConfig(ARDrafterConfig):
    """`drafter=nar`: a SpecDec Spec-Drafter (drafters/nar.py); `path: scratch` uses the architecture fields."""

    kind: str = "nar"
    # Of the drafter's layers, how many only encode the context (SpecDec's encoder); the mask queries pass through
    # the rest (its decoder). 0 = every layer sees the queries.
    encoder_layers: int = 0
    # Training: draft blocks (random start positions in the response) trained per sequence in one forward;
    # 0 = a block at every response position.
    blocks_per_sequence: int = 8
    # Training, GLAT glancing (SpecDec sec. 3.2): reveal this fraction of the wrongly predicted tokens of a block to
    # its queries, and learn the rest. 0 = off.
    glancing_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.encoder_layers >= 0, "drafter.encoder_layers", f"must be >= 0, got {self.encoder_layers}")
        check_field(self.blocks_per_sequence >= 0, "drafter.blocks_per_sequence",
               f"must be >= 0, got {self.blocks_per_sequence}")
        check_field(0 <= self.glancing_ratio <= 1, "drafter.glancing_ratio", f"must be in [0, 1], got {self.glancing_ratio}")
