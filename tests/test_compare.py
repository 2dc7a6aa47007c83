"""drafter-compare: several decoders against one plain decoding, side by side. Each decoder's counts must equal a
cache-free replay of its own decoding (and drafter-eval's figures for the same job); plain decoding runs once per
prompt and setting, shared by all; jobs that cannot share it are refused in one line before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from drafter_train.errors import DrafterTrainError
from drafter_train.evaluation import time_side_by_side
from drafter_train.recipes.cli import compare_jobs
from drafter_train.recipes.evaluate import run_eval_job
from tests.test_evaluate import folders, job, reference_counts  # noqa: F401 (folders: a fixture)
from tests.stubs import run_cli

COUNTS = ("tokens_generated", "target_forward_passes", "proposed_draft_tokens", "accepted_draft_tokens")


def common(folders) -> list[str]:
    return [f"target.path={folders / 'target'}", "target.chat_template=false", f"eval.prompts={folders / 'prompts.txt'}",
            "eval.max_new_tokens=24", "eval.num_prompts=4", "eval.baseline_kernels=same"]


def test_decoders_side_by_side_count_as_alone_and_share_plain_decoding(folders, tmp_path):
    result = run_cli("drafter-compare", *common(folders),
                     "chain:", f"drafter.path={folders / 'drafter'}", "eval.draft_len=3", "eval.output=chain.json",
                     "self:", f"drafter.path={folders / 'target'}", "eval.draft_len=4", "eval.output=self.json",
                     "lookup:", "drafter=ngram", "drafter.min_ngram=1", "eval.draft_len=2", "eval.output=lookup.json",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    chain, itself, lookup = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("chain", "self", "lookup"))
    # each decoder counts what a cache-free replay of it counts, and what drafter-eval counts for the same job
    tokens, passes, proposed, accepted = reference_counts(folders, 3, 24)
    assert [chain[k] for k in COUNTS] == [tokens, passes, proposed, accepted] and accepted > 0
    alone = run_eval_job(job(folders, "eval.draft_len=3", f"eval.output={tmp_path / 'alone.json'}"))
    assert [alone[k] for k in COUNTS] == [chain[k] for k in COUNTS]
    assert itself["per_position_acceptance"] == [1.0] * 4  # the target drafting itself: every draft accepted
    assert lookup["drafter_kind"] == "ngram" and lookup["draft_len"] == 2
    # lossless, and one plain decoding: the same plain runs (tokens and seconds) divide every speedup
    for metrics in (chain, itself, lookup):
        assert metrics["greedy_match"] == 1.0 and metrics["side_by_side"] == ["chain", "self", "lookup"]
        assert metrics["baseline"] == chain["baseline"] and metrics["ar_time_s"] == chain["ar_time_s"]
        assert metrics["speedup"] == pytest.approx(metrics["spec_tokens_per_s"] / chain["ar_tokens_per_s"])
        assert metrics["split"] and metrics["machine"]["cpu"] and metrics["config"]["eval"]["output"]
    assert chain["spec_time_s"] != itself["spec_time_s"]  # each decoder timed on its own
    assert "drafter-compare: chain" in result.stderr and "drafter-compare: lookup" in result.stderr  # the tables


def test_requests_interleave_every_decoder_with_every_plain_setting():
    calls = []

    def ready(name):
        return lambda: (lambda: calls.append(name) or name)

    orders = []
    for i in range(4):
        calls.clear()
        specs, ar = time_side_by_side(i, ("a", "b"), [ready("s0"), ready("s1"), ready("s2")],
                                      lambda k: (lambda: calls.append(k) or k), torch.device("cpu"))
        assert [r for r, _ in specs] == ["s0", "s1", "s2"] and {k: r for k, (r, _) in ar.items()} == {"a": "a", "b": "b"}
        orders.append(list(calls))
    # plain decoding first on even requests, the decoders first on odd ones; the decoders and the plain settings each
    # take turns going first
    assert orders == [["a", "b", "s0", "s1", "s2"], ["s1", "s2", "s0", "b", "a"], ["a", "b", "s2", "s0", "s1"],
                      ["s0", "s1", "s2", "b", "a"]]


@pytest.mark.parametrize("extra, words", [
    (["a:", "eval.output=a.json", "b:", "eval.output=b.json", "eval.max_new_tokens=5"], "b: eval.max_new_tokens=5"),
    (["a:", "eval.output=a.json", "b:", "eval.output=b.json", "eval.prompts=test"], "b: its eval.prompts differs"),
    (["a:", "eval.output=a.json", "b:", "eval.output=b.json", "eval.verify=sample"], "b: eval.verify=sample"),
    (["a:", "eval.output=a.json", "b:", "eval.output=a.json"], "b: eval.output=a.json is a's too"),
    (["a:", "eval.draft_len=2"], "a: eval.output must be set"),
    (["a:", "eval.output=a.json", "a:", "eval.output=b.json"], "given once"),
    (["a:", "eval.output=a.json", "eval.engine=llamacpp"], "a: drafter-compare runs our decoder"),
    (["a:", "eval.output=a.json", "drafter.path=/nowhere/drafter"], "drafter.path"),
    ([], "no decoder given"),
])
def test_jobs_that_cannot_share_plain_decoding_are_refused(folders, extra, words):
    with pytest.raises(DrafterTrainError, match=words.replace(".", r"\.")):
        compare_jobs([*common(folders), f"drafter.path={folders / 'drafter'}", *extra])


def test_cli_error_is_one_line_before_loading(folders, tmp_path):
    result = run_cli("drafter-compare", *common(folders), "a:", "eval.output=a.json", "b:", "eval.output=b.json",
                     "eval.seed=3", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("drafter-compare: error: b: eval.seed=3 differs")
