"""The prompt-lookup kind's typed config (ngram_schema)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_train.config import CorpusLookupConfig, DrafterConfig, check_field


@dataclass
class NgramDrafterConfig(DrafterConfig):
    """`drafter=ngram`: prompt-lookup decoding (drafters/ngram.py), no model and no training; `path: lookup` builds
    it from the fields below, a saved ngram folder loads its own."""

    kind: str = "ngram"
    path: str = "lookup"
    # Suffix n-gram sizes tried, longest first (vLLM: prompt_lookup_min / prompt_lookup_max).
    min_ngram: int = 1
    max_ngram: int = 3
    # Where the sequence itself has no match: lookup in a corpus of earlier responses (drafter.corpus.path).
    corpus: CorpusLookupConfig = field(default_factory=CorpusLookupConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self.min_ngram >= 1, "drafter.min_ngram", f"must be >= 1, got {self.min_ngram}")
        check_field(self.max_ngram >= self.min_ngram, "drafter.max_ngram", "must be >= drafter.min_ngram")
        self.corpus.check("drafter.corpus")
