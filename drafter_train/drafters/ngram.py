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

import numpy as np
import torch
from torch import Tensor
from transformers import AutoConfig, AutoModel, PretrainedConfig

from drafter_train.config import CorpusLookupConfig, DrafterConfig, LookupConfig, NgramDrafterConfig
from drafter_train.data.store import check_tokenizer, load_distill_dataset
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.drafters.registry import BuildContext, DrafterKind
from drafter_train.drafters.weightless import WeightlessModel
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


class CorpusIndex:
    """A corpus of token sequences, searchable by the 1- to 3-grams it contains.

    `propose(tokens, k)`: for the longest suffix n-gram of `tokens` (n = 3..1) found at least `min_count` times, walk
    its occurrences forward: the next draft is the token most of them continue with, kept while it continues at least
    `min_count` of them and a `min_share` of those still walked (SuffixDecoding's frequency rule); the walk goes on
    with the occurrences that agree. [] where nothing qualifies: then the step belongs to the next source.

    Each n-gram is one integer (its tokens as digits in base `self.base`, exact: no hashing), sorted once, so a lookup
    is a binary search; at most the last `MAX_OCCURRENCES` occurrences are walked.
    """

    MAX_NGRAM, MAX_OCCURRENCES, SEPARATOR = 3, 512, -1

    def __init__(self, sequences: Sequence[Sequence[int]], min_share: float = 0.3, min_count: int = 2):
        self.min_share, self.min_count = min_share, min_count
        flat = [t for seq in sequences for t in (*seq, self.SEPARATOR)]
        self.tokens = np.asarray(flat, dtype=np.int64)
        self.base = int(self.tokens.max(initial=0)) + 1
        if self.base ** self.MAX_NGRAM >= 2 ** 63:
            raise ValueError(f"token ids up to {self.base - 1} do not fit the corpus index")
        self.keys, self.follow = {}, {}
        for n in range(1, self.MAX_NGRAM + 1):
            starts = np.arange(max(0, len(flat) - n))  # n-gram tokens[s:s+n], followed by tokens[s+n]
            grams = np.stack([self.tokens[starts + j] for j in range(n)], axis=1) if len(starts) else np.zeros((0, n))
            valid = (grams >= 0).all(axis=1)
            keys = self._key(grams[valid])
            order = np.argsort(keys, kind="stable")  # equal n-grams stay in corpus order
            self.keys[n], self.follow[n] = keys[order], (starts[valid] + n)[order]

    def _key(self, grams: np.ndarray) -> np.ndarray:
        key = np.zeros(len(grams), dtype=np.int64)
        for column in grams.T:
            key = key * self.base + column
        return key

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for n in range(min(self.MAX_NGRAM, len(tokens)), 0, -1):
            suffix = np.asarray(tokens[len(tokens) - n:], dtype=np.int64)
            if suffix.max() >= self.base:
                continue  # a token the corpus never holds: no n-gram with it can match (a shorter one may)
            key = self._key(suffix[None])[0]
            lo, hi = np.searchsorted(self.keys[n], key, "left"), np.searchsorted(self.keys[n], key, "right")
            if hi - lo >= self.min_count:
                return self._walk(self.follow[n][max(lo, hi - self.MAX_OCCURRENCES):hi], k)
        return []

    def _walk(self, positions: np.ndarray, k: int) -> list[int]:
        drafts = []
        while len(drafts) < k:
            following = self.tokens[positions]
            ids, counts = np.unique(following[following >= 0], return_counts=True)
            if not len(ids):
                break
            best = int(counts.argmax())  # ties: the smaller token id
            if counts[best] < self.min_count or counts[best] < self.min_share * len(positions):
                break
            drafts.append(int(ids[best]))
            positions = positions[following == ids[best]] + 1
        return drafts


def _corpus_settings(cfg: CorpusLookupConfig | dict | None) -> Optional[CorpusLookupConfig]:
    """The corpus settings (a saved ngram folder holds them as a dict), or None when no corpus is configured."""
    cfg = CorpusLookupConfig(**cfg) if isinstance(cfg, dict) else cfg
    return cfg if cfg is not None and cfg.enabled else None


def corpus_index(cfg: CorpusLookupConfig | dict | None) -> Optional[CorpusIndex]:
    """The CorpusIndex of a drafter-datagen folder's responses (each record's target response, else its reference
    answer); None when no corpus is configured. A folder that is not datagen output is refused in one line."""
    cfg = _corpus_settings(cfg)
    if cfg is None:
        return None
    data = load_distill_dataset(cfg.path)
    sequences = [own or reference for own, reference in zip(data["response_ids"], data["reference_ids"])]
    return CorpusIndex(sequences, cfg.min_share, cfg.min_count)


def check_corpus(cfg: CorpusLookupConfig | dict | None, tokenizer, option: str) -> None:
    """Refuse (one line, naming `option`) a corpus folder whose token ids come from another tokenizer."""
    cfg = _corpus_settings(cfg)
    if cfg is not None:
        check_tokenizer(cfg.path, tokenizer, option)


def lookup_proposal(seq: Tensor, draft_len: int, min_ngram: int, max_ngram: int,
                    corpus: Optional[CorpusIndex] = None) -> Proposal:
    """lookup() on `seq` [L] (not searched for min_ngram 0), else `corpus`'s proposal, as a Proposal (empty where
    neither matches). Deterministic drafts: q is one-hot (verify.py)."""
    tokens = seq.tolist()
    drafts = lookup(tokens, draft_len, min_ngram, max_ngram) if min_ngram else []
    if not drafts and corpus is not None:
        drafts = corpus.propose(tokens, draft_len)
    return Proposal(torch.tensor(drafts, dtype=torch.long, device=seq.device), q_draft=None)


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


class LookupFirst:
    """Prompt lookup ahead of any drafter (eval.lookup): where the sequence's last n-gram occurred earlier, the
    tokens that followed it are the proposal and the drafter is not run; next, with a corpus (eval.lookup.corpus),
    where the corpus continues the sequence's last tokens; elsewhere the drafter proposes. The drafter
    is still told every commit, so a drafter that reads target features takes those of the lookup steps into its
    cache at its next proposal. Anything else (feature_layers, draft_vocab, share_target, exit_below) is the
    drafter's own, so draft exit applies where the drafter has it, to the drafter's proposals only."""

    def __init__(self, drafter, min_ngram: int, max_ngram: int, corpus: Optional[CorpusIndex] = None):
        self.drafter, self.min_ngram, self.max_ngram, self.corpus = drafter, min_ngram, max_ngram, corpus

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
        drafts = self.lookup_chain(seq, draft_len)
        if drafts.numel():
            return Proposal(drafts, q_draft=None, from_lookup=True)
        return self.drafter.propose(seq, draft_len, params, generator)

    def lookup_chain(self, seq: Tensor, max_len: int) -> Tensor:
        """The lookups' drafts (may be none): a chain's proposal, or what tree decoding verifies instead of the
        drafter's tree (decoding/tree.lookup_tree)."""
        return lookup_proposal(seq, max_len, self.min_ngram, self.max_ngram, self.corpus).tokens

    def commit(self, num_valid: int, features: Optional[Tensor] = None, path=None) -> None:
        self.drafter.commit(num_valid, features, path)


def lookup_first(drafter, cfg: LookupConfig):
    """`drafter` behind prompt lookup and corpus lookup (eval.lookup); the drafter itself when both are off."""
    return LookupFirst(drafter, cfg.min_ngram, cfg.max_ngram, corpus_index(cfg.corpus)) if cfg.enabled else drafter


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
