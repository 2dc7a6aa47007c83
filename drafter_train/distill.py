"""One distillation loss evaluation: drafter logits, teacher signal, loss (sum, token count)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from drafter_train.config import LossConfig
from drafter_train.data.batches import Batch
from drafter_train.drafters.nar import SpecDrafter
from drafter_train.losses import LossOutput, get_loss


def response_logits(model: PreTrainedModel, batch: Batch) -> Tensor:
    """Logits at the positions that predict response tokens: [B, R, V] (the no-grad teacher calls this directly)."""
    return _head_at(model, batch.input_ids, batch.attention_mask, batch.resp_pos)


def _head_at(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, resp_pos: Tensor) -> Tensor:
    """Runs the decoder stack on the whole sequence but the LM head only where a loss is taken."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    index = resp_pos[..., None].expand(-1, -1, hidden.shape[-1])
    logits = model.get_output_embeddings()(torch.gather(hidden, 1, index))
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma-2 style capping happens after the head
    return torch.tanh(logits / cap) * cap if cap else logits


class ResponseLogits(nn.Module):
    """The drafter as accelerate trains it: forward(input_ids, attention_mask, resp_pos) -> logits [B, R, V].

    DDP and DeepSpeed wrap the module given to `accelerator.prepare` and only do their work (gradient all-reduce,
    ZeRO-3 parameter gathering) when that module's own forward is called: calling the HF model's submodules
    directly would bypass them.
    """

    def __init__(self, drafter: PreTrainedModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids: Tensor, attention_mask: Tensor, resp_pos: Tensor) -> Tensor:
        return _head_at(self.drafter, input_ids, attention_mask, resp_pos)


def training_module(drafter: PreTrainedModel) -> nn.Module:
    """What `accelerator.prepare` receives; `distill_loss` calls it with a batch's tensors. A Spec-Drafter's own
    forward already takes training inputs (draft blocks), so it is trained as it is."""
    return drafter if isinstance(drafter, SpecDrafter) else ResponseLogits(drafter)


def hf_model_of(module: nn.Module) -> PreTrainedModel:
    """The HF drafter inside an (unwrapped) `training_module`: what is evaluated and saved."""
    return module if isinstance(module, SpecDrafter) else module.drafter


def teacher_logits(target: PreTrainedModel, batch: Batch, loss: LossConfig) -> Optional[Tensor]:
    """[B, R, V] target logits (online), a top-k reconstruction (offline), or None (ce)."""
    if loss.name == "ce":
        return None
    if loss.teacher == "online":
        with torch.no_grad():
            return response_logits(target, batch).float()
    # Offline: the target's top-k logits, -inf elsewhere, i.e. p_target renormalised over its top k.
    vocab = target.get_output_embeddings().weight.shape[0]
    dense = torch.full((*batch.topk_ids.shape[:2], vocab), float("-inf"), device=batch.topk_logits.device)
    return dense.scatter_(-1, batch.topk_ids, batch.topk_logits)


def distill_loss(
    student_module: nn.Module, target: PreTrainedModel, batch: Batch, loss: LossConfig, draft_len: int
) -> LossOutput:
    """The configured loss on one micro-batch, as (sum over response tokens, number of response tokens).

    `student_module` is the (prepared) `training_module` of the drafter.
    """
    student = student_module(batch.input_ids, batch.attention_mask, batch.resp_pos)
    return apply_loss(loss, student, batch.labels, batch.resp_mask, lambda: teacher_logits(target, batch, loss),
                      draft_len)


def apply_loss(
    loss: LossConfig, student: Tensor, labels: Tensor, mask: Tensor, teacher: Callable[[], Tensor], draft_len: int
) -> LossOutput:
    """student [B, T, V], labels/mask [B, T]; `teacher()` gives the [B, T, V] teacher logits (not called for ce)."""
    fn = get_loss(loss.name)
    if loss.name == "ce":
        return fn(student, labels, mask, temperature=loss.temperature)
    options = {"temperature": loss.temperature}
    if loss.name == "jsd":
        options["beta"] = loss.beta
    if loss.name in ("accepted_length", "reach_weighted_tvd"):
        options["draft_len"] = draft_len
    return fn(student, teacher(), mask, **options)
