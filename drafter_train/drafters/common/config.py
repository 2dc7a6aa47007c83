"""What the kinds on the target's hidden states share in their configs (EAGLE-3, DFlash)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from drafter_train.config import DrafterConfig, check_field


FEATURE_SOURCES = ("online", "offline")


@dataclass
class TargetFeaturesDrafterConfig(DrafterConfig):
    """What the kinds that read the target's own hidden states share (EAGLE-3, DFlash; drafters/conditioned.py):
    which target layers they fuse, the reduced draft vocabulary, and where training gets the features from."""

    path: str = "new"
    # Target layers whose OUTPUTS are fused (index convention: "output of layer i" = the residual stream after the
    # target's decoder layer i, 0-based = transformers' `output_hidden_states[i + 1]`). Empty: the kind's default.
    # Serving engines number these differently; the exports translate.
    target_layers: list[int] = field(default_factory=list)
    # Size of the reduced draft vocabulary: the most frequent tokens of the training data's responses (d2t / t2d
    # mapping stored with the weights). 0 = the target's whole vocabulary.
    draft_vocab_size: int = 8192
    # Target features during training: online (a no-grad target forward per batch) or offline (computed once into a
    # feature cache next to the data, reused by every epoch and run with the same target and layers).
    features: str = "online"
    # Storage dtype of the offline feature cache (16-bit; bfloat16 keeps the range of massive activations).
    feature_dtype: str = "bfloat16"
    # Folder of the offline feature cache; unset: <train.data_dir>/features/<hash of what the features depend on>.
    # A folder made for another target, layer set, response column, max_seq_len or dtype is refused.
    feature_cache: Optional[str] = None
    # Normalise each target feature (RMSNorm per layer) before the fc fusion: targets with massive activations
    # (SmolLM2's residual stream reaches ~25,000) otherwise swamp the fused input.
    fc_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.draft_vocab_size >= 0, "drafter.draft_vocab_size", f"must be >= 0, got {self.draft_vocab_size}")
        check_field(self.features in FEATURE_SOURCES, "drafter.features", f"must be one of {FEATURE_SOURCES}")
        check_field(self.feature_dtype in ("bfloat16", "float16"), "drafter.feature_dtype", "must be bfloat16 or float16")
        check_field(all(i >= 0 for i in self.target_layers), "drafter.target_layers", "layer ids must be >= 0")
