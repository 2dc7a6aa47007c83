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
    eagle3 = flat(cfg.known["eagle3"].run)
    assert eagle3[0] == "drafter-train" and "target=qwen2.5-coder-1.5b" in eagle3
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


def _rows(mode_tps: float) -> list[dict]:
    def row(decoder, setting, tps, label=None):
        return {"precision": "q4_k_m-llama", "decoder": decoder, "setting": setting, "tokens_per_s": tps, "tau": 1.5,
                **({"label": label} if label else {})}
    lengths = [row("EAGLE-3", f"--spec-type draft-eagle3 --spec-draft-n-max {n}", 10.0 + n, f"{p}-{n}")
               for p in ("e3", "ar", "df") for n in (1, 2, 3)]
    return [row("plain", "plain", 11.0), row("free n-gram", "--spec-type ngram-simple", mode_tps), *lengths]


def _write_dev_record(folder: Path, name: str, rows: list[dict]) -> None:
    """What benchmarks.engines writes for a dev pass: `rows`, or for the corpus pass (choose-corpus) the kept mode's
    row and the lookups product with the corpus cache, faster."""
    from drafter_train.engines.journal import machine_identity
    from drafter_train.engines.table import LOOKUPS_ONLY

    if name == "choose-corpus":
        rows = [rows[1], {"precision": "q4_k_m-llama", "decoder": "product", "label": LOOKUPS_ONLY,
                          "tokens_per_s": 13.0,
                          "setting": "--spec-type ngram-simple,ngram-cache --lookup-cache-static x"}]
    (folder / f"{name}.json").write_text(json.dumps({"prompts": "dev", "rows": rows, "machine": machine_identity()}))


def test_the_served_stages_choose_on_dev_then_serve_the_choice_on_test(tmp_path, monkeypatch):
    """choose, agreement and table with benchmarks.engines / engine_check replaced by a fake that records each
    command line and writes what the real one would: the dev passes feed choice.json, the agreement decodes ours once,
    and the table serves each drafter at the length chosen on dev."""
    from drafter_train.engines import export
    from drafter_train.engines.journal import machine_identity
    from drafter_train.engines.table import LOOKUPS_ONLY
    from drafter_train.pipeline import served
    from drafter_train.pipeline.runner import run_pipeline
    from drafter_train.recipes.pipeline import compose_pipeline

    out, results, calls = tmp_path / "out", tmp_path / "results", []

    def fake(module, args, ok=(0,)):
        args = [str(a) for a in args]
        calls.append((module, args))
        folder, name = Path(args[args.index("--output") + 1]), args[args.index("--result-name") + 1]
        folder.mkdir(parents=True, exist_ok=True)
        if module == "engine_check":
            (folder / "llamacpp_check.json").write_text("{}")
            results.mkdir(exist_ok=True)
            (results / f"{name}.json").write_text("{}")
            return 0
        _write_dev_record(folder, name, _rows(12.0))
        return 0

    monkeypatch.setattr(served, "benchmark", fake)
    monkeypatch.setattr(export, "llama_target_gguf", lambda target, gguf_type: tmp_path / f"{gguf_type}.llama.gguf")
    for export_dir in ("eagle3", "ar", "dflash"):
        (out / "exports" / export_dir).mkdir(parents=True)
    cfg = compose_pipeline(["pipeline=served_qwen", f"pipeline.out={out}", "pipeline.stages=[choose,agreement,table]",
                            f"pipeline.results_dir={results}", "pipeline.agreement_prompts=3"])
    run_pipeline(cfg, say=lambda m: None)

    choice = json.loads((out / "choice.json").read_text())
    assert choice["draft_len"] == {"e3": 3, "ar": 3, "df": 3} and choice["ngram_mode"] == "ngram-simple"
    assert choice["corpus"]["joins"] and choice["product_ngram"] == "ngram-simple,ngram-cache"
    (_, dev), (_, corpus), (_, f16), (_, q4), (_, table) = calls
    assert dev[dev.index("--ngram-modes") + 1] == "all"
    assert f"df-3={out}/exports/dflash/drafter.gguf@q4_k_m-llama" in dev and "df-3=3" in dev
    assert corpus[corpus.index("--product-ngram") + 1] == "ngram-simple,ngram-cache" and "e3q4-1=1" in corpus
    assert str(tmp_path / "f16.llama.gguf") in f16 and "--ours-from" not in f16
    assert "--ours-from" in q4 and (out / "agreement-ours.json").is_file()  # our decoding, made once
    assert "eagle3=3" in table and "0.5B=3" in table and "dflash=3" in table
    assert table[table.index("--product") + 1] == "eagle3" and ["--product", "lookups"] == table[
        table.index("lookups") - 1:table.index("lookups") + 1]  # the corpus cache joined: the lookups row too
    assert f"eagle3={out}/agreement-ours.json" in table and "--near-ties" in table
    # every result file into pipeline.results_dir (a reduced run's stays out of benchmarks/results)
    for written in (f16, q4, table):
        assert written[written.index("--results-dir") + 1] == str(results)
    assert f16[f16.index("--num-prompts") + 1] == "3"
    assert sorted(p.name for p in results.iterdir()) == ["engine_llamacpp_qwen1_5b_f16.json",
                                                         "engine_llamacpp_qwen1_5b_q4_k_m.json"]
    assert [json.loads(line)["stage"] for line in (out / "stages.jsonl").read_text().splitlines()] == [
        "choose", "agreement", "table"]


def test_choose_picks_eagle3s_target_file_from_the_verify_split_and_the_table_serves_it(tmp_path, monkeypatch):
    """With this machine's verify split (benchmarks/verify_split.py), choose adds the target file EAGLE-3 is predicted
    fastest on at its dev acceptance (choice.json's verify_file), and the table adds every verify file's plain row
    and EAGLE-3 on the chosen one."""
    from drafter_train.pipeline import served
    from drafter_train.pipeline.runner import run_pipeline
    from drafter_train.recipes.pipeline import compose_pipeline

    out, calls = tmp_path / "out", []

    def fake(module, args, ok=(0,)):
        args = [str(a) for a in args]
        calls.append(args)
        folder, name = Path(args[args.index("--output") + 1]), args[args.index("--result-name") + 1]
        folder.mkdir(parents=True, exist_ok=True)
        _write_dev_record(folder, name, [dict(r, acceptance_per_position=[0.6, 0.5, 0.4]) for r in _rows(10.0)])
        return 0

    monkeypatch.setattr(served, "benchmark", fake)
    for export_dir in ("eagle3", "ar", "dflash"):
        (out / "exports" / export_dir).mkdir(parents=True)
    figures = {label: {"plain_ms": plain, "kinds": {"eagle3": {"ms": {"2": step, "4": step * 1.3},
                                                               "draft_ms": {"2": 4.0, "4": 12.0}}}}
               for label, plain, step in (("q4_k_m-llama", 65.0, 120.0), ("q4_0-out_q4_0", 62.0, 90.0))}
    split = tmp_path / "verify_split.json"
    split.write_text(json.dumps({"data": {"figures": figures}}))
    cheap = tmp_path / "t.llama.q4_0-out_q4_0.gguf"
    cheap.write_bytes(b"GGUF")
    cfg = compose_pipeline(["pipeline=served_qwen", f"pipeline.out={out}", "pipeline.stages=[choose,table]",
                            f"pipeline.known.choose.args.verify_split={split}",
                            "+pipeline.known.table.args.verify_files="
                            f"{{q4_0-out_q4_0: {cheap}, q4_0: {tmp_path}/none}}"])
    run_pipeline(cfg, say=lambda m: None)

    choice = json.loads((out / "choice.json").read_text())
    assert choice["draft_len"]["e3"] == 3 and choice["verify_file"]["file"] == "q4_0-out_q4_0"
    table = calls[-1]
    assert f"q4_0-out_q4_0={cheap}" in table and not any(a.startswith("q4_0=") for a in table)  # made files only
    assert f"eagle3-q4_0-out_q4_0={out}/exports/eagle3-q4_k_m/drafter.gguf@q4_0-out_q4_0" in table
    assert "eagle3-q4_0-out_q4_0=3" in table
