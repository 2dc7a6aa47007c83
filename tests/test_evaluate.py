"""drafter-eval end to end on tiny local folders: the documented override line, metric definitions, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.drafters.common.truncated import cut_from_target
from drafter_train.errors import ConfigError, ModelNotFoundError, VocabMismatchError
from drafter_train.recipes.evaluate import run_eval_job
from tests.conftest import tiny_llama
from tests.stubs import VOCAB, compose_cfg, greedy_drafts, naive_greedy_speculative, run_cli, save_tiny, word_tokenizer



@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target, a drafter cut from it, a drafter with another vocabulary, and a prompt file."""
    root = tmp_path_factory.mktemp("eval")
    target = tiny_llama(vocab_size=VOCAB, num_layers=3)
    for name, model in (
        ("target", target),
        ("drafter", cut_from_target(target, 1, share_weights=False)),
        ("other_vocab", tiny_llama(vocab_size=VOCAB + 5, num_layers=1)),
    ):
        save_tiny(model, root / name)
    prompts = root / "prompts.txt"
    prompts.write_text("the cat sat on the mat\nthe dog ran\na big red house\nthe sun and the tree\n")
    return root


def job(folders, *overrides):
    return OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={folders / 'target'}", "target.chat_template=false", f"drafter.path={folders / 'drafter'}",
        f"eval.prompts={folders / 'prompts.txt'}", f"eval.output={folders / 'metrics.json'}", "eval.max_new_tokens=24",
        "eval.num_prompts=4", *overrides,
    ]))


def reference_counts(folders, draft_len: int, max_new_tokens: int) -> tuple[int, int, int, int]:
    """(tokens, target passes, proposed, accepted) over the prompt file, from `naive_greedy_speculative` with the
    drafter folder's greedy drafts (each a full forward, no cache)."""
    from drafter_train.targets import load_causal_lm

    target, drafter = (load_causal_lm(str(folders / name)) for name in ("target", "drafter"))
    tokenizer = word_tokenizer()
    totals = [0, 0, 0, 0]
    for line in (folders / "prompts.txt").read_text().splitlines():
        prompt = tokenizer(line).input_ids
        tokens, *counts = naive_greedy_speculative(target, greedy_drafts(drafter), prompt, draft_len, max_new_tokens,
                                                   eos=(tokenizer.eos_token_id,))
        totals = [a + b for a, b in zip(totals, (len(tokens), *counts))]
    return tuple(totals)


def drafter_eval(*args, cwd):
    return run_cli("drafter-eval", *args, cwd=cwd)


def test_cli_documented_override_line(folders, tmp_path):
    result = drafter_eval(
        f"target.path={folders / 'target'}", f"drafter.path={folders / 'drafter'}", "eval.draft_len=4",
        "eval.verify=greedy", "eval.num_prompts=8", "eval.max_new_tokens=32", f"eval.prompts={folders / 'prompts.txt'}",
        "eval.output=metrics.json", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_prompts"] == 4  # the file holds 4 prompts; all are used
    assert metrics["greedy_match"] == 1.0
    assert len(metrics["per_position_acceptance"]) == 4
    # tau against a cache-free replay of greedy speculative decoding over the same 4 prompts (warm-up not counted)
    tokens, passes, _, accepted = reference_counts(folders, 4, 32)
    assert accepted > 0 and (metrics["tokens_generated"], metrics["target_forward_passes"]) == (tokens, passes)
    assert metrics["tau"] == pytest.approx(tokens / passes) and metrics["tau"] > 1.0
    assert metrics["config"]["eval"]["draft_len"] == 4 and metrics["config"]["eval"]["max_new_tokens"] == 32
    assert "tau" in result.stderr  # the closing table


def test_metric_definitions_against_counts(folders):
    metrics = run_eval_job(job(folders, "eval.draft_len=3"))
    proposed, accepted = metrics["proposed_draft_tokens"], metrics["accepted_draft_tokens"]
    assert metrics["acceptance_rate"] == pytest.approx(accepted / proposed)
    assert metrics["tokens_generated"] == metrics["ar_tokens_generated"]  # same tokens as AR (lossless)
    # exact counts of a cache-free replay of the same decoding: some drafts must have been accepted
    reference = reference_counts(folders, 3, 24)
    assert reference[3] > 0
    assert (metrics["tokens_generated"], metrics["target_forward_passes"], proposed, accepted) == reference
    assert json.loads((folders / "metrics.json").read_text())["tau"] == metrics["tau"]
    # what the speedup was measured on: the CPU, its vector extensions, the threads and the kernel setting
    machine = metrics["machine"]
    assert machine["cpu"] and isinstance(machine["cpu_features"], list) and machine["torch_threads"] >= 1
    assert machine["cpu_kernels"] == "auto" and set(machine["usable"]) == {"torch_capability", "amx", "bf16_matmul"}


def test_drafter_equal_to_target_accepts_all(folders):
    metrics = run_eval_job(job(folders, f"drafter.path={folders / 'target'}", "eval.draft_len=4"))
    assert metrics["acceptance_rate"] == 1.0 and metrics["per_position_acceptance"] == [1.0] * 4
    assert metrics["greedy_match"] == 1.0
    # under sampling q == p, so every draft is kept (min(1, p/q) = 1 up to float noise between the two caches)
    sample = run_eval_job(job(folders, f"drafter.path={folders / 'target'}", "eval.draft_len=4", "eval.verify=sample",
                              "eval.temperature=0.8"))
    assert sample["acceptance_rate"] > 0.98 and sample["tau"] > 3.0


def test_truncated_baseline_and_modes(folders):
    sample = run_eval_job(job(folders, "drafter.path=truncated:2", "eval.verify=sample", "eval.temperature=0.8"))
    # a drafter made of 2 of the target's 3 layers keeps some drafts under sampling too
    assert sample["greedy_match"] is None and sample["accepted_draft_tokens"] > 0 and sample["tau"] > 1.0
    specdec = run_eval_job(job(folders, "eval.verify=specdec", "eval.specdec_top_beta=1", "eval.specdec_tolerance=0"))
    assert specdec["greedy_match"] == 1.0  # beta=1, tolerance 0 is greedy


@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (("drafter.path=/no/such/drafter",), ModelNotFoundError, "/no/such/drafter"),
        (("eval.draft_len=0",), ConfigError, "eval.draft_len"),
        (("eval.verify=beam",), ConfigError, "eval.verify"),
        (("drafter.path=truncated:9",), ConfigError, "truncated"),
        (("eval.output=/proc/forbidden/metrics.json",), ConfigError, "eval.output"),
    ],
)
def test_bad_input_is_one_clear_error(folders, overrides, error, words):
    with pytest.raises(error, match=words.replace(".", r"\.")):
        run_eval_job(job(folders, *overrides))


def test_vocab_mismatch_is_refused(folders, tmp_path):
    output = tmp_path / "out" / "metrics.json"
    with pytest.raises(VocabMismatchError, match="vocabulary"):
        run_eval_job(job(folders, f"drafter.path={folders / 'other_vocab'}", f"eval.output={output}"))
    assert not output.exists()  # the early writability check leaves no empty metrics file behind


def test_cli_error_is_one_line_without_traceback(folders, tmp_path):
    result = drafter_eval(f"target.path={folders / 'target'}", f"drafter.path={folders / 'other_vocab'}", cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert lines[-1].startswith("drafter-eval: error:") and "Traceback" not in result.stderr


def test_divergence_margin_reads_the_target_at_the_first_difference(make_tiny_llama):
    from drafter_train.evaluation import divergence_margin

    target = make_tiny_llama(vocab_size=32)
    prompt, ar = [1, 4, 5], [7, 8, 9]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + ar[:1]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert divergence_margin(target, prompt, ar, [7, 3, 9]) == pytest.approx(float(top2[0] - top2[1]), abs=1e-5)
