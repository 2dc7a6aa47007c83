"""Prompt lookup ahead of a trained drafter (eval.lookup): lossless for every kind, chains and topk trees, both
sources used, draft exit adapted on the drafter's proposals only, metrics counted apart, one-line refusals."""

from __future__ import annotations

import pytest
import torch

from drafter_train.config import CalibrationConfig, EvalConfig, LookupConfig, TreeConfig
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.draft_exit import DraftExit, supports_draft_exit
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import make_tree_verifier, make_verifier
from drafter_train.drafters.nar.model import NARDrafter, SpecDrafter
from drafter_train.decoding.lookup import LookupFirst, lookup, lookup_first
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.recipes.evaluate import evaluate_decoding
from tests.conftest import tiny_llama
from tests.test_dflash import random_dflash
from tests.test_eagle3 import random_eagle3
from tests.test_layerskip import drafter_for
from tests.test_sampling_exactness import RUNS, chi2_pvalue

GREEDY = make_verifier("greedy", SamplingParams())
# Repeats (lookup finds matches) and fresh stretches (it finds none, so the drafter proposes).
PROMPT = [1, 5, 9, 12, 7, 1, 5, 9, 3, 14, 2, 6]


def drafter_of(kind, target, make_tiny_llama):
    if kind == "ar":
        return make_drafter(make_tiny_llama(vocab_size=16, num_layers=1, init=0.5, seed=3))
    if kind == "eagle3":
        return make_drafter(random_eagle3(target, scale=0.5))
    if kind == "dflash":
        return make_drafter(random_dflash(target, scale=0.5))
    if kind == "layerskip":  # drafts on the target's own cache (share_target reaches it through the wrapper)
        return drafter_for(target, (1,), (2,))
    torch.manual_seed(0)
    return NARDrafter(SpecDrafter.from_target(target, 2, 0, 4).eval())


class Counting:
    """Counts the drafter's own proposals."""

    def __init__(self, drafter):
        self.inner, self.calls = drafter, 0

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, *args):
        self.calls += 1
        return self.inner.propose(*args)


@pytest.mark.parametrize("kind", ["ar", "eagle3", "dflash", "nar", "layerskip"])
@pytest.mark.parametrize("min_ngram", [1, 2])
def test_greedy_with_lookup_first_is_lossless_and_uses_both_sources(make_tiny_llama, kind, min_ngram):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    inner = Counting(drafter_of(kind, target, make_tiny_llama))
    drafter = LookupFirst(inner, min_ngram, 3)
    ar = generate_autoregressive(target, PROMPT, 40)
    spec = generate_speculative(target, drafter, PROMPT, 4, GREEDY, 40)
    assert spec.tokens == ar.tokens
    stats = spec.stats
    assert 0 < stats.lookup_proposals < stats.proposals  # lookup matched on some steps, the drafter drafted others
    assert inner.calls == stats.proposals - stats.lookup_proposals  # the drafter is not run on lookup steps
    assert stats.target_forward_passes == len(ar.tokens) - stats.accepted
    assert 0 <= stats.lookup_accepted <= stats.accepted


def test_lookup_proposals_are_the_lookup_rule(make_tiny_llama):
    """Every lookup proposal equals lookup() on the sequence it was made for; elsewhere the drafter's."""
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    inner = drafter_of("ar", target, make_tiny_llama)
    drafter = LookupFirst(inner, 2, 3)
    seen = []
    propose = drafter.propose

    def spy(seq, draft_len, params, generator):
        out = propose(seq, draft_len, params, generator)
        seen.append((seq.tolist(), draft_len, out))
        return out

    drafter.propose = spy
    generate_speculative(target, drafter, PROMPT, 4, GREEDY, 40)
    looked = [(s, k, p) for s, k, p in seen if p.from_lookup]
    assert looked and len(looked) < len(seen)
    for seq, k, proposal in seen:
        expected = lookup(seq, k, 2, 3)
        assert proposal.from_lookup == bool(expected)
        if expected:
            assert proposal.tokens.tolist() == expected and proposal.q_draft is None


VOCAB6, LOOP_PROMPT = 6, [0, 1, 0, 1, 0]  # the prompt repeats, so lookup matches from the first step


@torch.inference_mode()
def enumerate_joint(model, prompt: list[int], num_tokens: int, vocab: int, params: SamplingParams) -> torch.Tensor:
    """The exact distribution of the first `num_tokens` sampled tokens of a real model, [vocab] * num_tokens, by
    enumerating every prefix (full forwards, no cache): the reference the decoders' samples are tested against."""
    prefixes, joint = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64)
    for _ in range(num_tokens):
        probs = logits_to_probs(model(prefixes).logits[:, -1], params).double()  # [paths, V]
        joint = (joint[:, None] * probs).reshape(-1)
        following = torch.arange(vocab).repeat(len(prefixes))[:, None]
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), following], 1)
    return joint.reshape([vocab] * num_tokens)


def joint_pvalues(samples: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Chi-square p-values of sampled sequences [runs, n] against the exact joint: each position's marginal, and the
    joint of each two consecutive tokens (what a decoder that mixes up its caches across steps gets wrong)."""
    n, vocab = samples.shape[1], joint.shape[0]
    pvalues = {}
    for j in range(n):
        exact = joint.sum(dim=[d for d in range(n) if d != j])
        pvalues[f"token {j}"] = chi2_pvalue(torch.bincount(samples[:, j], minlength=vocab), exact)
    for j in range(n - 1):
        exact = joint.sum(dim=[d for d in range(n) if d not in (j, j + 1)]).reshape(-1)
        pairs = samples[:, j] * vocab + samples[:, j + 1]
        pvalues[f"tokens {j},{j + 1}"] = chi2_pvalue(torch.bincount(pairs, minlength=vocab * vocab), exact)
    return pvalues


def tiny_pair():
    """A 2-layer tiny Llama target and a 1-layer one as the drafter (another seed), vocabulary 6: real KV caches and
    positions, which lookup's rejected drafts make the decoder crop (chains) or keep (trees)."""
    target = tiny_llama(vocab_size=VOCAB6, num_layers=2)
    return target, tiny_llama(vocab_size=VOCAB6, num_layers=1, seed=3)


def sampled_with_lookup_first(min_ngram: int, corpus=None, seed: int = 1234, runs: int = RUNS, spec=None,
                              num_tokens: int = 4):
    """Speculative sampling (temperature 1), `runs` times, of `num_tokens` tokens by a tiny Llama target with a tiny
    Llama drafter behind LookupFirst, chains (or trees of `spec`): (chi-square p-values of the samples against the
    target's exact joint distribution, lookup proposals, the drafter's own proposals)."""
    params = SamplingParams(temperature=1.0)
    target, draft = tiny_pair()
    generator = torch.Generator().manual_seed(seed)
    drafter = LookupFirst(make_drafter(draft), min_ngram, 3, corpus)
    verifier = make_verifier("sample", params) if spec is None else make_tree_verifier("sample", params)

    def decode():
        if spec is None:
            return generate_speculative(target, drafter, LOOP_PROMPT, 3, verifier, num_tokens, params,
                                        generator=generator)
        return generate_tree_speculative(target, drafter, LOOP_PROMPT, spec, verifier, num_tokens, params,
                                         generator=generator)

    samples, looked, drafted = torch.zeros(runs, num_tokens, dtype=torch.long), 0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: threads only cost, ~40x on a busy 2-core machine
    try:
        for run in range(runs):
            out = decode()
            samples[run] = torch.tensor(out.tokens)
            looked += out.stats.lookup_proposals
            drafted += out.stats.proposals - out.stats.lookup_proposals
    finally:
        torch.set_num_threads(threads)
    joint = enumerate_joint(target, LOOP_PROMPT, num_tokens, VOCAB6, params)
    return joint_pvalues(samples, joint), looked, drafted


def test_speculative_sampling_with_lookup_first_matches_the_target_distribution():
    pvalues, looked, drafted = sampled_with_lookup_first(1)
    assert looked > 100 and drafted > 100  # both sources proposed, each with its own q (one-hot / the drafter's)
    assert min(pvalues.values()) > 1e-3, pvalues


def test_draft_exit_adapts_to_the_drafters_proposals_only(make_tiny_llama):
    """A drafter that is never sure proposes nothing: only lookup proposals are verified, and they must not move
    the adaptive threshold (it steers the drafter's own acceptance)."""
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    drafter = LookupFirst(drafter_of("eagle3", target, make_tiny_llama), 1, 3)
    exit = DraftExit(0.99999, adapt=True)
    spec = generate_speculative(target, drafter, PROMPT, 4, GREEDY, 40, draft_exit=exit)
    assert spec.tokens == generate_autoregressive(target, PROMPT, 40).tokens
    assert spec.stats.lookup_proposals == spec.stats.proposals > 0
    assert exit.threshold == 0.99999 and exit.rate is None
    # the adaptation still runs on the drafter's own proposals
    exit = DraftExit(0.5, adapt=True)
    spec = generate_speculative(target, drafter, PROMPT, 4, GREEDY, 40, draft_exit=exit)
    assert spec.stats.proposals > spec.stats.lookup_proposals and exit.threshold != 0.5


def test_draft_exit_is_the_drafters_own(make_tiny_llama):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    eagle = LookupFirst(drafter_of("eagle3", target, make_tiny_llama), 2, 3)
    assert supports_draft_exit(eagle)
    eagle.exit_below = 0.3
    assert eagle.drafter.exit_below == 0.3
    assert not supports_draft_exit(LookupFirst(drafter_of("dflash", target, make_tiny_llama), 2, 3))
    assert lookup_first(eagle.drafter, LookupConfig()) is eagle.drafter  # off: the drafter itself
    assert eagle.feature_layers == eagle.drafter.feature_layers  # what the decoder taps is the drafter's


def test_evaluation_reports_lookup_proposals_and_stays_lossless(make_tiny_llama):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    drafter = drafter_of("eagle3", target, make_tiny_llama)
    prompts = [PROMPT, [2, 4, 6, 2, 4, 6, 8]]
    off = evaluate_decoding(target, drafter, prompts, EvalConfig(max_new_tokens=24, warmup=0), (), progress=False)
    first = EvalConfig(max_new_tokens=24, warmup=0, lookup=LookupConfig(min_ngram=2))
    on = evaluate_decoding(target, drafter, prompts, first, (), progress=False)
    assert off["greedy_match"] == on["greedy_match"] == 1.0
    assert off["lookup_proposals"] == 0 < on["lookup_proposals"] <= on["proposals"]
    assert on["lookup_accepted"] <= on["accepted_draft_tokens"]


def test_lookup_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^eval.lookup.min_ngram: must be >= 0 \(0 = off\), got -1$"):
        LookupConfig(min_ngram=-1)
    with pytest.raises(ConfigError, match=r"^eval.lookup.max_ngram: must be >= eval.lookup.min_ngram \(3\), got 2$"):
        LookupConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ConfigError, match=r"^eval.lookup.min_ngram: prompt lookup's chains are deterministic and go "
                                          r"in front of topk trees, not of i.i.d. sampled ones"):
        EvalConfig(lookup=LookupConfig(min_ngram=2), tree=TreeConfig(top_k=2, depth=2, branching="iid"),
                   verify="sample")
    EvalConfig(lookup=LookupConfig(min_ngram=2), tree=TreeConfig(top_k=2))  # topk trees take lookup in front
    with pytest.raises(ConfigError, match=r"^eval.lookup.min_ngram: calibration predicts"):
        EvalConfig(lookup=LookupConfig(min_ngram=2), calibration=CalibrationConfig(enabled=True))


def test_greedy_with_lookup_first_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_causal_lm, load_tokenizer

    target = load_causal_lm(str(stories_path))
    model = random_eagle3(target, layers=(1, 2, 3), draft_ids=torch.arange(300), scale=0.05)
    prompt = load_tokenizer(str(stories_path))("Once upon a time, there was a little girl named Lily. Lily").input_ids
    ar = generate_autoregressive(target, prompt, 64)
    spec = generate_speculative(target, LookupFirst(make_drafter(model), 1, 3), prompt, 4, GREEDY, 64)
    assert spec.tokens == ar.tokens
    assert 0 < spec.stats.lookup_proposals < spec.stats.proposals and spec.stats.lookup_accepted > 0


# ---- lookup ahead of draft trees --------------------------------------------------------------------------------


class CountingTrees(Counting):
    """Counts the drafter's trees (tree_root is called once per tree)."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.trees = 0

    def tree_root(self, seq):
        self.trees += 1
        return self.inner.tree_root(seq)


@pytest.mark.parametrize("kind", ["ar", "eagle3", "dflash", "nar"])
@pytest.mark.parametrize("spec", [TreeSpec(2, 1, 2), TreeSpec(3, 2, 4)], ids=["k2d1n2", "k3d2n4"])
def test_greedy_trees_with_lookup_first_are_lossless_and_lookup_chains_replace_trees(make_tiny_llama, kind, spec):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    inner = CountingTrees(drafter_of(kind, target, make_tiny_llama))
    drafter = LookupFirst(inner, 2, 3)
    chains = []
    lookup_chain = drafter.lookup_chain

    def spy(seq, n):  # records every lookup the decoder asks for
        drafts = lookup_chain(seq, n)
        chains.append((seq.tolist(), n, drafts))
        return drafts

    drafter.lookup_chain = spy
    ar = generate_autoregressive(target, PROMPT, 40)
    out = generate_tree_speculative(target, drafter, PROMPT, spec, make_tree_verifier("greedy", SamplingParams()), 40)
    assert out.tokens == ar.tokens
    stats = out.stats
    assert 0 < stats.lookup_proposals < stats.proposals
    assert inner.trees == stats.proposals - stats.lookup_proposals  # the drafter grows no tree on lookup steps
    assert stats.target_forward_passes == len(ar.tokens) - stats.accepted
    matched = [(seq, n, drafts.tolist()) for seq, n, drafts in chains if drafts.numel()]
    assert len(matched) == stats.lookup_proposals
    for seq, n, drafts in matched:  # the lookup rule's chain, up to as many drafts as the tree has nodes
        assert n <= spec.nodes() and drafts == lookup(seq, n, 2, 3)
    assert any(len(drafts) > spec.depth for _, _, drafts in matched) or spec.depth == spec.nodes()
    assert len(stats.accepted_hist) == spec.nodes() + 1  # a lookup chain may accept more drafts than the tree is deep


def test_tree_sampling_with_lookup_first_matches_the_target_distribution():
    """Lookup chains (deterministic nodes: q one-hot) and the drafter's topk trees, verified by recursive rejection
    sampling: the sampled tokens follow the target's exact distribution, each position and each consecutive pair.
    Three siblings, and lookup from 2-grams only, so that many steps accept a path through a later sibling, whose
    cache rows must be kept (moved down), not the first ones."""
    # 1500 runs: a decoder that keeps the first rows instead of the accepted sibling's scores p = 1.3e-3 at 500
    pvalues, looked, drafted = sampled_with_lookup_first(2, seed=99, spec=TreeSpec(3, 1, 3), num_tokens=5, runs=1500)
    assert looked > 100 and drafted > 100
    assert min(pvalues.values()) > 1e-3, pvalues


def test_tree_evaluation_with_lookup_first_counts_lookup_steps(make_tiny_llama):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    drafter = drafter_of("eagle3", target, make_tiny_llama)
    prompts = [PROMPT, [2, 4, 6, 2, 4, 6, 8]]
    cfg = EvalConfig(max_new_tokens=24, warmup=0, lookup=LookupConfig(min_ngram=2), tree=TreeConfig(top_k=2, depth=1,
                                                                                                  total_tokens=2))
    on = evaluate_decoding(target, drafter, prompts, cfg, (), progress=False)
    assert on["greedy_match"] == 1.0
    assert 0 < on["lookup_proposals"] < on["proposals"]
    assert len(on["accepted_length_histogram"]) == 3  # lookup chains of 2 drafts ahead of depth-1 trees
    assert sum(on["accepted_length_histogram"]) == on["proposals"]
