"""Export of a seq2seq AR drafter as an HF folder that transformers' assisted generation takes as `assistant_model`
for the same target (a Spec-Drafter drafts without autoregression, which assisted generation cannot drive)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from drafter_train.errors import ConfigError
from drafter_train.seq2seq.drafters import SpecDrafter


def export_assistant(drafter: PreTrainedModel, out_dir: str, draft_len: int, tokenizer=None) -> Path:
    """Save the drafter (its own class: Marian, BART, T5, Whisper ...) with assisted-generation settings: a constant
    `num_assistant_tokens` = draft_len drafts per target pass, as this project's chains do."""
    if isinstance(drafter, SpecDrafter):
        raise ConfigError("export.format: a Spec-Drafter (NAR) is not an autoregressive model; transformers' "
                          "assisted generation needs an AR drafter (export the AR seq2seq drafter)")
    drafter.generation_config.update(num_assistant_tokens=draft_len, num_assistant_tokens_schedule="constant")
    drafter.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
