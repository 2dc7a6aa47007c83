"""The AR kind's typed config (its `drafter` config group schema: ar_schema)."""

from __future__ import annotations

from dataclasses import dataclass

from drafter_train.config import DrafterConfig, check_field
from drafter_train.errors import ConfigError

CUT_FROM_TARGET = "target"  # drafter.cut_from's default: truncated:N cuts the target itself


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
    # truncated:N cuts the first N layers of this model: "target" (the target itself), or another model on the
    # target's vocabulary: a named target (qwen2.5-coder-0.5b, or embedded:NAME), a local folder or GGUF file (read
    # through its dequantised copy, made once), a hub id. Another model may also be taken whole (N = its layers).
    cut_from: str = CUT_FROM_TARGET

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(bool(self.cut_from), "drafter.cut_from", f"must name a model or {CUT_FROM_TARGET!r}")
        if self.cut_from != CUT_FROM_TARGET and (self.kind != "ar" or not self.path.startswith("truncated:")):
            raise ConfigError(f"drafter.cut_from: cuts an AR drafter's truncated:N from another model; this drafter "
                              f"is kind {self.kind} with drafter.path={self.path} (use drafter=ar "
                              "drafter.path=truncated:N, or leave drafter.cut_from unset)")
        check_field(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        check_field(self.hidden_size % self.num_heads == 0, "drafter.hidden_size", "must be divisible by num_heads")
        check_field(self.num_heads % self.num_kv_heads == 0, "drafter.num_heads", "must be divisible by num_kv_heads")
