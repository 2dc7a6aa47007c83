"""Turn `drafter.path` into a drafter model that shares the target's vocabulary."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from drafter_train.config import DrafterConfig
from drafter_train.drafters.truncated import cut_from_target, parse_truncated
from drafter_train.errors import ModelNotFoundError
from drafter_train.targets import check_same_vocab, load_causal_lm, load_tokenizer


def load_drafter(
    cfg: DrafterConfig, target: PreTrainedModel, target_tok: PreTrainedTokenizerBase, dtype: str
) -> PreTrainedModel:
    """`truncated:N` cuts the target; anything else loads a causal LM and checks its vocabulary."""
    num_layers = parse_truncated(cfg.path)
    if num_layers is not None:
        return cut_from_target(target, num_layers)
    drafter = load_causal_lm(cfg.path, dtype).to(target.device)
    try:
        drafter_tok = load_tokenizer(cfg.path)
    except ModelNotFoundError:  # a drafter folder without tokenizer files: only the model vocab can be checked
        drafter_tok = None
    check_same_vocab(target, target_tok, drafter, drafter_tok)
    return drafter
