"""What the engine exports of several kinds share."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from drafter_train.errors import ConfigError


def drafter_weights(drafter_dir: Path, keep_embeddings: bool) -> dict[str, torch.Tensor]:
    """The saved drafter's tensors by name (without the embedding table when the engine shares the target's)."""
    files = sorted(drafter_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"export.checkpoint: {drafter_dir} has no .safetensors weights")
    weights = {}
    for file in files:
        weights.update(load_file(file))
    if not keep_embeddings:
        weights.pop("embed_tokens.weight", None)
    return weights
