"""What every kind's distillation loss shares: drafter/target logits at the response positions, the teacher signal
(online or offline), and the configured loss on (student logits, labels, mask, teacher)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from transformers import PreTrainedModel

from drafter_train.config import LossConfig
from drafter_train.cpu_kernels import stock_kernels
from drafter_train.data.batches import Batch
from drafter_train.errors import ConfigError
from drafter_train.losses import LossOutput, SharedTeacher, get_loss, keep_top_k


def response_logits(model: PreTrainedModel, batch: Batch) -> Tensor:
    """Logits at the positions that predict response tokens: [B, R, V] (the no-grad teacher calls this directly)."""
    return head_at(model, batch.input_ids, batch.attention_mask, batch.resp_pos)


def head_at(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, resp_pos: Tensor) -> Tensor:
    """Runs the decoder stack on the whole sequence but the LM head only where a loss is taken."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    index = resp_pos[..., None].expand(-1, -1, hidden.shape[-1])
    return output_logits(model, torch.gather(hidden, 1, index))


def output_logits(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """The LM head on final hidden states, with Gemma-2 style soft-capping when the model has it."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def teacher_logits(target: PreTrainedModel, batch: Batch, loss: LossConfig) -> Optional[Tensor]:
    """[B, R, V] target logits (online), a top-k reconstruction (offline), or None (ce)."""
    if loss.name == "ce":
        return None
    if loss.teacher == "online":  # stock kernels: the same bits whatever `auto` timed (cpu_kernels.py)
        with torch.no_grad(), stock_kernels():
            return response_logits(target, batch).float()
    # Offline: the target's top-k logits, -inf elsewhere, i.e. p_target renormalised over its top k.
    vocab = target.get_output_embeddings().weight.shape[0]
    dense = torch.full((*batch.topk_ids.shape[:2], vocab), float("-inf"), device=batch.topk_logits.device)
    return dense.scatter_(-1, batch.topk_ids, batch.topk_logits)


def apply_loss(
    loss: LossConfig, student: Tensor, labels: Tensor, mask: Tensor, teacher: Callable[[], Tensor], draft_len: int,
    weights: Optional[Tensor] = None,
) -> LossOutput:
    """student [B, T, V], labels/mask [B, T]; `teacher()` gives the [B, T, V] teacher logits (not called for ce);
    weights [B, T]: per-position loss weights (None: all 1). loss.top_k: the teacher restricted to its top k first
    (a SharedTeacher is restricted where it is made: top_k_teacher)."""
    fn = get_loss(loss.name)
    if loss.name == "ce":
        return fn(student, labels, mask, temperature=loss.temperature, weights=weights)
    options = {"temperature": loss.temperature, "weights": weights}
    if loss.name == "jsd":
        options["beta"] = loss.beta
    if loss.name in ("accepted_length", "reach_weighted_tvd"):
        options["draft_len"] = draft_len
    target = teacher()
    return fn(student, target if isinstance(target, SharedTeacher) else top_k_teacher(target, loss), mask, **options)


def top_k_teacher(logits: Tensor, loss: LossConfig) -> Tensor:
    """The teacher's logits restricted to its loss.top_k largest (losses.keep_top_k), a bad K in one line."""
    try:
        return keep_top_k(logits, loss.top_k)
    except ValueError as err:
        raise ConfigError(str(err)) from None
