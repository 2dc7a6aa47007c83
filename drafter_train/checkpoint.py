"""Run folders and checkpoints: checkpoints/<run>/step-<N>/{drafter/, training_state.pt, metrics.json, checksums.json}.

Each checkpoint is written into a hidden temporary folder and renamed into place, and `latest` / `best` are
symlinks replaced atomically, so a crash at any moment leaves the previous checkpoint intact and pointed to.
Pruning keeps the newest `keep_last` step folders and never deletes the ones `best` and `latest` point to.

What a crash cannot do, a disk or a person can: the last file written into a checkpoint, checksums.json, holds the
size and sha256 of every other file in it. Resuming verifies `latest` and falls back to the newest intact step;
drafter-eval and drafter-export verify what they read. A checkpoint without checksums.json (written before they
were recorded) is accepted unverified.

torch is imported by the four functions that save or restore tensors (RNG and training state), not with the module:
drafter-export checks the run folder it is given before torch loads.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from drafter_train.io import write_atomic
from drafter_train.errors import CheckpointDamagedError, ConfigError

_STEP = re.compile(r"^step-(\d+)$")
_SNAPSHOT = re.compile(r"^snapshot-(\d+)$")
MANIFEST = "checksums.json"
PROGRESS = "progress.json"


@dataclass
class TrainState:
    """Everything about progress that is not a tensor (resume restores it exactly)."""

    step: int = 0
    tokens_seen: int = 0
    best_tau: float = float("-inf")
    best_step: int = -1
    # train.best_by=engine: the best predicted served speedup so far (runs saved before it resume with the default)
    best_engine_speedup: float = float("-inf")
    # wall seconds of training so far, over every process that continued the run (evaluations left out), and the
    # machine kinds (machine.kind_slug) that trained it, in order: a learning-curve snapshot's cost and where it ran
    train_seconds: float = 0.0
    machine_kinds: list = field(default_factory=list)

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


# What a run is: resuming with any of these changed would continue a different experiment under the same name (what
# is learned: the drafter, the loss, the data and every optimizer setting; not how long, how often it saves or where).
RUN_IDENTITY = ("target", "drafter", "loss", "train.data_dir", "train.response", "train.batch_size",
                "train.grad_accum", "train.seed", "train.lr", "train.lr_schedule", "train.max_seq_len",
                "train.optimizer", "train.muon_lr", "train.muon_weight_decay", "train.weight_decay",
                "train.warmup_steps", "train.max_grad_norm", "train.max_records", "train.group_by_length")


def check_same_run(run_dir: Path, config: dict, ignore: Sequence[str] = (), started: bool = False,
                   defaults: Optional[dict] = None) -> None:
    """Refuse to resume a run whose saved config.yaml differs from `config` in what defines the run (dotted keys in
    `ignore` may change: how long a run goes on, say). started: the run holds progress even without a checkpoint.
    defaults: sections of the schema's defaults (e.g. {"drafter": ..., "loss": ...}): a field the saved config lacks
    was added since the run began, and is taken at its default, so a new off-by-default option does not refuse every
    run begun before it."""
    saved_path = run_dir / "config.yaml"
    if (latest_checkpoint(run_dir) is None and not started) or not saved_path.exists():
        return
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    for section, fields in (defaults or {}).items():
        if isinstance(saved.get(section), dict):
            saved[section] = {**fields, **saved[section]}
    saved, config = _without(saved, ignore), _without(config, ignore)
    changed = [key for key in RUN_IDENTITY if _get(saved, key) != _get(config, key)]
    if changed:
        detail = ", ".join(f"{k}: {_get(saved, k)!r} -> {_get(config, k)!r}" for k in changed)
        raise ConfigError(f"train.resume: {run_dir} holds a run with other settings ({detail}); "
                          "pick another train.run_name, or train.resume=never")


def save_run_config(run_dir: Path, config: dict) -> None:
    """config.yaml, replaced atomically: check_same_run of a later launch never reads half a file (main process)."""
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(config))


def _without(config: dict, dotted_keys: Sequence[str]) -> dict:
    """A copy of `config` without these dotted keys."""
    config = copy.deepcopy(config)
    for dotted in dotted_keys:
        *parents, last = dotted.split(".")
        node = _get(config, ".".join(parents)) if parents else config
        if isinstance(node, dict):
            node.pop(last, None)
    return config


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
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    import torch

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
    run_dir: Path, drafter, tokenizer, training_state: dict, metrics: dict, step: int, started: bool = False,
    progress: Optional[dict] = None, keep_as: Sequence[str] = (),
) -> Path:
    """Write step-<step> atomically and point `latest` at it. `drafter` is the unwrapped HF model with full weights.

    started=True: start_checkpoint() made the folder and all ranks have written their shards into it.
    progress: written as progress.json (steps, tokens, wall time, machines: what a snapshot's evaluation reads).
    keep_as: also keep the checkpoint under these names in the run folder (snapshot-<tokens>), made before `latest`
    moves, so a crash in between redoes the step and its snapshot alike.
    """
    import torch

    final = run_dir / f"step-{step}"
    tmp = partial_checkpoint(run_dir, step) if started else start_checkpoint(run_dir, step)
    drafter.save_pretrained(tmp / "drafter")
    tokenizer.save_pretrained(tmp / "drafter")
    torch.save(training_state, tmp / "training_state.pt")
    (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if progress is not None:
        (tmp / PROGRESS).write_text(json.dumps(progress, indent=2))
    write_manifest(tmp)  # last: every rank's files are in (DeepSpeed's partitions were written before the barrier)
    for name in keep_as:
        keep_copy(tmp, run_dir / name)
    if final.exists():  # re-saving a step (e.g. a resumed run's final step): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _relink(run_dir, "latest", final)
    return final


def keep_copy(step_dir: Path, kept: Path) -> None:
    """`step_dir` also as `kept` (replaced whole if it exists), by hard links: no bytes copied, and pruning the step
    folder later leaves the copy intact (checkpoint files are never rewritten in place)."""
    tmp = kept.with_name(f".{kept.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(step_dir, tmp, copy_function=os.link)
    shutil.rmtree(kept, ignore_errors=True)
    os.replace(tmp, kept)


def snapshot_dirs(run_dir: Path) -> list[Path]:
    """The run's learning-curve snapshots (train.snapshot_tokens), fewest tokens first."""
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _SNAPSHOT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


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
    import torch

    return torch.load(step_dir / "training_state.pt", weights_only=False)


# ----------------------------------------------------------------------------------------------------------------
# Checksums: written last into each checkpoint, verified by whatever reads one


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(step_dir: Path) -> None:
    """checksums.json: size and sha256 of every file under `step_dir`, by relative path (~0.1 s per 100 MB)."""
    files = {
        path.relative_to(step_dir).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(step_dir.rglob("*")) if path.is_file() and path.name != MANIFEST
    }
    (step_dir / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1) + "\n")


def verify_checkpoint(step_dir: Path, parts: Sequence[str] = ()) -> bool:
    """Check the files checksums.json records (only those under the top-level names in `parts`, when given).

    True: all there and unchanged. False: no checksums.json, a checkpoint written before they were recorded (not
    verifiable). Raises CheckpointDamagedError naming the first file that is missing or changed.
    """
    if not step_dir.is_dir():
        raise CheckpointDamagedError(f"{step_dir} is damaged: the folder is missing")
    if not (step_dir / MANIFEST).is_file():
        return False
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
        expected = {rel: (int(entry["size"]), str(entry["sha256"])) for rel, entry in files.items()
                    if not parts or rel.split("/")[0] in parts}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointDamagedError(f"{step_dir} is damaged: {MANIFEST} is unreadable ({err})") from None
    if not expected:
        raise CheckpointDamagedError(f"{step_dir} is damaged: {MANIFEST} lists no files of {', '.join(parts)}")
    for rel, (size, sha256) in expected.items():
        problem = _file_problem(step_dir / rel, size, sha256)
        if problem:
            raise CheckpointDamagedError(f"{step_dir} is damaged: {rel} {problem}")
    return True


def _file_problem(path: Path, size: int, sha256: str) -> Optional[str]:
    try:
        found = path.stat().st_size
        if found != size:
            return f"has {found} bytes, {size} when it was written"
        return None if _sha256(path) == sha256 else f"does not match its sha256 in {MANIFEST}"
    except FileNotFoundError:
        return "is missing"


def verify_drafter_folder(path: str) -> None:
    """When `path` is the drafter/ folder of a checkpoint (step-<N>/drafter, best/drafter...), verify its files."""
    folder = Path(path).expanduser()
    if folder.is_dir() and (folder.resolve().parent / MANIFEST).is_file():
        verify_checkpoint(folder.resolve().parent, parts=(folder.resolve().name,))


def resume_checkpoint(run_dir: Path, main_process: bool) -> Optional[Path]:
    """The checkpoint resume=auto continues from: `latest` if intact, else the newest intact step before it.

    Every rank calls this and gets the same answer; the main process says in one line what it skipped, and sets the
    damaged steps aside (see set_aside). Raises CheckpointDamagedError when `latest` exists but no intact checkpoint
    is left.
    """
    link = run_dir / "latest"
    if not link.is_symlink():
        return None
    named = run_dir / Path(os.readlink(link)).name
    candidates = [step for step in reversed(step_dirs(run_dir)) if _step_number(step) < _step_number(named)]
    damaged: list[tuple[Path, CheckpointDamagedError]] = []
    for step in [named, *candidates]:
        try:
            verified = verify_checkpoint(step)
        except CheckpointDamagedError as err:
            damaged.append((step, err))
            continue
        if main_process and not verified:
            print(f"drafter-train: note: {step} has no {MANIFEST} (written before checkpoints recorded checksums); "
                  "resuming from it unverified", file=sys.stderr)
        if main_process and damaged:
            set_aside(run_dir, [bad for bad, _ in damaged], step)
            print(f"drafter-train: warning: {'; '.join(str(err) for _, err in damaged)}; resuming from {step.name}, "
                  "the newest intact checkpoint (damaged steps kept as step-<N>.damaged)", file=sys.stderr)
        return step
    raise CheckpointDamagedError(
        f"train.resume: no intact checkpoint is left in {run_dir} ({'; '.join(str(err) for _, err in damaged)}); "
        "move the run folder away to start over, or pick another train.run_name"
    )


def _step_number(step_dir: Path) -> int:
    match = _STEP.match(step_dir.name)
    return int(match.group(1)) if match else -1


def set_aside(run_dir: Path, damaged: list[Path], resumed: Path) -> None:
    """Rename damaged steps to step-<N>.damaged (kept for inspection, never pruned by name) and point `latest` to
    the step resumed from, so that the run writes those steps anew and pruning never counts a damaged one. A `best`
    left pointing nowhere goes to the best step the resumed state knows of, if it is still there."""
    for step in damaged:
        if step.is_dir():
            aside = step.with_name(f"{step.name}.damaged")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(step, aside)
    _relink(run_dir, "latest", resumed)
    best = run_dir / "best"
    if best.is_symlink() and not best.resolve().is_dir():
        best_step = run_dir / f"step-{load_training_state(resumed)['train_state']['best_step']}"
        if best_step.is_dir():
            _relink(run_dir, "best", best_step)
        else:
            best.unlink()
