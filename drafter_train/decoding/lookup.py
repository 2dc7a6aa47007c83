"""Lookups: drafts copied from the sequence itself (prompt lookup, Saxena 2023) or from a corpus of earlier responses
(corpus lookup, SuffixDecoding / REST), and the lookup-first policy the evaluator puts ahead of any drafter
(`eval.lookup`): where a lookup matches, its chain is verified and the drafter is not run.

The ngram drafter kind (drafters/ngram/) drafts with these alone; the evaluator (evaluation.py) wraps any drafter in
`LookupFirst`. Deterministic drafts: q is one-hot (verify.py), so every use stays lossless.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from drafter_train.config import CorpusLookupConfig, LookupConfig
from drafter_train.data.store import check_tokenizer, load_distill_dataset
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams


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
