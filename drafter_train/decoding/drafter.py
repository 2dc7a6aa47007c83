"""The drafter interface the speculative decoder talks to, and the autoregressive drafter.

The decoder does not care how drafts are made: an AR drafter runs k cached forwards, a non-autoregressive drafter
(SpecDec) predicts all k in one pass. Both return a `Proposal` and are told, after verification, how much of the
sequence is still valid so they can cut their caches back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from drafter_train.decoding.cached_lm import CachedLM
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.drafters.nar import NARCaches, SpecDrafter
from drafter_train.errors import ConfigError


@dataclass
class Proposal:
    """k draft tokens and, for verify=sample, the distributions they were drawn from."""

    tokens: Tensor  # [k] long
    q_draft: Optional[Tensor] = None  # [k, V] processed draft probs; None when drafts were chosen greedily

    @property
    def draft_len(self) -> int:
        return self.tokens.numel()


class Drafter(Protocol):
    def reset(self) -> None:
        """Forget everything: a new sequence starts."""

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        """Propose `draft_len` tokens to follow `seq` [L] (prompt + everything accepted so far)."""

    def rollback(self, num_valid: int) -> None:
        """Only the first `num_valid` tokens of the last `seq` + proposal remain valid."""


class ARDrafter:
    """A small causal LM sharing the target's vocabulary: k cached forwards per proposal."""

    def __init__(self, model: PreTrainedModel):
        self.lm = CachedLM(model)

    def reset(self) -> None:
        self.lm.reset()

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        # Feed what the cache has not seen yet: the whole prompt at first, then 1 or 2 tokens per step
        # (the correction/bonus token, plus the last draft when all were accepted).
        logits = self.lm.forward(seq[self.lm.length :], num_logits=1)[-1]
        tokens, probs = [], []
        for i in range(draft_len):
            token, q = choose_token(logits, params, generator)
            tokens.append(token)
            probs.append(q)
            if i + 1 < draft_len:  # the last draft is only fed next step, if it is accepted
                logits = self.lm.forward(token.view(1), num_logits=1)[-1]
        q_draft = None if params.greedy else torch.stack(probs)
        return Proposal(tokens=torch.stack(tokens), q_draft=q_draft)

    def rollback(self, num_valid: int) -> None:
        self.lm.crop(num_valid)


class NARDrafter:
    """A Spec-Drafter (drafters/nar.py): all drafts of a proposal from ONE forward pass.

    The k per-position distributions do not depend on each other's draws, so q_draft[r] is exactly the
    distribution draft r was drawn from, whatever was drawn before it: speculative sampling stays lossless.
    """

    def __init__(self, model: SpecDrafter):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.caches = NARCaches(self.model)

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        if draft_len > self.model.draft_len:
            raise ConfigError(
                f"eval.draft_len: this Spec-Drafter has {self.model.draft_len} mask queries, cannot draft {draft_len}"
            )
        logits = self.model.draft_logits(seq[self.caches.length :], self.caches)  # [model draft_len, V]
        drafts = [choose_token(logits[r], params, generator) for r in range(draft_len)]
        q_draft = None if params.greedy else torch.stack([q for _, q in drafts])
        return Proposal(tokens=torch.stack([token for token, _ in drafts]), q_draft=q_draft)

    def rollback(self, num_valid: int) -> None:
        self.caches.crop(num_valid)  # drafts never enter the cache, so this only matters for shorter sequences


def make_drafter(model: PreTrainedModel) -> Drafter:
    """The decoder-side drafter for a model: one NAR pass per proposal for a Spec-Drafter, else AR."""
    return NARDrafter(model) if isinstance(model, SpecDrafter) else ARDrafter(model)
