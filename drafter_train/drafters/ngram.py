"""The ngram kind: prompt-lookup decoding (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM `method: ngram`).

No model and no training: the drafts are the tokens that followed the most recent earlier occurrence of the longest
suffix n-gram of the sequence so far (prompt and output), for n from `max_ngram` down to `min_ngram`. Where nothing
matches it proposes nothing and the step is a plain target step, so it never drafts blindly. It is the free
baseline every trained drafter must beat: it wins where the output copies its input (summaries, RAG, code edits).

Lossless like every kind: the drafts are deterministic, so q is one-hot on each draft (speculative sampling then
accepts draft d with probability p(d) and resamples from norm(max(0, p - onehot)) on rejection).

A "drafter folder" is a config.json (model_type `ngram_drafter`, the n-gram sizes; `save_pretrained` writes it):
`drafter-eval drafter=ngram` builds one, `drafter=path` loads a saved one; `drafter-train` has nothing to train and
says so (so there is no run to export either).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModel, PretrainedConfig

from drafter_train.config import DrafterConfig, NgramDrafterConfig
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.drafters.registry import BuildContext, DrafterKind
from drafter_train.drafters.weightless import WeightlessModel
from drafter_train.errors import ConfigError

MODEL_TYPE = "ngram_drafter"


class NgramConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, **kwargs):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        super().__init__(**kwargs)


class NgramModel(WeightlessModel):
    """Holds the n-gram settings so the kind saves, loads and reports like the others; it has no weights."""

    config_class = NgramConfig
    base_model_prefix = "ngram"


def lookup(tokens: list[int], draft_len: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to `draft_len` tokens that followed the most recent earlier occurrence of the longest matching suffix
    n-gram of `tokens` (n = max_ngram .. min_ngram); [] when no suffix n-gram occurred before."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # most recent first; the suffix itself is excluded
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + draft_len]
                if follow:
                    return follow
    return []


def followers(tokens: list[int], min_ngram: int, max_ngram: int) -> dict[int, float]:
    """The tokens that followed earlier occurrences of the longest suffix n-gram of `tokens` that occurred before
    (n = max_ngram .. min_ngram), each scored by how often it followed (ties: the more recent first); {} when no
    suffix n-gram occurred before."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix, scores = tokens[length - n:], {}
        for start in range(length - n - 1, -1, -1):  # most recent first; the suffix itself is excluded
            if tokens[start:start + n] == suffix:
                follower = tokens[start + n]
                # +1 per occurrence, and a recency bonus below 1 (the most recent occurrence adds the most)
                scores[follower] = scores.get(follower, 0.0) + 1 + 1e-3 * (start + 1) / length
        if scores:
            return scores
    return {}


def lookup_proposal(seq: Tensor, draft_len: int, min_ngram: int, max_ngram: int, from_lookup: bool = False) -> Proposal:
    """lookup() on `seq` [L] as a Proposal (empty without a match). Deterministic drafts: q is one-hot (verify.py)."""
    drafts = lookup(seq.tolist(), draft_len, min_ngram, max_ngram)
    return Proposal(torch.tensor(drafts, dtype=torch.long, device=seq.device), q_draft=None, from_lookup=from_lookup)


class PromptLookupDrafter:
    """The decoder-side prompt-lookup drafter (no cache: each proposal searches the sequence).

    Trees (a retrieval tree, as in REST / lookahead decoding): a node's children are the tokens that followed the
    earlier occurrences of the longest suffix n-gram of the sequence continued by the node's path, with logits
    log(occurrences); a node whose context matches nothing has no children.
    """

    feature_layers: Sequence[int] = ()
    draft_ids: Optional[Tensor] = None

    def __init__(self, model: NgramModel):
        self.min_ngram, self.max_ngram = model.config.min_ngram, model.config.max_ngram
        self.vocab_size = getattr(model.config, "vocab_size", None)  # the target's (trees score every token id)

    def _logits(self, tokens: list[int], device: torch.device) -> Tensor:
        """[V] log(score) of each follower (followers()), -inf for every other token."""
        if not self.vocab_size:
            raise ConfigError("drafter.path: this ngram folder records no vocab_size (the target's), which draft "
                              "trees need; save it again with drafter-eval drafter=ngram")
        logits = torch.full((self.vocab_size,), float("-inf"), device=device)
        scores = followers(tokens, self.min_ngram, self.max_ngram)
        if scores:
            logits[list(scores)] = torch.tensor(list(scores.values()), device=device).log()
        return logits

    def tree_root(self, seq: Tensor) -> Tensor:
        self.seq = seq.tolist()
        return self._logits(self.seq, seq.device)

    def tree_expand(self, pool, nodes: list[int]) -> Tensor:
        paths = [[pool.tokens[a] for a in pool.ancestors_of(node)] for node in nodes]
        return torch.stack([self._logits(self.seq + path, pool.device) for path in paths])

    def reset(self) -> None:
        pass

    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        return lookup_proposal(seq, draft_len, self.min_ngram, self.max_ngram)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        pass


class LookupFirst:
    """Prompt lookup ahead of any drafter (eval.lookup): where the sequence's last n-gram occurred earlier, the
    tokens that followed it are the proposal and the drafter is not run; elsewhere the drafter proposes. The drafter
    is still told every commit, so a drafter that reads target features takes those of the lookup steps into its
    cache at its next proposal. Anything else (feature_layers, draft_vocab, share_target, exit_below) is the
    drafter's own, so draft exit applies where the drafter has it, to the drafter's proposals only."""

    def __init__(self, drafter, min_ngram: int, max_ngram: int):
        self.drafter, self.min_ngram, self.max_ngram = drafter, min_ngram, max_ngram

    def __getattr__(self, name: str):
        if name == "drafter":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    @property
    def exit_below(self) -> float:
        return self.drafter.exit_below  # AttributeError for drafters without draft exit: hasattr() is False

    @exit_below.setter
    def exit_below(self, value: float) -> None:
        self.drafter.exit_below = value

    def reset(self) -> None:
        self.drafter.reset()

    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams,
                generator: Optional[torch.Generator]) -> Proposal:
        proposal = lookup_proposal(seq, draft_len, self.min_ngram, self.max_ngram, from_lookup=True)
        return proposal if proposal.draft_len else self.drafter.propose(seq, draft_len, params, generator)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        self.drafter.commit(num_valid, features, path)


def lookup_first(drafter, min_ngram: int, max_ngram: int):
    """`drafter` behind prompt lookup (eval.lookup); the drafter itself when min_ngram is 0 (off)."""
    return LookupFirst(drafter, min_ngram, max_ngram) if min_ngram > 0 else drafter


def build(cfg: DrafterConfig, ctx: BuildContext) -> NgramModel:
    if cfg.path != "lookup":
        return load(cfg.path, ctx.dtype)
    if ctx.for_training:
        raise ConfigError("drafter=ngram: prompt lookup has nothing to train; evaluate it with "
                          "drafter-eval drafter=ngram (drafter.min_ngram / drafter.max_ngram)")
    return NgramModel(NgramConfig(min_ngram=cfg.min_ngram, max_ngram=cfg.max_ngram,
                                  vocab_size=ctx.target.config.vocab_size))


def load(path: str, dtype: str) -> NgramModel:
    return NgramModel(NgramConfig.from_pretrained(path)).eval()  # a config.json only: there are no weights


def _no_loss(*args, **kwargs):
    raise ConfigError("drafter=ngram: prompt lookup has nothing to train")


KIND = DrafterKind(
    name="ngram",
    description="a prompt-lookup (n-gram) drafter",
    model_type=MODEL_TYPE,
    config_class=NgramDrafterConfig,
    build=build,
    load=load,
    decoder_drafter=PromptLookupDrafter,
    loss=_no_loss,
    summary="Prompt-lookup decoding: drafts copy what followed the latest earlier occurrence of the sequence's "
            "last n-gram; no model, no training.",
    card_tags=("prompt-lookup", "ngram"),
    has_weights=False,
)

AutoConfig.register(MODEL_TYPE, NgramConfig, exist_ok=True)
AutoModel.register(NgramConfig, NgramModel, exist_ok=True)
