"""Speculative decoder: hand-written stubs (exact acceptance counts) and invariants on real tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier, verify_greedy
from drafter_train.drafters.common.truncated import cut_from_target
from tests.stubs import BigramLM, cycle_table, greedy_table

GREEDY = make_verifier("greedy", SamplingParams())


def spec(target, drafter_model, prompt, draft_len, max_new_tokens, verifier=GREEDY, eos=()):
    return generate_speculative(
        target, ARDrafter(drafter_model), prompt, draft_len, verifier, max_new_tokens, eos_token_ids=eos
    )


# ---- stubs with hand-written logits -------------------------------------------------------------------------------


def test_never_accepted_drafts_give_one_token_per_pass():
    target, drafter = BigramLM(cycle_table(5, 1)), BigramLM(cycle_table(5, 2))  # drafter always wrong
    out = spec(target, drafter, [0], draft_len=3, max_new_tokens=12)
    assert out.tokens == generate_autoregressive(target, [0], 12).tokens
    assert out.stats.accepted == 0 and out.stats.proposed > 0
    assert out.stats.tau == 1.0
    assert out.stats.per_position_acceptance == [0.0, 0.0, 0.0]


def test_always_accepted_drafts_give_k_plus_one_tokens_per_pass():
    table = cycle_table(5, 1)
    out = spec(BigramLM(table), BigramLM(table.clone()), [0], draft_len=3, max_new_tokens=13)
    # prefill gives 1 token, then 3 full steps of k+1 = 4 tokens: 13 tokens in 4 passes.
    assert out.tokens == [(i + 1) % 5 for i in range(13)]
    assert out.stats.target_forward_passes == 4
    assert out.stats.acceptance_rate == 1.0


def test_partial_acceptance_matches_hand_count():
    # Target cycles 0->1->2->3->0; the drafter is wrong only after token 2 (it says 0 instead of 3).
    target = BigramLM(greedy_table({0: 1, 1: 2, 2: 3, 3: 0}, 4))
    drafter = BigramLM(greedy_table({0: 1, 1: 2, 2: 0, 3: 0}, 4))
    out = spec(target, drafter, [0], draft_len=3, max_new_tokens=19)
    # Step 1 from token 1: drafts 2,0,1 -> 2 accepted, 0 rejected (target says 3): 2 tokens.
    # Steps 2-5 from token 3: drafts 0,1,2 all accepted + bonus 3: 4 tokens each. 1 + 2 + 16 = 19 tokens.
    assert out.tokens == [(i + 1) % 4 for i in range(19)]
    assert out.stats.target_forward_passes == 6
    assert (out.stats.accepted, out.stats.proposed) == (13, 15)
    assert out.stats.reached == [5, 5, 4] and out.stats.accepted_at == [5, 4, 4]
    assert out.stats.per_position_acceptance == [1.0, 0.8, 1.0]


def test_eos_inside_accepted_drafts_stops_exactly_like_ar():
    table = cycle_table(6, 1)
    target, eos = BigramLM(table), [4]
    ar = generate_autoregressive(target, [0], 50, eos_token_ids=eos)
    out = spec(target, BigramLM(table.clone()), [0], draft_len=6, max_new_tokens=50, eos=eos)
    assert ar.tokens == [1, 2, 3, 4] and out.tokens == ar.tokens


def test_stats_count_verification_even_past_eos():
    # Drafts 1,2,3,4,5,0 are all accepted, but the output stops at EOS=2: alpha describes the verifier,
    # tokens_generated the output.
    table = cycle_table(6, 1)
    out = spec(BigramLM(table), BigramLM(table.clone()), [0], draft_len=6, max_new_tokens=50, eos=[2])
    assert out.tokens == [1, 2]
    assert (out.stats.accepted, out.stats.proposed, out.stats.target_forward_passes) == (6, 6, 2)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7])
def test_max_new_tokens_is_exact(max_new_tokens):
    table = cycle_table(5, 1)
    out = spec(BigramLM(table), BigramLM(table.clone()), [0], draft_len=4, max_new_tokens=max_new_tokens)
    assert len(out.tokens) == max_new_tokens


def test_greedy_verify_returns_correction_or_bonus():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])  # argmax 1, 2, 0
    from drafter_train.decoding.drafter import Proposal

    assert verify_greedy(Proposal(torch.tensor([1, 2])), logits) == (2, 0)  # all accepted, bonus 0
    n, token = verify_greedy(Proposal(torch.tensor([1, 0])), logits)
    assert (n, int(token)) == (1, 2)  # second rejected, corrected to 2


# ---- real tiny models ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_len", range(1, 9))
def test_greedy_speculative_equals_ar_on_tiny_llama(make_tiny_llama, draft_len):
    target = make_tiny_llama(vocab_size=64, num_layers=4)
    drafter = cut_from_target(target, 2)
    prompt = [1, 5, 9, 33, 7]
    ar = generate_autoregressive(target, prompt, 48)
    out = spec(target, drafter, prompt, draft_len, 48)
    assert out.tokens == ar.tokens


def test_drafter_equal_to_target_accepts_everything(make_tiny_llama):
    target = make_tiny_llama()
    draft_len, max_new = 5, 40
    out = spec(target, target, [1, 3, 4], draft_len, max_new)
    assert out.stats.acceptance_rate == 1.0
    # Away from the end every pass yields k+1 tokens: 1 (prefill) + 6 * 6 = 37, then a shortened last step.
    assert out.stats.target_forward_passes == 1 + 6 + 1
    assert out.stats.per_position_acceptance == [1.0] * draft_len


@pytest.fixture(scope="module")
def stories(stories_path):
    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    return model, cut_from_target(model, 2)


@pytest.mark.parametrize("draft_len", range(1, 9))
def test_greedy_speculative_equals_ar_on_stories260k(stories, draft_len):
    target, drafter = stories
    prompt = [1, 403, 407, 261, 378, 425]  # "Once upon a time" in the stories260K tokenizer
    ar = generate_autoregressive(target, prompt, 64, eos_token_ids=[2])
    out = spec(target, drafter, prompt, draft_len, 64, eos=[2])
    assert out.tokens == ar.tokens
    assert 0.0 < out.stats.acceptance_rate < 1.0  # a real, partially agreeing drafter


def test_specdec_beta1_tolerance0_equals_greedy(stories):
    target, drafter = stories
    prompt = [1, 403, 407, 261]
    specdec = make_verifier("specdec", SamplingParams(), top_beta=1, tolerance=0.0)
    a = spec(target, drafter, prompt, 4, 48, verifier=specdec)
    b = spec(target, drafter, prompt, 4, 48)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_specdec_rule_on_hand_written_logits():
    from drafter_train.decoding.drafter import Proposal

    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    lenient = make_verifier("specdec", SamplingParams(), top_beta=2, tolerance=1.0)
    strict = make_verifier("specdec", SamplingParams(), top_beta=2, tolerance=0.4)
    drafts = Proposal(torch.tensor([1, 1]))  # 2nd-best twice: log(0.5/0.3) = 0.51 below top-1
    assert lenient(drafts, logp, None)[0] == 2 and int(lenient(drafts, logp, None)[1]) == 2
    assert strict(drafts, logp, None)[0] == 0 and int(strict(drafts, logp, None)[1]) == 0
    assert lenient(Proposal(torch.tensor([2, 1])), logp, None)[0] == 0  # 3rd-best is outside top-2


def test_specdec_relaxation_accepts_at_least_greedy(stories):
    target, drafter = stories
    relaxed = make_verifier("specdec", SamplingParams(), top_beta=3, tolerance=2.0)
    a = spec(target, drafter, [1, 403, 407, 261], 4, 48, verifier=relaxed)
    b = spec(target, drafter, [1, 403, 407, 261], 4, 48)
    assert a.stats.acceptance_rate >= b.stats.acceptance_rate


def test_sampling_helpers_match_naive():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.1, -1.0]])
    p = logits_to_probs(logits, SamplingParams(temperature=0.7, top_k=3))
    naive = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.7, -1)
    torch.testing.assert_close(p[0, :3], naive, atol=1e-6, rtol=0)
    assert p[0, 3:].sum() == 0
    full = torch.softmax(logits[0], -1)  # masses .57 .21 .13 ... -> top_p 0.7 keeps the first two
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p[0, :2], full[:2] / full[:2].sum(), atol=1e-6, rtol=0)
    assert p[0, 2:].sum() == 0
