"""Turn a `DrafterConfig` into a drafter model that shares the target's vocabulary, whatever its kind."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_train.config import DrafterConfig
from drafter_train.drafters.registry import BuildContext, is_saved_drafter, resolve_kind
from drafter_train.errors import ModelNotFoundError
from drafter_train.targets import check_same_vocab, load_tokenizer


def load_drafter(
    cfg: DrafterConfig,
    target: PreTrainedModel,
    target_tok: PreTrainedTokenizerBase,
    dtype: str,
    for_training: bool = False,
    token_counts: Optional[Callable[[], torch.Tensor]] = None,
) -> PreTrainedModel:
    """Build (truncated:N, scratch, new...) or load (a folder or hub id) the drafter `cfg` names, as its kind does.

    for_training=True gives the drafter its own copy of any weights it shares with the target (the optimizer must
    never write into the target) and applies the freeze options. `token_counts` (training data statistics) is
    passed to kinds that derive something from the data when built new.
    """
    kind = resolve_kind(cfg)
    drafter = kind.build(cfg, BuildContext(target, target_tok, dtype, for_training, token_counts))
    if is_saved_drafter(cfg.path):
        check_same_vocab(target, target_tok, drafter, _tokenizer_or_none(cfg.path))
    if for_training:
        drafter.train()
        drafter.requires_grad_(True)
        freeze(drafter, cfg)
    return drafter


def freeze(drafter: PreTrainedModel, cfg: DrafterConfig) -> None:
    """Freeze input embeddings and/or the LM head (tied weights freeze together: they are one tensor)."""
    if cfg.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    if cfg.freeze_lm_head and drafter.get_output_embeddings() is not None:
        drafter.get_output_embeddings().requires_grad_(False)
        final_norm = getattr(drafter, "norm", None)  # drafters whose final norm is a direct child (EAGLE-3)
        if isinstance(final_norm, torch.nn.Module):
            final_norm.requires_grad_(False)


def _tokenizer_or_none(path: str):
    try:
        return load_tokenizer(path)
    except ModelNotFoundError:  # a drafter folder without tokenizer files: only the model vocab can be checked
        return None
