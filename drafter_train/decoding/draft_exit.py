"""Adaptive draft exit (Draft & Verify, Zhang et al. 2024, §3.3): stop drafting when the drafter is unsure.

An autoregressive drafter stops a proposal at the first draft whose top-1 draft probability is below the threshold
γ; when even the first one is, it proposes nothing and the step is a plain target step (1 token for a 1-token
pass). Where a multi-token verify pass costs far more than a 1-token one (this CPU: ~1.6-2x), unlikely drafts are
not worth verifying. The decision reads only the drafter's own distribution, so verification stays lossless.

γ adapts to the measured acceptance with the paper's rule, after every verified proposal:

    r  <- β1·r + (1 − β1)·(accepted / drafted)         smoothed acceptance of the drafted tokens
    γ' <- γ + ε  if r <= target  else  γ − ε          raise the bar while acceptance is below the target
    γ  <- β2·γ + (1 − β2)·γ'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from drafter_train.decoding.sampling import SamplingParams


@dataclass
class DraftExit:
    threshold: float  # γ: stop before a draft whose top-1 draft probability is below it (0 = never)
    adapt: bool = False
    target: float = 0.9  # acceptance the adaptation steers to
    beta1: float = 0.5
    beta2: float = 0.9
    epsilon: float = 0.01
    rate: Optional[float] = field(default=None, init=False)  # smoothed acceptance; None before the first proposal

    def update(self, drafted: int, accepted: int) -> None:
        """One verified proposal of `drafted` tokens, `accepted` of them kept."""
        if not self.adapt or drafted == 0:
            return
        step = accepted / drafted
        self.rate = step if self.rate is None else self.beta1 * self.rate + (1 - self.beta1) * step
        moved = self.threshold + self.epsilon if self.rate <= self.target else self.threshold - self.epsilon
        self.threshold = min(1.0, max(0.0, self.beta2 * self.threshold + (1 - self.beta2) * moved))


def draft_confidence(logits: Tensor, q: Optional[Tensor], params: SamplingParams) -> float:
    """The drafter's top-1 probability for its next draft: of the processed distribution q when sampling, of
    softmax(logits) when drafting greedily (where q is not formed)."""
    probs = q if q is not None and not params.greedy else torch.softmax(logits.float(), dim=-1)
    return float(probs.detach().max())


def supports_draft_exit(drafter: object) -> bool:
    """Drafters that make drafts one at a time carry `exit_below` (γ for the next proposal)."""
    return hasattr(drafter, "exit_below")
