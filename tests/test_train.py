"""drafter-train end to end on tiny models: datagen -> steps -> checkpoint evaluation, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from drafter_train.machine import probe_cpu
from drafter_train.config import CONF_DIR
from drafter_train.recipes.cli import compose_config
from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
from drafter_train.drafters.registry import get_kind
from drafter_train.errors import ConfigError, ModelNotFoundError, VocabMismatchError
from drafter_train.recipes.train import TrainingDivergedError, train
from tests.stubs import compose_cfg, run_cli


def train_cfg(root: Path, out: Path, *overrides: str):
    return OmegaConf.to_object(compose_cfg("train", [
        f"target.path={root / 'target'}", "target.chat_template=false", "drafter.path=truncated:1",
        f"train.data_dir={root / 'data'}", f"train.output_root={out}", "train.max_steps=6", "train.batch_size=4",
        "train.save_every=3", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=0", "eval.num_prompts=2",
        "eval.max_new_tokens=8", "eval.warmup=0", *overrides,
    ]))


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


# ---- configs ------------------------------------------------------------------------------------------------------


def _group(name):
    return sorted(p.stem for p in (Path(CONF_DIR) / name).glob("*.yaml"))


GROUPS = ("target", "drafter", "loss", "tracker", "experiment")
REQUIRED = {"target=local": "target.path=/some/target", "drafter=path": "drafter.path=/some/drafter"}


@pytest.mark.parametrize("choice", [f"{g}={o}" for g in GROUPS for o in _group(g)])
def test_every_train_config_composes(choice):
    """Each option of each group, with the defaults for the others."""
    overrides = [choice] + ([REQUIRED[choice]] if choice in REQUIRED else [])
    cfg = OmegaConf.to_object(compose_cfg("train", overrides))
    assert cfg.eval.draft_len == cfg.drafter.draft_len


@pytest.mark.parametrize("name", ["eval", "datagen", "export"])
def test_other_entry_configs_compose(name):
    OmegaConf.to_object(compose_cfg(name, []))


def test_compose_config_gives_the_typed_config_the_cli_composes():
    """The scripts' (and notebooks') way to a job config: the same as the command line's, typed and validated."""
    overrides = ["drafter=eagle3", "train.max_steps=7", "eval.draft_len=3"]
    cfg = compose_config("train", overrides)
    assert cfg == OmegaConf.to_object(compose_cfg("train", overrides))
    assert isinstance(cfg.drafter, Eagle3DrafterConfig) and cfg.train.max_steps == 7
    with pytest.raises(ConfigError, match="train.max_steps"):
        compose_config("train", ["train.max_steps=0"])


# ---- training ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["fkl", "ce", "tvd", "jsd", "accepted_length", "reach_weighted_tvd"])
def test_tiny_run_loss_goes_down_and_checkpoints_are_evaluated(tiny_data, tmp_path, loss):
    cfg = train_cfg(tiny_data, tmp_path, f"loss={loss}", "train.max_steps=12", "train.save_every=6")
    metrics = train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    by_step = losses(run_dir)
    assert by_step[12] < by_step[1]
    assert {"tau", "acceptance_rate", "per_position_acceptance", "speedup"} <= set(metrics)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval/tau" in r] == [0, 6, 12]  # untrained baseline + every checkpoint
    assert (run_dir / "best").resolve().name.startswith("step-") and (run_dir / "latest").resolve().name == "step-12"
    # the checkpoint's figures name their machine: the CPU as listed and what was probed usable
    machine = json.loads((run_dir / "step-12" / "metrics.json").read_text())["machine"]
    assert machine["cpu"] and machine["usable"] == probe_cpu() and machine["torch_threads"] >= 1
    assert not any("machine" in k for r in evals for k in r)  # not repeated in every metrics.jsonl row


def test_offline_teacher_matches_stored_logits(tiny_data, tmp_path):
    """The offline teacher is the target's distribution renormalised over the stored top 8 (checked against the
    target's own logits on the same batch), and a run trained on it learns (its loss goes down)."""
    from drafter_train.config import LossConfig
    from drafter_train.data.batches import collate
    from drafter_train.data.store import load_distill_dataset
    from drafter_train.drafters.common.distill import teacher_logits
    from drafter_train.targets import load_causal_lm

    target = load_causal_lm(str(tiny_data / "target"))
    batch = collate(list(load_distill_dataset(tiny_data / "data").select(range(2))), "response_ids", 64, 0, topk=True)
    online = teacher_logits(target, batch, LossConfig(teacher="online"))[batch.resp_mask]  # [N, V]
    offline = teacher_logits(target, batch, LossConfig(teacher="offline"))[batch.resp_mask]
    top = online.topk(8, dim=-1).indices
    kept = torch.zeros_like(online, dtype=torch.bool).scatter_(-1, top, True)
    assert torch.equal(offline.isfinite(), kept)  # exactly the target's top 8, -inf elsewhere
    reference = online.masked_fill(~kept, float("-inf")).log_softmax(-1)
    torch.testing.assert_close(offline.log_softmax(-1)[kept], reference[kept], rtol=0, atol=2e-2)

    cfg = train_cfg(tiny_data, tmp_path, "loss=fkl", "loss.teacher=offline")
    train(cfg)
    by_step = losses(tmp_path / cfg.train.run_name)
    assert by_step[6] < by_step[1]


def stories_run(stories_path, data, tmp_path, *overrides: str) -> tuple[dict, float | None, Path]:
    """Train on stories260K's datagen output `data` (the stories_data fixture); returns (last metrics, untrained tau
    or None without an evaluation at step 0, run dir)."""
    cfg = OmegaConf.to_object(compose_cfg("train", [
        f"target.path={stories_path}", "target.chat_template=false", "drafter.path=truncated:2",
        f"train.data_dir={data}", f"train.output_root={tmp_path}", "train.max_steps=30",
        "train.batch_size=4", "train.save_every=30", "train.log_every=1", "train.lr=3e-3", "eval.num_prompts=4",
        "eval.max_new_tokens=32", "eval.prompts=null", *overrides,  # datagen's held-out stories, not dev's chat
    ]))
    metrics = train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    baseline = next((r["eval/tau"] for r in rows if r["step"] == 0 and "eval/tau" in r), None)
    return metrics, baseline, run_dir


def test_training_raises_tau_on_stories260k(stories_path, stories_data, tmp_path):
    metrics, baseline, run_dir = stories_run(stories_path, stories_data, tmp_path)
    by_step = losses(run_dir)
    assert by_step[30] < by_step[1]
    assert metrics["tau"] > baseline + 0.3 and metrics["greedy_match"] == 1.0


def assert_resumes_exactly(make_cfg, kind: str, tmp_path: Path, monkeypatch) -> tuple[Path, Path, dict]:
    """Train make_cfg(out) once straight through (out a/) and once interrupted in step 5 then resumed from step-3
    (out b/, make_cfg(out) must checkpoint every 3 of 6 steps); both give the same losses and weights. Returns
    (run a, run b, the resumed run's metrics)."""
    reference = make_cfg(tmp_path / "a")
    train(reference)
    calls = {"n": 0}
    real_loss = get_kind(kind).loss

    def crash_in_step_5(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(get_kind(kind), "loss", crash_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(make_cfg(tmp_path / "b"))
    monkeypatch.setattr(get_kind(kind), "loss", real_loss)
    run_a, run_b = tmp_path / "a" / reference.train.run_name, tmp_path / "b" / reference.train.run_name
    assert (run_b / "latest").resolve().name == "step-3"
    metrics = train(make_cfg(tmp_path / "b"))  # resume=auto
    for step in (4, 5, 6):
        assert losses(run_b)[step] == pytest.approx(losses(run_a)[step], rel=1e-6, abs=1e-7)
    weights_a = load_file(run_a / "step-6" / "drafter" / "model.safetensors")
    weights_b = load_file(run_b / "step-6" / "drafter" / "model.safetensors")
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-6, atol=1e-7)
    return run_a, run_b, metrics


@pytest.mark.parametrize("kind", ["ar", "nar"])
def test_interrupted_run_resumes_exactly(tiny_data, tmp_path, monkeypatch, kind):
    """Interrupted in step 5, resumed from step-3: the same losses and weights as the uninterrupted run (for nar
    too, whose random block positions come from the checkpointed RNG)."""
    drafter = (f"drafter={'nar' if kind == 'nar' else 'truncated'}", "drafter.path=truncated:1")
    assert_resumes_exactly(lambda out: train_cfg(tiny_data, out, *drafter), kind, tmp_path, monkeypatch)


def test_resuming_with_other_settings_is_refused(tiny_data, tmp_path):
    train(train_cfg(tiny_data, tmp_path, "train.max_steps=3", "train.run_name=r"))
    with pytest.raises(ConfigError, match=r"train\.resume: .*loss"):
        train(train_cfg(tiny_data, tmp_path, "train.max_steps=6", "train.run_name=r", "loss=tvd"))
    # what is learned, besides the drafter and the loss: the optimizer's settings (a long run's recipe)
    with pytest.raises(ConfigError, match=r"train\.resume: .*train\.warmup_steps: 0 -> 5"):
        train(train_cfg(tiny_data, tmp_path, "train.max_steps=6", "train.run_name=r", "train.warmup_steps=5"))
    train(train_cfg(tiny_data, tmp_path, "train.max_steps=6", "train.run_name=r"))  # more steps: a plain resume


def test_gradient_accumulation_equals_big_batch(tiny_data, tmp_path):
    big = train_cfg(tiny_data, tmp_path / "big", "train.max_steps=1", "train.save_every=1", "train.eval_at_start=false")
    acc = train_cfg(tiny_data, tmp_path / "acc", "train.max_steps=1", "train.save_every=1", "train.batch_size=2",
                    "train.grad_accum=2", "train.eval_at_start=false")
    train(big), train(acc)
    a = load_file(tmp_path / "big" / big.train.run_name / "step-1" / "drafter" / "model.safetensors")
    b = load_file(tmp_path / "acc" / acc.train.run_name / "step-1" / "drafter" / "model.safetensors")
    # One AdamW step moves each weight by ~lr * g / (|g| + eps): where a gradient is near eps (1e-8) that ratio
    # amplifies float summation-order noise (seen: 1.8e-6 on one weight of 2048). atol = lr/300 still catches any
    # wrong weighting of the micro-batches, which changes the update direction on most weights by ~lr.
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5)


def test_crash_while_writing_a_checkpoint_keeps_the_last_good_one(tiny_data, tmp_path, monkeypatch):
    cfg = train_cfg(tiny_data, tmp_path, "train.max_steps=3")
    train(cfg)
    run_dir = tmp_path / cfg.train.run_name

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("torch.save", broken_save)  # what checkpoint.py saves the training state with
    with pytest.raises(OSError):
        train(train_cfg(tiny_data, tmp_path, "train.max_steps=6"))
    assert (run_dir / "latest").resolve().name == "step-3"
    assert (run_dir / "latest" / "drafter" / "model.safetensors").exists()
    assert not (run_dir / "step-6").exists()


def test_nan_loss_stops_with_a_clear_message(tiny_data, tmp_path, monkeypatch):
    real_loss = get_kind("ar").loss

    def nan_loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        return out._replace(loss_sum=out.loss_sum * float("nan"))

    monkeypatch.setattr(get_kind("ar"), "loss", nan_loss)
    with pytest.raises(TrainingDivergedError, match="loss is nan at step 1"):
        train(train_cfg(tiny_data, tmp_path))


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_trackers_write_offline(tiny_data, tmp_path, tracker):
    cfg = train_cfg(tiny_data, tmp_path, f"tracker={tracker}", "train.max_steps=3")
    train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    pattern = "wandb/offline-run-*" if tracker == "wandb" else "**/events.out.tfevents.*"
    assert list(run_dir.glob(pattern)), list(run_dir.rglob("*"))


# ---- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, error, words", [
    (["drafter=path", "drafter.path=OTHER"], VocabMismatchError, "vocabulary"),
    (["target.path=/no/such/target"], ModelNotFoundError, "/no/such/target"),
    (["train.output_root=/proc/forbidden"], ConfigError, "train.output_root"),
    (["train.data_dir=EMPTY"], ConfigError, "empty"),
])
def test_bad_input_is_one_clear_error(tiny_data, tmp_path, overrides, error, words):
    (tmp_path / "empty").mkdir()
    overrides = [o.replace("OTHER", str(tiny_data / "other_vocab")).replace("EMPTY", str(tmp_path / "empty"))
                 for o in overrides]
    with pytest.raises(error, match=words):
        train(train_cfg(tiny_data, tmp_path, *overrides))


@pytest.mark.parametrize("override, field", [("drafter.draft_len=0", "drafter.draft_len"),
                                             ("loss.name=kl", "loss.name"), ("train.batch_size=0", "train.batch_size")])
def test_impossible_values_name_the_field(tiny_data, tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        train_cfg(tiny_data, tmp_path, override)


# ---- pieces --------------------------------------------------------------------------------------------------------


def test_stored_topk_lines_up_with_online_target_logits(tiny_data):
    """Offline KD reads the target's logits at the same positions the online teacher computes them."""
    from drafter_train.config import LossConfig
    from drafter_train.data.batches import collate
    from drafter_train.recipes.datagen import load_distill_dataset
    from drafter_train.drafters.common.distill import teacher_logits
    from drafter_train.targets import load_causal_lm

    target = load_causal_lm(str(tiny_data / "target"))
    records = list(load_distill_dataset(tiny_data / "data").select(range(4)))
    batch = collate(records, "response_ids", 512, pad_id=0, topk=True)
    online = teacher_logits(target, batch, LossConfig(name="fkl", teacher="online"))
    offline = teacher_logits(target, batch, LossConfig(name="fkl", teacher="offline"))
    mask = batch.resp_mask
    stored = torch.gather(offline, -1, batch.topk_ids)[mask]
    torch.testing.assert_close(stored, torch.gather(online, -1, batch.topk_ids)[mask], atol=1e-4, rtol=1e-4)
    assert (online.argmax(-1)[mask] == batch.labels[mask]).all()  # greedy data: the response is the target's argmax


def test_scratch_drafter_and_bf16_autocast_train(tiny_data, tmp_path):
    cfg = train_cfg(tiny_data, tmp_path, "drafter=scratch", "drafter.num_layers=1", "drafter.hidden_size=32",
                    "drafter.num_heads=2", "drafter.num_kv_heads=1", "drafter.intermediate_size=64",
                    "train.mixed_precision=bf16", "train.max_steps=8", "train.save_every=8")
    train(cfg)
    by_step = losses(tmp_path / cfg.train.run_name)
    assert by_step[8] < by_step[1]


def test_keep_last_prunes_but_never_best(tiny_data, tmp_path):
    cfg = train_cfg(tiny_data, tmp_path, "train.max_steps=8", "train.save_every=2", "train.keep_last=1")
    train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    steps = sorted(p.name for p in run_dir.glob("step-*"))
    kept = {"step-8", (run_dir / "best").resolve().name}
    assert set(steps) == kept


def test_cli_trains_and_reports_errors_in_one_line(tiny_data, tmp_path):
    base = [f"target.path={tiny_data / 'target'}",
            "target.chat_template=false", "drafter.path=truncated:1", f"train.data_dir={tiny_data / 'data'}",
            f"train.output_root={tmp_path}", "train.max_steps=2", "train.save_every=2", "train.batch_size=4",
            "eval.num_prompts=1", "eval.max_new_tokens=4"]
    ok = run_cli("drafter-train", *base, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "ar-fkl-k4" / "latest" / "drafter" / "config.json").exists()
    bad = run_cli("drafter-train", *base, "drafter.draft_len=0", cwd=tmp_path)
    assert bad.returncode != 0 and "drafter.draft_len" in bad.stderr and "Traceback" not in bad.stderr
