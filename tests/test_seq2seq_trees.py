"""Draft trees for seq2seq targets (drafter_train/seq2seq): where the decoder takes tree positions through its public
forward (Whisper: decoder_position_ids and a 4-D decoder_attention_mask), greedy trees equal plain decoding and
sampled trees (i.i.d. and top-k) follow the target's exact distribution (chi-square), for the AR and NAR drafters;
where it does not (T5's relative bias, BART's learned and Marian's sinusoidal positions, all derived from the cache
length), a tree is refused in one line before the target runs."""

from __future__ import annotations

import pytest
import torch

from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import make_tree_verifier
from drafter_train.errors import ConfigError
from drafter_train.seq2seq.decoding import (evaluate_seq2seq, generate_seq2seq_autoregressive,
                                            generate_seq2seq_tree_speculative)
from drafter_train.seq2seq.drafters import Seq2SeqDrafter, SpecDrafter, cut_from_target, small_from_target
from drafter_train.seq2seq.target import check_trees, tree_refusal
from tests.test_sampling_exactness import RUNS, chi2_pvalue
from tests.test_seq2seq import exact_marginals, source_for, tiny

GREEDY = SamplingParams()


def drafter_of(kind: str, target, draft_len: int = 3) -> Seq2SeqDrafter:
    if kind == "nar":
        return Seq2SeqDrafter(SpecDrafter.from_target(target, draft_len=draft_len), target)
    return Seq2SeqDrafter(cut_from_target(target, 1) if kind == "ar" else small_from_target(target, 1, 1), target)


@pytest.mark.parametrize("family,why", [("t5", "relative position bias"), ("bart", "derives its positions"),
                                        ("marian", "derives its positions")])
def test_tree_is_refused_in_one_line_before_the_target_runs(family, why):
    target = tiny(family)
    calls = []
    target.register_forward_pre_hook(lambda *_: calls.append(1))
    spec = TreeSpec(top_k=2, depth=2)
    for kind in ("ar", "nar"):
        with pytest.raises(ConfigError, match=f"^eval.tree: draft trees need per-token decoder positions, and a "
                                              f"{family} decoder.*{why}.*; use chains$") as error:
            generate_seq2seq_tree_speculative(target, drafter_of(kind, target), source_for(target), spec,
                                              make_tree_verifier("greedy", GREEDY), 8)
        assert "\n" not in str(error.value)
    assert not calls  # refused before any decoding (and before the encoder)
    with pytest.raises(ConfigError, match=f"a {family} decoder"):  # from config.json alone (no weights)
        check_trees(target.config)
    assert tree_refusal(tiny("whisper")) is None and tree_refusal(tiny("whisper").config) is None


def test_nar_tree_deeper_than_its_queries_is_refused():
    target = tiny("whisper")
    with pytest.raises(ConfigError, match="^eval.tree.depth: this Spec-Drafter has 2 mask queries"):
        generate_seq2seq_tree_speculative(target, drafter_of("nar", target, 2), source_for(target),
                                          TreeSpec(top_k=2, depth=3), make_tree_verifier("greedy", GREEDY), 8)


@pytest.mark.parametrize("kind", ["ar", "ar-small", "nar"])
def test_greedy_tree_is_lossless_on_whisper(kind):
    """Random drafters reject often, so the accepted path is often a side branch: its tokens sat at positions other
    than their row's (a decoder ignoring the tree's positions gives other tokens: checked by mutation)."""
    target = tiny("whisper")
    drafter = drafter_of(kind, target)
    verifier = make_tree_verifier("greedy", GREEDY)
    for spec in (TreeSpec(top_k=3, depth=3, total_tokens=8), TreeSpec(top_k=2, depth=3, branching="iid")):
        for seed in range(3):
            source = source_for(target, seed)
            plain = generate_seq2seq_autoregressive(target, source, 16)
            tree = generate_seq2seq_tree_speculative(target, drafter, source, spec, verifier, 16)
            assert tree.tokens == plain.tokens and len(plain.tokens) > 8
            assert tree.stats.proposals and tree.stats.target_forward_passes <= plain.stats.target_forward_passes


def test_target_as_its_own_tree_drafter_accepts_a_full_path():
    target = tiny("whisper")
    target.generation_config.eos_token_id = target.config.eos_token_id = None  # exactly 10 tokens
    out = generate_seq2seq_tree_speculative(target, Seq2SeqDrafter(target, target), source_for(target),
                                            TreeSpec(top_k=2, depth=3), make_tree_verifier("greedy", GREEDY), 10)
    assert out.stats.target_forward_passes == 4  # prefill, then 3 passes of 3 accepted + 1


@pytest.mark.parametrize("kind,branching", [("ar", "iid"), ("nar", "iid"), ("ar", "topk"), ("nar", "topk")])
def test_sampled_tree_matches_target_distribution(kind, branching):
    target = tiny("whisper", init=1.0, vocab=8)
    target.generation_config.eos_token_id = target.config.eos_token_id = None  # every run yields num_tokens tokens
    model = SpecDrafter.from_target(target, draft_len=2) if kind == "nar" else small_from_target(target, 1, 1)
    if kind == "nar":  # queries far apart, so that depth 1's and depth 2's distributions differ
        torch.manual_seed(1)
        model.mask_embeds.data.normal_(std=1.0)
    drafter, source = Seq2SeqDrafter(model, target), source_for(target)
    # Runs, measured with deliberately broken verifiers: with the Spec-Drafter a residual that forgets rejected
    # siblings fails at p < 1e-9 after RUNS runs (iid and topk); with the AR drafter (a new small model with its own
    # encoder) it moves the samples far less, so it keeps 1200.
    params, num_tokens = SamplingParams(temperature=1.0), 4
    runs = RUNS if kind == "nar" else 1200
    spec = TreeSpec(top_k=2, depth=2, branching=branching)
    counts, generator = torch.zeros(num_tokens, 8), torch.Generator().manual_seed(1)
    verifier = make_tree_verifier("sample", params)
    for _ in range(runs):
        out = generate_seq2seq_tree_speculative(target, drafter, source, spec, verifier, num_tokens, params, generator)
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
    exact = exact_marginals(target, source, num_tokens, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    assert min(pvalues) > 1e-3, pvalues


def test_evaluator_runs_trees_with_the_same_fields():
    target = tiny("whisper")
    sources = [source_for(target, seed) for seed in range(2)]
    spec = TreeSpec(top_k=2, depth=3, total_tokens=5)
    tree = evaluate_seq2seq(target, drafter_of("ar", target), sources, 3, 12, baseline_kernels="same", warmup=0,
                            tree=spec)
    chain = evaluate_seq2seq(target, drafter_of("ar", target), sources, 3, 12, baseline_kernels="same", warmup=0)
    assert tree["greedy_match"] == 1.0 and tree["tree"] == spec.describe() and chain["tree"] is None
    assert set(tree) == set(chain)
    with pytest.raises(ConfigError, match="^eval.tree: .* a marian decoder"):
        marian = tiny("marian")
        evaluate_seq2seq(marian, drafter_of("ar", marian), [source_for(marian)], 3, 12, tree=spec)


def test_drafter_seq2seq_reads_eval_tree():
    """drafter-seq2seq's eval.tree: the decoder's TreeSpec (depth unset: drafter.draft_len); iid trees need sampling.
    (Its text targets are refused before loading: tests/test_seq2seq_entry.py.)"""
    from drafter_train.recipes.cli import job_config
    from tests.stubs import compose_cfg

    def job(*overrides: str):
        return job_config(compose_cfg("seq2seq", ["target.path=t", "data.path=d", "drafter.draft_len=3", *overrides]),
                          "drafter-seq2seq")

    iid = job("eval.tree.top_k=2", "eval.tree.branching=iid", "eval.verify=sample")
    assert iid.tree_spec() == TreeSpec(2, 3, None, "iid") and job().tree_spec() is None
    with pytest.raises(ConfigError, match="^eval.tree.branching: iid trees are sampled"):
        job("eval.tree.top_k=2", "eval.tree.branching=iid")
    with pytest.raises(ConfigError, match=r"^eval.tree.total_tokens: must be in \[depth"):
        job("eval.tree.top_k=2", "eval.tree.total_tokens=99")


def test_a_decoder_with_sliding_window_layers_is_refused():
    """T5Gemma's decoder takes decoder_position_ids, but its Gemma 2 layers alternate sliding-window attention."""
    from transformers import T5GemmaConfig
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig

    sub = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16)
    config = T5GemmaConfig(encoder=T5GemmaModuleConfig(**sub), decoder=T5GemmaModuleConfig(**sub), vocab_size=24)
    with pytest.raises(ConfigError, match="^eval.tree: .* a t5gemma decoder has sliding-window attention layers"):
        check_trees(config)
