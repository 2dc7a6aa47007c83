"""The DFlash kind's typed config (dflash_schema)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from drafter_train.config import check_field
from drafter_train.drafters.common.config import TargetFeaturesDrafterConfig


@dataclass
class DFlashDrafterConfig(TargetFeaturesDrafterConfig):
    """`drafter=dflash`: a one-pass block drafter on the target's context features (DFlash, arXiv 2602.06036;
    drafters/dflash.py). A block [last verified token, MASK x (block_size - 1)] passes through num_layers decoder
    layers whose keys/values also hold the fused target features of every earlier position; one forward drafts
    up to block_size - 1 tokens. Empty target_layers: num_layers layers evenly spaced from EAGLE-3's low (2) to
    high (L - 3) layer ({2, L // 2, L - 3} for 3 on a 30-layer target, so an EAGLE-3 feature cache is reused)."""

    kind: str = "dflash"
    # Drafter depth: decoder layers of the target's architecture, each reading the injected context features.
    num_layers: int = 1
    # Block size B trained: one anchor token plus B - 1 mask slots; drafter.draft_len / eval.draft_len <= B - 1.
    block_size: int = 16
    # Per-head RMSNorm on queries and keys (DFlash's layers are Qwen3 layers, which have it; on a target without
    # it, e.g. Llama, the layers become Qwen3 layers of the target's sizes). vLLM and SGLang serve only such layers.
    qk_norm: bool = True
    # Training: random anchors per sequence in the response, redrawn every batch (0 = an anchor at every position).
    blocks_per_sequence: int = 16
    # Loss weight of block position k (1 .. B - 1): exp(-(k - 1) / position_decay). None: DFlash's gamma for the
    # block size (7, 5, 4 for B = 16, 10, 8; linear between and beyond those). 0: all positions weigh 1.
    position_decay: Optional[float] = None
    # Training, GLAT glancing: reveal this fraction of a block's wrongly predicted tokens in their mask slots and
    # learn the rest. 0 = off.
    glancing_ratio: float = 0.0
    # The token id serving engines put in the mask slots (vLLM, SGLang); None: chosen when the drafter is built
    # (a special token of the tokenizer that is not BOS, EOS or padding, else the last id).
    mask_token_id: Optional[int] = None
    # true: the mask slots have a learned embedding of their own (exported to vLLM as mask_embedding.pt).
    # false: they use the target's frozen embedding of mask_token_id, as DFlash's released drafters do (what SGLang
    # can serve); an untrained row of the target's embedding (vocabulary padding) is a trap.
    learned_mask: bool = True
    fc_norm: bool = False  # DFlash (and vLLM / SGLang) fuse with fc then one norm; true adds EAGLE-3's per-layer norm

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.num_layers >= 1, "drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        check_field(self.block_size >= 2, "drafter.block_size", f"must be >= 2 (an anchor and a mask slot), got "
               f"{self.block_size}")
        check_field(self.draft_len <= self.block_size - 1, "drafter.draft_len", f"must be <= block_size - 1 = "
               f"{self.block_size - 1} (one forward drafts that many), got {self.draft_len}")
        check_field(self.blocks_per_sequence >= 0, "drafter.blocks_per_sequence",
               f"must be >= 0, got {self.blocks_per_sequence}")
        check_field(self.position_decay is None or self.position_decay >= 0, "drafter.position_decay",
               f"must be >= 0, got {self.position_decay}")
        check_field(0 <= self.glancing_ratio <= 1, "drafter.glancing_ratio", f"must be in [0, 1], got {self.glancing_ratio}")
        check_field(self.mask_token_id is None or self.mask_token_id >= 0, "drafter.mask_token_id", "must be >= 0")
