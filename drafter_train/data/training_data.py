"""What a training run reads: the distillation dataset and the held-out prompts its checkpoints are evaluated on
(drafter-train, and layer-skip's search)."""

from __future__ import annotations

import logging
from pathlib import Path

from drafter_train.config import RESPONSE_COLUMNS, TrainJobConfig
from drafter_train.data.prompts import load_prompt_records
from drafter_train.data.store import check_tokenizer, load_distill_dataset
from drafter_train.errors import ConfigError
from drafter_train.targets import encode_prompt

log = logging.getLogger(__name__)


def load_training_data(cfg: TrainJobConfig, tokenizer):
    """The distillation dataset, checked against what the config asks of it and the target's tokenizer."""
    check_tokenizer(cfg.train.data_dir, tokenizer, "train.data_dir")
    data = load_distill_dataset(cfg.train.data_dir)
    if 0 < cfg.train.max_records < len(data):
        data = data.select(range(cfg.train.max_records))  # a prefix: a grown folder keeps its first records
    column = RESPONSE_COLUMNS[cfg.train.response]
    if column == "reference_ids":
        data = data.filter(lambda r: len(r["reference_ids"]) > 0)
    if len(data) == 0:
        raise ConfigError(f"train.data_dir: {cfg.train.data_dir} has no records with {column}")
    if cfg.loss.uses_stored_logits and "topk_ids" not in data.column_names:
        raise ConfigError("loss.teacher=offline: the dataset has no stored logits (run datagen with store_topk > 0)")
    report_cut(data, column, cfg.train.max_seq_len)
    return data, column


def report_cut(data, column: str, max_seq_len: int) -> int:
    """Records longer than train.max_seq_len are cut (batches.collate: the prompt from the left, the response from
    the right, so later turns of a long conversation go first); say how many, once, instead of cutting silently."""
    lengths = full_lengths(data, column)
    cut = sum(n > max_seq_len for n in lengths)
    if cut:
        log.warning("drafter-train: %d of %d training records are longer than train.max_seq_len=%d and are cut to "
                    "it (the prompt from the left, the response from the right)", cut, len(lengths), max_seq_len)
    return cut


def full_lengths(data, column: str) -> list[int]:
    """Each record's prompt + response tokens before any cut (train.group_by_length sorts by them, cut to
    train.max_seq_len)."""
    columns, lengths = data.select_columns(["prompt_ids", column]), []
    for start in range(0, len(columns), 1024):  # read in chunks: no cache files written into the data folder
        part = columns[start:start + 1024]
        lengths += [len(p) + len(r) for p, r in zip(part["prompt_ids"], part[column])]
    return lengths


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
