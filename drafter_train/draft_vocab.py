"""A reduced draft vocabulary: the drafter's LM head covers only the most frequent target tokens.

On this project's CPU the 49,152 x 576 LM head of SmolLM2 alone costs 9 ms per token, more than the rest of a
one-layer drafter; EAGLE-3's answer is a head over the few thousand tokens that carry almost all of the mass of the
target's outputs. A target token outside the draft vocabulary can never be proposed, so never accepted.

Mapping conventions (EAGLE-3, vLLM, SGLang, speculators): the draft ids are the chosen target ids in ascending
order; `d2t[d] = target_id(d) - d` (an offset, so that `d + d2t[d]` is the target id), `t2d[t]` is True for the
target ids in the draft vocabulary.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch
from torch import Tensor

from drafter_train.errors import ConfigError


def select_draft_ids(counts: Tensor, size: int, always: Sequence[int] = ()) -> Tensor:
    """The `size` most frequent target ids by `counts` [V] (ties: lower id first), plus `always` (e.g. EOS ids),
    in ascending order. size = 0 or >= V: the whole vocabulary."""
    vocab = counts.numel()
    if size == 0 or size >= vocab:
        return torch.arange(vocab)
    always = sorted(set(int(t) for t in always if 0 <= int(t) < vocab))
    if len(always) > size:
        raise ConfigError(f"drafter.draft_vocab_size: {size} cannot hold the {len(always)} tokens it must include")
    score = counts.double().clone()
    score[always] = float("inf")  # kept whatever their frequency: EOS must be draftable
    # Stable descending sort on the count: among equal counts the lower id comes first.
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:size]).values


def check_size(size: int, target_vocab: int) -> None:
    if size > target_vocab:
        raise ConfigError(f"drafter.draft_vocab_size: {size} is larger than the target's vocabulary ({target_vocab})")


def mapping(draft_ids: Tensor, target_vocab: int) -> tuple[Tensor, Tensor]:
    """(d2t [Vd] long offsets, t2d [V] bool) for ascending draft ids."""
    d2t = draft_ids.long() - torch.arange(draft_ids.numel())
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_to_target(d2t: Tensor) -> Tensor:
    """[Vd] target id of each draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(d2t: Tensor, target_vocab: int) -> Tensor:
    """[V] draft id of each target id, -1 outside the draft vocabulary."""
    index = torch.full((target_vocab,), -1, dtype=torch.long, device=d2t.device)
    index[draft_to_target(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return index


def fingerprint(d2t: Tensor) -> str:
    """A short hash of the draft vocabulary (the config records it, so a d2t of another vocabulary is caught)."""
    return hashlib.sha256(draft_to_target(d2t.long().cpu()).numpy().tobytes()).hexdigest()[:16]


def check_mapping(d2t: Tensor, t2d: Tensor, head_rows: int, expected: Optional[str] = None) -> None:
    """Refuse a mapping that does not fit the LM head it came with (a d2t/t2d of another draft vocabulary):
    sizes, d2t/t2d agreement, and the vocabulary's fingerprint recorded when the head was made."""
    ids = draft_to_target(d2t.long())
    problem = None
    if expected is not None and fingerprint(d2t) != expected:
        problem = "d2t is not the draft vocabulary this head was trained with (fingerprint differs)"
    elif d2t.numel() != head_rows:
        problem = f"d2t maps {d2t.numel()} draft ids but the LM head has {head_rows} rows"
    elif int(t2d.sum()) != head_rows:
        problem = f"t2d marks {int(t2d.sum())} target ids but the LM head has {head_rows} rows"
    elif bool((ids < 0).any() or (ids >= t2d.numel()).any()) or not bool(t2d[ids.clamp(0, t2d.numel() - 1)].all()):
        problem = "d2t and t2d name different target ids"
    elif bool((ids[1:] <= ids[:-1]).any()):
        problem = "d2t does not map draft ids to ascending target ids"
    if problem:
        raise ConfigError(f"drafter.path: the draft vocabulary mapping does not match the LM head ({problem})")


def coverage(tokens: Tensor, t2d: Tensor) -> float:
    """Share of `tokens` (target ids) inside the draft vocabulary."""
    return float(t2d[tokens].float().mean()) if tokens.numel() else 1.0
