"""The decoder side of DFlash: the drafter the speculative decoder calls (model.py holds the network and training).

Each proposal is one pass of the drafter over [last token, mask x draft_len], reading the verified positions'
context keys/values from its cache; the cache grows from the target's verify-pass features, with no extra target
forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from drafter_train import draft_vocab
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreePool
from drafter_train.drafters.common import conditioned
from drafter_train.errors import ConfigError

if TYPE_CHECKING:
    from drafter_train.drafters.dflash.model import DFlashModel


class DFlashDrafter:
    """The decoder-side DFlash drafter: every proposal is ONE pass over [last token, mask x draft_len].

    Its cache holds the context keys/values of the verified positions, from the target's verify-pass features (no
    extra target forward); the drafts' distributions do not depend on each other's draws, so q is exact.
    """

    def __init__(self, model: DFlashModel):
        self.model = model
        self.feature_layers = list(model.config.target_layers)
        self.draft_ids = draft_vocab.draft_to_target(model.d2t)  # draft id -> target id
        self.draft_vocab = model.t2d  # [V] bool: the evaluator reports how much of the output lies outside
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.length = 0  # verified positions whose context keys/values are in the cache
        self.pending: list[Tensor] = []  # target features [n, F] of verified positions not yet in the cache

    def commit(self, num_valid: int, features: Optional[Tensor], path=None) -> None:
        # Trees too: `features` are those of the accepted path's positions, so nothing else is needed.
        self.pending.append(features)
        held = self.length + sum(f.shape[0] for f in self.pending)
        if held != num_valid:
            raise RuntimeError(f"DFlash drafter out of step: features for {held} positions, {num_valid} verified")

    def _block_logits(self, seq: Tensor, draft_len: int, setting: str) -> Tensor:
        """The one pass: draft logits [draft_len, Vd] of the mask slots after seq[-1]."""
        model = self.model
        if draft_len > model.block_size - 1:
            raise ConfigError(f"{setting}: this DFlash drafter was trained with blocks of {model.block_size} "
                              f"(an anchor and {model.block_size - 1} mask slots), it drafts at most "
                              f"{model.block_size - 1}, not {draft_len}")
        if self.pending:  # the newly verified positions join the context
            features = torch.cat(self.pending)
            positions = torch.arange(self.length, self.length + features.shape[0], device=seq.device)[None]
            model.add_context(self.cache, model.fuse(features)[None], positions)
            self.length, self.pending = self.length + features.shape[0], []
        anchor, rows = seq.numel() - 1, draft_len + 1  # the last token (its features come with the next pass)
        if anchor != self.length:
            raise RuntimeError(f"DFlash drafter out of step: {self.length} context positions, anchor at {anchor}")
        embeds = model.block_embeds(seq[-1:], rows)  # [1, rows, H]
        positions = torch.arange(anchor, anchor + rows, device=seq.device)[None]
        no_mask = torch.zeros(1, 1, rows, anchor + rows, dtype=embeds.dtype, device=seq.device)  # all visible
        hidden = model.run_block(embeds, positions, no_mask, self.cache)
        self.cache.crop(-rows)  # negative: drop the block's keys/values again
        return model.draft_logits(hidden[0, 1:])  # [draft_len, Vd]

    @torch.inference_mode()
    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        logits = self._block_logits(seq, draft_len, "eval.draft_len")
        drafts = [choose_token(logits[r], params, generator) for r in range(draft_len)]
        tokens = self.draft_ids[torch.stack([token for token, _ in drafts])]
        if params.greedy:
            return Proposal(tokens)
        q = torch.stack([q for _, q in drafts])
        return Proposal(tokens, conditioned.to_target_vocab(q, self.draft_ids, self.draft_vocab.numel()))

    # Trees: like nar, the one pass gives every block position's distribution whatever was drafted before it, so a
    # node's children are the top-k (or samples) of the next slot: one drafter pass per tree, as deep as the block.
    @torch.inference_mode()
    def tree_root(self, seq: Tensor) -> Tensor:
        self.block = self._block_logits(seq, self.model.block_size - 1, "eval.tree.depth")
        return self.block[0]

    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        positions = [pool.depths[node] for node in nodes]  # block slot of the nodes' children (0-based)
        if max(positions) >= self.block.shape[0]:
            raise ConfigError(f"eval.tree.depth: this DFlash drafter drafts at most {self.block.shape[0]} deep "
                              f"(blocks of {self.model.block_size}), not {max(positions) + 1}")
        return self.block[positions]
