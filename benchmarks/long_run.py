"""The long run's learning curve: each snapshot of one drafter-train run (train.snapshot_tokens, the long_run
pipeline's `curve` stage) decoded on the dev and test splits exactly as benchmarks.learning_curve decodes its points
(its `evaluate`: our decoder, the drafter's top-1 chain, greedy), into a result file with learning_curve's columns plus
the machine kinds that trained each snapshot and its evaluation's wall time.

    python -m benchmarks.long_run --run checkpoints/long-run-smollm2 --result-name long_run_smollm2

Unlike learning_curve's points, nothing is retrained per point: snapshot-<N> is the run's checkpoint at the first step
that reached N response tokens (repeats counted), so `train s` is the run's training wall time up to it (evaluations
left out, over every machine that continued it). Each snapshot's evaluations are kept in its folder
(dev-chain.json, test-chain.json), so a rerun decodes only new snapshots.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from benchmarks import learning_curve as lc
from benchmarks.common import command_line, write_result
from drafter_train.checkpoint import PROGRESS, snapshot_dirs
from drafter_train.errors import ConfigError
from drafter_train.io import write_atomic
from drafter_train.targets import model_name

COLUMNS = [*lc.COLUMNS, "machine kinds", "eval s"]


def target_options(run: Path) -> list[str]:
    """drafter-eval options naming the target the run was trained on (its config.yaml)."""
    target = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))["target"]
    options = ["target=local", f"target.path={target['path']}", f"target.chat_template={target['chat_template']}"]
    return options + ([f"target.gguf_file={target['gguf_file']}"] if target.get("gguf_file") else [])


def snapshot_point(snapshot: Path, args) -> dict:
    """One snapshot decoded on dev and test (kept evaluations reused when decoded as asked): a learning_curve point,
    with its machine kinds and evaluation seconds."""
    progress = json.loads((snapshot / PROGRESS).read_text())
    chains, timing = [snapshot / "dev-chain.json", snapshot / "test-chain.json"], snapshot / "eval_seconds.json"
    stamps = lambda: [f.stat().st_mtime_ns if f.is_file() else None for f in chains]  # noqa: E731
    before = stamps()
    began = time.perf_counter()
    dev = lc.evaluate(snapshot / "drafter", "dev", args, chains[0])
    test = lc.evaluate(snapshot / "drafter", "test", args, chains[1])
    seconds = round(time.perf_counter() - began, 1)
    if stamps() == before and timing.is_file():  # both kept: when they were decoded
        seconds = json.loads(timing.read_text())["eval_s"]
    else:
        write_atomic(timing, json.dumps({"eval_s": seconds}) + "\n")
    return {"variant": args.variant, "snapshot": snapshot.name, "response_tokens": progress["tokens_seen"],
            "records": progress["records_seen"], "steps": progress["step"], "train_s": progress["train_seconds"],
            "machine_kinds": progress["machine_kinds"], "eval_s": seconds,
            "dev": lc._figures(dev), "test": lc._figures(test), "eval": lc.eval_settings(args),
            "machine": test["machine"]}


def row(point: dict) -> list:
    return [*lc.row(point), ", ".join(point["machine_kinds"]), point["eval_s"]]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a drafter-train run folder with snapshot-<tokens>/ checkpoints")
    parser.add_argument("--variant", default="long-run", help="the rows' variant column")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--aims", type=float, nargs="+", default=list(lc.AIMS))
    parser.add_argument("--draft-len", type=int, default=lc.DECODE_DEFAULTS["draft_len"])
    parser.add_argument("--num-prompts", type=int, default=lc.DECODE_DEFAULTS["num_prompts"])
    parser.add_argument("--max-new-tokens", type=int, default=lc.DECODE_DEFAULTS["max_new_tokens"])
    parser.add_argument("--result-name", default="long_run")
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--command", default=None, help="the command line the result file records")
    args = parser.parse_args(argv)
    run = Path(args.run)
    snapshots = snapshot_dirs(run) if run.is_dir() else []
    if not snapshots:
        raise ConfigError(f"--run: {run} holds no snapshot-<tokens> folders (train.snapshot_tokens)")
    args.target_options = target_options(run)
    points = []
    for snapshot in snapshots:
        points.append(snapshot_point(snapshot, args))
        print(json.dumps(row(points[-1])), flush=True)
    write(points, run, args, args.command or command_line("long_run", argv))


def write(points: list[dict], run: Path, args, command: str) -> Path:
    config = OmegaConf.load(run / "config.yaml")
    on = model_name(config.target.path)
    notes = [f"Snapshots of one drafter-train run ({run}, data {config.train.data_dir}, train.response="
             f"{config.train.response}), not one run per point: response tokens are those trained on when the snapshot "
             f"was taken (repeats counted); train s is the run's training wall time to it, on the machine kinds named. "
             f"A snapshot holds the weights at its step, at the learning rate of the run's {config.train.lr_schedule} "
             f"schedule over {config.train.max_steps} steps then: not decayed as a run that ended there would be, so "
             f"early points understate what their tokens could give. "
             f"Decoded as benchmarks.learning_curve decodes its points: our decoder, greedy, the drafter's top-1 "
             f"tokens as a chain of {args.draft_len}, {args.max_new_tokens} new tokens per prompt, the target in "
             f"{args.eval_dtype}; acceptance i = P(draft i accepted | drafts before it accepted)."]
    if lc.fit_notes(points, args.aims):
        notes.append(f"Fit, a straight line in log tokens (it flattens near the ceiling: a floor on the data needed): "
                     f"{lc.fit_notes(points, args.aims)}.")
    extra = {"results_dir": Path(args.results_dir)} if args.results_dir else {}
    return write_result(args.result_name, title=f"The long run's acceptance against training data on {on}",
                        question="How does one long run's first-position acceptance grow with the tokens it has "
                                 "trained on, read from its own snapshots?",
                        command=command, split=f"test split, first {args.num_prompts} prompts (dev split beside it)",
                        baseline="none (acceptance, not speed)", columns=COLUMNS, rows=[row(p) for p in points],
                        notes=" ".join(notes), machine=points[-1]["machine"], data={"points": points}, **extra)


if __name__ == "__main__":
    main()
