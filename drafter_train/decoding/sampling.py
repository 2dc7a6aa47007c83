"""Sampling helpers shared by the drafter, the target, the AR baseline and the evaluator.

One function turns logits into the distribution that is actually sampled from (temperature, top-k, top-p), so the
target's p and the drafter's q in speculative sampling are processed identically: the losslessness proof of
Leviathan et al. (2023) holds for whatever p is, as long as the same p is used by the AR baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = keep all tokens
    top_p: float = 1.0  # 1.0 = keep all tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Processed sampling distribution.

    logits: [..., V] -> probs: [..., V] float32, zero outside the top-k / top-p set.
    """
    logits = logits.float()
    # Shifted so that the largest logit is 0 before dividing: softmax is unchanged, and at a tiny temperature (any
    # eval.temperature > 0 is accepted, down to the smallest positive float, which is 0 in float32) the quotients run
    # to -inf instead of inf, and inf - inf = NaN: the top token(s) keep 0, i.e. greedy with ties shared.
    # A row with no finite logit (a lookup that matched nothing: no children) is left as it was, so it stays a row
    # that proposes nothing instead of becoming uniform.
    top = logits.amax(-1, keepdim=True)
    shifted = torch.where(logits == top, 0.0, (logits - top) / params.temperature)
    logits = torch.where(torch.isfinite(top), shifted, logits / params.temperature)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top-1 token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(probs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One draw per row. probs: [..., V] -> tokens: [...] (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose_token(
    logits: Tensor, params: SamplingParams, generator: Optional[torch.Generator]
) -> tuple[Tensor, Optional[Tensor]]:
    """Pick one token from logits [V]: (token [] long, probs [V] or None when greedy)."""
    if params.greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, params)
    return sample(probs, generator), probs
