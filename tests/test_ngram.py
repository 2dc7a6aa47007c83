"""Prompt lookup (drafter=ngram): the lookup rule, lossless decoding, loading, and its one-line refusals."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.ngram.model import NgramConfig, NgramModel, PromptLookupDrafter
from drafter_train.decoding.lookup import lookup
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.recipes.train import train
from tests.stubs import compose_cfg, naive_greedy_speculative, word_tokenizer
from tests.test_sampling_exactness import RUNS, chi2_pvalue, enumerate_marginals
from tests.test_train import train_cfg


def test_lookup_takes_the_longest_suffix_ngram_and_its_latest_occurrence():
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    # "5 6" occurred twice before: the latest (followed by 8, 2) wins over the first (followed by 7, 1)
    assert lookup(tokens, 3, 1, 3) == [8, 2, 9]
    # a longer match beats a more recent shorter one: "7 1 5" only once, at the start
    assert lookup([7, 1, 5, 4, 4, 1, 5, 3, 7, 1, 5], 2, 1, 3) == [4, 4]
    assert lookup([1, 2, 3, 4], 4, 1, 3) == []  # no suffix n-gram occurred before
    assert lookup([1, 2, 1], 4, 1, 3) == [2, 1]  # fewer drafts when the match is near the end
    assert lookup([3, 9, 9, 3], 2, 2, 3) == []  # only 1-grams match, and min_ngram is 2


def ngram(min_ngram=1, max_ngram=3):
    return NgramModel(NgramConfig(min_ngram=min_ngram, max_ngram=max_ngram))


@pytest.mark.parametrize("draft_len", [1, 3, 6])
def test_greedy_with_prompt_lookup_is_lossless_and_accepts_copies(make_tiny_llama, draft_len):
    target = make_tiny_llama(vocab_size=16, num_layers=2, init=0.6)
    prompt = [1, 3, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    ar = generate_autoregressive(target, prompt, 40)
    spec = generate_speculative(target, make_drafter(ngram()), prompt, draft_len, make_verifier("greedy", SamplingParams()),
                                40)
    assert spec.tokens == ar.tokens
    # The target's output repeats (it settles into a loop), so lookup must be accepted: the exact counts of a
    # cache-free replay of the lookup rule, greedy verification done by full forwards.
    tokens, passes, proposed, accepted = naive_greedy_speculative(
        target, lambda seq, k: lookup(seq, k, 1, 3), prompt, draft_len, 40)
    assert tokens == ar.tokens and accepted >= 15
    stats = spec.stats
    assert (stats.target_forward_passes, stats.proposed, stats.accepted) == (passes, proposed, accepted)


def test_greedy_with_prompt_lookup_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_causal_lm, load_tokenizer

    target = load_causal_lm(str(stories_path))
    prompt = load_tokenizer(str(stories_path))("Once upon a time, there was a little girl named Lily. Lily").input_ids
    ar = generate_autoregressive(target, prompt, 64)
    spec = generate_speculative(target, make_drafter(ngram()), prompt, 4, make_verifier("greedy", SamplingParams()), 64)
    assert spec.tokens == ar.tokens and spec.stats.accepted > 0


def test_speculative_sampling_with_prompt_lookup_matches_the_target(make_tiny_llama):
    """Deterministic drafts are verified with a one-hot q: the output still follows the target exactly."""
    target = make_tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    params, prompt, num_tokens = SamplingParams(temperature=1.0), [1, 5, 3, 1, 5, 3, 1, 5], 3
    counts = torch.zeros(num_tokens, 8)
    generator, verifier = torch.Generator().manual_seed(1234), make_verifier("sample", params)
    proposed = 0
    for _ in range(RUNS):
        out = generate_speculative(target, PromptLookupDrafter(ngram()), prompt, 2, verifier, num_tokens, params,
                                   generator=generator)
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
        proposed += out.stats.proposed
    exact = enumerate_marginals(target, prompt, num_tokens, 8, params)
    assert proposed > RUNS // 2  # the prompt repeats, so lookup drafts in most runs
    assert min(chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)) > 1e-3


def test_a_saved_ngram_drafter_loads_by_path_and_cannot_be_trained(tiny_data, tmp_path):
    from drafter_train.targets import load_causal_lm

    target = load_causal_lm(str(tiny_data / "target"))
    built = load_drafter(NgramDrafterConfig(min_ngram=2, max_ngram=4), target, word_tokenizer(), "float32")
    built.save_pretrained(tmp_path / "ngram")
    loaded = load_drafter(OmegaConf.to_object(compose_cfg("eval", ["drafter=path", f"drafter.path={tmp_path / 'ngram'}"])
                                              ).drafter, target, word_tokenizer(), "float32")
    assert isinstance(loaded, NgramModel) and (loaded.config.min_ngram, loaded.config.max_ngram) == (2, 4)
    with pytest.raises(ConfigError, match="drafter=ngram: prompt lookup has nothing to train"):
        train(train_cfg(tiny_data, tmp_path / "runs", "drafter=ngram", "drafter.path=lookup"))
    with pytest.raises(ConfigError, match="drafter.max_ngram: must be >= drafter.min_ngram"):
        OmegaConf.to_object(compose_cfg("eval", ["drafter=ngram", "drafter.min_ngram=3", "drafter.max_ngram=2"]))
