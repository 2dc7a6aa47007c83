"""Run a pipeline's stages in order: skip a stage that is done, write its outputs whole, time what ran.

A stopped or failed run resumes: rerunning the same command skips every stage whose outputs are whole and starts at
the first that is not. "Whole" is the stage's `done` rule (config.Stage): its outputs exist (none older than an input
file), or a training run ended at its step count. A stage that writes `{part}` writes outputs[0] under a temporary
name that is renamed only when the stage succeeds, so a stage killed half-way leaves nothing a rerun takes for done.
Each stage that ran appends its wall time and the machine's CPU to <out>/stages.jsonl (the budget, measured). Timings
are only comparable on the CPU that made them: a stage's `measured` files from another CPU are set aside (moved to
<out>/other-machines/<when>/, kept) before it runs, so it measures them again here.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from drafter_train.errors import ConfigError, DrafterTrainError
from drafter_train.pipeline.config import PART, PipelineConfig, Stage

STAGES_FILE = "stages.jsonl"
ELSEWHERE = "other-machines"


class StageFailed(DrafterTrainError):
    """A stage's command exited with a status it does not accept; `returncode` is the pipeline's exit status."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def selected(cfg: PipelineConfig) -> list[str]:
    """pipeline.stages with each group's name replaced by its stages; an unknown name is one line."""
    names = []
    for name in cfg.stages:
        for one in cfg.groups.get(name, [name]):
            if one not in cfg.known:
                known = ", ".join([*cfg.known, *cfg.groups])
                raise ConfigError(f"pipeline.stages: unknown stage {one} (known: {known})")
            names.append(one)
    return names


def run_pipeline(cfg: PipelineConfig, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> None:
    """Run cfg's selected stages in order (module doc); StageFailed names the stage that failed."""
    names = selected(cfg)  # every name checked before anything runs
    out = Path(cfg.out)
    if not cfg.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    for key, value in cfg.env.items():
        os.environ.setdefault(key, str(value))
    for name in names:
        stage = cfg.known[name]
        if cfg.dry_run:
            say(f"{cfg.name}: {name}: {'done' if is_done(stage) else 'to run'}: {shown(stage)}")
            continue
        set_aside_elsewhere(stage, out, f"{cfg.name}: {name}", say)
        if is_done(stage):
            say(f"{cfg.name}: {name}: done, skipped")
            continue
        missing = [p for p in stage.inputs if not Path(p).exists()]
        if missing:
            raise ConfigError(f"{cfg.name}: stage {name} needs {', '.join(missing)} (an earlier stage makes it: "
                              f"run it first, e.g. pipeline.stages=[...])")
        say(f"{cfg.name}: {name}")
        start = time.monotonic()
        run_stage(stage, f"{cfg.name}: stage {name}")
        record(out, name, time.monotonic() - start)
    say(f"{cfg.name}: done ({out})")


def is_done(stage: Stage) -> bool:
    if stage.done == "always":
        return False
    if stage.done == "trained":
        return trained(Path(stage.outputs[0]), stage.steps)
    if stage.done != "outputs":
        return bool(function(stage.done)(stage))
    return bool(stage.outputs) and all(Path(p).exists() for p in stage.outputs) and not stale(stage)


def trained(run: Path, steps: int) -> bool:
    """Whether drafter-train's run folder ended at `steps` (latest -> step-<steps>) and chose a `best` checkpoint."""
    latest = run / "latest"
    return latest.is_symlink() and os.readlink(latest) == f"step-{steps}" and (run / "best" / "drafter").exists()


def stale(stage: Stage) -> bool:
    """Whether an output is older than an input file (remade since); folders are inputs by existence only."""
    newest = max((Path(p).stat().st_mtime for p in stage.inputs if Path(p).is_file()), default=None)
    return newest is not None and min(Path(p).stat().st_mtime for p in stage.outputs) < newest


def run_stage(stage: Stage, what: str) -> None:
    """Run the stage once; with `{part}`, outputs[0] appears only when it succeeded (module doc)."""
    part = partial(stage)
    if part is not None:
        remove(part)  # what a stopped attempt left: never taken for done, made again
    fill = (lambda v: filled(v, part))
    if stage.run:
        argv = command_line([str(a) for a in flat(fill(stage.run))])
        if stage.log:
            Path(stage.log).parent.mkdir(parents=True, exist_ok=True)
            with open(stage.log, "w") as log:
                code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
        else:
            code = subprocess.run(argv).returncode
        if code not in stage.ok_returncodes:
            tail = f"; its log: {stage.log}" if stage.log else ""
            raise StageFailed(f"{what} failed (exit {code}){tail}; rerunning resumes at it", code)
    else:
        function(stage.call)(**{k: fill(v) for k, v in stage.args.items()})
    if part is not None:
        if not part.exists():
            raise StageFailed(f"{what} wrote nothing at {part}", 1)
        remove(Path(stage.outputs[0]))  # a stale output (older than an input) is replaced
        os.replace(part, stage.outputs[0])


def flat(value: Any) -> Any:
    """A list with the lists inside it spliced in (a stage splices pipeline.shared's argument lists)."""
    if not isinstance(value, list):
        return value
    return [x for v in value for x in (flat(v) if isinstance(v, list) else [v])]


def filled(value: Any, part: Optional[Path]) -> Any:
    """`value` with `{part}` replaced by the partial path, and its lists flattened, all the way down."""
    if isinstance(value, str):
        return value.replace(PART, str(part)) if part is not None else value
    if isinstance(value, list):
        return [filled(v, part) for v in flat(value)]
    if isinstance(value, dict):
        return {k: filled(v, part) for k, v in value.items()}
    return value


def shown(stage: Stage) -> str:
    """The stage's command line, or its function and arguments, as one line."""
    if stage.run:
        return " ".join(shlex.quote(str(a)) for a in flat(stage.run))
    return f"{stage.call}({json.dumps(stage.args, default=str)})"


def partial(stage: Stage) -> Optional[Path]:
    """Where the stage writes outputs[0] before the rename, when its command or args name `{part}`."""
    if PART not in json.dumps([stage.run, stage.args], default=str):
        return None
    final = Path(stage.outputs[0])
    return final.with_name(final.name + ".part")


def command_line(argv: Sequence[str]) -> list[str]:
    """drafter-<job> and python3 run in this interpreter, so a pipeline runs the package that runs it (a checkout on
    PYTHONPATH included), not whatever the PATH finds first."""
    head, rest = argv[0], list(argv[1:])
    if head.startswith("drafter-"):
        return [sys.executable, "-m", "drafter_train.recipes.cli", head[len("drafter-"):], *rest]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    return [head, *rest]


def function(dotted: str) -> Callable[..., Any]:
    module, _, name = dotted.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"pipeline stage: {dotted}: no such function ({err})") from err


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def record(out: Path, stage: str, seconds: float) -> None:
    """One line of <out>/stages.jsonl: the stage, its wall time, this machine's CPU, when it ended (UTC)."""
    from drafter_train.machine import cpu_model

    line = {"stage": stage, "seconds": int(seconds), "cpu": cpu_model(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    with open(out / STAGES_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


def set_aside_elsewhere(stage: Stage, out: Path, what: str, say: Callable[[str], None]) -> Optional[Path]:
    """Move the stage's set_aside paths into <out>/other-machines/<when>/ when one of its `measured` files or journals
    was measured on another machine (journal.machine_identity); returns that folder, else None."""
    from drafter_train.engines.journal import measured_here

    elsewhere = [why for p in stage.measured if Path(p).exists() and (why := measured_here(Path(p)))]
    if not elsewhere:
        return None
    return set_aside(out / ELSEWHERE, stage.set_aside, f"{what}: {elsewhere[0]}", say)


def set_aside(root: Path, paths: Sequence[str], why: str, say: Callable[[str], None]) -> Path:
    """Move each existing path of `paths` into root/<UTC time>/ (kept, no longer used)."""
    to = root / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    to.mkdir(parents=True, exist_ok=True)
    moved = [p for p in paths if Path(p).exists()]
    for p in moved:
        shutil.move(p, to / Path(p).name)
    say(f"{why}; set aside in {to}: {' '.join(moved)}")
    return to
