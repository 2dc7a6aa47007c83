"""What a long run records and checks beside its checkpoints (drafter-train's loop calls these; issue 72): saves due
by wall time, the token milestones a step passed (learning-curve snapshots), progress.json, the machine kinds that
trained the run, and the tokenizer and data it was trained with, refused in one line when they change."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from drafter_train.checkpoint import PROGRESS, TrainState, latest_checkpoint
from drafter_train.config import TrainJobConfig
from drafter_train.data.store import check_tokenizer, tokenizer_fingerprint
from drafter_train.devices import device_name, on_cpu
from drafter_train.errors import ConfigError
from drafter_train.machine import kind_slug
from drafter_train.targets import load_target_tokenizer


def due_by_time(accelerator, minutes: float, last_save: float) -> bool:
    """train.save_every_minutes: whether that much wall time has passed since the last checkpoint, the same answer on
    every rank (saving is collective: the first rank whose clock says so decides for all)."""
    if not minutes:
        return False
    due = torch.tensor(float(time.monotonic() - last_save >= minutes * 60), device=accelerator.device)
    return bool(accelerator.reduce(due, "max")) if accelerator.num_processes > 1 else bool(due)


class TrainingRate:
    """train/tokens_per_s: the tokens of a logging window over its training time. A checkpoint saved (and evaluated)
    inside the window pauses the clock, and the window keeps the tokens trained before it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.start, self.tokens = clock(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = self.clock()
        try:
            yield
        finally:
            self.start += self.clock() - began

    def take(self) -> float:
        """The window's rate; a new window begins."""
        now = self.clock()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return rate


def crossed(milestones: Sequence[int], before: int, now: int) -> list[int]:
    """The token milestones a step took the run past (before < m <= now)."""
    return [m for m in milestones if before < m <= now]


def expected_tokens(state: TrainState, max_steps: int) -> Optional[int]:
    """The run's tokens at max_steps at the pace so far (the bar's total, hence its ETA); None before a step."""
    return round(state.tokens_seen / state.step * max_steps) if state.step else None


def machine_kind(device) -> str:
    """What a run's machine_kinds records: the GPU's name, else the CPU's kind (machine.kind_slug)."""
    return kind_slug() if on_cpu(device) else device_name(device)


def this_machine(accelerator, tcfg) -> dict:
    """What a checkpoint records of the machine that wrote it; a resume elsewhere says what differs."""
    return {"kind": machine_kind(accelerator.device), "processes": accelerator.num_processes,
            "mixed_precision": tcfg.mixed_precision, "torch": torch.__version__}


def say_what_changed(step_dir, saved: Optional[dict], now: dict) -> None:
    """One line when a run resumes on another machine than the one that wrote its checkpoint (nothing otherwise)."""
    if saved is None:  # written before checkpoints recorded their machine
        return
    changed = [f"{key} {saved.get(key)} -> {value}" for key, value in now.items() if saved.get(key) != value]
    if changed:
        print(f"drafter-train: resuming {step_dir.name} on another machine: {', '.join(changed)} (the state is "
              "restored whole; the arithmetic of later steps is this machine's)", file=sys.stderr)


def progress_record(state: TrainState, cfg: TrainJobConfig, accelerator, identity: dict, machine: dict) -> dict:
    """progress.json: how far the checkpoint is (what a learning-curve snapshot is evaluated as), and the tokenizer
    and data it was trained with (identity: check_same_tokenizer, same_data)."""
    rows_per_step = cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes
    return {"step": state.step, "tokens_seen": state.tokens_seen, "records_seen": state.step * rows_per_step,
            "train_seconds": round(state.train_seconds, 3), "machine_kinds": list(state.machine_kinds),
            "machine": machine, **identity}


def recorded_progress(run_dir) -> dict:
    """The latest checkpoint's progress.json ({} without one: a new run, or one saved before it was recorded)."""
    latest = latest_checkpoint(run_dir)
    return json.loads((latest / PROGRESS).read_text()) if latest is not None and (latest / PROGRESS).is_file() else {}


def same_data(run_dir, identity: dict) -> bool:
    """Whether train.data_dir holds the data the run's latest checkpoint was trained on, wherever it lies."""
    return recorded_progress(run_dir).get("data_sha256") == identity["data_sha256"]


def check_same_tokenizer(cfg: TrainJobConfig, run_dir) -> str:
    """Refuse (one line, before the target loads) a target whose tokenizer differs from the data's or from the one
    the run's latest checkpoint was trained with; returns the tokenizer's fingerprint."""
    fingerprint = tokenizer_fingerprint(tokenizer := load_target_tokenizer(cfg.target))
    check_tokenizer(cfg.train.data_dir, tokenizer, "target.path")
    recorded = recorded_progress(run_dir).get("tokenizer_sha256") if cfg.train.resume == "auto" else None
    if recorded and recorded != fingerprint:
        latest = latest_checkpoint(run_dir)
        raise ConfigError(f"target.path: {cfg.target.path}'s tokenizer is not the one {run_dir}/{latest.name} was "
                          f"trained with (vocabulary sha256 {fingerprint[:12]} against {recorded[:12]}); resume with "
                          "that run's target, or pick another train.run_name")
    return fingerprint
