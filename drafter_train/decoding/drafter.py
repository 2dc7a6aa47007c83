"""The drafter interface the speculative decoder talks to, and the autoregressive drafter.

The decoder does not care how drafts are made: an AR drafter runs k cached forwards, a non-autoregressive drafter
(SpecDec) predicts all k in one pass, an EAGLE-3 drafter reads the target's own hidden states. Each returns a
`Proposal`, and after every target pass is told how much of the sequence is verified (`commit`), with the target's
features of the newly verified positions when it reads them. Each kind's module (drafters/) builds its drafter.

A drafter that drafts on the target's own KV cache (self-speculative layer skipping) also has
`share_target(lm: CachedLM)`, which the decoder calls after `reset` with the target's cache of the verified prefix.

Draft trees (decoding/tree.py) are grown by the decoder through two more calls, `tree_root` and `tree_expand`;
after a tree pass `commit` also gets the accepted path, so that caches keep the prefix and that path only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from drafter_train.decoding.cached_lm import CachedLM
from drafter_train.decoding.draft_exit import draft_confidence
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.decoding.tree import TreeDrafter, TreePool, attention_mask


@dataclass
class Proposal:
    """k draft tokens and, for verify=sample, the distributions they were drawn from."""

    tokens: Tensor  # [k] long
    q_draft: Optional[Tensor] = None  # [k, V] processed draft probs; None when drafts were chosen greedily
    # Made by prompt lookup ahead of the drafter (eval.lookup): counted apart, and not fed to draft exit's adaptation.
    from_lookup: bool = False

    @property
    def draft_len(self) -> int:
        return self.tokens.numel()


class Drafter(TreeDrafter, Protocol):
    """What the decoders call. Trees: the two calls of decoding/tree.py's TreeDrafter (draft_ids, tree_root,
    tree_expand) and `commit`'s path."""

    # Target layers whose outputs this drafter reads (features.py convention); empty: it reads none.
    feature_layers: Sequence[int]

    def reset(self) -> None:
        """Forget everything: a new sequence starts."""

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        """Propose `draft_len` tokens to follow `seq` [L] (prompt + everything accepted so far)."""

    def commit(self, num_valid: int, features: Optional[Tensor], path: Optional[Sequence[int]] = None) -> None:
        """A target pass verified the sequence up to `num_valid` tokens: anything beyond (rejected drafts) is gone.

        features [n, F]: the target's features (at `feature_layers`) of the n positions that pass verified and kept,
        i.e. positions num_valid - n .. num_valid - 1; None for drafters that read none.
        path: after a tree pass, the accepted nodes (candidate ids of the last tree's pool, root side first); None
        after a chain.
        """


class ARDrafter:
    """A small causal LM sharing the target's vocabulary: k cached forwards per proposal.

    Trees: one cached forward per depth over the nodes it expands, each attending to the prefix, its ancestors and
    itself; after verification the cache keeps the prefix and the accepted nodes it holds (an index selection).
    """

    feature_layers: Sequence[int] = ()
    exit_below: float = 0.0  # adaptive draft exit's threshold γ for the next proposal (0 = off)
    draft_ids: Optional[Tensor] = None

    def __init__(self, model: PreTrainedModel):
        self.lm = CachedLM(model)

    def reset(self) -> None:
        self.lm.reset()
        self.base, self.slots = 0, {}  # the tree's prefix length; expanded node -> its cache position

    def propose(
        self, seq: Tensor, draft_len: int, params: SamplingParams, generator: Optional[torch.Generator]
    ) -> Proposal:
        # Feed what the cache has not seen yet: the whole prompt at first, then 1 or 2 tokens per step
        # (the correction/bonus token, plus the last draft when all were accepted).
        logits = self.lm.forward(seq[self.lm.length :], num_logits=1)[-1]
        tokens, probs = [], []
        for i in range(draft_len):
            token, q = choose_token(logits, params, generator)
            if self.exit_below and draft_confidence(logits, q, params) < self.exit_below:
                break  # adaptive draft exit (decoding/draft_exit.py)
            tokens.append(token)
            probs.append(q)
            if i + 1 < draft_len:  # the last draft is only fed next step, if it is accepted
                logits = self.lm.forward(token.view(1), num_logits=1)[-1]
        if not tokens:  # the first draft was already unsure: a plain target step (as the loop's k == 0 step)
            return Proposal(seq.new_empty(0))
        q_draft = None if params.greedy else torch.stack(probs)
        return Proposal(tokens=torch.stack(tokens), q_draft=q_draft)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path: Optional[Sequence[int]] = None) -> None:
        if path is not None:  # keep the prefix and the accepted nodes that were fed (a prefix of the path)
            kept = [self.slots[node] for node in path if node in self.slots]
            self.lm.keep(torch.cat([torch.arange(self.base), torch.tensor(kept, dtype=torch.long)]).to(self.lm.device))
            self.slots = {}
        self.lm.crop(num_valid)

    def tree_root(self, seq: Tensor) -> Tensor:
        logits = self.lm.forward(seq[self.lm.length :], num_logits=1)[-1]
        self.base, self.slots = self.lm.length, {}
        return logits

    def tree_expand(self, pool: TreePool, nodes: list[int]) -> Tensor:
        fed = list(self.slots)  # expanded nodes, in cache order
        mask = attention_mask(pool.visible(nodes, fed + nodes), self.base, self.lm.model.dtype)
        # seq[-1] sits at base - 1, so a depth-d node at base + d - 1
        positions = torch.tensor([[self.base + pool.depths[n] - 1 for n in nodes]], device=self.lm.device)
        logits = self.lm.forward_tree(torch.tensor([pool.tokens[n] for n in nodes], device=self.lm.device), mask,
                                      positions)
        self.slots.update({node: self.base + len(fed) + i for i, node in enumerate(nodes)})
        return logits
