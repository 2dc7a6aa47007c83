"""The speedup model calibration and the engine table share (drafter_train/calibrate.py): predicted speedup, break-even
tau and the acceptance it needs, per engine, against hand-computed references."""

import pytest

from drafter_train.calibrate import (Candidate, measured_speedups, acceptance_needed, break_even_tau, chain_tau,
                                     cost_at, engine_costs, engine_predictions, predicted_speedup,
                                     predicted_steps_speedup, relative_costs)


def test_predicted_speedup_by_hand():
    # llama.cpp F32 as the issue measured it: 14.6 ms for 1 token, 17.2 ms for 2; 2 ms of drafting; tau 1.25
    verify, draft = 17.2 / 14.6, 2.0 / 14.6
    assert predicted_speedup(1.25, verify, draft) == pytest.approx(1.25 * 14.6 / 19.2)  # 0.9505
    assert predicted_speedup(1.25, verify, draft) == pytest.approx(0.95052, abs=1e-5)
    assert break_even_tau(verify, draft) == pytest.approx(19.2 / 14.6)
    assert predicted_speedup(break_even_tau(verify, draft), verify, draft) == pytest.approx(1.0)
    assert relative_costs({2: 12.5, 1: 10.0, 5: 20.0}) == {1: 1.0, 2: 1.25, 5: 2.0}


def test_acceptance_needed_inverts_chain_tau():
    assert chain_tau(0.5, 2) == pytest.approx(1.75) and chain_tau(0.0, 4) == 1.0 and chain_tau(1.0, 3) == 4.0
    assert acceptance_needed(1.44, 1) == pytest.approx(0.44)  # 1 + a = 1.44
    assert acceptance_needed(1.75, 2) == pytest.approx(0.5)  # 1 + a + a^2 = 1.75
    assert acceptance_needed(1.0, 3) == pytest.approx(0.0, abs=1e-12)
    assert acceptance_needed(3.5, 2) is None  # more than draft_len + 1 tokens per pass: no chain of 2 gets there


def test_engine_predictions_by_hand():
    """A chain candidate in an engine: its tau over the engine's cost at draft_len + 1 plus the drafter's share of a
    1-token pass measured here; trees are left out (engines verify chains) and so are sizes the curve lacks."""
    ar_ms = 20.0
    chain1 = Candidate(1, None, 1, accepted_per_step=0.5, draft_ms=2.0, verify_ms=24.0)
    chain3 = Candidate(3, None, 3, accepted_per_step=0.9, draft_ms=6.0, verify_ms=30.0)
    chain8 = Candidate(8, None, 8, accepted_per_step=1.0, draft_ms=16.0, verify_ms=60.0)
    tree = Candidate(1, {"top_k": 2, "depth": 1, "total_tokens": 2, "branching": "topk"}, 2, 0.7, 2.0, 25.0)
    record = {"data": {"cost_curves": [{"engine": "llama.cpp", "precision": "q8_0", "ms_1": 5.0,
                                        "relative": {"1": 1.0, "2": 1.5, "4": 2.0}}]}}
    curves = engine_costs(record)
    assert curves[0]["relative"] == {1: 1.0, 2: 1.5, 4: 2.0}
    rows = engine_predictions([chain1, chain3, chain8, tree], ar_ms, curves)
    assert [r["name"] for r in rows] == ["chain draft_len=1", "chain draft_len=3"]  # best first, no tree, no n=9
    by_len = {r["draft_len"]: r for r in rows}
    assert by_len[1]["predicted_speedup"] == pytest.approx(1.5 / (1.5 + 0.1))  # 0.9375
    assert by_len[3]["predicted_speedup"] == pytest.approx(1.9 / (2.0 + 0.3))  # 0.8261
    assert by_len[1]["break_even_tau"] == pytest.approx(1.6) and by_len[1]["acceptance_needed"] == pytest.approx(0.6)
    assert by_len[3]["break_even_tau"] == pytest.approx(2.3)
    a = by_len[3]["acceptance_needed"]
    assert 1 + a + a * a + a ** 3 == pytest.approx(2.3)
    assert engine_costs({"data": {}}) == [] and engine_costs({}) == []
    # between measured sizes the cost is interpolated: a chain of 2 verifies 3 tokens, (1.5 + 2.0) / 2
    chain2 = Candidate(2, None, 2, accepted_per_step=0.8, draft_ms=4.0, verify_ms=27.0)
    (row,) = engine_predictions([chain2], ar_ms, curves)
    assert row["verify_cost"] == pytest.approx(1.75)


def test_engine_costs_take_llama_servers_own_verify_step_where_measured():
    """llama-bench's pass curve leaves out the logits at every position and the drafter's work on the verify batch:
    where engines.py measured llama-server's step, that is the curve (EAGLE-3's first, else n-gram's, else the
    draft model's); other engines keep their pass curve."""
    server = {"ms_1": 6.0, "kinds": {"ngram": {"relative": {"1": 1.0, "3": 3.0}},
                                     "eagle3": {"relative": {"1": 1.0, "3": 3.4, "9": 5.3}}}}
    record = {"data": {"cost_curves": [
        {"engine": "llama.cpp", "precision": "q8_0", "ms_1": 5.6, "relative": {"1": 1.0, "3": 2.2}, "server": server},
        {"engine": "llama.cpp", "precision": "f32", "ms_1": 15.0, "relative": {"1": 1.0, "3": 1.3},
         "server": {"ms_1": 15.0, "kinds": {"ngram": {"relative": {"1": 1.0, "3": 1.44}}}}},
        {"engine": "ours", "precision": "f32", "ms_1": 25.0, "relative": {"1": 1.0, "3": 1.16}}]}}
    q8, f32, ours = engine_costs(record)
    assert q8["relative"] == {1: 1.0, 3: 3.4, 9: 5.3} and q8["source"] == "llama-server eagle3 step"
    assert f32["relative"] == {1: 1.0, 3: 1.44} and f32["source"] == "llama-server ngram step"
    assert ours["relative"] == {1: 1.0, 3: 1.16} and ours["source"] == "pass curve"


def test_measured_speedup_divides_by_the_baseline_the_prediction_models():
    """The prediction models plain decoding on the target's own kernels; measured against the same, and both over
    the fastest plain decoding beside it."""
    metrics = {"speedup": 1.1, "speedup_same_kernels": 1.32, "spec_kernels": "auto",
               "baseline": {"kernels": "onednn", "tokens_per_s": 48.0,
                            "by_kernels": {"auto": {"tokens_per_s": 40.0}, "onednn": {"tokens_per_s": 48.0}}}}
    got = measured_speedups(1.2, metrics)
    assert got["measured_speedup"] == 1.32 and got["measured_speedup_over_fastest"] == 1.1
    assert got["predicted_speedup_over_fastest"] == pytest.approx(1.2 * 40.0 / 48.0)
    assert "auto" in got["baseline"] and "onednn" in got["fastest_baseline"]
    single = measured_speedups(1.2, {"speedup": 0.9, "speedup_same_kernels": 0.9, "spec_kernels": "auto",
                                      "baseline": {"kernels": "auto", "tokens_per_s": 30.0,
                                                   "by_kernels": {"auto": {"tokens_per_s": 30.0}}}})
    assert single["measured_speedup"] == 0.9 and single["predicted_speedup_over_fastest"] == pytest.approx(1.2)


def test_predicted_steps_speedup_by_hand():
    """Mixed steps: 10 tokens from 2 one-token passes, a step that drafted 1 (pass of 2) and one that drafted 3 (pass
    of 4, between the measured 3 and 5), and 0.5 passes' worth of drafting."""
    relative = {1: 1.0, 2: 1.2, 3: 1.5, 5: 2.5}
    assert cost_at(relative, 4) == pytest.approx(2.0) and cost_at(relative, 9) == 2.5 and cost_at(relative, 2) == 1.2
    got = predicted_steps_speedup(10, 2, [1, 3], relative, 0.5)
    assert got == pytest.approx(10 / (2 + 1.2 + 2.0 + 0.5))
    # every step drafting k is the plain formula
    steps = 20
    tau = 1.6
    tokens = round(tau * steps)
    assert predicted_steps_speedup(tokens, 0, [2] * steps, relative, 0.1 * steps) == pytest.approx(
        predicted_speedup(tau, 1.5, 0.1))


def test_engine_costs_file_is_refused_in_one_line_and_printed(tmp_path):
    import json

    from rich.console import Console

    from drafter_train.errors import ConfigError
    from drafter_train.evaluation import print_engine_predictions
    from drafter_train.recipes.evaluate import engine_curves

    assert engine_curves(None) == []
    with pytest.raises(ConfigError, match=r"eval\.calibration\.engine_costs: no such file"):
        engine_curves(str(tmp_path / "missing.json"))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"data": {}}))
    with pytest.raises(ConfigError, match=r"eval\.calibration\.engine_costs: .* holds no cost curves"):
        engine_curves(str(empty))
    good = tmp_path / "engines.json"
    good.write_text(json.dumps({"data": {"cost_curves": [{"engine": "llama.cpp", "precision": "f16", "ms_1": 7.6,
                                                          "relative": {"1": 1.0, "2": 1.25}}]}}))
    curves = engine_curves(str(good))
    rows = engine_predictions([Candidate(1, None, 1, 0.3, 1.0, 11.0)], 10.0, curves)
    console = Console(record=True, width=200)
    print_engine_predictions(rows, console)
    text = console.export_text()
    # tau 1.3 over 1.25 + 0.1: 0.963; break-even 1.35 needs acceptance 0.35 at draft length 1
    assert "llama.cpp f16" in text and "0.963" in text and "1.35" in text and "0.35" in text
