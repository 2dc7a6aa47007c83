"""Adaptive draft exit (Draft & Verify): proposals stop at the drafter's first unsure draft, losslessly."""

from __future__ import annotations

import pytest
import torch

from drafter_train.config import EvalConfig
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.draft_exit import DraftExit
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.evaluation import make_draft_exit
from drafter_train.drafters.ngram.model import NgramConfig, NgramModel, PromptLookupDrafter
from tests.stubs import BigramLM
from tests.test_eagle3 import random_eagle3
from tests.test_sampling_exactness import bigram_marginals, chi2_pvalue, make_bigram_pair

GREEDY = make_verifier("greedy", SamplingParams())


def test_the_threshold_follows_draft_and_verifys_rule():
    state = DraftExit(0.5, adapt=True, target=0.6)
    gamma, rate = 0.5, None
    for drafted, accepted in [(4, 1), (4, 4), (0, 0), (2, 2), (3, 0), (4, 3)]:
        state.update(drafted, accepted)
        if drafted:  # a step without drafts teaches nothing
            step = accepted / drafted
            rate = step if rate is None else 0.5 * rate + 0.5 * step
            moved = gamma + 0.01 if rate <= 0.6 else gamma - 0.01
            gamma = 0.9 * gamma + 0.1 * moved
        assert state.threshold == pytest.approx(gamma, abs=1e-12) and state.rate == rate
    fixed = DraftExit(0.5)
    fixed.update(4, 0)
    assert fixed.threshold == 0.5


def test_a_proposal_stops_before_the_first_unsure_draft(make_tiny_llama):
    model = make_tiny_llama(vocab_size=16, num_layers=2, init=0.6)
    seq = torch.tensor([1, 5, 9, 12, 7])
    full = ARDrafter(model).propose(seq, 6, SamplingParams(), None).tokens
    with torch.no_grad():  # reference: the drafter's top-1 probability before each of its greedy drafts
        logits = model(torch.cat([seq, full])[None]).logits[0, seq.numel() - 1 : -1]
    confidence = torch.softmax(logits.float(), -1).max(-1).values
    assert torch.equal(logits.argmax(-1), full)
    for cut in range(1, 6):
        # a threshold just above the cut's confidence and below all earlier ones stops exactly there
        if confidence[cut] >= confidence[:cut].min():
            continue
        drafter = ARDrafter(model)
        drafter.exit_below = float(confidence[cut] + confidence[:cut].min()) / 2
        assert torch.equal(drafter.propose(seq, 6, SamplingParams(), None).tokens, full[:cut])
    drafter = ARDrafter(model)
    drafter.exit_below = float(confidence[0]) + 1e-4
    assert drafter.propose(seq, 6, SamplingParams(), None).draft_len == 0


@pytest.mark.parametrize("kind", ["ar", "eagle3"])
@pytest.mark.parametrize("threshold, adapt", [(0.6, False), (0.7, True), (0.99999, False)])
def test_greedy_with_draft_exit_is_lossless(make_tiny_llama, kind, threshold, adapt):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    if kind == "ar":
        drafter = make_drafter(make_tiny_llama(vocab_size=16, num_layers=1, init=0.5, seed=3))
    else:
        drafter = make_drafter(random_eagle3(target, scale=0.5))
    prompt = [1, 5, 9, 12, 7]
    ar = generate_autoregressive(target, prompt, 40)
    plain = generate_speculative(target, drafter, prompt, 4, GREEDY, 40)
    exit = DraftExit(threshold, adapt=adapt)
    spec = generate_speculative(target, drafter, prompt, 4, GREEDY, 40, draft_exit=exit)
    assert spec.tokens == ar.tokens == plain.tokens
    # fewer drafts are verified; a step without drafts is a plain 1-token target step, counted as a target pass
    assert spec.stats.proposed < plain.stats.proposed
    assert spec.stats.target_forward_passes == len(ar.tokens) - spec.stats.accepted
    if threshold == 0.99999:  # nothing these random drafters say is that certain: plain decoding
        assert spec.stats.proposals == 0 and spec.stats.target_forward_passes == len(ar.tokens)
        # the declined calls still cost drafter time: per step it is counted, per proposal there is none
        assert spec.stats.draft_seconds == 0 < spec.stats.drafter_call_seconds
        assert spec.stats.summary()["drafter_ms_per_step"] > 0
    assert (exit.threshold != threshold) == adapt


def test_a_reused_drafter_gets_its_own_threshold_back_after_a_draft_exit_run(make_tiny_llama):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    drafter = make_drafter(make_tiny_llama(vocab_size=16, num_layers=1, init=0.5, seed=3))
    prompt = [1, 5, 9, 12, 7]
    plain = generate_speculative(target, drafter, prompt, 4, GREEDY, 40)
    generate_speculative(target, drafter, prompt, 4, GREEDY, 40, draft_exit=DraftExit(0.99999))
    assert drafter.exit_below == 0.0
    again = generate_speculative(target, drafter, prompt, 4, GREEDY, 40)  # no draft exit: as the first run
    assert again.tokens == plain.tokens and again.stats.proposed == plain.stats.proposed > 0
    drafter.exit_below = 0.3  # a drafter's own γ (a searched layerskip folder) survives a run that sets another
    generate_speculative(target, drafter, prompt, 4, GREEDY, 40, draft_exit=DraftExit(0.7, adapt=True))
    assert drafter.exit_below == 0.3


def test_speculative_sampling_with_draft_exit_matches_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    target_table, draft_table = make_bigram_pair()
    target, draft = BigramLM(target_table), BigramLM(draft_table)
    runs, num_tokens = 3000, 4
    counts = torch.zeros(num_tokens, 6)
    generator, exit = torch.Generator().manual_seed(1234), DraftExit(0.35, adapt=True, target=0.7)
    proposed = 0
    for _ in range(runs):
        out = generate_speculative(
            target, make_drafter(draft), [0], 3, make_verifier("sample", params), num_tokens, params,
            generator=generator, draft_exit=exit,
        )
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
        proposed += out.stats.proposed
    assert 0 < proposed < runs * 3 * (num_tokens - 1)  # the exit cut some proposals, not all
    exact = bigram_marginals(target_table, 0, params, num_tokens)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    assert min(pvalues) > 1e-3, pvalues


def test_draft_exit_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^eval.draft_exit: must be in \[0, 1\), got 1.5$"):
        EvalConfig(draft_exit=1.5)
    with pytest.raises(ConfigError, match=r"^eval.draft_exit: PromptLookupDrafter does not draft token by token"):
        make_draft_exit(EvalConfig(draft_exit=0.5), PromptLookupDrafter(NgramModel(NgramConfig())))
    assert make_draft_exit(EvalConfig(), PromptLookupDrafter(NgramModel(NgramConfig()))) is None
