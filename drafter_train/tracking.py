"""Metrics out of a run: metrics.jsonl in the run folder (always) and accelerate's trackers (wandb / tensorboard).

Only the main process writes; wandb runs offline by default (no network, no API key needed; `wandb sync` later).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from drafter_train.config import TrackerConfig

if TYPE_CHECKING:  # imported by drafter-report and the sweep callback, which need no accelerate
    from accelerate import Accelerator


def flat_config(config: dict, prefix: str = "") -> dict:
    """Nested config -> {"train/lr": 0.001, ...} with scalar values (TensorBoard's hparams accept nothing else)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{name}/"))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def log_with(cfg: TrackerConfig) -> Optional[str]:
    """The `log_with` argument of Accelerator for this tracker config."""
    return None if cfg.kind == "none" else cfg.kind


def wandb_init_kwargs(cfg: TrackerConfig, folder: Path, name: str, tags: list[str]) -> dict:
    """wandb.init arguments: the run's files (wandb/offline-run-*) go into `folder`."""
    return {"mode": cfg.mode, "dir": str(folder), "name": name, "tags": tags}


class RunLogger:
    def __init__(
        self, accelerator: Accelerator, run_dir: Path, cfg: TrackerConfig, run_name: str, tags: list[str], config: dict
    ):
        self.accelerator, self.cfg = accelerator, cfg
        self.path = run_dir / "metrics.jsonl"
        if cfg.kind == "none":
            return
        init_kwargs = {"wandb": wandb_init_kwargs(cfg, run_dir, run_name, tags)} if cfg.kind == "wandb" else {}
        accelerator.init_trackers(cfg.project, config=flat_config(config), init_kwargs=init_kwargs)

    def log(self, metrics: dict, step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.cfg.kind != "none":
            self.accelerator.log(scalars, step=step)

    def log_eval_table(self, rows: list[dict], step: int) -> None:
        """Per-checkpoint eval history as a table (wandb only; other trackers get the scalars)."""
        if self.cfg.kind != "wandb" or not self.accelerator.is_main_process or not rows:
            return
        columns = list(rows[0])
        data = [[row.get(c) for c in columns] for row in rows]
        self.accelerator.get_tracker("wandb").log_table("eval", columns=columns, data=data, step=step)

    def finish(self) -> None:
        """End this run's trackers, and only them: accelerate's end_training() also destroys the process group, which
        belongs to the launch, and a `-m` sweep's later jobs in the same launch still need it."""
        if self.cfg.kind != "none":
            for tracker in self.accelerator.trackers:
                tracker.finish()


def log_report(cfg: TrackerConfig, folder: Path, columns: list[str], rows: list[list], markdown: str,
               image: Path) -> None:
    """A sweep report as a tracker run of its own, written into `folder`: wandb gets a Table and an Image,
    TensorBoard the markdown as text and the image. Called by one process only, outside any Accelerator."""
    if cfg.kind == "wandb":
        import wandb

        run = wandb.init(project=cfg.project, **wandb_init_kwargs(cfg, folder, "sweep-report", ["report"]))
        run.log({"report/table": wandb.Table(columns=columns, data=rows), "report/plot": wandb.Image(str(image))})
        run.finish()
    elif cfg.kind == "tensorboard":
        import numpy as np
        from PIL import Image
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(folder / cfg.project)) as writer:  # where accelerate's tracker puts a run's events
            writer.add_text("report/table", markdown)
            writer.add_image("report/plot", np.asarray(Image.open(image).convert("RGB")), dataformats="HWC")
