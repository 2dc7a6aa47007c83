"""Turn a `DrafterConfig` into a drafter model that shares the target's vocabulary."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from drafter_train.config import DrafterConfig
from drafter_train.drafters.nar import SpecDrafter, is_spec_drafter_folder, spec_config
from drafter_train.drafters.truncated import cut_from_target, parse_truncated
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.targets import check_same_vocab, load_causal_lm, load_tokenizer

SCRATCH = "scratch"


def load_drafter(
    cfg: DrafterConfig,
    target: PreTrainedModel,
    target_tok: PreTrainedTokenizerBase,
    dtype: str,
    for_training: bool = False,
) -> PreTrainedModel:
    """`truncated:N` cuts the target, `scratch` builds a new small model, anything else loads a pretrained drafter.

    for_training=True gives the drafter its own copy of any weights it shares with the target (the optimizer must
    never write into the target) and applies the freeze options.
    """
    num_layers = parse_truncated(cfg.path)
    if num_layers is not None and cfg.kind == "nar":
        drafter = SpecDrafter.from_target(target, num_layers, cfg.encoder_layers, cfg.draft_len)
    elif num_layers is not None:
        drafter = cut_from_target(target, num_layers, share_weights=not for_training)
    elif cfg.path == SCRATCH:
        drafter = scratch_drafter(cfg, target)
    else:
        drafter = _load_folder(cfg.path, dtype).to(target.device)
        if cfg.kind == "nar" and not isinstance(drafter, SpecDrafter):
            raise ConfigError(f"drafter.kind=nar: {cfg.path} holds an autoregressive drafter, not a Spec-Drafter")
        check_same_vocab(target, target_tok, drafter, _tokenizer_or_none(cfg.path))
    if for_training and isinstance(drafter, SpecDrafter) and drafter.draft_len != cfg.draft_len:
        raise ConfigError(f"drafter.draft_len: {cfg.path} has {drafter.draft_len} mask queries; train it with "
                          f"drafter.draft_len={drafter.draft_len}")
    if for_training:
        drafter.train()
        drafter.requires_grad_(True)
        freeze(drafter, cfg)
    return drafter


def scratch_drafter(cfg: DrafterConfig, target: PreTrainedModel) -> PreTrainedModel:
    """A new model of the target's class and vocabulary (a Spec-Drafter on it for kind=nar), sized by the config."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = cfg.num_layers
    config.hidden_size = cfg.hidden_size
    config.intermediate_size = cfg.intermediate_size
    config.num_attention_heads = cfg.num_heads
    config.num_key_value_heads = cfg.num_kv_heads
    config.head_dim = cfg.hidden_size // cfg.num_heads
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: cfg.num_layers]
    if cfg.kind == "nar":
        spec = spec_config(config, cfg.num_layers, cfg.encoder_layers, cfg.draft_len)
        return SpecDrafter(spec).to(dtype=target.dtype, device=target.device)
    return AutoModelForCausalLM.from_config(config, dtype=target.dtype).to(target.device)


def _load_folder(path: str, dtype: str) -> PreTrainedModel:
    """A saved drafter, whatever its kind: a Spec-Drafter folder or a causal LM."""
    if is_spec_drafter_folder(path):
        drafter = SpecDrafter.from_pretrained(path, dtype=getattr(torch, dtype)).eval()  # "float32" -> torch.float32
        return drafter.requires_grad_(False)  # as load_causal_lm: training turns gradients back on
    return load_causal_lm(path, dtype)


def freeze(drafter: PreTrainedModel, cfg: DrafterConfig) -> None:
    """Freeze input embeddings and/or the LM head (tied weights freeze together: they are one tensor)."""
    if cfg.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    if cfg.freeze_lm_head and drafter.get_output_embeddings() is not None:
        drafter.get_output_embeddings().requires_grad_(False)


def _tokenizer_or_none(path: str):
    try:
        return load_tokenizer(path)
    except ModelNotFoundError:  # a drafter folder without tokenizer files: only the model vocab can be checked
        return None
