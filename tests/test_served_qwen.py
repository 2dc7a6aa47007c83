"""scripts/served_qwen.sh, the served pipeline on Qwen2.5-Coder-1.5B: a wrong stage is one line before anything runs,
and every drafter-train / drafter-export command it gives composes into the project's typed configs (each run with
Hydra's --cfg job in place of the real work, so a renamed or misspelt option fails here, not hours into a run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "served_qwen.sh"


def run(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(tmp_path / "out"),
                                                       "DATA": str(tmp_path / "data"), **env},
                          capture_output=True, text=True, timeout=600)


def test_an_unknown_stage_is_one_line(tmp_path):
    done = run({"STAGES": "eagle3 tabel"}, tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "served_qwen: STAGES: unknown stage tabel"
    assert not (tmp_path / "out" / "eagle3").exists()


@pytest.mark.skipif(shutil.which("drafter-train") is None, reason="the package's entry points are not installed")
def test_the_training_and_export_commands_compose_into_valid_configs(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for entry in ("drafter-train", "drafter-export"):
        real = shutil.which(entry)
        (fake / entry).write_text(f'#!/bin/sh\necho "{entry} $*" >> "{tmp_path}/calls"\nexec "{real}" "$@" --cfg job\n')
        (fake / entry).chmod(0o755)
    done = run({"STAGES": "eagle3 ar dflash", "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "E3_STEPS": "7",
                "DF_BLOCK": "3"}, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("drafter-train target=qwen2.5-coder-1.5b") for c in calls)
    assert "drafter.norm_before_fc=true" in calls[0] and "train.max_steps=7" in calls[0]
    assert "drafter.cut_from=qwen2.5-coder-0.5b" in calls[1]
    assert "drafter=dflash" in calls[2] and "drafter.block_size=3" in calls[2]
    assert "norm_before_fc: true" in done.stdout and "cut_from: qwen2.5-coder-0.5b" in done.stdout
    # DFlash reads EAGLE-3's layers, so the EAGLE-3 feature cache serves both
    assert "target_layers:\n  - 2\n  - 14\n  - 25\n" in done.stdout and "block_size: 3" in done.stdout
    stages = (tmp_path / "out" / "stages.jsonl").read_text()
    assert all(f'"stage": "{s}"' in stages for s in ("eagle3", "ar", "dflash"))


def test_timings_from_another_cpu_are_set_aside_and_the_table_waits_for_this_machines_choice(tmp_path):
    """choose and table are timings: a table journal measured on another CPU moves to OUT/other-machines/ (kept),
    and the table refuses to serve a choice.json chosen on another CPU (one line: run the choose stage here)."""
    import json

    from drafter_train.engines.journal import machine_identity

    there = dict(machine_identity(), cpu="Some Other CPU")
    from drafter_train.machine import kind_slug

    out = tmp_path / "out"
    # the table's result (and journal) is named by this machine's kind, so another kind's table is never replaced
    table = f"served_qwen1.5b-{kind_slug()}"
    journal = out / "table" / f"{table}.journal"
    journal.mkdir(parents=True)
    (journal / "run.json").write_text(json.dumps({"config": {}, "machine": there}))
    (out / "choice.json").write_text(json.dumps({"ngram_mode": "ngram-simple", "machine": there}))
    done = run({"STAGES": "table"}, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == ("served_qwen: the table serves what the choose stage chose on "
                                                   "this machine: run STAGES=choose first")
    assert not (out / "table").exists()
    [aside] = (out / "other-machines").iterdir()
    assert (aside / "table" / f"{table}.journal" / "run.json").is_file()
    assert (out / "choice.json").is_file()  # the choose stage (not run here) sets it aside when it runs


def test_a_choice_made_without_one_of_the_drafters_is_set_aside_and_made_again(tmp_path):
    """A choice.json from this machine that chose no draft length for one of the drafters the script now weighs (a
    drafter added since) is set aside (OUT/superseded/, kept), so the choose stage times every drafter again side by
    side instead of serving a drafter it never chose for."""
    import json

    from drafter_train.engines.journal import machine_identity

    out = tmp_path / "out"
    out.mkdir()
    (out / "choice.json").write_text(json.dumps({"ngram_mode": "ngram-simple", "machine": machine_identity(),
                                                 "corpus": {}, "draft_len": {"e3": 1, "ar": 1}}))
    (out / "choose").mkdir()
    done = run({"STAGES": "choose", "DRAFTER_TRAIN_LLAMACPP": str(tmp_path / "no-llamacpp")}, tmp_path)
    assert "served_qwen: chosen without one of e3 ar df, set aside in" in done.stderr, done.stderr[-2000:]
    [aside] = (out / "superseded").iterdir()
    assert json.loads((aside / "choice.json").read_text())["draft_len"] == {"e3": 1, "ar": 1}
    assert (aside / "choose").is_dir() and not (out / "other-machines").exists()
    assert not (out / "choice.json").exists()  # the dev pass after it needs llama.cpp, which this test lacks
