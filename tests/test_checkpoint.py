"""Checkpoints that survive concurrency and damage: ranks preparing one run folder at once, checksums recorded in
every checkpoint, resume falling back to the newest intact step, drafter-eval and drafter-export refusing a damaged
one in one line."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from drafter_train.checkpoint import (
    MANIFEST, TrainState, prepare_run_dir, prune, resume_checkpoint, save_checkpoint, step_dirs, verify_checkpoint,
)
from drafter_train.errors import CheckpointDamagedError
from drafter_train.recipes.evaluate import run_eval_job
from drafter_train.recipes.export import ExportConfig, export
from drafter_train.recipes.train import train
from tests.conftest import tiny_llama
from drafter_train.data.store import load_eval_prompts
from drafter_train.targets import load_causal_lm
from tests.stubs import VOCAB, compose_cfg, greedy_drafts, naive_greedy_speculative, run_cli, word_tokenizer
from tests.test_train import train_cfg

WEIGHTS = "drafter/model.safetensors"


# ---- many processes, one run folder ------------------------------------------------------------------------------


def test_ranks_preparing_one_run_folder_at_once_never_fail(tmp_path):
    """Every rank of a launch checks that the run folder is writable at the same moment. With one probe file name
    shared by all of them, one rank deleted it while another still used it: `cannot write ...: No such file`."""
    def prepare_many(root: str) -> list[str]:
        errors = []
        for _ in range(300):
            try:
                prepare_run_dir(root, "run", "auto")
            except Exception as err:  # noqa: BLE001 - any failure at all is the bug
                errors.append(str(err))
        return errors

    for attempt in range(3):  # a fresh folder each time, as for a new run
        with ThreadPoolExecutor(8) as pool:
            errors = [e for found in pool.map(prepare_many, [str(tmp_path / str(attempt))] * 8) for e in found]
        assert errors == [], errors[:3]
        assert [p.name for p in (tmp_path / str(attempt) / "run").iterdir()] == []  # no probe left behind


# ---- checksums ----------------------------------------------------------------------------------------------------


def training_state(step: int, best_step: int) -> dict:
    state = TrainState(step=step, best_tau=1.5, best_step=best_step)
    return {"optimizer": {"state": {0: {"exp_avg": torch.randn(64, 64)}}}, "train_state": state.state_dict()}


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run folder with step-1 and step-2 (latest, and best), written by save_checkpoint."""
    model, tokenizer = tiny_llama(vocab_size=VOCAB, num_layers=1), word_tokenizer()
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2):
        save_checkpoint(run, model, tokenizer, training_state(step, step), {"tau": 1.0 + step}, step)
    (run / "best").symlink_to("step-2")
    return run


def junk_weights(path: Path) -> None:
    path.write_bytes(b"\0junk" * 10)  # what the fresh-clone test did: "header too small" in safetensors


def same_size_junk(path: Path) -> None:
    path.write_bytes(bytes(len(path.read_bytes())))  # only the checksum can tell


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def wrong_checksum(step_dir: Path, rel: str) -> None:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][rel]["sha256"] = "0" * 64
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


DAMAGE = {
    "junk weights": (WEIGHTS, lambda step: junk_weights(step / WEIGHTS), "has 50 bytes"),
    "same-size junk weights": (WEIGHTS, lambda step: same_size_junk(step / WEIGHTS), "does not match its sha256"),
    "truncated optimizer state": ("training_state.pt", lambda step: truncate(step / "training_state.pt"), "bytes"),
    "missing file": ("drafter/config.json", lambda step: (step / "drafter/config.json").unlink(), "is missing"),
    "checksum that does not match": (
        "metrics.json", lambda step: wrong_checksum(step, "metrics.json"), "does not match its sha256"),
    "unreadable checksum file": (MANIFEST, lambda step: (step / MANIFEST).write_text("{"), "unreadable"),
}


def test_every_file_of_a_checkpoint_is_recorded(run_dir):
    files = json.loads((run_dir / "step-2" / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(run_dir / "step-2").as_posix() for p in (run_dir / "step-2").rglob("*") if p.is_file()}
    assert set(files) == on_disk - {MANIFEST} and {WEIGHTS, "training_state.pt", "metrics.json"} <= set(files)
    assert verify_checkpoint(run_dir / "step-2") is True


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_found_and_named(run_dir, case):
    name, damage, words = DAMAGE[case]
    damage(run_dir / "step-2")
    with pytest.raises(CheckpointDamagedError, match=words) as err:
        verify_checkpoint(run_dir / "step-2")
    assert name in str(err.value) and "\n" not in str(err.value)
    if name.startswith("drafter/"):  # only what the reader reads is checked
        assert verify_checkpoint(run_dir / "step-2", parts=("training_state.pt",)) is True


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_step(run_dir, case, capsys):
    name, damage, _ = DAMAGE[case]
    damage(run_dir / "step-2")
    assert resume_checkpoint(run_dir, main_process=False) == run_dir / "step-1"  # other ranks: same answer, silent
    assert capsys.readouterr().err == "" and (run_dir / "step-2").is_dir()
    assert resume_checkpoint(run_dir, main_process=True) == run_dir / "step-1"
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "warning" in warning and name in warning and "step-1" in warning
    # The damaged step is set aside, so pruning never counts it and the run writes step-2 anew; links follow.
    assert (run_dir / "step-2.damaged" / MANIFEST).is_file() and not (run_dir / "step-2").exists()
    assert (run_dir / "latest").resolve() == (run_dir / "best").resolve() == run_dir / "step-1"
    prune(run_dir, keep_last=1)  # the intact fallback is what is kept, not the damaged newer step
    assert [p.name for p in step_dirs(run_dir)] == ["step-1"]
    assert resume_checkpoint(run_dir, main_process=True) == run_dir / "step-1"  # and it stays consistent
    assert capsys.readouterr().err == ""


def test_no_intact_checkpoint_is_one_line(run_dir):
    junk_weights(run_dir / "step-2" / WEIGHTS)
    (run_dir / "step-1" / "training_state.pt").unlink()
    with pytest.raises(CheckpointDamagedError, match=r"train\.resume: no intact checkpoint") as err:
        resume_checkpoint(run_dir, main_process=True)
    assert "step-2" in str(err.value) and "step-1" in str(err.value) and "\n" not in str(err.value)


def test_latest_pointing_to_a_missing_folder_falls_back(run_dir, capsys):
    shutil.rmtree(run_dir / "step-2")
    assert resume_checkpoint(run_dir, main_process=True) == run_dir / "step-1"
    assert "the folder is missing" in capsys.readouterr().err


def test_a_checkpoint_from_before_checksums_resumes_unverified(run_dir, capsys):
    (run_dir / "step-2" / MANIFEST).unlink()
    assert verify_checkpoint(run_dir / "step-2") is False
    assert resume_checkpoint(run_dir, main_process=True) == run_dir / "step-2"
    assert "unverified" in capsys.readouterr().err


# ---- end to end: a run, its damaged last checkpoint, and the tools that read it ------------------------------------


@pytest.fixture(scope="module")
def finished_run(tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """A 4-step run (checkpoints at 2 and 4), and a copy of its intact step-4 weights."""
    out = tmp_path_factory.mktemp("finished")
    cfg = train_cfg(tiny_data, out, "train.max_steps=4", "train.save_every=2", "train.run_name=run")
    train(cfg)
    shutil.copyfile(out / "run" / "step-4" / WEIGHTS, out / "intact.safetensors")
    return out / "run", out / "intact.safetensors"


def damaged_copy(finished_run, tmp_path) -> Path:
    run_dir = shutil.copytree(finished_run[0], tmp_path / "run", symlinks=True)
    junk_weights(run_dir / "step-4" / WEIGHTS)
    return run_dir


def test_rerunning_a_run_with_damaged_latest_resumes_and_rewrites_it(tiny_data, finished_run, tmp_path):
    """The fresh-clone report: junk in latest's weights, then the same command again. It warns in one line, resumes
    from step-2 and trains steps 3-4 again: the same weights as before the damage."""
    run_dir = damaged_copy(finished_run, tmp_path)
    (run_dir / "best").unlink()
    (run_dir / "best").symlink_to("step-4")
    args = [f"target.path={tiny_data / 'target'}", "target.chat_template=false", "drafter.path=truncated:1",
            f"train.data_dir={tiny_data / 'data'}", f"train.output_root={tmp_path}", "train.run_name=run",
            "train.max_steps=4", "train.save_every=2", "train.batch_size=4", "train.log_every=1", "train.lr=3e-3",
            "train.warmup_steps=0", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.warmup=0"]
    done = run_cli("drafter-train", *args, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and WEIGHTS in warnings[0] and "resuming from step-2" in warnings[0], warnings
    assert verify_checkpoint(run_dir / "latest") and (run_dir / "latest").resolve().name == "step-4"
    assert (run_dir / "best").resolve().is_dir() and (run_dir / "step-4.damaged").is_dir()
    rerun, before = load_file(run_dir / "step-4" / WEIGHTS), load_file(finished_run[1])
    for name in before:
        torch.testing.assert_close(rerun[name], before[name], rtol=1e-6, atol=1e-7)
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step for step in logged if step > 2] == [3, 4, 4, 3, 4, 4]  # (train row, eval row) per step, twice


COUNTS = ("tokens_generated", "target_forward_passes", "proposed_draft_tokens", "accepted_draft_tokens")


def eval_job(tiny_data, drafter_path: Path, output: Path, *overrides: str):
    return OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false", f"drafter.path={drafter_path}",
        "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.warmup=0", f"eval.output={output}", *overrides,
    ]))


@pytest.mark.parametrize("which", ["step-4", "latest"])
def test_drafter_eval_refuses_a_damaged_checkpoint(tiny_data, finished_run, tmp_path, which):
    run_dir = damaged_copy(finished_run, tmp_path)
    with pytest.raises(CheckpointDamagedError, match=rf"drafter\.path: .*step-4 is damaged: {WEIGHTS}"):
        run_eval_job(eval_job(tiny_data, run_dir / which / "drafter", tmp_path / "m.json"))
    intact = run_dir / "step-2" / "drafter"
    run_eval_job(eval_job(tiny_data, intact, tmp_path / "m.json", "eval.max_new_tokens=16",
                          f"eval.prompts={tiny_data / 'data' / 'eval_prompts.jsonl'}"))  # intact: evaluated
    # ... with step-2's own weights: the exact counts of a cache-free greedy replay with that drafter
    metrics = json.loads((tmp_path / "m.json").read_text())
    target, drafter = load_causal_lm(str(tiny_data / "target")), load_causal_lm(str(intact))
    prompt = word_tokenizer()(load_eval_prompts(tiny_data / "data")[0]).input_ids
    tokens, *counts = naive_greedy_speculative(target, greedy_drafts(drafter), prompt, 4, 16, eos=(2,))
    assert counts[2] > 0  # the 2-step drafter (the target's first layer) keeps some drafts
    assert [metrics[name] for name in COUNTS] == [len(tokens), *counts]


def test_drafter_export_refuses_a_damaged_checkpoint(finished_run, tmp_path):
    run_dir = damaged_copy(finished_run, tmp_path)
    with pytest.raises(CheckpointDamagedError, match=rf"export\.which=latest: .*step-4 is damaged: {WEIGHTS}"):
        export(ExportConfig(run_dir=str(run_dir), which="latest", output_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()  # refused, not exported from another step
    truncate(run_dir / "step-2" / "metrics.json")
    with pytest.raises(CheckpointDamagedError, match=r"export\.checkpoint: .*step-2 is damaged: metrics\.json"):
        export(ExportConfig(checkpoint=str(run_dir / "step-2"), output_dir=str(tmp_path / "out")))


def test_a_run_begun_before_a_new_option_resumes_and_a_changed_one_is_refused(tmp_path):
    """A field added to the drafter's schema since the run began (a new off-by-default option) is missing from its
    saved config.yaml: taken at its default, the run resumes; set to something else, or an old field changed, the
    resume is refused in one line."""
    from drafter_train.checkpoint import check_same_run
    from drafter_train.errors import ConfigError

    run = tmp_path / "run"
    (run / "step-2").mkdir(parents=True)
    (run / "latest").symlink_to("step-2")
    (run / "config.yaml").write_text(OmegaConf.to_yaml({"drafter": {"kind": "eagle3", "ttt_steps": 1},
                                                       "loss": {"name": "fkl"}, "train": {"lr": 0.002}}))
    now = {"drafter": {"kind": "eagle3", "ttt_steps": 1, "feature_noise": 0.0}, "loss": {"name": "fkl", "top_k": 0},
           "train": {"lr": 0.002}}
    defaults = {"drafter": {"feature_noise": 0.0, "ttt_steps": 3}, "loss": {"top_k": 0}}
    check_same_run(run, now, defaults=defaults)
    with pytest.raises(ConfigError, match=r"other settings \(drafter: .*'feature_noise': 0.2"):
        check_same_run(run, {**now, "drafter": {**now["drafter"], "feature_noise": 0.2}}, defaults=defaults)
    with pytest.raises(ConfigError, match="other settings"):  # without the defaults: the old refusal
        check_same_run(run, now)
