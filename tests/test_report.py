"""Sweep reports: the table and plot from synthetic run folders, tracker logging, and real tiny `-m` sweeps of
drafter-train and drafter-eval that write their report through the Hydra callback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from PIL import Image

from drafter_train.checkpoint import mark_best
from drafter_train.config import TrackerConfig
from drafter_train.errors import ConfigError
from drafter_train.recipes.report import collect, group_lines, write_report
from tests.stubs import compose_cfg, run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# (loss, kind or None = not recorded, draft_len) -> best checkpoint's (tau, acceptance_rate, speedup); every run also
# has a later, worse checkpoint that must not be reported. Values with at most 3 decimals: the table shows 3.
RUNS = {
    ("fkl", None, 2): (1.625, 0.5, 1.125),
    ("fkl", None, 4): (2.25, 0.375, 1.375),
    ("tvd", "ar", 2): (1.75, 0.625, 1.25),
    ("tvd", "ar", 4): (2.5, 0.4, 1.5),
    ("fkl", "nar", 4): (3.125, 0.75, 2.0),
}


def write_run(root: Path, loss: str, kind, draft_len: int, best: tuple) -> Path:
    """A run folder as drafter-train leaves it: config.yaml, step-N/metrics.json, `best` -> the highest tau."""
    run_dir = root / f"{loss}-{kind or 'old'}-k{draft_len}"
    drafter = {"path": "truncated:1", "draft_len": draft_len, **({"kind": kind} if kind else {})}
    (run_dir / "step-3").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(json.dumps({"loss": {"name": loss}, "drafter": drafter}))
    tau, acceptance, speedup = best
    for step, scale in ((3, 1.0), (6, 0.5)):
        (run_dir / f"step-{step}").mkdir(exist_ok=True)
        metrics = {"tau": tau * scale, "acceptance_rate": acceptance * scale, "speedup": speedup * scale,
                   "draft_len": draft_len, "per_position_acceptance": [acceptance] * draft_len}
        (run_dir / f"step-{step}" / "metrics.json").write_text(json.dumps(metrics))
    mark_best(run_dir, run_dir / "step-3")
    return run_dir


@pytest.fixture
def runs(tmp_path) -> Path:
    for (loss, kind, draft_len), best in RUNS.items():
        write_run(tmp_path / "runs", loss, kind, draft_len, best)
    (tmp_path / "runs" / "not-a-run").mkdir()  # ignored: holds nothing a run writes
    return tmp_path / "runs"


def table_rows(markdown: str) -> list[dict]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|")))) for line in lines[2:]]


def assert_valid_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 200 and image.height > 100


# ---- table, plot, grouping ------------------------------------------------------------------------------------------


def test_table_holds_exactly_the_best_checkpoints_metrics(runs, tmp_path):
    report = write_report(runs, tmp_path / "out", TrackerConfig())
    rows = table_rows(report.markdown.read_text())
    assert len(rows) == len(RUNS)
    for row in rows:
        kind = row["kind"] if (row["loss"], row["kind"], int(row["draft_len"])) in RUNS else None
        tau, acceptance, speedup = RUNS[(row["loss"], kind, int(row["draft_len"]))]
        assert (float(row["tau"]), float(row["acceptance_rate"]), float(row["speedup"])) == (tau, acceptance, speedup)
        assert row["measured_at"] == "best (step-3)"
    assert "best checkpoint" in report.markdown.read_text()


def test_plot_is_a_valid_png(runs, tmp_path):
    report = write_report(runs, tmp_path / "out", TrackerConfig())
    assert_valid_png(report.plot)
    assert f"]({report.plot.name})" in report.markdown.read_text()  # the markdown shows it


def test_lines_group_by_loss_and_kind(runs):
    lines = group_lines(collect(runs).results)
    # Runs that predate drafter.kind count as "ar": they share the tvd/ar runs' kind, not their line (other loss).
    assert {line: [(p.draft_len, p.tau) for p in points] for line, points in lines.items()} == {
        "loss=fkl, kind=ar": [(2, 1.625), (4, 2.25)],
        "loss=fkl, kind=nar": [(4, 3.125)],
        "loss=tvd, kind=ar": [(2, 1.75), (4, 2.5)],
    }


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_sweep_callback_logs_the_report_to_the_sweeps_tracker_offline(runs, tracker):
    """The callback as conf/train.yaml configures it, at the end of a sweep whose folder holds the runs."""
    cfg = compose_cfg("train", [f"tracker={tracker}", f"hydra.sweep.dir={runs}"], return_hydra_config=True)
    instantiate(cfg.hydra.callbacks.report).on_multirun_end(config=cfg)
    assert len(table_rows((runs / "report.md").read_text())) == len(RUNS)
    if tracker == "wandb":
        (run,) = runs.glob("wandb/offline-run-*")
        (table,) = run.glob("files/media/table/report/table_*.table.json")
        logged = json.loads(table.read_text())
        assert len(logged["data"]) == len(RUNS) and 3.125 in [row[4] for row in logged["data"]]
        (image,) = run.glob("files/media/images/report/plot_*.png")
        assert_valid_png(image)
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = runs.glob("**/events.out.tfevents.*")
        accumulator = EventAccumulator(str(events.parent), size_guidance={"images": 0, "tensors": 0})
        accumulator.Reload()
        assert "report/plot" in accumulator.Tags()["images"]
        assert "report/table/text_summary" in accumulator.Tags()["tensors"]


def test_folder_without_runs_is_one_clear_error(tmp_path):
    (tmp_path / "empty" / "wandb").mkdir(parents=True)
    result = run_cli("drafter-report", f"report.input={tmp_path / 'empty'}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("drafter-report: error: report.input:") and "holds no runs" in line
    with pytest.raises(ConfigError, match=r"report\.input: .*no such folder"):
        collect(tmp_path / "missing")


def test_run_without_a_best_checkpoint_is_listed_as_not_reported(runs, tmp_path):
    (runs / "crashed").mkdir()
    (runs / "crashed" / "config.yaml").write_text("loss: {name: ce}\n")
    report = write_report(runs, tmp_path / "out", TrackerConfig())
    assert "crashed: no best checkpoint" in report.markdown.read_text()
    assert len(table_rows(report.markdown.read_text())) == len(RUNS)


# ---- real sweeps ----------------------------------------------------------------------------------------------------


def test_train_multirun_trains_each_job_and_reports_through_the_callback(tiny_data, tmp_path):
    out = tmp_path / "ckpt"
    result = run_cli(
        "drafter-train", "-m", "drafter.draft_len=1,2", f"target.path={tiny_data / 'target'}",
        "target.chat_template=false", "drafter.path=truncated:1", f"train.data_dir={tiny_data / 'data'}",
        f"train.output_root={out}", "train.max_steps=2", "train.save_every=2", "train.batch_size=4",
        "train.eval_at_start=false", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.warmup=0",
        "tracker=tensorboard", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = {}
    for draft_len in (1, 2):
        run_dir = out / f"ar-fkl-k{draft_len}"  # conf/train.yaml: ${drafter.kind}-${loss.name}-k${drafter.draft_len}
        assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()
        assert (run_dir / "step-2" / "drafter" / "model.safetensors").is_file()
        best[draft_len] = json.loads((run_dir / "best" / "metrics.json").read_text())
        assert best[draft_len]["draft_len"] == draft_len
    sweep = out / "multirun"
    rows = table_rows((sweep / "report.md").read_text())
    assert [(r["loss"], r["kind"], int(r["draft_len"])) for r in rows] == [("fkl", "ar", 1), ("fkl", "ar", 2)]
    for row in rows:
        assert float(row["tau"]) == round(best[int(row["draft_len"])]["tau"], 3)
        assert float(row["speedup"]) == round(best[int(row["draft_len"])]["speedup"], 3)
    assert_valid_png(sweep / "report.png")
    assert list(sweep.glob("**/events.out.tfevents.*")), "the report was not logged to the sweep's tracker"


def test_eval_multirun_writes_per_job_metrics_and_a_report(tiny_data, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "drafter-eval", "-m", "eval.draft_len=1,3", f"target.path={tiny_data / 'target'}",
        "target.chat_template=false", "drafter.path=truncated:1", f"eval.prompts={tiny_data / 'prompts.jsonl'}",
        "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.warmup=0", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads((sweep / str(job) / "metrics.json").read_text()) for job in (0, 1)]
    assert [m["draft_len"] for m in metrics] == [1, 3]
    assert not (tmp_path / "metrics.json").exists()  # no job wrote the old shared default
    rows = table_rows((sweep / "report.md").read_text())
    assert [(r["drafter"], int(r["draft_len"]), float(r["tau"])) for r in rows] == [
        ("truncated:1", m["draft_len"], round(m["tau"], 3)) for m in metrics]
    assert_valid_png(sweep / "report.png")
    # drafter-report accepts the same sweep folder and writes the same table elsewhere.
    again = run_cli("drafter-report", f"report.input={sweep}", f"report.output_dir={tmp_path / 'r'}",
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert table_rows((tmp_path / "r" / "report.md").read_text()) == rows
