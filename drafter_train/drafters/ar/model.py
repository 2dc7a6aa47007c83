"""The AR kind: a small causal LM on the target's vocabulary, proposing one token per forward.

Built as the target's first N layers (`truncated:N`, drafters/truncated.py), or another model's on the target's
vocabulary (`drafter.cut_from`: e.g. the family's 0.5B cut for a 1.5B target), as a new small model of the target's
architecture (`scratch`), or loaded from a folder / hub id. Trained on the response tokens of the distillation data
(distill.py's losses), decoded by `ARDrafter` (k cached forwards per proposal), exported as a plain causal-LM folder
that transformers' assisted generation can drive.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from drafter_train.config import DrafterConfig, TrainJobConfig
from drafter_train.drafters.ar import export as ar_export
from drafter_train.drafters.ar.config import CUT_FROM_TARGET, ARDrafterConfig
from drafter_train.data.batches import Batch
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.drafters.common.distill import apply_loss, head_at, teacher_logits
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.drafters.common.truncated import cut_from_target, parse_truncated
from drafter_train.losses import LossOutput
from drafter_train.targets import check_same_vocab, load_causal_lm, load_tokenizer, named_path, target_folder

SCRATCH = "scratch"


def build(cfg: DrafterConfig, ctx: BuildContext) -> PreTrainedModel:
    num_layers = parse_truncated(cfg.path)
    if num_layers is not None and cfg.cut_from != CUT_FROM_TARGET:
        return cut_from_model(cfg.cut_from, num_layers, ctx)
    if num_layers is not None:
        return cut_from_target(ctx.target, num_layers, share_weights=not ctx.for_training)
    if cfg.path == SCRATCH:
        return scratch_drafter(cfg, ctx.target)
    return load_causal_lm(cfg.path, ctx.dtype).to(ctx.target.device)


def cut_from_model(value: str, num_layers: int, ctx: BuildContext) -> PreTrainedModel:
    """The first `num_layers` layers of another model (drafter.cut_from), or all of them, as a drafter of its own
    (loaded for this drafter alone: nothing is shared with the target); refused in one line unless it shares the
    target's vocabulary."""
    source = named_path(value)
    folder = target_folder(source)  # a named or GGUF model through its dequantised copy; None for a hub id
    model = load_causal_lm(str(folder or source), ctx.dtype).to(ctx.target.device)
    check_same_vocab(ctx.target, ctx.tokenizer, model, load_tokenizer(str(folder or source)))
    if num_layers == model.config.num_hidden_layers:
        return model
    return cut_from_target(model, num_layers, whose=f"drafter.cut_from={value}'s")


def scratch_config(cfg: ARDrafterConfig, target: PreTrainedModel):
    """The target's config resized by the scratch fields of `cfg` (vocabulary and rope settings kept)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = cfg.num_layers
    config.hidden_size = cfg.hidden_size
    config.intermediate_size = cfg.intermediate_size
    config.num_attention_heads = cfg.num_heads
    config.num_key_value_heads = cfg.num_kv_heads
    config.head_dim = cfg.hidden_size // cfg.num_heads
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: cfg.num_layers]
    return config


def scratch_drafter(cfg: ARDrafterConfig, target: PreTrainedModel) -> PreTrainedModel:
    """A new model of the target's class and vocabulary, sized by the config."""
    return AutoModelForCausalLM.from_config(scratch_config(cfg, target), dtype=target.dtype).to(target.device)


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
        return head_at(self.drafter, input_ids, attention_mask, resp_pos)


def distill_loss(module: nn.Module, target: PreTrainedModel, batch: Batch, cfg: TrainJobConfig) -> LossOutput:
    """The configured loss on one micro-batch, as (sum over response tokens, number of response tokens)."""
    student = module(batch.input_ids, batch.attention_mask, batch.resp_pos)
    return apply_loss(cfg.loss, student, batch.labels, batch.resp_mask,
                      lambda: teacher_logits(target, batch, cfg.loss), cfg.drafter.draft_len)


KIND = register(DrafterKind(
    name="ar",
    description="an autoregressive drafter",
    model_type=None,
    config_class=ARDrafterConfig,
    build=build,
    load=load_causal_lm,
    decoder_drafter=ARDrafter,
    loss=distill_loss,
    training_module=ResponseLogits,
    hf_model=lambda module: module.drafter,
    hf_assistant=True,
    export_formats=ar_export.FORMATS,
    summary="An autoregressive draft model on the target's vocabulary.",
    card_tags=("assisted-generation",),
))
