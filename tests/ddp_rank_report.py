"""Run by each rank of a 2-process launch (tests/test_distributed.py): train as drafter-train would, and report what
this rank drew from the data and the parameters it holds at every checkpoint.

    accelerate launch ... -m tests.ddp_rank_report REPORT_DIR <train overrides> [:: REPORT_DIR <train overrides> ...]

Several runs separated by `::` train one after the other in the same launch (its process group), as the jobs of a
Hydra sweep do: one launch (its interpreter and library start-up, most of a tiny run's cost) serves several checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

import drafter_train.recipes.train as train_module
from drafter_train.data.batches import BatchStream
from tests.stubs import compose_cfg


def main(report_dir: Path, overrides: list[str]) -> None:
    drawn: list[list[int]] = []  # this run's draws
    draw, save = BatchStream.next_indices, train_module.save_and_evaluate

    def recording_draw(stream):
        drawn.append(draw(stream))
        return drawn[-1]

    def reporting_save(accelerator, cfg, run_dir, drafter, kind, *args, **kwargs):
        metrics = save(accelerator, cfg, run_dir, drafter, kind, *args, **kwargs)
        state = args[4]  # after tokenizer, optimizer, scheduler, stream: save_and_evaluate's state
        drafter_state = kind.hf_model(accelerator.unwrap_model(drafter)).state_dict()
        weights = {k: v.detach().clone() for k, v in drafter_state.items()}
        report = {"num_processes": accelerator.num_processes, "drawn": list(drawn), "weights": weights}
        torch.save(report, report_dir / f"rank{accelerator.process_index}-step{state.step}.pt")
        return metrics

    BatchStream.next_indices = recording_draw
    train_module.save_and_evaluate = reporting_save
    try:
        train_module.train(OmegaConf.to_object(compose_cfg("train", overrides)))
    finally:
        BatchStream.next_indices, train_module.save_and_evaluate = draw, save


def runs(args: list[str]) -> list[tuple[Path, list[str]]]:
    """`REPORT_DIR overrides... [:: REPORT_DIR overrides...]` -> [(report dir, overrides)], in order."""
    jobs, job = [], []
    for arg in [*args, "::"]:
        if arg != "::":
            job.append(arg)
        elif job:
            jobs.append((Path(job[0]), job[1:]))
            job = []
    return jobs


if __name__ == "__main__":
    for report_dir, overrides in runs(sys.argv[1:]):
        main(report_dir, overrides)
