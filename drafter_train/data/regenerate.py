"""datagen.multi_turn: the target's own answers for every assistant turn of a conversation, turn by turn.

Round r asks the backend (hf or vllm, the same `generate(prompts)` as single-turn datagen) for the next assistant
turn of every conversation of the shard that still has one: its prompt is the conversation so far, with the earlier
assistant turns already regenerated and the user turns as the source has them, rendered with the generation prompt.
The answer (up to its first EOS, which is not kept: the template writes the turn's end) replaces the source's
answer, and the next round continues. A turn whose prompt exceeds datagen.max_prompt_tokens ends its conversation
(conversations.py). A turn that reaches max_new_tokens without EOS is kept as cut and counted (``cut_turns``);
the end token the template writes after it is not learned, since the target did not stop there.

Resume mid-conversation: after every round, one JSON line with the round's answers is appended to
``shards/.shard-NNNNN.turns.jsonl`` (fsynced). A killed run replays the complete lines of the unfinished shard and
goes on with the next round; with sampling each round is seeded from (seed, shard, round), so the resumed data
equal an uninterrupted run's. The file is deleted once the shard is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from drafter_train.data.chat import ChatTemplate, strip_thinking
from drafter_train.data.conversations import TrainConversation, end_with_assistant
from drafter_train.data.sources import TrainPrompt

# Backend prompt ids (vLLM seeds sampling by it) of turn k of conversation c: c * TURN_STRIDE + k.
TURN_STRIDE = 1_000_000


@dataclass
class Dialogue:
    """One conversation being regenerated."""

    conv: TrainConversation
    messages: list = field(default_factory=list)  # the source's, answers replaced as they are regenerated
    done: int = 0  # messages [0, done) are final
    cut: list = field(default_factory=list)  # indices of the turns cut at max_new_tokens

    def next_turn(self) -> Optional[int]:
        return next((k for k in range(self.done, len(self.messages)) if self.messages[k]["role"] == "assistant"), None)

    def answer(self, k: int, content: str, cut: bool) -> None:
        self.messages[k] = dict(self.messages[k], content=content)
        self.done = k + 1
        if cut:
            self.cut.append(k)

    def end_before(self, k: int) -> None:
        """The turn at k does not fit: the conversation ends with the last regenerated turn."""
        self.messages = end_with_assistant(self.messages[:k])
        self.done = len(self.messages)


def progress_path(shards_dir: Path, index: int) -> Path:
    return shards_dir / f".shard-{index:05d}.turns.jsonl"


def round_seed(seed: int, shard: int, round_: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{shard}:{round_}".encode()).digest()[:8], "little") >> 1


def regenerate(backend, chat: ChatTemplate, convs: Sequence[TrainConversation], dg, shard: int, progress: Path,
               on_batch: Callable[[int, float], None]) -> list[Dialogue]:
    """Every assistant turn of ``convs`` regenerated (module doc); `on_batch(tokens, seconds)` after each call."""
    dialogues = [Dialogue(c, [dict(m) for m in c.messages]) for c in convs]
    round_ = _replay(progress, dialogues)
    while True:
        asks = _next_prompts(dialogues, chat, dg.max_prompt_tokens)
        if not asks:
            return dialogues
        torch.manual_seed(round_seed(dg.seed, shard, round_))
        answers = _generate(backend, asks, on_batch)
        lines = []
        for (dialogue, k, _), ids in zip(asks, answers):
            content, cut = answer_text(chat, ids, backend.eos_token_ids, dg.max_new_tokens)
            dialogue.answer(k, content, cut)
            lines.append([dialogue.conv.index, k, content, cut])
        _append(progress, {"round": round_, "turns": lines})
        round_ += 1


def _next_prompts(dialogues: list[Dialogue], chat: ChatTemplate, max_prompt_tokens: int) -> list[tuple]:
    asks = []
    for dialogue in dialogues:
        k = dialogue.next_turn()
        if k is None:
            continue
        ids = chat.prompt_ids(dialogue.messages[:k])
        if len(ids) > max_prompt_tokens:
            dialogue.end_before(k)
            continue
        asks.append((dialogue, k, ids))
    return asks


def _generate(backend, asks: list[tuple], on_batch) -> list[list[int]]:
    """Response ids per ask, batched by prompt length as single-turn datagen does."""
    prompts = [TrainPrompt(d.conv.index * TURN_STRIDE + k, d.conv.text, ids, []) for d, k, ids in asks]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i].prompt_ids))
    size = backend.batch_size or len(prompts)
    answers: list = [None] * len(prompts)
    for start in range(0, len(by_length), size):
        batch = by_length[start:start + size]
        outputs, seconds = backend.generate([prompts[i] for i in batch])
        on_batch(sum(len(o.response_ids) for o in outputs), seconds)
        for i, output in zip(batch, outputs):
            answers[i] = output.response_ids
    return answers


def answer_text(chat: ChatTemplate, ids: list[int], eos: Sequence[int], max_new_tokens: int) -> tuple[str, bool]:
    """The answer's text (its final EOS dropped; special tokens inside are kept so the rendering has them again)
    and whether it was cut at max_new_tokens."""
    stopped = bool(ids) and ids[-1] in set(eos)
    text = chat.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
    if chat.thinking == "strip":  # a target that thinks anyway: its blocks go, as the source's did
        text = strip_thinking([{"role": "assistant", "content": text}])[0]["content"]
    return text, not stopped and len(ids) >= max_new_tokens


def _replay(progress: Path, dialogues: list[Dialogue]) -> int:
    """Apply the complete rounds a killed run left; returns how many there were."""
    if not progress.is_file():
        return 0
    by_index = {d.conv.index: d for d in dialogues}
    rounds = 0
    for line in progress.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill: that round is redone
            break
        if entry.get("round") != rounds:
            break
        for index, k, content, cut in entry["turns"]:
            by_index[index].answer(k, content, cut)
        rounds += 1
    _truncate_after(progress, rounds)
    return rounds


def _truncate_after(progress: Path, rounds: int) -> None:
    lines = progress.read_text(encoding="utf-8").splitlines()[:rounds]
    progress.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _append(progress: Path, entry: dict) -> None:
    with open(progress, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(entry, ensure_ascii=False) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
