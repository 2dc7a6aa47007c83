"""A causal LM plus its KV cache, addressed by position.

The decoder never recomputes a prefix: after a rejection it crops the cache back to the last valid position and the
next forward continues from there (HF derives positions from the cache length).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from drafter_train.errors import ConfigError
class CachedLM:
    """Wraps an HF causal LM for incremental decoding of ONE sequence (batch size 1)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = model.device
        self.reset()

    def reset(self) -> None:
        # A full cache for every layer, sliding-window ones included (Mistral, Gemma 2/3, gpt-oss): transformers'
        # sliding layers drop keys past the window and then cannot crop back after a rejection. The window is still
        # applied, by the attention mask the model builds from its config.
        self.cache = DynamicCache()
        self.length = 0  # tokens whose keys/values are in the cache

    def forward(self, tokens: Tensor, num_logits: int) -> Tensor:
        """Feed tokens [n] after the cached prefix; return logits [num_logits, V] for the last positions.

        `logits_to_keep` skips the LM head on positions nobody reads (the prefill of a long prompt, say),
        which matters for large vocabularies.
        """
        out = self.model(
            input_ids=tokens.view(1, -1),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self.length += tokens.numel()
        return out.logits[0, -num_logits:]

    def forward_tree(self, tokens: Tensor, mask: Tensor, position_ids: Tensor) -> Tensor:
        """Feed tokens [n] (a tree: decoding/tree.py) with an additive mask [1, 1, n, length + n] and position ids
        [1, n]; return the logits [n, V] of every row."""
        out = self.model(input_ids=tokens.view(1, -1), attention_mask=mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=tokens.numel())
        self.length += tokens.numel()
        return out.logits[0]

    def keep(self, positions: Tensor) -> None:
        """Keep only the cached positions `positions` (increasing; e.g. the prefix and one accepted tree path: not a
        contiguous range). The leading positions that are already in place stay where they are; only the rows after
        them are moved down, then the cache is cropped. (Selecting every position copied the whole cache on each
        tree step: ~2.5 ms of a ~37 ms SmolLM2 pass at 256 cached tokens on a 2-core CPU.)"""
        n = positions.numel()
        in_place = int((positions == torch.arange(n, device=positions.device)).cumprod(0).sum()) if n else 0
        moved = positions[in_place:]
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ConfigError("eval.tree (draft trees) needs a full KV cache; this model has sliding-window layers")
            if moved.numel() and getattr(layer, "is_initialized", False) and layer.keys.numel():
                layer.keys[..., in_place:n, :] = layer.keys.index_select(-2, moved)
                layer.values[..., in_place:n, :] = layer.values.index_select(-2, moved)
        self.crop(n)

    def crop(self, length: int) -> None:
        """Keep only the first `length` cached positions (no-op if fewer are cached)."""
        if length < self.length:
            # transformers v5: crop() takes the (negative) number of tokens to drop.
            self.cache.crop(length - self.length)
            self.length = length


def as_tensor(token_ids, device: torch.device) -> Tensor:
    """list[int] or 1-D tensor -> 1-D long tensor on `device`."""
    return torch.as_tensor(token_ids, dtype=torch.long, device=device).view(-1)
