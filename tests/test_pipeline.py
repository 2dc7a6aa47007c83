"""The pipeline runner (drafter_train/pipeline/runner.py) with fake stages: small Python commands that count their runs,
write their outputs, fail or hang on request. A stopped or failed run resumes where it stopped, a stage killed
half-way leaves nothing a rerun takes for done, timings from another CPU are set aside, and the stage list given on
the command line is the one that runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter_train.errors import ConfigError
from drafter_train.pipeline.config import PipelineConfig, Stage
from drafter_train.pipeline.runner import STAGES_FILE, StageFailed, is_done, run_pipeline, selected

REPO = Path(__file__).resolve().parent.parent

# A fake stage: counts its runs in <name>.runs, fails (exit 3) while <name>.fail exists, hangs while <name>.hang
# exists, and writes its output at argv[2] (the stage's {part} or its final path) in two halves.
FAKE = """
import pathlib, sys, time
name, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
runs = name.with_suffix(".runs")
runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
if name.with_suffix(".fail").exists():
    sys.exit(3)
out.write_text("half ")
while name.with_suffix(".hang").exists():
    time.sleep(0.05)
out.write_text("half whole")
"""


def fake(tmp: Path, name: str, part: bool = True, **kw) -> Stage:
    out = tmp / "out" / f"{name}.txt"
    return Stage(run=[sys.executable, "-c", FAKE, str(tmp / name), "{part}" if part else str(out)],
                 outputs=[str(out)], **kw)


def pipeline(tmp: Path, stages: dict, **kw) -> PipelineConfig:
    return PipelineConfig(name="fake", out=str(tmp / "out"), stages=list(stages), known=stages, **kw)


def runs(tmp: Path, name: str) -> int:
    file = tmp / f"{name}.runs"
    return int(file.read_text()) if file.exists() else 0


def timed(tmp: Path) -> list[str]:
    file = tmp / "out" / STAGES_FILE
    return [json.loads(line)["stage"] for line in file.read_text().splitlines()] if file.exists() else []


def test_a_failed_stage_stops_the_run_and_the_rerun_resumes_at_it(tmp_path):
    cfg = pipeline(tmp_path, {n: fake(tmp_path, n) for n in ("a", "b", "c")})
    (tmp_path / "b.fail").touch()
    with pytest.raises(StageFailed, match="fake: stage b failed \\(exit 3\\)") as failed:
        run_pipeline(cfg, say=lambda m: None)
    assert failed.value.returncode == 3
    assert (tmp_path / "out" / "a.txt").read_text() == "half whole" and not (tmp_path / "out" / "b.txt").exists()
    assert runs(tmp_path, "c") == 0 and timed(tmp_path) == ["a"]
    (tmp_path / "b.fail").unlink()
    said = []
    run_pipeline(cfg, say=said.append)
    assert [runs(tmp_path, n) for n in "abc"] == [1, 2, 1]  # a was done: skipped, not run again
    assert "fake: a: done, skipped" in said and timed(tmp_path) == ["a", "b", "c"]
    line = json.loads((tmp_path / "out" / STAGES_FILE).read_text().splitlines()[0])
    assert set(line) == {"stage", "seconds", "cpu", "date"} and line["cpu"]  # each stage's wall time and machine


def _killed_half_way(tmp_path: Path, part: bool) -> Path:
    """Run stage `a` in a child process, kill the child's whole process group once `a` wrote half its output."""
    stage = fake(tmp_path, "a", part=part)
    (tmp_path / "a.hang").touch()
    driver = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from drafter_train.pipeline.config import PipelineConfig, Stage\n"
              "from drafter_train.pipeline.runner import run_pipeline\n"
              f"run_pipeline(PipelineConfig(name='fake', out={str(tmp_path / 'out')!r}, stages=['a'], "
              f"known={{'a': Stage(run={stage.run!r}, outputs={stage.outputs!r})}}))\n")
    child = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
    written = Path(stage.outputs[0] + (".part" if part else ""))
    deadline = time.monotonic() + 60
    while not (written.exists() and written.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert written.read_text() == "half "
    (tmp_path / "a.hang").unlink()
    return written


def test_a_stage_killed_half_way_leaves_no_output_a_rerun_takes_for_done(tmp_path):
    written = _killed_half_way(tmp_path, part=True)
    stage = fake(tmp_path, "a")
    final = Path(stage.outputs[0])
    assert not final.exists() and not is_done(stage)  # only the partial name holds the half-written output
    run_pipeline(pipeline(tmp_path, {"a": stage}), say=lambda m: None)
    assert final.read_text() == "half whole" and not written.exists() and runs(tmp_path, "a") == 2


def test_a_training_run_stopped_before_its_last_step_is_not_done(tmp_path):
    run = tmp_path / "run"
    (run / "step-5" / "drafter").mkdir(parents=True)
    (run / "latest").symlink_to("step-5")
    (run / "best").symlink_to("step-5")
    stage = Stage(run=["true"], outputs=[str(run)], done="trained", steps=10)
    assert not is_done(stage)
    (run / "step-10" / "drafter").mkdir(parents=True)
    (run / "latest").unlink()
    (run / "latest").symlink_to("step-10")
    assert is_done(stage)


def test_an_output_older_than_an_input_file_is_made_again(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("v1")
    stage = fake(tmp_path, "a", inputs=[str(source)])
    cfg = pipeline(tmp_path, {"a": stage})
    run_pipeline(cfg, say=lambda m: None)
    run_pipeline(cfg, say=lambda m: None)
    assert runs(tmp_path, "a") == 1
    later = Path(stage.outputs[0]).stat().st_mtime + 5
    os.utime(source, (later, later))  # the input was made again since
    run_pipeline(cfg, say=lambda m: None)
    assert runs(tmp_path, "a") == 2


def test_a_timing_measured_on_another_cpu_is_set_aside_and_measured_again(tmp_path):
    from drafter_train.engines.journal import machine_identity

    out = tmp_path / "out"
    out.mkdir()
    timing, journal = out / "timing.json", out / "journal"
    stage = Stage(run=[sys.executable, "-c", f"import json, sys; sys.path.insert(0, {str(REPO)!r})\n"
                       "from drafter_train.engines.journal import machine_identity\n"
                       f"open({str(timing)!r}, 'w').write(json.dumps({{'machine': machine_identity()}}))"],
                  outputs=[str(timing)], measured=[str(timing)], set_aside=[str(timing), str(journal)])
    timing.write_text(json.dumps({"tokens_per_s": 9.9, "machine": dict(machine_identity(), cpu="Some Other CPU")}))
    journal.mkdir()
    said = []
    run_pipeline(pipeline(tmp_path, {"t": stage}), say=said.append)
    [aside] = (out / "other-machines").iterdir()
    assert json.loads((aside / "timing.json").read_text())["tokens_per_s"] == 9.9 and (aside / "journal").is_dir()
    assert any("measured on Some Other CPU, not this machine; set aside in" in m for m in said)
    assert json.loads(timing.read_text())["machine"] == machine_identity()  # measured again, here
    run_pipeline(pipeline(tmp_path, {"t": stage}), say=said.append)  # this machine's timing stays
    assert len(list((out / "other-machines").iterdir())) == 1 and timed(tmp_path) == ["t"]


def test_the_stage_list_given_is_the_one_that_runs_and_groups_stand_for_their_stages(tmp_path):
    known = {n: fake(tmp_path, n) for n in ("a", "b", "c", "d")}
    cfg = pipeline(tmp_path, known, groups={"cd": ["c", "d"]})
    cfg.stages = ["cd", "a"]
    assert selected(cfg) == ["c", "d", "a"]
    run_pipeline(cfg, say=lambda m: None)
    assert [runs(tmp_path, n) for n in "abcd"] == [1, 0, 1, 1] and timed(tmp_path) == ["c", "d", "a"]
    cfg.stages = ["a", "tabel"]
    with pytest.raises(ConfigError, match="pipeline.stages: unknown stage tabel"):
        run_pipeline(cfg, say=lambda m: None)
    assert runs(tmp_path, "a") == 1  # nothing ran: every name is checked first


def test_the_stage_list_override_reaches_the_served_pipeline_through_hydra():
    from drafter_train.recipes.pipeline import compose_pipeline

    cfg = compose_pipeline(["pipeline=served_qwen", "pipeline.stages=[exports,table]", "pipeline.num_prompts=16"])
    assert selected(cfg)[:2] == ["export-eagle3", "export-eagle3-q8_0"] and selected(cfg)[-1] == "table"
    assert "datagen.num_prompts=16" in cfg.known["datagen"].run
    verify = compose_pipeline(["pipeline=served_qwen", "pipeline.verify_rounds=1"]).known["verify-split"].run
    assert str(verify[verify.index("--rounds") + 1]) == "1"
    default = compose_pipeline(["pipeline=served_qwen"])
    assert default.stages[:3] == ["targets", "llamacpp", "datagen"] and "ours" not in default.stages


def test_a_missing_input_is_one_line_naming_it(tmp_path):
    stage = fake(tmp_path, "a", inputs=[str(tmp_path / "nowhere")])
    with pytest.raises(ConfigError, match="fake: stage a needs .*nowhere"):
        run_pipeline(pipeline(tmp_path, {"a": stage}), say=lambda m: None)
    assert runs(tmp_path, "a") == 0


@pytest.mark.parametrize("name", ["quickstart", "served_qwen", "engine_artifacts", "long_run"])
def test_every_shipped_pipeline_composes_and_its_jobs_compose_into_valid_configs(name, tmp_path):
    """Each drafter-<job> command of each shipped pipeline, run with Hydra's --cfg job in place of the work: a renamed
    or misspelt option fails here, not hours into a run."""
    from drafter_train.pipeline.runner import command_line, flat
    from drafter_train.recipes.pipeline import compose_pipeline

    cfg = compose_pipeline([f"pipeline={name}", f"pipeline.out={tmp_path}"])
    assert set(selected(cfg)) <= set(cfg.known)
    for stage, job in cfg.known.items():
        argv = [str(a).replace("{part}", str(tmp_path / "part")) for a in flat(job.run)]
        if not argv or not argv[0].startswith("drafter-"):
            continue
        done = subprocess.run([*command_line(argv), "--cfg", "job"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, f"{name} {stage}: {done.stderr[-2000:]}"


def test_the_main_job_runs_the_same_jobs_as_before():
    """The main job's command lines (scripts/quickstart.sh before it became a pipeline), so a run made before resumes
    and its figures stay comparable (datagen.dtype=auto resumes a folder begun in float32 in float32)."""
    from drafter_train.pipeline.runner import flat
    from drafter_train.recipes.pipeline import compose_pipeline

    known = compose_pipeline(["pipeline=quickstart"]).known
    settings = "eval.num_prompts=16 eval.max_new_tokens=48 eval.draft_len=2"
    tree = "eval.tree.top_k=2 eval.tree.depth=1 eval.tree.total_tokens=2"
    lookups = "eval.lookup.min_ngram=2 eval.lookup.corpus.path=data/quickstart-smollm2"
    line = {name: " ".join(map(str, flat(stage.run))) for name, stage in known.items()}
    assert line["datagen"] == ("drafter-datagen datagen.num_prompts=1600 datagen.num_eval_prompts=8 "
                               "datagen.dtype=auto datagen.batch_size=64 datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 "
                               "datagen.output_dir=data/quickstart-smollm2")
    # the recipe is drafter=eagle3's own (conf/recipe/eagle3.yaml, its one statement; benchmarks.learning_curve trains
    # with it too): the stage names the kind, and the rest is pinned here
    assert line["train"] == ("drafter-train train.data_dir=data/quickstart-smollm2 train.output_root=checkpoints "
                             "train.run_name=quickstart-smollm2 drafter=eagle3 "
                             "train.max_steps=1200 train.save_every=600 train.log_every=10 train.eval_at_start=false "
                             f"eval.prompts=dev {settings} {tree} {lookups}")
    best = "drafter.path=checkpoints/quickstart-smollm2/best/drafter"
    out = "eval.output=checkpoints/quickstart-smollm2"
    # the five test-split decoders side by side against one plain decoding, each job as drafter-eval ran it alone
    assert line["test"] == (f"drafter-compare eval.prompts=test {settings} "
                            f"product: drafter=path {best} {tree} {lookups} {out}/product.json "
                            f"drafter-alone: drafter=path {best} {tree} {out}/drafter-alone.json "
                            f"drafter-chain: drafter=path {best} {out}/drafter-chain.json "  # the top-1 chain (issue 54)
                            f"prompt-lookup: drafter=ngram drafter.min_ngram=2 {out}/prompt-lookup.json "
                            "corpus-lookup: drafter=ngram drafter.min_ngram=2 drafter.corpus.path=data/quickstart-smollm2 "
                            f"{out}/corpus-lookup.json")


def test_drafter_eagle3_trains_with_the_recipe_unless_an_option_says_otherwise():
    """`drafter-train drafter=eagle3` with no recipe options (the README's "your own target" path) trains with the
    main job's recipe, stated once in conf/recipe/eagle3.yaml: the settings the main job listed before it moved
    there; options on the command line still win, and kinds without a recipe keep the trainer's defaults."""
    from drafter_train.recipes.cli import compose_config

    cfg = compose_config("train", ["drafter=eagle3"])
    before = compose_config("train", ["drafter=eagle3", "drafter.features=offline", "drafter.draft_vocab_size=4096",
                                      "drafter.ttt_steps=1", "loss=fkl", "train.batch_size=8", "train.optimizer=muon",
                                      "train.lr=2e-3", "train.warmup_steps=20", "train.mixed_precision=auto"])
    assert (cfg.drafter, cfg.loss, cfg.train) == (before.drafter, before.loss, before.train)
    assert (cfg.train.optimizer, cfg.train.lr, cfg.drafter.draft_vocab_size) == ("muon", 2e-3, 4096)
    mine = compose_config("train", ["drafter=eagle3", "train.lr=1e-4", "loss=tvd", "drafter.ttt_steps=3"])
    assert (mine.train.lr, mine.loss.name, mine.drafter.ttt_steps, mine.train.optimizer) == (1e-4, "tvd", 3, "muon")
    plain = compose_config("train", ["drafter=ar"])
    assert (plain.train.optimizer, plain.train.lr, plain.train.mixed_precision) == ("adamw", 5e-4, "no")
