"""llama-server's verify-step calibration (drafter_train/engines/llamacpp_cost.py) and how the engine table (drafter_train/engines/table.py) predicts a
llama.cpp row from it: the verify kind of each --spec-type, the calibration server's command (synthetic acceptance
0), the step cost taken from a run's timings and logged steps, the median over rounds, and the prediction from the
row's kind curve with the free first token of each request left out. Hand-computed references; no engine runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafter_train.engines import llamacpp_cost
from drafter_train.engines import table as engines
from drafter_train.engines.llamacpp_cost import (calibration_command, drafts_for, median_server_curves, plain_step_ms,
                                      repeating_prompt, step_cost, verify_kind)
from drafter_train.calibrate import predicted_steps_speedup


def test_verify_kind_of_each_spec_type():
    assert verify_kind(None) is None and verify_kind("") is None
    assert verify_kind("ngram-simple") == verify_kind("ngram-mod") == verify_kind("ngram-cache") == "ngram"
    assert verify_kind("draft-eagle3") == verify_kind("ngram-cache,draft-eagle3") == "eagle3"
    assert verify_kind("draft-simple") == "ar"
    assert verify_kind("draft-dflash") == verify_kind("ngram-mod,draft-dflash") == "dflash"
    with pytest.raises(ValueError, match="draft-mtp"):
        verify_kind("draft-mtp")


def test_drafts_for_the_decoders_present():
    decoders = [{"spec_type": None, "draft_len": 0}, {"spec_type": "ngram-simple", "draft_len": 2},
                {"spec_type": "draft-eagle3", "draft_len": 2}, {"spec_type": "ngram-cache,draft-eagle3", "draft_len": 2},
                {"spec_type": "draft-simple", "draft_len": 3}]
    assert drafts_for(decoders) == {"ngram": llamacpp_cost.NGRAM_DRAFTS, "eagle3": (2, llamacpp_cost.CACHE_DRAFTS),
                                    "ar": (3,)}
    assert drafts_for(decoders[:1]) == {}


def test_each_labelled_drafter_gets_its_own_cost_key():
    """Two draft models of one kind (a stock 0.5B and a trained AR drafter) cost differently per step: their
    calibrations are kept apart by label; an n-gram row has no drafter and keeps the kind alone."""
    decoders = [{"spec_type": "draft-simple", "draft_len": 3, "label": "0.5B"},
                {"spec_type": "draft-simple", "draft_len": 2, "label": "ar-2l"},
                {"spec_type": "ngram-cache,draft-dflash", "draft_len": 4, "label": "dflash"},
                {"spec_type": "ngram-mod", "draft_len": 2, "label": "ignored"}]
    assert [llamacpp_cost.cost_key(d) for d in decoders] == ["ar:0.5B", "ar:ar-2l", "dflash:dflash", "ngram"]
    assert drafts_for(decoders) == {"ar:0.5B": (3,), "ar:ar-2l": (2,), "dflash:dflash": (4, llamacpp_cost.CACHE_DRAFTS),
                                    "ngram": llamacpp_cost.NGRAM_DRAFTS}


def test_server_curves_calibrate_each_key_with_its_own_drafter(monkeypatch):
    """server_curves runs one synthetic-acceptance server per key and draft length, with that key's drafter file and
    its kind's --spec-type (DFlash's draft-dflash included)."""
    seen = []

    def decode(command, log, prompts, n_new, ignore_eos):
        seen.append((_value(command, "--spec-type") if "--spec-type" in command else None,
                     _value(command, "-md") if "-md" in command else None))
        return {"steps": [(0, 2)] * 4 if "--spec-type" in command else [], "generated": 10, "requests": 1,
                "gen_ms": 100.0, "draft_ms": 0.0}

    monkeypatch.setattr(llamacpp_cost.engine, "decode_prompts", decode)
    got = llamacpp_cost.server_curves(Path("/b"), Path("/t.gguf"), {"ar:a": Path("/a.gguf"), "dflash": Path("/d.gguf")},
                                      [[1, 2, 3]], 8, 2, False, Path("/log"), {"dflash": (2,), "ar:a": (2,)})
    assert seen == [(None, None), ("draft-simple", "/a.gguf"), ("draft-dflash", "/d.gguf")]
    assert set(got["kinds"]) == {"ar:a", "dflash"}


def _value(command, flag):
    return command[command.index(flag) + 1]


def test_calibration_commands_reject_every_draft():
    bin_dir, target, drafter = Path("/b"), Path("/t.gguf"), Path("/d.gguf")
    plain = calibration_command(bin_dir, target, None, 0, None, 2, 8080, False)
    assert "--spec-type" not in plain and "--spec-synth-rates" not in plain
    eagle = calibration_command(bin_dir, target, "eagle3", 3, drafter, 2, 8080, True)
    assert _value(eagle, "--spec-type") == "draft-eagle3" and _value(eagle, "-md") == str(drafter)
    assert _value(eagle, "--spec-draft-n-max") == "3" and _value(eagle, "--spec-synth-rates") == "0,0,0"
    assert _value(eagle, "-ctk") == "f32"  # the f32 target's server keeps f32 caches, as in the timed runs
    ar = calibration_command(bin_dir, target, "ar", 2, drafter, 2, 8080, False)
    assert _value(ar, "--spec-type") == "draft-simple" and _value(ar, "--spec-synth-rates") == "0,0"
    ngram = calibration_command(bin_dir, target, "ngram", 8, drafter, 2, 8080, False)
    assert "-md" not in ngram and _value(ngram, "--spec-type") == "ngram-simple"
    assert _value(ngram, "--spec-ngram-simple-size-m") == "8" and _value(ngram, "--spec-synth-rates") == ",".join(
        ["0"] * 8)


def test_repeating_prompt_gives_an_ngram_lookup_its_full_draft():
    prompt = [5, 6, 7, 6, 9]
    got = repeating_prompt(prompt, period=8, repeats=3)
    chunk = [5, 6, 7, 9, 256, 257, 258, 259]  # distinct: the prompt's own tokens, then ids from 256
    assert got == prompt + chunk * 3
    # llama.cpp's ngram-simple (n-gram of 3): the last 3 tokens are found one period back, the 7 after them follow
    tail = got[-3:]
    match = max(j for j in range(len(got) - 3) if got[j:j + 3] == tail)
    assert match == len(got) - 3 - 8 and got[match + 3:match + 10] == chunk[:7]


def test_step_cost_by_hand():
    """2 requests x 11 tokens: 2 free first tokens, 20 steps; 16 drafted 3 (rejected: 1 token each), 2 drafted 1
    (the end of a request), 2 plain steps at 10 ms. Generation 500 ms, drafting 80 ms logged."""
    steps = [(0, 3)] * 16 + [(0, 1)] * 2
    served = {"generated": 22, "requests": 2, "gen_ms": 500.0, "draft_ms": 80.0, "steps": steps}
    ms, n = step_cost(served, 10.0, 3)
    # 400 ms over 18 steps of c(4) = 10 + x (16 of them) or 10 + x / 3 (2 of them): 180 + x (16 + 2 / 3) = 400
    x = (500 - 80 - 2 * 10 - 18 * 10) / (16 + 2 / 3)
    assert n == 18 and ms == pytest.approx(10 + x)
    # every draft full: the mean verify step
    full = dict(served, generated=20, gen_ms=400.0, steps=[(0, 3)] * 18)
    assert step_cost(full, 10.0, 3)[0] == pytest.approx(320 / 18)
    assert plain_step_ms({"generated": 22, "requests": 2, "gen_ms": 200.0}) == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="drafted nothing"):
        step_cost(dict(served, steps=[]), 10.0, 3)


def test_median_server_curves_over_rounds():
    def one(ms_1, ms3):
        return {"ms_1": ms_1, "kinds": {"eagle3": {"ms": {1: ms_1, 3: ms3}}}}

    got = median_server_curves([one(10.0, 20.0), one(12.0, 27.0), one(11.0, 22.0)])
    assert got["ms_1"] == 11.0
    assert got["kinds"]["eagle3"]["ms"] == {1: 11.0, 3: 22.0}
    assert got["kinds"]["eagle3"]["relative"] == {1: 1.0, 3: pytest.approx(2.0)}
    # a kind whose calibration failed in a round (its rows then fall back to llama-bench) keeps the others' median
    got = median_server_curves([one(10.0, 20.0), {"ms_1": 12.0, "kinds": {}}, one(11.0, 24.0)])
    assert got["ms_1"] == 11.0 and got["kinds"]["eagle3"]["ms"] == {1: 11.0, 3: 22.0}


def test_engines_predicts_a_llamacpp_row_from_its_kind_and_leaves_the_free_tokens_out():
    """The row's verify kind picks the server curve (not llama-bench's), its 1-token cost is the plain server's; the
    first token of each of 16 requests is made by the prompt pass in both runs."""
    curve = {"engine": "llama.cpp", "precision": "f32", "ms_1": 13.0, "relative": {1: 1.0, 3: 1.2},
             "server": {"ms_1": 14.0, "kinds": {"eagle3": {"relative": {1: 1.0, 3: 1.6}},
                                                "ngram": {"relative": {1: 1.0, 9: 2.0}}}}}
    row = {"engine": "llama.cpp", "precision": "f32", "verify_kind": "eagle3", "tokens": 768, "free_tokens": 16,
           "plain_passes": 28, "drafted": [2] * 590, "draft_ms": 840.0}
    relative, ms_1 = engines._relative_for(row, curve)
    assert ms_1 == 14.0 and relative == {1: 1.0, 3: 1.6}
    got = engines.predict(row, relative, ms_1)
    assert got == pytest.approx(752 / (12 + 590 * 1.6 + 840 / 14))
    assert got == pytest.approx(predicted_steps_speedup(752, 12, [2] * 590, {1: 1.0, 3: 1.6}, 60.0))
    # ours (no server curve, no verify kind) keeps its own curve
    ours = {"engine": "ours", "tree": True}
    assert engines._relative_for(ours, {"ms_1": 20.0, "relative": {1: 1.0}, "tree_relative": {3: 1.03}}) == (
        {1: 1.0, 3: 1.03}, 20.0)


def test_llamacpp_record_keeps_the_verify_kind_and_the_requests():
    decoder = {"engine": "llama.cpp", "precision": "q8_0", "decoder": "product", "draft_len": 2,
               "spec_type": "ngram-cache,draft-eagle3"}
    served = {"tokens_per_s": 60.0, "tokens": 96, "steps": [(1, 2)] * 20 + [(0, 2)] * 30, "draft_ms": 70.0,
              "requests": 2}
    record = engines.llamacpp_record(decoder, served)
    assert record["verify_kind"] == "eagle3" and record["free_tokens"] == 2
    assert record["plain_passes"] == 96 - 70 and record["drafted"] == [2] * 50
