"""Corpus lookup (drafter.corpus / eval.lookup.corpus): the index against a naive reference, lossless decoding with
it ahead of a drafter (greedy and sampling), the datagen folder as corpus, saving, and one-line refusals (bad
settings; data whose token ids come from another tokenizer, as corpus or as training data)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from omegaconf import OmegaConf

from drafter_train.config import CorpusLookupConfig, EvalConfig, LookupConfig
from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.data.store import check_tokenizer, load_distill_dataset, tokenizer_fingerprint
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.ngram.model import PromptLookupDrafter
from drafter_train.decoding.lookup import CorpusIndex, LookupFirst, corpus_index, lookup
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.recipes.evaluate import evaluate_decoding
from tests.stubs import WORDS, compose_cfg, word_tokenizer
from tests.test_eagle3 import random_eagle3
from tests.test_lookup_first import PROMPT, Counting, drafter_of, sampled_with_lookup_first

GREEDY = make_verifier("greedy", SamplingParams())


def naive_propose(seqs, tokens, k, min_share, min_count):
    """The documented rule, spelled out over (sequence, position) pairs."""
    for n in range(min(3, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n:]
        occ = [(i, p + n) for i, s in enumerate(seqs) for p in range(len(s) - n + 1) if s[p:p + n] == suffix]
        if len(occ) < min_count:
            continue
        drafts = []
        while len(drafts) < k:
            following = [seqs[i][q] if q < len(seqs[i]) else None for i, q in occ]
            counts = Counter(t for t in following if t is not None)
            if not counts:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            if counts[token] < min_count or counts[token] < min_share * len(occ):
                break
            drafts.append(token)
            occ = [(i, q + 1) for (i, q), t in zip(occ, following) if t == token]
        return drafts
    return []


def test_corpus_index_follows_the_rule_of_a_naive_reference():
    rng = random.Random(0)
    checked = nonempty = 0
    for trial in range(40):
        vocab = rng.randint(3, 7)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 10))]
        share, count = rng.choice([0.2, 0.3, 0.5, 1.0]), rng.choice([1, 2, 3])
        index = CorpusIndex(seqs, share, count)
        for _ in range(25):
            tokens = [rng.randrange(vocab + 1) for _ in range(rng.randint(1, 6))]  # vocab itself: unseen
            k = rng.randint(1, 6)
            expected = naive_propose(seqs, tokens, k, share, count)
            assert index.propose(tokens, k) == expected, (seqs, tokens, k, share, count)
            checked, nonempty = checked + 1, nonempty + bool(expected)
    assert nonempty > checked // 4  # the comparison covers real proposals, not only empty ones


def test_corpus_index_walks_the_shared_continuation():
    index = CorpusIndex([[1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 4]], min_share=0.3, min_count=2)
    assert index.propose([9, 1, 2], 4) == [3]  # "1 2" twice: 3 follows both; then 4 and 5 once each (count < 2)
    assert index.propose([9, 7, 2, 3], 4) == [4]  # "7 2 3" once: too rare; "2 3" three times: 4 follows 2 of them
    assert index.propose([2], 4) == [3, 4]  # the walk keeps the occurrences that agree; a sequence end stops it
    assert CorpusIndex([[1, 2, 3, 4], [1, 2, 3, 5], [7, 2, 3, 4]], 0.7, 2).propose([2], 4) == [3]  # 4: 2/3 < 0.7
    assert index.propose([8], 4) == [] and index.propose([99], 4) == []  # unseen, and beyond every corpus id


@pytest.mark.parametrize("min_ngram", [0, 2])
def test_greedy_with_corpus_lookup_is_lossless_and_each_source_keeps_its_turn(make_tiny_llama, min_ngram):
    """Sequence lookup first (unless off), the corpus where it finds nothing, the drafter where neither does."""
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    corpus = CorpusIndex([generate_autoregressive(target, p, 24).tokens for p in ([3, 4, 5], [7, 1], [9, 9, 2])],
                         min_share=0.3, min_count=1)
    inner = Counting(drafter_of("ar", target, make_tiny_llama))
    drafter = LookupFirst(inner, min_ngram, 3, corpus)
    sources, propose = Counter(), drafter.propose

    def spy(seq, draft_len, params, generator):
        out = propose(seq, draft_len, params, generator)
        own = lookup(seq.tolist(), draft_len, min_ngram, 3) if min_ngram else []
        from_corpus = [] if own else corpus.propose(seq.tolist(), draft_len)
        expected = own or from_corpus
        assert out.from_lookup == bool(expected) and (not expected or out.tokens.tolist() == expected)
        sources["sequence" if own else "corpus" if from_corpus else "drafter"] += 1
        return out

    drafter.propose = spy
    ar = generate_autoregressive(target, PROMPT, 40)
    spec = generate_speculative(target, drafter, PROMPT, 4, GREEDY, 40)
    assert spec.tokens == ar.tokens
    assert sources["corpus"] > 0 and sources["drafter"] > 0 and (sources["sequence"] > 0) == bool(min_ngram)
    assert inner.calls == sources["drafter"] == spec.stats.proposals - spec.stats.lookup_proposals


def test_speculative_sampling_with_corpus_lookup_matches_the_target_distribution():
    corpus = CorpusIndex([[0, 1, 2, 3], [0, 2, 2, 4], [1, 0, 5]], min_share=0.2, min_count=1)
    pvalues, looked, drafted = sampled_with_lookup_first(0, corpus, seed=4321)
    assert looked > 100 and drafted > 100  # corpus drafts (one-hot q) and the drafter's (its own q) both verified
    assert min(pvalues.values()) > 1e-3, pvalues


def test_the_corpus_is_a_datagen_folders_responses(tiny_data):
    from drafter_train.targets import load_causal_lm

    data = load_distill_dataset(tiny_data / "data")
    index = corpus_index(CorpusLookupConfig(path=str(tiny_data / "data"), min_share=0.5, min_count=3))
    responses = [r or ref for r, ref in zip(data["response_ids"], data["reference_ids"])]
    assert index.tokens.tolist() == [t for r in responses for t in (*r, -1)]
    assert (index.min_share, index.min_count) == (0.5, 3)
    assert corpus_index(CorpusLookupConfig()) is None and corpus_index(None) is None
    # evaluation with the corpus ahead of a drafter, on the data's own target (greedy datagen) and two of its prompts:
    # their greedy answers are in the corpus, so corpus drafts are proposed and accepted
    target = load_causal_lm(str(tiny_data / "target"))
    corpus = CorpusLookupConfig(path=str(tiny_data / "data"), min_count=1)
    cfg = EvalConfig(max_new_tokens=16, warmup=0, lookup=LookupConfig(corpus=corpus))
    assert cfg.lookup.enabled and not cfg.lookup.min_ngram
    metrics = evaluate_decoding(target, make_drafter(random_eagle3(target, layers=(0, 1, 2))),
                                [list(p) for p in data["prompt_ids"][:2]], cfg, (), progress=False)
    assert metrics["greedy_match"] == 1.0 and metrics["lookup_accepted"] > 0


def test_an_ngram_drafter_with_a_corpus_saves_and_loads_it(tiny_data, tmp_path):
    from drafter_train.targets import load_causal_lm

    target = load_causal_lm(str(tiny_data / "target"))
    cfg = NgramDrafterConfig(min_ngram=2, corpus=CorpusLookupConfig(path=str(tiny_data / "data"), min_share=0.4))
    load_drafter(cfg, target, word_tokenizer(), "float32").save_pretrained(tmp_path / "ngram")
    saved = OmegaConf.to_object(compose_cfg("eval", ["drafter=path", f"drafter.path={tmp_path / 'ngram'}"]))
    loaded = load_drafter(saved.drafter, target, word_tokenizer(), "float32")
    assert loaded.config.corpus["path"] == str((tiny_data / "data").resolve())
    drafter = PromptLookupDrafter(loaded)
    assert drafter.corpus is not None and (drafter.corpus.min_share, drafter.corpus.min_count) == (0.4, 2)
    plain = load_drafter(NgramDrafterConfig(), target, word_tokenizer(), "float32")
    assert PromptLookupDrafter(plain).corpus is None


def test_corpus_settings_are_checked_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval.lookup.corpus.min_share: must be in \(0, 1\], got 0.0$"):
        OmegaConf.to_object(compose_cfg("eval", ["eval.lookup.corpus.path=x", "eval.lookup.corpus.min_share=0"]))
    with pytest.raises(ConfigError, match=r"^drafter.corpus.min_count: must be >= 1, got 0$"):
        OmegaConf.to_object(compose_cfg("eval", ["drafter=ngram", "drafter.corpus.min_count=0"]))
    with pytest.raises(ConfigError, match=r"not a drafter-datagen output folder"):
        corpus_index(CorpusLookupConfig(path=str(tmp_path)))


def test_data_made_with_another_tokenizer_is_refused_in_one_line(tiny_data, tmp_path):
    import json
    import shutil

    from drafter_train.targets import load_causal_lm
    from drafter_train.recipes.train import load_training_data

    data = tiny_data / "data"
    own, other = word_tokenizer(), word_tokenizer(list(reversed(WORDS)))  # the same tokens under other ids
    assert json.loads((data / "datagen.json").read_text())["run"]["tokenizer_sha256"] == tokenizer_fingerprint(own)
    assert tokenizer_fingerprint(own) != tokenizer_fingerprint(other)
    refused = r": .*/data holds token ids of another tokenizer \(made with .*/target's\); make data for this target"
    check_tokenizer(data, own, "eval.lookup.corpus.path")
    with pytest.raises(ConfigError, match="^eval.lookup.corpus.path" + refused):
        check_tokenizer(data, other, "eval.lookup.corpus.path")
    # where token ids are read: the ngram drafter's corpus, and the training data
    target = load_causal_lm(str(tiny_data / "target"))
    corpus = NgramDrafterConfig(corpus=CorpusLookupConfig(path=str(data)))
    assert PromptLookupDrafter(load_drafter(corpus, target, own, "float32")).corpus is not None
    with pytest.raises(ConfigError, match="^drafter.corpus.path" + refused):
        load_drafter(corpus, target, other, "float32")
    cfg = OmegaConf.to_object(compose_cfg("train", [f"train.data_dir={data}"]))
    assert len(load_training_data(cfg, own)[0]) == 32
    with pytest.raises(ConfigError, match="^train.data_dir" + refused):
        load_training_data(cfg, other)
    # a folder written before datagen.json recorded the fingerprint is taken as it is
    legacy = tmp_path / "legacy"
    shutil.copytree(data, legacy)
    manifest = json.loads((legacy / "datagen.json").read_text())
    del manifest["run"]["tokenizer_sha256"]
    (legacy / "datagen.json").write_text(json.dumps(manifest))
    check_tokenizer(legacy, other, "train.data_dir")
