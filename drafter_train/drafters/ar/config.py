"""The AR kind's typed config (its `drafter` config group schema: ar_schema)."""

from __future__ import annotations

from dataclasses import dataclass

from drafter_train.config import DrafterConfig, check_field


@dataclass
class ARDrafterConfig(DrafterConfig):
    """`drafter=truncated|scratch`: an autoregressive drafter (a small causal LM on the target's vocabulary)."""

    kind: str = "ar"
    # scratch only: architecture of the new drafter (the target's model class, vocabulary and rope settings).
    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        check_field(self.hidden_size % self.num_heads == 0, "drafter.hidden_size", "must be divisible by num_heads")
        check_field(self.num_heads % self.num_kv_heads == 0, "drafter.num_heads", "must be divisible by num_kv_heads")
