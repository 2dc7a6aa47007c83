"""What a training run reads: the distillation dataset and the held-out prompts its checkpoints are evaluated on
(drafter-train, and layer-skip's search)."""

from __future__ import annotations

from pathlib import Path

from drafter_train.config import TrainJobConfig
from drafter_train.data.prompts import load_prompt_records
from drafter_train.data.store import check_tokenizer, load_distill_dataset
from drafter_train.errors import ConfigError
from drafter_train.targets import encode_prompt


def load_training_data(cfg: TrainJobConfig, tokenizer):
    """The distillation dataset, checked against what the config asks of it and the target's tokenizer."""
    check_tokenizer(cfg.train.data_dir, tokenizer, "train.data_dir")
    data = load_distill_dataset(cfg.train.data_dir)
    column = "response_ids" if cfg.train.response == "target" else "reference_ids"
    if column == "reference_ids":
        data = data.filter(lambda r: len(r["reference_ids"]) > 0)
    if len(data) == 0:
        raise ConfigError(f"train.data_dir: {cfg.train.data_dir} has no records with {column}")
    if cfg.loss.uses_stored_logits and "topk_ids" not in data.column_names:
        raise ConfigError("loss.teacher=offline: the dataset has no stored logits (run datagen with store_topk > 0)")
    return data, column


def eval_prompts_path(cfg: TrainJobConfig) -> str:
    """Where a run's checkpoints are evaluated: eval.prompts (the dev split by default, conf/train.yaml), else the
    prompts drafter-datagen split off before training."""
    return cfg.eval.prompts or str(Path(cfg.train.data_dir) / "eval_prompts.jsonl")


def eval_prompt_texts(cfg: TrainJobConfig) -> list[str]:
    return [text for text, _ in load_prompt_records(eval_prompts_path(cfg), cfg.eval.num_prompts, cfg.eval.prompt_field)]


def eval_prompt_ids(cfg: TrainJobConfig, tokenizer) -> tuple[list[list[int]], list]:
    """Held-out prompts (token ids, and task categories where the file has them), from eval_prompts_path."""
    records = load_prompt_records(eval_prompts_path(cfg), cfg.eval.num_prompts, cfg.eval.prompt_field)
    return [encode_prompt(tokenizer, text, cfg.target.chat_template) for text, _ in records], [c for _, c in records]
