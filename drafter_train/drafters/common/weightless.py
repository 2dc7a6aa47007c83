"""A drafter "model" with no weights (prompt lookup, layer skipping): its config holds the kind's settings, so the kind
saves (config.json only), loads and reports like the kinds that have weights."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


class WeightlessModel(PreTrainedModel):
    """Subclasses set `config_class` and `base_model_prefix`."""

    _no_split_modules = []

    def __init__(self, config):
        super().__init__(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    @property
    def dtype(self) -> torch.dtype:  # no parameters to take it from; saving asks for one
        return torch.float32

    def get_input_embeddings(self):
        return None

    def get_output_embeddings(self):
        return None
