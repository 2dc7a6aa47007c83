"""Datagen prompt sources and the eval/train split.

A source yields (prompt, reference) pairs in a fixed order: ShareGPT first user turns (default), a local
json / jsonl / parquet / txt file, or a `datasets` hub id (online only). ``select_prompts`` then drops unusable
prompts and splits the rest: evaluation prompts first, training prompts after them, disjoint by text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import datasets
from transformers import PreTrainedTokenizerBase

from drafter_train.config import DatagenConfig
from drafter_train.data.overlap import OverlapIndex
from drafter_train.data.prompts import BUILDERS, TEXT_COLUMNS, column_texts, find_column, load_prompts, read_prompt_table
from drafter_train.data.sharegpt import load_sharegpt_pairs, sharegpt_source
from drafter_train.errors import ConfigError
from drafter_train.targets import encode_prompt

# Column holding the source's own answer when datagen.response_field names none (absent: no reference).
RESPONSE_COLUMNS = ("response", "output", "answer", "completion")


@dataclass(frozen=True)
class TrainPrompt:
    """One training prompt, ready for the target."""

    index: int  # position among the training prompts (0-based): shard s holds [s * shard_size, (s+1) * shard_size)
    text: str
    prompt_ids: list[int]  # chat template applied (when on)
    reference_ids: list[int]  # the source's own answer, plain tokens, cut to max_new_tokens; [] if none
    sample: int = 0  # which of its datagen.samples_per_prompt answers this copy draws (vLLM seeds by it)


@dataclass
class Selection:
    """The split, plus why prompts were dropped (reported in datagen.json)."""

    eval_prompts: list[str] = field(default_factory=list)
    train: list[TrainPrompt] = field(default_factory=list)
    skipped: dict = field(default_factory=lambda: {"empty": 0, "duplicate": 0, "too_long": 0})

    def fingerprint(self, num_train: Optional[int] = None) -> str:
        """sha256 of the selected texts (of the first ``num_train`` training prompts when given): a resumed run must
        be continuing the same prompts, and a grown one must start with them."""
        texts = {"eval": self.eval_prompts, "train": [p.text for p in self.train[:num_train]]}
        return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


def source_name(cfg: DatagenConfig) -> str:
    """How datagen.json names the source (a changed name on rerun means different data)."""
    return sharegpt_source() if cfg.prompts is None else cfg.prompts


def open_source(cfg: DatagenConfig) -> Iterator[tuple[str, str]]:
    """(prompt, reference) pairs in source order. Files and hub datasets are read (and checked) at the call."""
    if cfg.prompts is None:
        return load_sharegpt_pairs()  # lazy: only as much of the file as the selection needs is parsed
    rows = _read_local(cfg.prompts) if is_local(cfg.prompts) else read_hub(cfg.prompts)
    where = cfg.prompts
    text_col = find_column(rows.column_names, cfg.prompt_field, TEXT_COLUMNS, where, "datagen", "prompt_field")
    ref_col = find_column(
        rows.column_names, cfg.response_field, RESPONSE_COLUMNS, where, "datagen", "response_field", required=False
    )
    texts = column_texts(rows, text_col, where, "datagen", "prompt_field")
    refs = column_texts(rows, ref_col, where, "datagen", "response_field") if ref_col else [""] * len(texts)
    return iter(zip(texts, refs))


def exclusion_index(cfg: DatagenConfig) -> Optional[OverlapIndex]:
    """The prompts of datagen.exclude's evaluation files, indexed once (None when it names none)."""
    if not cfg.exclude:
        return None
    texts = []
    for path in cfg.exclude:
        try:
            texts += load_prompts(path, 1 << 62)
        except ConfigError as err:  # the prompt reader names eval.prompts: name the option that gave the file
            raise ConfigError(f"datagen.exclude: {str(err).split(': ', 1)[-1]}") from None
    return OverlapIndex(texts)


def is_local(prompts: str) -> bool:
    """Existing paths and anything with a prompt-file suffix are local (a typo must not become a hub look-up)."""
    path = Path(prompts).expanduser()
    return path.exists() or path.suffix.lower() in BUILDERS or prompts.startswith(("/", ".", "~"))


def _read_local(path: str) -> datasets.Dataset:
    return read_prompt_table(path, "datagen")


def read_hub(name: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split="train")
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:  # offline, unknown id, no train split
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"datagen.prompts: {name} is not a local file and could not be loaded: {reason}") from err


def select_prompts(
    pairs: Iterable[tuple[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: DatagenConfig,
    chat_template: bool,
    exclude: Optional[OverlapIndex] = None,
) -> Selection:
    """Walk the source in order, dropping empty, duplicate (same stripped text), excluded (overlapping an evaluation
    file of datagen.exclude: exact or a shared long run of words) and too-long prompts, BEFORE the split: the first
    ``num_eval_prompts`` survivors are the evaluation prompts, the next ``num_prompts`` the training prompts.
    Dropping first keeps the split fixed-size; de-duplicating keeps eval text out of training."""
    selection, seen = Selection(), set()
    if exclude is not None:
        selection.skipped["excluded"] = 0
    wanted = cfg.num_eval_prompts + cfg.num_prompts
    for text, reference in pairs:
        text = text.strip()
        reason = "empty" if not text else "duplicate" if text in seen else None
        if reason is None and exclude is not None and (exclude.exact_matches(text) or exclude.shared_ngrams(text)):
            reason = "excluded"
        prompt_ids = encode_prompt(tokenizer, text, chat_template) if reason is None else []
        if reason is None and len(prompt_ids) > cfg.max_prompt_tokens:
            reason = "too_long"
        if reason is not None:
            selection.skipped[reason] += 1
            continue
        seen.add(text)
        _add(selection, cfg, text, prompt_ids, _reference_ids(tokenizer, reference, cfg.max_new_tokens))
        if len(selection.eval_prompts) + len(selection.train) >= wanted:
            break
    check_enough(selection, cfg)
    return selection


def _add(selection: Selection, cfg: DatagenConfig, text: str, prompt_ids: list[int], reference: list[int]) -> None:
    if len(selection.eval_prompts) < cfg.num_eval_prompts:
        selection.eval_prompts.append(text)
    else:
        selection.train.append(TrainPrompt(len(selection.train), text, prompt_ids, reference))


def _reference_ids(tokenizer: PreTrainedTokenizerBase, reference: str, max_new_tokens: int) -> list[int]:
    """Plain tokens (no BOS, no template): the answer as the target would continue after its prompt."""
    if not reference:
        return []
    return list(tokenizer(reference, add_special_tokens=False).input_ids[:max_new_tokens])


def check_enough(selection: Selection, cfg: DatagenConfig, what: str = "training prompts") -> None:
    """One line when the source leaves nothing to train on, with what was skipped and why."""
    if selection.train:
        return
    skipped = ", ".join(f"{n} {why}" for why, n in selection.skipped.items() if n) or "none skipped"
    raise ConfigError(
        f"datagen.prompts: no {what} left in {cfg.prompts or 'ShareGPT'} after "
        f"{len(selection.eval_prompts)} eval prompts ({skipped}; max_prompt_tokens={cfg.max_prompt_tokens})"
    )
