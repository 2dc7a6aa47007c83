"""Run folders and checkpoints: checkpoints/<run>/step-<N>/{drafter/, training_state.pt, metrics.json}.

Each checkpoint is written into a hidden temporary folder and renamed into place, and `latest` / `best` are
symlinks replaced atomically, so a crash at any moment leaves the previous checkpoint intact and pointed to.
Pruning keeps the newest `keep_last` step folders and never deletes the one `best` points to.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from drafter_train.errors import ConfigError

_STEP = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    """Everything about progress that is not a tensor (resume restores it exactly)."""

    step: int = 0
    tokens_seen: int = 0
    best_tau: float = float("-inf")
    best_step: int = -1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def prepare_run_dir(output_root: str, run_name: str, resume: str) -> Path:
    """Create (or reuse, under resume=auto) the run folder; fail early and in one line if that is impossible."""
    run_dir = Path(output_root) / run_name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A nameless probe file of this process's own: every rank of a launch checks the same folder at once.
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise ConfigError(f"train.output_root: cannot write {run_dir}: {err.strerror}") from None
    if resume == "never" and latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"train.resume: {run_dir} already has checkpoints; pick another train.run_name or resume=auto")
    return run_dir


# What a run is: resuming with any of these changed would continue a different experiment under the same name.
RUN_IDENTITY = ("target", "drafter", "loss", "train.data_dir", "train.response", "train.batch_size",
                "train.grad_accum", "train.seed", "train.lr", "train.lr_schedule", "train.max_seq_len")


def check_same_run(run_dir: Path, config: dict) -> None:
    """Refuse to resume a run whose saved config.yaml differs from `config` in what defines the run."""
    saved_path = run_dir / "config.yaml"
    if latest_checkpoint(run_dir) is None or not saved_path.exists():
        return
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    changed = [key for key in RUN_IDENTITY if _get(saved, key) != _get(config, key)]
    if changed:
        detail = ", ".join(f"{k}: {_get(saved, k)!r} -> {_get(config, k)!r}" for k in changed)
        raise ConfigError(f"train.resume: {run_dir} holds a run with other settings ({detail}); "
                          "pick another train.run_name, or train.resume=never")


def save_run_config(run_dir: Path, config: dict) -> None:
    """config.yaml, replaced atomically: check_same_run of a later launch never reads half a file (main process)."""
    tmp = run_dir / f".config.yaml.tmp-{os.getpid()}"
    tmp.write_text(OmegaConf.to_yaml(config))
    os.replace(tmp, run_dir / "config.yaml")


def _get(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    link = run_dir / "latest"
    return link.resolve() if link.is_symlink() and link.resolve().is_dir() else None


def _relink(run_dir: Path, name: str, step_dir: Path) -> None:
    tmp = run_dir / f".{name}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(step_dir.name)  # relative: the run folder can be moved or copied
    os.replace(tmp, run_dir / name)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def partial_checkpoint(run_dir: Path, step: int) -> Path:
    """The hidden folder step-<step> is written into before it is renamed into place (the same path on every rank)."""
    return run_dir / f".step-{step}.tmp"


def start_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty partial_checkpoint folder (main process), for other ranks to add their shards to before saving."""
    tmp = partial_checkpoint(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash mid-write
    tmp.mkdir()
    return tmp


def save_checkpoint(
    run_dir: Path, drafter, tokenizer, training_state: dict, metrics: dict, step: int, started: bool = False
) -> Path:
    """Write step-<step> atomically and point `latest` at it. `drafter` is the unwrapped HF model with full weights.

    started=True: start_checkpoint() made the folder and all ranks have written their shards into it.
    """
    final = run_dir / f"step-{step}"
    tmp = partial_checkpoint(run_dir, step) if started else start_checkpoint(run_dir, step)
    drafter.save_pretrained(tmp / "drafter")
    tokenizer.save_pretrained(tmp / "drafter")
    torch.save(training_state, tmp / "training_state.pt")
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if final.exists():  # re-saving a step (e.g. a resumed run's final step): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _relink(run_dir, "latest", final)
    return final


def mark_best(run_dir: Path, step_dir: Path) -> None:
    _relink(run_dir, "best", step_dir)


def step_dirs(run_dir: Path) -> list[Path]:
    """The run's step-<N> folders, oldest first."""
    steps = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps)]


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step folders, sparing whatever `best` and `latest` point to."""
    protected = {(run_dir / name).resolve() for name in ("best", "latest") if (run_dir / name).is_symlink()}
    for path in step_dirs(run_dir)[:-keep_last]:
        if path.resolve() not in protected:
            shutil.rmtree(path)


def load_training_state(step_dir: Path) -> dict:
    return torch.load(step_dir / "training_state.pt", weights_only=False)
