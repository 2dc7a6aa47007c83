"""Training batches from the distillation dataset.

A record is prompt_ids + response_ids. Losses only concern the positions that predict response tokens, so a batch
carries, per row, the positions that predict each learned response token (`resp_pos`); the models' LM heads run on
those positions only (the prompt can be longer than the response and the vocabulary is large). Multi-turn records
(datagen.multi_turn) also carry a mask column: only the assistant tokens are learned, so `resp_pos` then has gaps
(the user turns), and kinds that need runs of consecutive tokens (draft blocks) check for them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from drafter_train.errors import ConfigError


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] right-padded prompt + response
    attention_mask: Tensor  # [B, T]
    resp_pos: Tensor  # [B, R] position whose logits predict response token j (0 where padded)
    resp_mask: Tensor  # [B, R] bool, True for real response tokens
    labels: Tensor  # [B, R] response tokens (0 where padded)
    topk_ids: Optional[Tensor] = None  # [B, R, K] target's stored top-k ids (offline teacher)
    topk_logits: Optional[Tensor] = None  # [B, R, K]
    # Spec-Drafter training (nar_distill.to_blocks): the context length of each of n draft blocks; the response
    # fields above then hold the blocks' positions, R = n * draft_len.
    context_lens: Optional[Tensor] = None  # [B, n]
    # EAGLE-3 training with the offline feature cache (data/feature_cache.py): the target's features at every
    # position and its final hidden states at the response positions (else computed online from the target).
    features: Optional[Tensor] = None  # [B, T, n * H]
    target_hidden: Optional[Tensor] = None  # [B, R, H]

    @property
    def num_tokens(self) -> int:
        return int(self.resp_mask.sum())

    def to(self, device) -> "Batch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v.to(device) for k, v in moved.items() if isinstance(v, Tensor)})


def mask_key(response_key: str) -> str:
    """The column marking which tokens of `response_key` are learned (multi-turn data: the assistant tokens;
    data/chat.py). Single-turn data has none: every response token is learned."""
    return response_key.replace("_ids", "_mask")


def _fit(prompt: list[int], response: list[int], mask: list[int], max_seq_len: int
         ) -> tuple[list[int], list[int], list[int]]:
    """Drop prompt tokens from the left (the response is what is learned), keeping at least one; then cut the
    response (and its mask) from the right."""
    response, mask = response[: max_seq_len - 1], mask[: max_seq_len - 1]
    return prompt[max(0, len(prompt) - (max_seq_len - len(response))) :] or prompt[-1:], response, mask


def collate(records: Sequence[dict], response_key: str, max_seq_len: int, pad_id: int, topk: bool = False) -> Batch:
    """Records -> a Batch whose response fields hold the learned tokens: all response tokens, or those its mask
    column marks (multi-turn: the assistant turns, not the user turns between them)."""
    masked = mask_key(response_key) in records[0]
    rows = [_fit(list(r["prompt_ids"]), list(r[response_key]),
                 list(r[mask_key(response_key)]) if masked else [1] * len(r[response_key]), max_seq_len)
            for r in records]
    learned = [[j for j, m in enumerate(mask) if m] for _, _, mask in rows]  # response indices learned
    seq_len = max(len(p) + len(r) for p, r, _ in rows)
    resp_len = max(max(len(js) for js in learned), 1)
    b = len(rows)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, seq_len, dtype=torch.long)
    resp_pos = torch.zeros(b, resp_len, dtype=torch.long)
    labels = torch.zeros(b, resp_len, dtype=torch.long)
    resp_mask = torch.zeros(b, resp_len, dtype=torch.bool)
    for i, ((prompt, response, _), js) in enumerate(zip(rows, learned)):
        n_p, n_r, index = len(prompt), len(js), torch.tensor(js, dtype=torch.long)
        input_ids[i, : n_p + len(response)] = torch.tensor(prompt + response)
        attention_mask[i, : n_p + len(response)] = 1
        resp_pos[i, :n_r] = n_p - 1 + index  # logits at t predict token t + 1
        labels[i, :n_r] = torch.tensor(response, dtype=torch.long)[index]
        resp_mask[i, :n_r] = True
    batch = Batch(input_ids, attention_mask, resp_pos, resp_mask, labels)
    if topk:
        batch.topk_ids, batch.topk_logits = _stack_topk(records, [len(r) for _, r, _ in rows], resp_len)
    return batch


def _stack_topk(records: Sequence[dict], lengths: list[int], resp_len: int) -> tuple[Tensor, Tensor]:
    k = len(records[0]["topk_ids"][0])
    ids = torch.zeros(len(records), resp_len, k, dtype=torch.long)
    logits = torch.zeros(len(records), resp_len, k)
    for i, (record, n) in enumerate(zip(records, lengths)):
        ids[i, :n] = torch.tensor(record["topk_ids"][:n], dtype=torch.long)
        logits[i, :n] = torch.tensor(record["topk_logits"][:n], dtype=torch.float32)
    return ids, logits


def token_counts(records, column: str, vocab_size: int, chunk: int = 1024) -> Tensor:
    """[vocab_size] occurrences of each token id in `column` over all records of a dataset (only the learned
    ones where the dataset has a mask column: multi-turn data)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    masked = mask_key(column) in records.column_names if hasattr(records, "column_names") else False
    if hasattr(records, "select_columns"):  # a datasets.Dataset: read only the columns needed
        records = records.select_columns([column, mask_key(column)] if masked else [column])
    for start in range(0, len(records), chunk):
        part = records[start : start + chunk]
        rows = part[column]
        masks = part[mask_key(column)] if masked else [[1] * len(row) for row in rows]
        if rows:
            ids = torch.tensor([t for row, mask in zip(rows, masks) for t, m in zip(row, mask) if m], dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


class BatchStream:
    """Seeded epoch permutations. The state (epoch, cursor) is checkpointed, so a resumed run draws exactly the
    batches the uninterrupted run would have. With several processes each rank takes its own slice of every
    global batch: data is sharded, not duplicated.

    group_by_length=N (with `lengths`, each record's tokens as trained): each epoch's permutation is cut into windows
    of N global batches, each window sorted by length into its batches, and the batches shuffled over the epoch, so a
    batch pads to the longest of records of similar length. On ShareGPT's whole conversations (up to 2048 tokens)
    random batches of 8 are 66 % real tokens, windows of 64 batches 99 % (docs/train.md, "A long run"). Still a
    function of (seed, epoch): resumes stay exact."""

    def __init__(self, num_records: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 lengths: Optional[Sequence[int]] = None, group_by_length: int = 0):
        self.global_batch = batch_size * world_size
        if num_records < self.global_batch:
            raise ConfigError(
                f"train.batch_size: {num_records} training records cannot fill one batch of {self.global_batch}"
            )
        if group_by_length and (lengths is None or len(lengths) != num_records):
            raise ValueError("group_by_length needs one length per record")
        self.num_records, self.batch_size, self.seed = num_records, batch_size, seed
        self.rank = rank
        self.epoch, self.cursor = 0, 0
        self.lengths = torch.as_tensor(lengths) if group_by_length else None
        self.group_by_length = group_by_length
        self._cached: tuple[int, Tensor] | None = None  # (epoch, its order): one permutation an epoch, not a step

    def _order(self) -> Tensor:
        if self._cached is None or self._cached[0] != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_records, generator=generator)
            if self.group_by_length:
                order = self._grouped(order, generator)
            self._cached = (self.epoch, order)
        return self._cached[1]

    def _grouped(self, order: Tensor, generator: torch.Generator) -> Tensor:
        """`order`'s whole global batches regrouped by length within windows, then shuffled as batches (the ragged
        tail, dropped by next_indices, stays last)."""
        usable = self.num_records // self.global_batch * self.global_batch
        window = self.group_by_length * self.global_batch
        parts = []
        for start in range(0, usable, window):
            chunk = order[start : min(start + window, usable)]
            parts.append(chunk[torch.sort(self.lengths[chunk], descending=True, stable=True).indices])
        batches = torch.cat(parts).view(-1, self.global_batch)
        batches = batches[torch.randperm(len(batches), generator=generator)]
        return torch.cat([batches.flatten(), order[usable:]])

    def next_indices(self) -> list[int]:
        if self.cursor + self.global_batch > self.num_records:  # drop the ragged tail: equal batches on all ranks
            self.epoch, self.cursor = self.epoch + 1, 0
        start = self.cursor + self.rank * self.batch_size
        self.cursor += self.global_batch
        return self._order()[start : start + self.batch_size].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
