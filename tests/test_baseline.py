"""The speedup's baseline (evaluation.evaluate_decoding): plain decoding timed on every CPU kernel setting, the fastest
the divisor; the timing contract (warm-up untimed, same kernels and threads, interleaving); the definitions of the
fields it reports; sampling at the smallest accepted temperature."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console
from torch import nn

from drafter_train import evaluation
from drafter_train.config import EvalConfig, LookupConfig, TreeConfig
from drafter_train.cpu_kernels import (ALWAYS_ONEDNN, CPU_KERNELS, GROUPED_ATTENTION, OneDNNLinear, kernel_state,
                                       kernel_states, kernels_in_use, onednn_available, use_grouped_attention,
                                       use_onednn_linears)
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.truncated import cut_from_target
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.evaluation import evaluate_decoding
from tests.conftest import tiny_llama

# vocab 1024 x hidden 64 = 65,536 weights: the LM head is just big enough for cpu_kernels to patch it, so the three
# settings differ (its kernel and the attention)
VOCAB = 1024
PROMPTS = [[5, 9, 12, 7, 5, 9, 3], [3, 14, 2, 6], [8, 8, 1, 4, 20], [11, 30, 11, 30, 11]]
# plain decoding's seconds per prompt on each setting, and the speculative run's: onednn is the fastest baseline,
# auto (the speculative run's own) is not
FAKE_SECONDS = {"auto": 3.0, "onednn": 2.0, "default": 5.0, "spec": 1.0}

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")


def setting_of(model: nn.Module) -> str:
    """Which CPU_KERNELS setting the model's LM head and attention are on, read off the modules (not the code's own
    kernels_in_use)."""
    head, attention = model.lm_head, model.config._attn_implementation
    if type(head) is nn.Linear and attention == "sdpa":
        return "default"
    assert type(head) is OneDNNLinear and attention == GROUPED_ATTENTION, (type(head), attention)
    return "onednn" if head.row_policy is ALWAYS_ONEDNN else "auto"


@pytest.fixture
def auto_target():
    """A target on target.cpu_kernels=auto, as load_target leaves it, and a drafter cut from it."""
    target = tiny_llama(vocab_size=VOCAB, num_layers=2)
    use_onednn_linears(target, "auto")
    use_grouped_attention(target, "auto")
    return target, make_drafter(cut_from_target(target, 1, share_weights=False), "default")


class Spy:
    """Records every decode (which decoder, on which kernels, with how many threads, timed or not) and hands the
    evaluator FAKE_SECONDS as its timings."""

    def __init__(self, monkeypatch, target):
        self.target, self.events, self.timing = target, [], False
        monkeypatch.setattr(evaluation, "generate_autoregressive", self.wrap("ar", generate_autoregressive))
        monkeypatch.setattr(evaluation, "generate_speculative", self.wrap("spec", generate_speculative))
        monkeypatch.setattr(evaluation, "_timed", self.timed)

    def wrap(self, kind, fn):
        def spied(*args, **kwargs):
            self.events.append({"kind": kind, "kernels": setting_of(self.target), "threads": torch.get_num_threads(),
                                "timed": self.timing})
            return fn(*args, **kwargs)

        return spied

    def timed(self, fn, device):
        self.timing = True
        try:
            result = fn()
        finally:
            self.timing = False
        last = self.events[-1]
        return result, FAKE_SECONDS["spec" if last["kind"] == "spec" else last["kernels"]]


@needs_onednn
def test_timing_contract_and_fastest_baseline(auto_target, monkeypatch):
    target, drafter = auto_target
    before = kernel_state(target)
    spy = Spy(monkeypatch, target)
    cfg = EvalConfig(draft_len=2, max_new_tokens=6, warmup=2)
    metrics = evaluate_decoding(target, drafter, PROMPTS, cfg, (), progress=False, kernels="auto")

    untimed = [e for e in spy.events if not e["timed"]]
    timed = [e for e in spy.events if e["timed"]]
    # warm-up: every decoder and every setting, twice, all before the first timed decode and never timed
    assert spy.events[:len(untimed)] == untimed
    assert sorted((e["kind"], e["kernels"]) for e in untimed) == sorted(
        [("ar", k) for k in CPU_KERNELS] * 2 + [("spec", "auto")] * 2)
    # interleaving: plain first on even prompts, speculative first on odd ones; the plain settings take turns first
    order = [(e["kind"], e["kernels"]) for e in timed]
    plain = [("ar", "auto"), ("ar", "onednn"), ("ar", "default")]
    spec = [("spec", "auto")]
    assert order == (plain + spec) + (spec + plain[1:] + plain[:1]) + (plain[2:] + plain[:2] + spec) + (spec + plain)
    # the speculative run always on its own kernels; one thread count for every decode
    assert {e["kernels"] for e in spy.events if e["kind"] == "spec"} == {"auto"}
    assert len({e["threads"] for e in spy.events}) == 1

    # the arithmetic: only the timed runs count, and the divisor is the fastest plain decoding (the least seconds)
    n, tokens = len(PROMPTS), metrics["tokens_generated"]
    assert metrics["greedy_match"] == 1.0 and tokens == 6 * n
    by = metrics["baseline"]["by_kernels"]
    assert set(by) == set(CPU_KERNELS)
    for k in CPU_KERNELS:
        assert by[k]["time_s"] == pytest.approx(FAKE_SECONDS[k] * n)
        assert by[k]["tokens_generated"] == tokens
        assert by[k]["tokens_per_s"] == pytest.approx(tokens / (FAKE_SECONDS[k] * n))
    assert metrics["baseline"]["kernels"] == "onednn" and metrics["spec_kernels"] == "auto"
    assert metrics["ar_tokens_per_s"] == metrics["baseline"]["tokens_per_s"] == pytest.approx(tokens / (2.0 * n))
    assert metrics["spec_time_s"] == pytest.approx(1.0 * n)
    assert metrics["speedup"] == pytest.approx(2.0)  # 2 s of the fastest plain decoding over 1 s, same tokens
    assert metrics["speedup_same_kernels"] == pytest.approx(3.0)

    out = io.StringIO()  # the printed table names the baseline and the speculative run's kernels
    evaluation.print_table({**metrics, "per_category": {"maths": metrics}}, Console(file=out, width=200))
    assert "plain decoding on onednn kernels, the fastest of auto " in out.getvalue()
    assert "[maths] tau / speedup" in out.getvalue() and "speculative kernels" in out.getvalue()

    # the target is left exactly on its configured kernels: the same layers, the same timed policy object
    after = kernel_state(target)
    assert after == before and all(a[1] is b[1] for a, b in zip(after.linears, before.linears))


@needs_onednn
def test_per_category_speedups_use_the_same_fastest_baseline(auto_target, monkeypatch):
    target, drafter = auto_target
    Spy(monkeypatch, target)
    metrics = evaluate_decoding(target, drafter, PROMPTS, EvalConfig(draft_len=2, max_new_tokens=6, warmup=0), (),
                                progress=False, categories=["a", "b", "a", None], kernels="auto")
    assert set(metrics["per_category"]) == {"a", "b"}
    assert all(c["speedup"] == pytest.approx(2.0) for c in metrics["per_category"].values())


@needs_onednn
def test_same_kernels_times_plain_decoding_once(auto_target, monkeypatch):
    target, drafter = auto_target
    spy = Spy(monkeypatch, target)
    cfg = EvalConfig(draft_len=2, max_new_tokens=6, warmup=1, baseline_kernels="same")
    metrics = evaluate_decoding(target, drafter, PROMPTS, cfg, (), progress=False, kernels="auto")
    assert {e["kernels"] for e in spy.events} == {"auto"}
    assert [e["kind"] for e in spy.events if e["timed"]] == ["ar", "spec", "spec", "ar"] * 2
    assert list(metrics["baseline"]["by_kernels"]) == ["auto"] and metrics["baseline"]["kernels"] == "auto"
    assert metrics["speedup"] == metrics["speedup_same_kernels"] == pytest.approx(3.0)


@needs_onednn
def test_target_kernels_are_restored_when_decoding_fails(auto_target, monkeypatch):
    target, drafter = auto_target
    before = kernel_state(target)

    def fails(*args, **kwargs):
        if setting_of(target) == "onednn":
            raise RuntimeError("boom")
        return generate_autoregressive(*args, **kwargs)

    monkeypatch.setattr(evaluation, "generate_autoregressive", fails)
    with pytest.raises(RuntimeError, match="boom"):  # the first prompt's plain runs: auto, then onednn fails
        evaluate_decoding(target, drafter, PROMPTS, EvalConfig(warmup=0, max_new_tokens=4), (), progress=False,
                          kernels="auto")
    assert kernel_state(target) == before


@needs_onednn
def test_kernel_states_name_each_setting_and_keep_the_timed_policy(auto_target):
    target, _ = auto_target
    policy = target.lm_head.row_policy
    states = kernel_states(target, "auto", CPU_KERNELS)
    assert list(states) == list(CPU_KERNELS) and target.lm_head.row_policy is policy  # left on auto, not re-timed
    for name, state in states.items():
        evaluation.apply_kernel_state(target, state)
        assert setting_of(target) == kernels_in_use(target) == name
    evaluation.apply_kernel_state(target, states["auto"])
    assert target.lm_head.row_policy is policy
    # a target built in-process, never switched, is on PyTorch's own kernels: that is what evaluate_decoding names
    assert kernels_in_use(tiny_llama(vocab_size=VOCAB, num_layers=1)) == "default"


def test_baseline_kernels_is_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^eval.baseline_kernels: must be one of \('all', 'same'\), got 'some'$"):
        EvalConfig(baseline_kernels="some")


def test_lookup_ahead_of_a_tree_reports_one_draft_len():
    """The product's proposal (the drafter's 2 best next tokens as siblings, lookups ahead): draft_len is the most
    drafts a verify pass can accept, i.e. the lookup chains' 2, and per_position_acceptance has that many entries."""
    target = tiny_llama(vocab_size=32, num_layers=2)
    drafter = make_drafter(cut_from_target(target, 1, share_weights=False), "default")
    cfg = EvalConfig(tree=TreeConfig(top_k=2, depth=1, total_tokens=2), lookup=LookupConfig(min_ngram=1),
                     max_new_tokens=16, warmup=0, baseline_kernels="same")
    metrics = evaluate_decoding(target, drafter, PROMPTS, cfg, (), progress=False)
    assert metrics["tree"]["depth"] == 1 and metrics["lookup_proposals"] > 0
    assert metrics["draft_len"] == len(metrics["per_position_acceptance"]) == len(metrics["per_position_tested"]) == 2
    assert len(metrics["accepted_length_histogram"]) == 3
    assert metrics["deepest_tested_position"] == 2 and metrics["per_position_tested"][1] > 0  # a lookup chain of 2
    assert metrics["per_position_tested"][0] == metrics["proposals"]  # every proposal tests its first position


def test_tau_counts_the_prefill_pass():
    """tau = tokens_generated / target_forward_passes with the prefill pass counted: plain decoding has tau 1."""
    target = tiny_llama(vocab_size=32, num_layers=2)
    plain = generate_autoregressive(target, PROMPTS[0], 7)
    assert plain.stats.target_forward_passes == 7 and plain.stats.tau == 1.0
    spec = generate_speculative(target, make_drafter(target, "default"), PROMPTS[0], 3, make_verifier(
        "greedy", SamplingParams()), 7)
    # the drafter is the target: every step accepts all 3 drafts plus the bonus: prefill (1 token) + 4 + 2 tokens
    assert spec.tokens == plain.tokens and spec.stats.target_forward_passes == 3 and spec.stats.tau == 7 / 3


SMALLEST_TEMPERATURE = math.ulp(0.0)  # 5e-324: eval.temperature accepts any float > 0


def test_the_smallest_accepted_temperature_samples_greedily_without_nan():
    with pytest.raises(ConfigError, match="eval.temperature"):
        EvalConfig(verify="sample", temperature=0.0)
    cfg = EvalConfig(verify="sample", temperature=SMALLEST_TEMPERATURE, draft_len=3, max_new_tokens=12)
    params = evaluation.sampling_params(cfg)
    logits = torch.tensor([[1.0, 3.0, 3.0 - 1e-6, -2.0], [0.5, 0.5, -1.0, float("-inf")]])
    probs = logits_to_probs(logits, params)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))  # ties share

    target = tiny_llama(vocab_size=32, num_layers=2)
    drafter = make_drafter(cut_from_target(target, 1, share_weights=False), "default")
    verifier = make_verifier("sample", params)
    for prompt in PROMPTS:  # speculative sampling at that temperature: the greedy output, token for token
        greedy = generate_autoregressive(target, prompt, 12).tokens
        gen = torch.Generator().manual_seed(0)
        assert generate_speculative(target, drafter, prompt, 3, verifier, 12, params, (), gen).tokens == greedy
    tree = EvalConfig(verify="sample", temperature=SMALLEST_TEMPERATURE, max_new_tokens=12, warmup=0,
                      tree=TreeConfig(top_k=2, depth=2), baseline_kernels="same")
    metrics = evaluate_decoding(target, drafter, PROMPTS, tree, (), progress=False)
    assert metrics["tokens_generated"] == metrics["ar_tokens_generated"] == 12 * len(PROMPTS)
    assert 0 < metrics["acceptance_rate"] <= 1 and not math.isnan(metrics["tau"])
