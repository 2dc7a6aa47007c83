"""`drafter-seq2seq` (recipes/seq2seq.py): a tiny run end to end through the console script, exact resume after an
interruption, `best` on the dev split, and one-line errors before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.config import CONF_DIR
from drafter_train.errors import ConfigError
from drafter_train.recipes import seq2seq as recipe
from drafter_train.recipes.cli import job_config
from drafter_train.seq2seq.drafters import SpecDrafter
from drafter_train.seq2seq.toy import make_pairs, toy_target, toy_tokenizer
from drafter_train.seq2seq.training import DrafterTraining
from tests.stubs import compose_cfg, run_cli

SIZES = {"train": 12, "dev": 3, "test": 3}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny random Marian target folder with its tokenizer, a folder of toy train/dev/test pairs)."""
    root = tmp_path_factory.mktemp("seq2seq_entry")
    tokenizer = toy_tokenizer()
    toy_target(len(tokenizer), d_model=32, decoder_layers=2).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    make_pairs(root / "pairs", sizes=SIZES)
    return root / "target", root / "pairs"


def job(inputs, out: Path, *extra: str):
    target, pairs = inputs
    overrides = [f"target.path={target}", f"data.path={pairs}", f"train.output_root={out}", "data.max_new_tokens=6",
                 "train.batch_size=4", "train.max_steps=4", "train.save_every=2", "eval.warmup=0", *extra]
    return job_config(compose_cfg("seq2seq", overrides), "drafter-seq2seq")


def test_console_script_runs_datagen_training_and_test_evaluation(inputs, tmp_path):
    target, pairs = inputs
    done = run_cli("drafter-seq2seq", f"target.path={target}", f"data.path={pairs}",
                   f"train.output_root={tmp_path}", "data.max_new_tokens=6", "train.batch_size=4", "train.max_steps=4",
                   "train.save_every=2", "drafter.kind=nar", "drafter.draft_len=3", "loss.name=accepted_length",
                   "eval.baseline_kernels=same", "target.cpu_kernels=default", f"hydra.run.dir={tmp_path}/hydra",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "seq2seq"
    datagen = [json.loads(line) for line in (run_dir / "datagen" / "train.jsonl").read_text().splitlines()]
    assert len(datagen) == SIZES["train"] and all(row["output_ids"] for row in datagen)
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-2", "step-4"]
    best = (run_dir / "best").resolve()
    dev = {step: json.loads((run_dir / step / "metrics.json").read_text()) for step in ("step-2", "step-4")}
    assert best.name == max(dev, key=lambda s: (dev[s]["tau"], -int(s[5:])))  # first of the highest dev tau
    assert all(m["split"] == "dev" and m["num_requests"] == SIZES["dev"] for m in dev.values())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["split"] == "test" and metrics["num_requests"] == SIZES["test"] and metrics["greedy_match"] == 1.0
    assert metrics["best_step"] == int(best.name[5:]) and metrics["dev_tau"] == dev[best.name]["tau"]
    assert metrics["drafter_kind"] == "nar" and metrics["encoder_shared"] and metrics["draft_len"] == 3
    assert metrics["spec_kernels"] == "default"  # target.cpu_kernels
    assert set(metrics["baseline"]["by_kernels"]) == {"default"}  # eval.baseline_kernels=same
    assert isinstance(SpecDrafter.from_pretrained(best / "drafter"), SpecDrafter)
    assert "test split: tau" in done.stderr


def weights(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(step_dir / "drafter" / "model.safetensors")


def test_resume_after_an_interruption_continues_exactly(inputs, tmp_path, monkeypatch):
    straight = recipe.run(job(inputs, tmp_path / "a"))
    real_step, calls = DrafterTraining.step, []

    def dies_at_step_3(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint
        return real_step(self)

    monkeypatch.setattr(DrafterTraining, "step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        recipe.run(job(inputs, tmp_path / "b"))
    assert (tmp_path / "b" / "seq2seq" / "latest").resolve().name == "step-2"
    monkeypatch.setattr(DrafterTraining, "step", real_step)
    generated = (tmp_path / "b" / "seq2seq" / "datagen" / "train.jsonl").stat().st_mtime_ns
    resumed = recipe.run(job(inputs, tmp_path / "b"))
    assert (tmp_path / "b" / "seq2seq" / "datagen" / "train.jsonl").stat().st_mtime_ns == generated  # not redone
    a, b = weights(tmp_path / "a" / "seq2seq" / "step-4"), weights(tmp_path / "b" / "seq2seq" / "step-4")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    untrained = weights(tmp_path / "a" / "seq2seq" / "step-2")
    assert any(not torch.equal(a[k], untrained[k]) for k in a)  # the steps after the checkpoint did train
    for key in ("tau", "best_step", "dev_tau", "tokens_generated", "per_position_acceptance"):
        assert resumed[key] == straight[key], key
    assert straight["spec_kernels"] == "auto" and set(straight["baseline"]["by_kernels"]) == {"auto", "onednn", "default"}
    # a finished run resumes to the same place: nothing more to train, the same test metrics again
    again = recipe.run(job(inputs, tmp_path / "b"))
    assert again["tau"] == straight["tau"] and again["best_step"] == straight["best_step"]
    with pytest.raises(ConfigError, match=r"^train.resume: .* other settings \(drafter: .*'kind': 'ar'.* -> .*'kind': 'nar'"):
        recipe.run(job(inputs, tmp_path / "b", "drafter.kind=nar"))


@pytest.mark.parametrize("override,message", [
    ("drafter.kind=tree", r"^drafter.kind: must be one of \('ar', 'nar'\)"),
    ("eval.verify=specdec", r"^eval.verify: must be one of"),
    ("eval.baseline_kernels=fast", r"^eval.baseline_kernels: must be one of"),
    ("target.cpu_kernels=fast", r"^target.cpu_kernels: must be one of"),
    ("train.save_every=0", r"^train.save_every: must be >= 1"),
    ("loss.teacher=offline", r"^loss.teacher: seq2seq drafters learn from the target's logits"),
    ("eval.tree.depth=2", r"^eval.tree.top_k: set it to draft a tree"),
])
def test_bad_settings_are_one_line_errors(inputs, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        job(inputs, tmp_path, override)


def test_bad_paths_are_one_line_errors_before_anything_loads(inputs, tmp_path, monkeypatch):
    target, pairs = inputs
    monkeypatch.setattr(recipe, "load_seq2seq", lambda *a, **k: pytest.fail("loaded before the paths were checked"))
    (tmp_path / "no_test").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "no_test" / f"{split}.jsonl").write_text((pairs / f"{split}.jsonl").read_text())
    for override, message in ((f"target.path={tmp_path}", r"^target.path: .* is not a model folder"),
                              (f"data.path={tmp_path / 'missing'}", r"^data.path: .*: no such folder"),
                              ("drafter.decoder_layers=2", r"^drafter.decoder_layers: must be below the target's 2"),
                              (f"data.path={tmp_path / 'no_test'}", r"^data.path: .* has no test split"),
                              ("eval.tree.top_k=2", r"^eval.tree: draft trees need per-token decoder positions, and "
                                                    r"a marian decoder derives its positions from the cache length")):
        with pytest.raises(ConfigError, match=message):
            recipe.run(job(inputs, tmp_path / "out", override))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"^data.path: must be set"):
        job_config(compose_cfg("seq2seq", [f"target.path={target}"]), "drafter-seq2seq")
    done = run_cli("drafter-seq2seq", f"target.path={target}", f"data.path={tmp_path / 'missing'}",
                   f"hydra.run.dir={tmp_path}/hydra", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"drafter-seq2seq: error: data.path: {tmp_path / 'missing'}: no such folder"]


def test_config_composes_with_its_documented_command():
    first = (Path(CONF_DIR) / "seq2seq.yaml").read_text().splitlines()[0]
    assert first.startswith("# drafter-seq2seq target.path=")
    cfg = OmegaConf.to_object(compose_cfg("seq2seq", ["target.path=t", "data.path=d"]))
    assert cfg.drafter.kind == "ar" and cfg.eval.baseline_kernels == "all" and cfg.run_dir == Path("checkpoints/seq2seq")
