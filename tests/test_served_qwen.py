"""The served pipeline on Qwen2.5-Coder-1.5B (conf/pipeline/served_qwen.yaml, run by scripts/served_qwen.sh): a wrong
stage is one line before anything runs, every drafter-train / drafter-export command it gives composes into the
project's typed configs (each run with Hydra's --cfg job in place of the real work, so a renamed or misspelt option
fails here, not hours into a run), and its timed stages keep to what this machine measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from drafter_train.pipeline.runner import command_line, flat

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "served_qwen.sh"


def run(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    folders = [f"pipeline.out={tmp_path / 'out'}", f"pipeline.data={tmp_path / 'data'}"]
    return subprocess.run(["bash", str(SCRIPT), *folders, *overrides], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_an_unknown_stage_is_one_line(tmp_path):
    done = run(tmp_path, "pipeline.stages=[eagle3,tabel]")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().startswith("drafter-pipeline: error: pipeline.stages: unknown stage tabel (known: ")
    assert not (tmp_path / "out" / "eagle3").exists()


def test_the_training_and_export_commands_compose_into_valid_configs(tmp_path):
    from drafter_train.recipes.pipeline import compose_pipeline

    cfg = compose_pipeline(["pipeline=served_qwen", f"pipeline.out={tmp_path}", "pipeline.e3_steps=7",
                            "pipeline.df_block=3"])
    shown = {}
    for name in ("eagle3", "ar", "dflash", "export-eagle3-q4_k_m"):
        argv = [str(a).replace("{part}", str(tmp_path / "part")) for a in flat(cfg.known[name].run)]
        done = subprocess.run([*command_line(argv), "--cfg", "job"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        shown[name] = done.stdout
    assert cfg.known["eagle3"].run[0] == "drafter-train" and "target=qwen2.5-coder-1.5b" in flat(cfg.known["eagle3"].run)
    assert "norm_before_fc: true" in shown["eagle3"] and "max_steps: 7" in shown["eagle3"]
    assert cfg.known["eagle3"].steps == 7  # its done rule follows the step count given
    assert "cut_from: qwen2.5-coder-0.5b" in shown["ar"]
    # DFlash reads EAGLE-3's layers, so the EAGLE-3 feature cache serves both
    assert "target_layers:\n  - 2\n  - 14\n  - 25\n" in shown["dflash"] and "block_size: 3" in shown["dflash"]
    assert "drafter_gguf_type: q4_k_m" in shown["export-eagle3-q4_k_m"]


def test_timings_from_another_cpu_are_set_aside_and_the_table_waits_for_this_machines_choice(tmp_path):
    """choose and table are timings: a table journal measured on another CPU moves to OUT/other-machines/ (kept),
    and the table refuses to serve a choice.json chosen on another CPU (one line: run the choose stage here)."""
    from drafter_train.engines.journal import machine_identity
    from drafter_train.machine import kind_slug

    there = dict(machine_identity(), cpu="Some Other CPU")
    out = tmp_path / "out"
    # the table's result (and journal) is named by this machine's kind, so another kind's table is never replaced
    journal = out / "table" / f"served_qwen1.5b-{kind_slug()}.journal"
    journal.mkdir(parents=True)
    (journal / "run.json").write_text(json.dumps({"config": {}, "machine": there}))
    (out / "choice.json").write_text(json.dumps({"ngram_mode": "ngram-simple", "machine": there}))
    done = run(tmp_path, "pipeline.stages=[table]")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(
        "drafter-pipeline: error: served_qwen: the table serves what the choose stage chose on this machine: run "
        "pipeline.stages=[choose] first")
    assert not (out / "table").exists()
    [aside] = (out / "other-machines").iterdir()
    assert (aside / "table" / journal.name / "run.json").is_file()
    assert (out / "choice.json").is_file()  # the choose stage (not run here) sets it aside when it runs


def test_a_choice_made_without_one_of_the_drafters_is_set_aside_and_made_again(tmp_path):
    """A choice.json from this machine that chose no draft length for one of the drafters the pipeline now weighs (a
    drafter added since) is set aside (OUT/superseded/, kept), so the choose stage times every drafter again side by
    side instead of serving a drafter it never chose for."""
    from drafter_train.engines.journal import machine_identity

    out = tmp_path / "out"
    for export in ("eagle3", "ar", "dflash"):
        (out / "exports" / export).mkdir(parents=True)
    (out / "choice.json").write_text(json.dumps({"ngram_mode": "ngram-simple", "machine": machine_identity(),
                                                 "corpus": {}, "draft_len": {"e3": 1, "ar": 1}}))
    (out / "choose").mkdir()
    done = run(tmp_path, "pipeline.stages=[choose]", env={"DRAFTER_TRAIN_LLAMACPP": str(tmp_path / "no-llamacpp")})
    assert "served_qwen: chosen without one of e3 ar df; set aside in" in done.stderr, done.stderr[-2000:]
    [aside] = (out / "superseded").iterdir()
    assert json.loads((aside / "choice.json").read_text())["draft_len"] == {"e3": 1, "ar": 1}
    assert (aside / "choose").is_dir() and not (out / "other-machines").exists()
    assert not (out / "choice.json").exists()  # the dev pass after it needs llama.cpp, which this test lacks


@pytest.mark.parametrize("e3_type, served", [("q4_k_m", "eagle3-q4_k_m"), ("f16", "eagle3")])
def test_the_table_serves_the_eagle3_export_chosen_by_e3_type(e3_type, served):
    from drafter_train.recipes.pipeline import compose_pipeline

    cfg = compose_pipeline(["pipeline=served_qwen", f"pipeline.e3_type={e3_type}"])
    assert cfg.known["table"].args["drafts"]["eagle3"][0].endswith(f"/exports/{served}/drafter.gguf@q4_k_m-llama")


def test_the_wrapper_is_one_line_of_work():
    lines = [line for line in SCRIPT.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1 and "drafter_train.recipes.pipeline pipeline=served_qwen" in lines[0]
    assert sys.executable  # the runner's commands run in this interpreter (runner.command_line)
