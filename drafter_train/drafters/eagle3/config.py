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
    # of step j - 1), weighted ttt_decay ** j. 1.0 (every step alike, speculators' weighting) raised the later
    # positions over 0.8 on the dev split and the test split alike (docs/lab-notes/acceptance.md, fifth session).
    ttt_steps: int = 3
    ttt_decay: float = 1.0
    # One RMSNorm over the whole concatenation of the target features before fc, instead of fc_norm's one per layer:
    # the layout llama.cpp's EAGLE-3 runs (`norm_before_fc`; export.format=gguf refuses per-layer fc_norm). Set it
    # with drafter.fc_norm=false.
    norm_before_fc: bool = False
    # EAGLE 3.1 (speculators' default for eagle3): each drafting step hands the next its output after the final norm
    # (vLLM reads `norm_output` from the speculators config; llama.cpp's eagle3 has no such switch).
    norm_output: bool = False
    # EAGLE's feature augmentation: U(-feature_noise, feature_noise) added to the target's features in training only
    # (never when decoding or evaluating), after their norm (fc_norm or norm_before_fc, one of which it needs): the
    # raw residual stream has no one scale (drafters/common/conditioned.py, feature_noise). EAGLE uses 0.2. 0 = off.
    feature_noise: float = 0.0
    # A new drafter's decoder layer starts as the target's own last layer (q/k/v on the hidden half, zeros on the
    # embedding half: Eagle3Model.copy_target_layers) instead of random. A saved drafter (and a resumed run) keeps its
    # own weights. Targets whose layer has what a Llama layer has not (biases, q/k norms) are refused.
    init_from_target: bool = False
    # Capacity: decoder layers (the first reads [embedding; hidden], the rest are plain layers on its output) and their
    # MLP width (0: the target's). Our decoder and vLLM/SGLang-format exports of a wider MLP take them; the exports of
    # more than one layer and llama.cpp's of a wider MLP are refused (drafters/eagle3/export.py).
    num_layers: int = 1
    intermediate_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.ttt_steps >= 1, "drafter.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        check_field(0 < self.ttt_decay <= 1, "drafter.ttt_decay", f"must be in (0, 1], got {self.ttt_decay}")
        check_field(not (self.norm_before_fc and self.fc_norm), "drafter.norm_before_fc",
                    "replaces the per-layer fc_norm: set drafter.fc_norm=false with it")
        check_field(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        check_field(self.intermediate_size >= 0, "drafter.intermediate_size",
                    f"must be >= 0 (0 = the target's), got {self.intermediate_size}")
        check_field(not (self.init_from_target and self.intermediate_size), "drafter.init_from_target",
                    "copies the target's MLP: not with drafter.intermediate_size (leave it 0, the target's)")
        check_field(self.feature_noise >= 0, "drafter.feature_noise", f"must be >= 0, got {self.feature_noise}")
        check_field(not self.feature_noise or self.fc_norm or self.norm_before_fc, "drafter.feature_noise",
                    "needs the features normalised (drafter.fc_norm=true or drafter.norm_before_fc=true): one scale "
                    "means nothing on the raw residual stream")
