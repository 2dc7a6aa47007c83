"""Training both seq2seq drafters on the target's outputs with losses.py's losses (through drafters/common's
`apply_loss`, as every decoder-only kind does): teacher-forced on the target's own (greedy) outputs, the target's
logits at the same positions as the teacher (loss.teacher=online).

AR: the drafter's logits at every output position against the target's, [B, T, V].
NAR: per example, `blocks_per_example` random cuts c; the k queries after the prefix [start, y_1 .. y_c] against the
target's logits at positions c .. c + k - 1, [B * n, k, V] (accepted_length / reach_weighted_tvd take each block as
one draft window, as in decoding).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from drafter_train.config import LossConfig
from drafter_train.drafters.common.distill import apply_loss
from drafter_train.losses import LossOutput
from drafter_train.seq2seq.drafters import SpecDrafter, same_encoder
from drafter_train.seq2seq.target import decoder_prompt


@dataclass
class Example:
    """One training pair: the source's token ids and the target's output for it (EOS included)."""

    source_ids: list[int]
    output_ids: list[int]


@dataclass
class Seq2SeqBatch:
    input_ids: Tensor  # [B, S] sources, right-padded
    attention_mask: Tensor  # [B, S]
    decoder_input_ids: Tensor  # [B, T] decoder start + outputs[:-1]
    labels: Tensor  # [B, T] the outputs
    mask: Tensor  # [B, T] bool: real output positions

    def target_logits(self, target: PreTrainedModel) -> Tensor:
        """[B, T, V] the target's teacher-forced logits (no gradient)."""
        with torch.no_grad():
            return target(input_ids=self.input_ids, attention_mask=self.attention_mask,
                          decoder_input_ids=self.decoder_input_ids).logits.float()


def _pad(rows: Sequence[Sequence[int]], value: int) -> Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def collate(examples: Sequence[Example], start_id: int, pad_id: int, device: Optional[torch.device] = None) -> Seq2SeqBatch:
    sources = _pad([e.source_ids for e in examples], pad_id)
    outputs = [e.output_ids for e in examples]
    lengths = torch.tensor([len(o) for o in outputs])
    labels = _pad(outputs, pad_id)
    mask = torch.arange(labels.shape[1])[None] < lengths[:, None]
    decoder_inputs = torch.cat([torch.full((len(examples), 1), start_id), labels[:, :-1]], dim=1)
    source_mask = torch.arange(sources.shape[1])[None] < torch.tensor([len(e.source_ids) for e in examples])[:, None]
    return Seq2SeqBatch(sources.to(device), source_mask.long().to(device), decoder_inputs.to(device),
                        labels.to(device), mask.to(device))


def ar_loss(drafter: PreTrainedModel, target: PreTrainedModel, batch: Seq2SeqBatch, loss: LossConfig,
            draft_len: int) -> LossOutput:
    student = drafter(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      decoder_input_ids=batch.decoder_input_ids).logits  # [B, T, V]
    return apply_loss(loss, student, batch.labels, batch.mask, lambda: batch.target_logits(target), draft_len)


def nar_loss(drafter: SpecDrafter, target: PreTrainedModel, batch: Seq2SeqBatch, loss: LossConfig,
             blocks_per_example: int, generator: torch.Generator) -> LossOutput:
    k, (examples, length) = drafter.draft_len, batch.labels.shape
    lengths = batch.mask.sum(1)  # [B]
    cuts = (torch.rand(examples, blocks_per_example, generator=generator) * lengths[:, None].cpu()).long()
    rows = torch.arange(examples).repeat_interleave(blocks_per_example).to(lengths.device)  # [R] example of a block
    cuts = cuts.view(-1).to(lengths.device)  # [R] c: the block predicts outputs c .. c + k - 1
    encoded = drafter.get_encoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    student = drafter.block_logits(BaseModelOutput(last_hidden_state=encoded.last_hidden_state[rows]),
                                   batch.attention_mask[rows], batch.decoder_input_ids[rows], cuts + 1)  # [R, k, V]
    positions = cuts[:, None] + torch.arange(k, device=cuts.device)  # [R, k]
    mask = positions < lengths[rows, None]
    index = positions.clamp(max=length - 1)

    def teacher() -> Tensor:  # [R, k, V]
        logits = batch.target_logits(target)[rows]
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

    return apply_loss(loss, student, batch.labels[rows].gather(1, index), mask, teacher, k)


def optimizer_step(loss: Tensor, optimizer: torch.optim.Optimizer, schedule=None) -> float:
    """Backward, step (and the learning-rate schedule's), zero the gradients; returns the loss."""
    loss.backward()
    optimizer.step()
    if schedule is not None:
        schedule.step()
    optimizer.zero_grad()
    return loss.item()


class DrafterTraining:
    """One drafter's training, step by step: AdamW on random batches of `examples`. Its state_dict (optimizer, batch
    sampler and block-cut generators) with the drafter's weights continues the run exactly where it stopped. A
    drafter that shares the target's encoder (drafters.py's rule) trains with that encoder frozen, so that it keeps
    sharing it."""

    def __init__(self, drafter: PreTrainedModel, target: PreTrainedModel, examples: Sequence[Example],
                 loss: LossConfig, draft_len: int, pad_id: int, batch_size: int = 32, lr: float = 1e-3,
                 blocks_per_example: int = 4, seed: int = 0):
        if same_encoder(drafter, target):
            drafter.get_encoder().requires_grad_(False)
        self.drafter, self.target, self.examples, self.loss = drafter, target, list(examples), loss
        self.draft_len, self.pad_id = draft_len, pad_id
        self.batch_size, self.blocks_per_example = batch_size, blocks_per_example
        self.optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
        self.rng, self.generator = random.Random(seed), torch.Generator().manual_seed(seed)
        self.start_id = decoder_prompt(target)[0]

    def step(self) -> float:
        """One optimizer step (the drafter in train mode); returns its mean loss."""
        self.drafter.train()
        batch = collate(self.rng.sample(self.examples, min(self.batch_size, len(self.examples))), self.start_id,
                        self.pad_id, self.target.device)
        if isinstance(self.drafter, SpecDrafter):
            out = nar_loss(self.drafter, self.target, batch, self.loss, self.blocks_per_example, self.generator)
        else:
            out = ar_loss(self.drafter, self.target, batch, self.loss, self.draft_len)
        return optimizer_step(out.mean(), self.optimizer)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "rng": self.rng.getstate(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        self.generator.set_state(state["generator"])


def train_drafter(drafter: PreTrainedModel, target: PreTrainedModel, examples: Sequence[Example], steps: int,
                  loss: LossConfig, draft_len: int, pad_id: int, batch_size: int = 32, lr: float = 1e-3,
                  blocks_per_example: int = 4, seed: int = 0) -> list[float]:
    """`steps` steps of a DrafterTraining; returns each step's mean loss. The drafter is left in eval mode."""
    training = DrafterTraining(drafter, target, examples, loss, draft_len, pad_id, batch_size, lr,
                               blocks_per_example, seed)
    losses = [training.step() for _ in range(steps)]
    drafter.eval()
    return losses
