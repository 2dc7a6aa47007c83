"""Distillation loss for a Spec-Drafter: random draft blocks of a target-generated response, all in one forward.

A block starting at response index s has as context the prompt and response[:s]; its k = draft_len queries learn
response[s : s + k], the target's next k tokens. Per row, `blocks_per_sequence` block starts are drawn at random
(torch's global RNG, which checkpoints save and restore, so resumed runs draw the same blocks). Every loss of
losses.py applies unchanged, with each block as one row of k positions: ce per position, and the
acceptance-oriented ones (accepted_length, reach_weighted_tvd) with their windows equal to the blocks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from drafter_train.config import DrafterConfig, LossConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data.batches import Batch
from drafter_train.drafters.common.distill import apply_loss, teacher_logits
from drafter_train.losses import LossOutput


def sample_block_starts(resp_mask: Tensor, blocks_per_sequence: int) -> Tensor:
    """[B, n] response index where each block starts (-1: no block; a row with fewer tokens than n blocks).

    blocks_per_sequence = 0: a block at every response position, in order.
    """
    batch, resp_len = resp_mask.shape
    positions = torch.arange(resp_len, device=resp_mask.device).expand(batch, -1)
    if blocks_per_sequence == 0:
        return torch.where(resp_mask, positions, -1)
    scores = torch.where(resp_mask, torch.rand(batch, resp_len).to(resp_mask.device), -1.0)
    top = scores.topk(min(blocks_per_sequence, resp_len), dim=1)
    return torch.where(top.values >= 0, top.indices, -1)


def block_batch(batch: Batch, starts: Tensor, draft_len: int) -> Batch:
    """The batch with its response fields gathered block by block ([B, n * k]) and `context_lens` [B, n] set.

    Position r of block m is response index starts[m] + r; it counts only inside the response and while the
    positions run on without a gap (multi-turn masks: not across a user turn), so the batch's
    `num_tokens` is the number of tokens the blocks predict (known before the forward, as accumulation needs).
    """
    resp_len = batch.resp_mask.shape[1]
    index = starts[..., None] + torch.arange(draft_len, device=starts.device)  # [B, n, k]
    valid = (starts[..., None] >= 0) & (index < resp_len)
    flat = index.clamp(0, resp_len - 1).flatten(1)  # [B, n*k]

    def take(field: Tensor) -> Tensor:
        idx = flat.view(*flat.shape, *[1] * (field.dim() - 2)).expand(-1, -1, *field.shape[2:])
        return field.gather(1, idx)

    names = ("resp_pos", "resp_mask", "labels", "topk_ids", "topk_logits", "target_hidden")
    gathered = {name: take(getattr(batch, name)) for name in names if getattr(batch, name) is not None}
    # A block is a run of consecutive positions: with multi-turn masks the learned tokens have gaps (user turns),
    # and a block stops at the end of its assistant turn.
    pos = gathered["resp_pos"].view(*index.shape)
    valid &= pos == pos[..., :1] + torch.arange(draft_len, device=pos.device)
    gathered["resp_mask"] = gathered["resp_mask"] & valid.flatten(1)
    context_lens = gathered["resp_pos"][:, ::draft_len] + 1  # the logits predicting token s sit at s - 1
    return dataclasses.replace(batch, context_lens=context_lens, **gathered)


def to_blocks(batch: Batch, drafter: DrafterConfig) -> Batch:
    """A collated batch -> random draft blocks of it (see module doc)."""
    return block_batch(batch, sample_block_starts(batch.resp_mask, drafter.blocks_per_sequence), drafter.draft_len)


def glance(predicted: Tensor, labels: Tensor, mask: Tensor, ratio: float) -> tuple[Tensor, Tensor]:
    """GLAT glancing (Qian et al. 2021, used by SpecDec): reveal round(ratio * #wrong) random tokens of each block.

    predicted/labels/mask [B, n, k] (the drafter's argmax without glancing, the tokens to learn, which count).
    Returns (glance_ids [B, n, k]: revealed token or -1, mask without the revealed positions).
    """
    wrong = ((predicted != labels) & mask).sum(-1, keepdim=True)  # [B, n, 1] Hamming distance per block
    num_reveal = torch.floor(wrong * ratio + 0.5)
    scores = torch.where(mask, torch.rand(mask.shape).to(mask.device), -1.0)
    rank = scores.argsort(-1, descending=True).argsort(-1)  # 0 = first to reveal
    revealed = mask & (rank < num_reveal)
    return torch.where(revealed, labels, -1), mask & ~revealed


def nar_distill_loss(
    module: nn.Module, target: PreTrainedModel, blocks: Batch, loss: LossConfig, drafter: DrafterConfig
) -> LossOutput:
    """The configured loss on one micro-batch of draft blocks (`to_blocks`), as (sum, number of block tokens).

    With glancing, revealed tokens add 0 but still count: the step's token count is fixed before the forward.
    """
    k, context_lens = drafter.draft_len, blocks.context_lens
    rows, n = context_lens.shape
    labels, mask = blocks.labels.view(rows, n, k), blocks.resp_mask.view(rows, n, k)
    glance_ids, learn = None, mask
    if drafter.glancing_ratio > 0:
        with torch.no_grad(), stock_kernels():  # glancing's guesses are training data (cpu_kernels.py)
            predicted = module(blocks.input_ids, blocks.attention_mask, context_lens).argmax(-1)
        glance_ids, learn = glance(predicted, labels, mask, drafter.glancing_ratio)
    student = module(blocks.input_ids, blocks.attention_mask, context_lens, glance_ids)  # [B, n, k, V]
    teacher = lambda: teacher_logits(target, blocks, loss).view(rows * n, k, -1)  # noqa: E731
    out = apply_loss(loss, student.flatten(0, 1), labels.flatten(0, 1), learn.flatten(0, 1), teacher, k)
    return LossOutput(out.loss_sum, mask.sum())
