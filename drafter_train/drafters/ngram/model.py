"""The ngram kind: prompt-lookup decoding (Saxena 2023; HF `prompt_lookup_num_tokens`, vLLM `method: ngram`).

No model and no training: the drafts are the tokens that followed the most recent earlier occurrence of the longest
suffix n-gram of the sequence so far (prompt and output), for n from `max_ngram` down to `min_ngram`. Where nothing
matches it proposes nothing and the step is a plain target step, so it never drafts blindly. It is the free
baseline every trained drafter must beat: it wins where the output copies its input (summaries, RAG, code edits).

Lossless like every kind: the drafts are deterministic, so q is one-hot on each draft (speculative sampling then
accepts draft d with probability p(d) and resamples from norm(max(0, p - onehot)) on rejection).

Corpus lookup (`drafter.corpus.path`, and `eval.lookup.corpus.path` ahead of any drafter): where the sequence itself
has no match, the drafts come from a corpus of earlier responses, a drafter-datagen folder (CorpusIndex). SuffixDecoding
(Oliaro et al. 2024, vLLM `method: suffix`) drafts from the target's earlier outputs the same way; a model's phrasing
repeats across answers ("Here are some", list markup, closing lines) where no prompt holds it.

A "drafter folder" is a config.json (model_type `ngram_drafter`, the n-gram sizes; `save_pretrained` writes it):
`drafter-eval drafter=ngram` builds one, `drafter=path` loads a saved one; `drafter-train` has nothing to train and
says so (so there is no run to export either).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModel, PretrainedConfig

from drafter_train.config import DrafterConfig
from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.drafters.registry import BuildContext, DrafterKind, register
from drafter_train.drafters.common.weightless import WeightlessModel
from drafter_train.decoding.lookup import check_corpus, corpus_index, followers, lookup_proposal
from drafter_train.errors import ConfigError

MODEL_TYPE = "ngram_drafter"


class NgramConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, corpus: Optional[dict] = None, **kwargs):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.corpus = corpus  # CorpusLookupConfig's fields (path, min_share, min_count), or None
        super().__init__(**kwargs)


class NgramModel(WeightlessModel):
    """Holds the n-gram settings so the kind saves, loads and reports like the others; it has no weights."""

    config_class = NgramConfig
    base_model_prefix = "ngram"


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
        self.corpus = corpus_index(getattr(model.config, "corpus", None))  # chains only: trees use the sequence

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
        return lookup_proposal(seq, draft_len, self.min_ngram, self.max_ngram, self.corpus)

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        pass


def build(cfg: DrafterConfig, ctx: BuildContext) -> NgramModel:
    if cfg.path != "lookup":
        model = load(cfg.path, ctx.dtype)
        check_corpus(model.config.corpus, ctx.tokenizer, "drafter.path (its corpus)")
        return model
    if ctx.for_training:
        raise ConfigError("drafter=ngram: prompt lookup has nothing to train; evaluate it with "
                          "drafter-eval drafter=ngram (drafter.min_ngram / drafter.max_ngram)")
    check_corpus(cfg.corpus, ctx.tokenizer, "drafter.corpus.path")
    # the corpus folder as an absolute path: a saved ngram folder is loaded from anywhere on this machine
    corpus = dict(dataclasses.asdict(cfg.corpus), path=str(Path(cfg.corpus.path).resolve())) \
        if cfg.corpus.enabled else None
    return NgramModel(NgramConfig(min_ngram=cfg.min_ngram, max_ngram=cfg.max_ngram, corpus=corpus,
                                  vocab_size=ctx.target.config.vocab_size))


def load(path: str, dtype: str) -> NgramModel:
    return NgramModel(NgramConfig.from_pretrained(path)).eval()  # a config.json only: there are no weights


def _no_loss(*args, **kwargs):
    raise ConfigError("drafter=ngram: prompt lookup has nothing to train")


KIND = register(DrafterKind(
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
))

AutoConfig.register(MODEL_TYPE, NgramConfig, exist_ok=True)
AutoModel.register(NgramConfig, NgramModel, exist_ok=True)
