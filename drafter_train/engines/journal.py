"""A timed run kept unit by unit (one decoder's pass over the prompts in one round, one round's cost calibration), so
a run longer than a session resumes where it stopped instead of starting again (benchmarks/engines.py: the served
table at full size takes hours on 2 cores).

A unit is written whole or not at all (a temporary file, then a rename). The journal's folder holds run.json: the
settings every unit depends on and the machine it was measured on. Resuming with other settings, or on another
machine, is refused in one line: a table's rows are ratios measured side by side on one machine, and a round timed
on another CPU would make them meaningless. Units are pickled (their keys and values are the driver's own: tuples
included), read back only from a journal this process's settings wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from drafter_train.errors import ConfigError
from drafter_train.io import write_atomic

HEADER = "run.json"


def machine_identity() -> dict:
    """What a resumed run must share with the stopped one: the CPU's model, its listed extensions, its cores."""
    from drafter_train.machine import cpu_features, cpu_model

    return {"cpu": cpu_model(), "cpu_features": cpu_features(), "logical_cores": os.cpu_count()}


class RunJournal:
    """Units of one run in `folder`, keyed by name; `config` (JSON-able, Paths as strings) and `machine` must equal
    the journal's own, else ConfigError (one line) before anything runs."""

    def __init__(self, folder: Path, config: dict, machine: dict, what: str = "--output"):
        self.folder = Path(folder)
        config = json.loads(json.dumps(config, sort_keys=True, default=str))
        header = self.folder / HEADER
        if header.is_file():
            kept = json.loads(header.read_text())
            if kept["config"] != config:
                changed = sorted(k for k in {*kept["config"], *config} if kept["config"].get(k) != config.get(k))
                raise ConfigError(f"{what}: {self.folder} holds a stopped run with other settings ({', '.join(changed)}"
                                  "): remove that folder to start again, or choose another")
            if kept["machine"] != machine:
                then, now = (f"{m['cpu']}, {', '.join(m['cpu_features']) or 'no listed extensions'}"
                             for m in (kept["machine"], machine))
                raise ConfigError(f"{what}: {self.folder} holds a run measured on another machine ({then}; this is "
                                  f"{now}): its rounds cannot be compared with this machine's; remove that folder to "
                                  "start again")
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(header, json.dumps({"config": config, "machine": machine}, indent=2))

    def _path(self, unit: str) -> Path:
        return self.folder / f"{hashlib.sha1(unit.encode()).hexdigest()[:16]}.pkl"

    def __contains__(self, unit: str) -> bool:
        return self._path(unit).is_file()

    def get(self, unit: str, compute: Callable[[], Any]) -> Any:
        """The unit's kept value, else compute() kept whole (temporary file, rename) and returned."""
        path = self._path(unit)
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = compute()
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(pickle.dumps(value))
        os.replace(tmp, path)
        return value


def measured_here(path: Path) -> Optional[str]:
    """None when the measurement at `path` (a JSON file with a "machine", or a journal folder: its run.json) was made
    on this machine (machine_identity); else why not, in one line."""
    file = Path(path) / HEADER if Path(path).is_dir() else Path(path)
    if not file.is_file():
        return f"{path}: nothing measured there"
    machine = json.loads(file.read_text()).get("machine")
    if machine is None:
        return f"{path}: names no machine"
    return None if machine == machine_identity() else f"{path}: measured on {machine['cpu']}, not this machine"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """python -m drafter_train.engines.journal PATH: exit 0 when PATH was measured on this machine, else 1 and why
    (the pipeline runner measures again what another CPU measured: pipeline/runner.py set_aside_elsewhere)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m drafter_train.engines.journal", description=main.__doc__)
    parser.add_argument("path", type=Path, help="a JSON file naming its machine, or a journal folder")
    why = measured_here(parser.parse_args(argv).path)
    if why:
        print(why)
    return 1 if why else 0


if __name__ == "__main__":
    raise SystemExit(main())
