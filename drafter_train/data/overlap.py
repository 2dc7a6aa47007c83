"""Overlap between evaluation prompts and what a drafter was trained on or looks up: exact matches and long shared
word n-grams, so no evaluated prompt silently repeats a training prompt or sits in the lookup corpus's answers.

The evaluation prompts are indexed once (their normalised texts and a set of hashed n-grams); the training texts
then stream past the index, each cut into its own n-grams and looked up: linear in the training data, never a scan
of every pair. drafter-eval and drafter-train check before they evaluate (eval.overlap); drafter-datagen drops
training prompts that overlap the files in datagen.exclude.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from omegaconf import OmegaConf

from drafter_train.data.store import load_distill_dataset
from drafter_train.errors import ConfigError

# Length of the shared run of words that counts as overlap. 13 words, as in GPT-3's contamination analysis (Brown et
# al. 2020, appendix C) and the studies that followed it: long enough that ordinary phrases ("what is the difference
# between a list and a") do not match by chance, short enough to catch a prompt pasted inside a longer one or
# quoted in an answer. Words rather than tokens: the check then means the same for every target's tokenizer, and
# a datagen folder written for one target is compared to prompts that another would tokenize differently. Prompts
# shorter than 13 words can only match exactly (after normalisation).
NGRAM_WORDS = 13
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased words: case, punctuation and spacing do not hide a match."""
    return _WORD.findall(text.lower())


def _grams(tokens: Sequence[str], n: int) -> Iterable[int]:
    return (hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1))


@dataclass
class OverlapIndex:
    """The evaluation prompts, indexed once: normalised full text -> prompt indices, hashed n-gram -> indices."""

    prompts: Sequence[str]
    n: int = NGRAM_WORDS
    exact: dict = field(init=False, default_factory=dict)
    grams: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for index, text in enumerate(self.prompts):
            tokens = words(text)
            self.exact.setdefault(" ".join(tokens), set()).add(index)
            for gram in _grams(tokens, self.n):
                self.grams.setdefault(gram, set()).add(index)

    def exact_matches(self, text: str) -> set[int]:
        """Evaluation prompts equal to `text` after normalisation."""
        return self.exact.get(" ".join(words(text)), set())

    def shared_ngrams(self, text: str) -> set[int]:
        """Evaluation prompts sharing a run of `n` words with `text`."""
        hits: set[int] = set()
        for gram in _grams(words(text), self.n):
            hits |= self.grams.get(gram, set())
        return hits


@dataclass
class OverlapReport:
    """Which evaluation prompts overlap which training texts."""

    num_prompts: int
    checked: list[str]  # the sources looked at, as the config names them
    exact: set[int] = field(default_factory=set)  # equal to a training prompt
    ngram: set[int] = field(default_factory=set)  # sharing an NGRAM_WORDS run with a training prompt or answer

    @property
    def prompts(self) -> list[int]:
        return sorted(self.exact | self.ngram)

    def summary(self) -> str:
        """One line with the word `overlap` and the count."""
        where = ", ".join(self.checked) or "nothing"
        return (f"overlap: {len(self.prompts)} of {self.num_prompts} eval prompts overlap the training data "
                f"({len(self.exact)} exact matches of training prompts, {len(self.ngram)} sharing a {NGRAM_WORDS}-word "
                f"run with training prompts or answers; checked {where})")

    def record(self) -> dict:
        """What metrics.json keeps: the count, which prompts (0-based) and against what."""
        return {"count": len(self.prompts), "prompts": self.prompts, "exact": sorted(self.exact),
                "ngram_words": NGRAM_WORDS, "checked": self.checked}


def find_overlap(prompts: Sequence[str], sources: Sequence[tuple[str, Iterable[str], Iterable[str]]]
                 ) -> OverlapReport:
    """`sources`: (name, training prompts, answers) each; prompts are checked for exact and n-gram matches, answers
    for n-gram matches only (an answer equal to a prompt is no contamination of its own)."""
    index, report = OverlapIndex(prompts), OverlapReport(len(prompts), [name for name, _, _ in sources])
    for _, train_prompts, answers in sources:
        for text in train_prompts:
            report.exact |= index.exact_matches(text)
            report.ngram |= index.shared_ngrams(text)
        for text in answers:
            report.ngram |= index.shared_ngrams(text)
    report.ngram -= report.exact
    return report


def datagen_texts(data_dir: str, tokenizer) -> tuple[list[str], Iterable[str]]:
    """A drafter-datagen folder's training prompts and answers (the target's continuations and the source's
    references, decoded with `tokenizer`). Its own eval_prompts.jsonl is no training data and is not read."""
    data = load_distill_dataset(data_dir)
    answers = (tokenizer.decode(ids, skip_special_tokens=True)
               for column in ("response_ids", "reference_ids") for ids in data[column] if ids)
    return list(data["prompt"]), answers


def recorded_data_dir(drafter_path: str) -> list[str]:
    """The train.data_dir a drafter-train checkpoint was trained on (config.yaml of its run folder, a few levels up
    from run/step-N/drafter), when it is recorded and still there; [] otherwise."""
    path = Path(drafter_path).expanduser().resolve()
    if not path.is_dir():  # a hub id, or a kind with no folder (ngram, layerskip's skips)
        return []
    for folder in list(path.parents)[:3]:
        config = folder / "config.yaml"
        if config.is_file():
            data_dir = OmegaConf.select(OmegaConf.load(config), "train.data_dir")
            return [data_dir] if data_dir and Path(data_dir).expanduser().is_dir() else []
    return []


def data_folders(cfg, trained_on: Sequence[str]) -> list[str]:
    """Every datagen folder a job's evaluation prompts must not overlap: what the drafter was trained on, the
    lookup corpora (eval.lookup.corpus.path, drafter.corpus.path) and eval.overlap_with; each once, in that order."""
    corpus = getattr(getattr(cfg, "drafter", None), "corpus", None)
    folders = [*trained_on, cfg.eval.lookup.corpus.path, corpus.path if corpus else None, *cfg.eval.overlap_with]
    return list(dict.fromkeys(f for f in folders if f))


def check_eval_overlap(prompts: Sequence[str], cfg, tokenizer, trained_on: Sequence[str]) -> dict | None:
    """eval.overlap's check before an evaluation: warn (one line on stderr) or refuse (one-line ConfigError) when an
    evaluation prompt overlaps the data; returns what metrics.json records (None when eval.overlap=off)."""
    if cfg.eval.overlap == "off":
        return None
    report = find_overlap(prompts, [(d, *datagen_texts(d, tokenizer)) for d in data_folders(cfg, trained_on)])
    if report.prompts and cfg.eval.overlap == "refuse":
        raise ConfigError(f"eval.overlap: {report.summary()}; evaluate on other prompts or set eval.overlap=warn")
    if report.prompts:
        print(f"warning: {report.summary()}", file=sys.stderr)
    return report.record()
