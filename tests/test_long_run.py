"""The long run (issue 72) on tiny models: killed with SIGKILL and continued from its run folder alone to the same
weights and losses, checkpoints by wall time, learning-curve snapshots and their curve, the line on another machine,
and the refusals before anything heavy loads (another tokenizer, data still being written)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter_train.checkpoint import PROGRESS, snapshot_dirs, verify_checkpoint
from drafter_train.errors import ConfigError
from drafter_train.recipes.train import train
from tests.test_train import losses, train_cfg

REPO = Path(__file__).resolve().parents[1]
# every step is a checkpoint by wall time (1e-6 minutes), evaluated ones every 3 steps; snapshots at these tokens
LONG = ("train.save_every_minutes=1e-6", "train.keep_last=1", "train.snapshot_tokens=[1,100]",
        "train.eval_at_start=false", "eval.num_prompts=1")

# The same run in a fresh interpreter, killed by SIGKILL as its 5th step computes its loss (checkpoints up to step 4
# written, step 4's by wall time alone).
KILLED = """
import os, signal, sys
from pathlib import Path
from drafter_train.drafters.registry import get_kind
from drafter_train.recipes.train import train
from tests.test_train import train_cfg
kind, calls = get_kind("ar"), []
real = kind.loss
def loss(*args, **kwargs):
    calls.append(1)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
kind.loss = loss
train(train_cfg(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]))
"""


def weights(step_dir: Path) -> dict:
    return load_file(step_dir / "drafter" / "model.safetensors")


def test_a_run_killed_by_sigkill_continues_from_its_folder_alone_to_the_same_weights(tiny_data, tmp_path, capsys):
    """Killed mid-step 5 with SIGKILL, the run folder and the data copied elsewhere (another machine's disk and
    paths) and continued in this process: losses, final weights and snapshots equal those of the run that was never
    stopped."""
    reference = train_cfg(tiny_data, tmp_path / "a", *LONG)
    train(reference)
    run_a = tmp_path / "a" / reference.train.run_name
    killed = subprocess.run([sys.executable, "-c", KILLED, str(tiny_data), str(tmp_path / "b"), *LONG], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_b = tmp_path / "b" / reference.train.run_name
    assert (run_b / "latest").resolve().name == "step-4"  # by wall time: save_every=3 alone would leave step-3
    assert json.loads((run_b / "step-4" / "metrics.json").read_text()) == {}  # not evaluated
    assert (run_b / "best").resolve().name == "step-3"
    moved = tmp_path / "c"
    shutil.copytree(run_b, moved / reference.train.run_name, symlinks=True)
    shutil.copytree(tiny_data / "data", tmp_path / "data-elsewhere")
    train(train_cfg(tiny_data, moved, *LONG, f"train.data_dir={tmp_path / 'data-elsewhere'}"))
    run_c = moved / reference.train.run_name
    assert "on another machine" not in capsys.readouterr().err  # the same machine: nothing to say
    for step in (5, 6):
        assert losses(run_c)[step] == pytest.approx(losses(run_a)[step], rel=1e-6, abs=1e-7)
    for a, c in [(run_a / "step-6", run_c / "step-6"), *zip(snapshot_dirs(run_a), snapshot_dirs(run_c))]:
        for name, tensor in weights(a).items():
            torch.testing.assert_close(weights(c)[name], tensor, rtol=1e-6, atol=1e-7)
    assert [p.name for p in snapshot_dirs(run_c)] == ["snapshot-1", "snapshot-100"]


@pytest.fixture(scope="module")
def snapshot_run(tiny_data, tmp_path_factory) -> Path:
    """A finished 6-step run with snapshots at 1 and 100 tokens, its step folders pruned to the last (shared: the
    tests below only read it)."""
    out = tmp_path_factory.mktemp("snapshots")
    cfg = train_cfg(tiny_data, out, "train.keep_last=1", "train.snapshot_tokens=[1,100]", "train.eval_at_start=false",
                    "eval.num_prompts=1")
    train(cfg)
    return out / cfg.train.run_name


def test_snapshots_are_the_checkpoints_where_the_tokens_passed_each_milestone(snapshot_run):
    run = snapshot_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["train/tokens_seen"] for r in rows if "train/tokens_seen" in r}
    for snapshot, milestone in zip(snapshot_dirs(run), (1, 100)):
        progress = json.loads((snapshot / PROGRESS).read_text())
        step = progress["step"]
        assert seen[step] == progress["tokens_seen"] >= milestone > seen.get(step - 1, 0)
        assert progress["records_seen"] == 4 * step and progress["machine_kinds"] and progress["train_seconds"] > 0
        assert verify_checkpoint(snapshot)  # whole, checksums and all, though step-<N> was pruned (keep_last=1)
    assert not (run / f"step-{json.loads((snapshot_dirs(run)[0] / PROGRESS).read_text())['step']}").exists()


def test_a_resume_on_another_machine_kind_says_what_changed_in_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    cfg = train_cfg(tiny_data, tmp_path, "train.max_steps=3", "eval.num_prompts=1", "train.eval_at_start=false")
    train(cfg)
    for where in ("drafter_train.recipes.train", "drafter_train.run_progress"):  # the loop's and the checkpoint's
        monkeypatch.setattr(f"{where}.machine_kind", lambda device: "intel-xeon-amx")
    train(train_cfg(tiny_data, tmp_path, "train.max_steps=4", "eval.num_prompts=1", "train.eval_at_start=false"))
    said = [line for line in capsys.readouterr().err.splitlines() if "on another machine" in line]
    assert len(said) == 1 and "resuming step-3" in said[0] and "-> intel-xeon-amx" in said[0]
    progress = json.loads((tmp_path / cfg.train.run_name / "latest" / PROGRESS).read_text())
    assert progress["machine_kinds"][-1] == "intel-xeon-amx" and len(progress["machine_kinds"]) == 2


def test_a_nan_loss_mid_run_stops_naming_its_step_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path,
                                                                                      monkeypatch):
    from drafter_train.drafters.registry import get_kind
    from drafter_train.recipes.train import TrainingDivergedError

    real_loss, calls = get_kind("ar").loss, []

    def nan_in_step_5(*args, **kwargs):
        calls.append(1)
        out = real_loss(*args, **kwargs)
        return out._replace(loss_sum=out.loss_sum * float("nan")) if len(calls) == 5 else out

    monkeypatch.setattr(get_kind("ar"), "loss", nan_in_step_5)
    cfg = train_cfg(tiny_data, tmp_path, "eval.num_prompts=1", "train.eval_at_start=false")
    with pytest.raises(TrainingDivergedError, match="loss is nan at step 5;") as caught:
        train(cfg)
    assert "\n" not in str(caught.value)
    run = tmp_path / cfg.train.run_name
    assert (run / "latest").resolve().name == "step-3" and verify_checkpoint(run / "latest")
    assert not (run / "step-6").exists()


# ---- refused before anything heavy loads ------------------------------------------------------------------------


def no_target_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr("drafter_train.recipes.train.load_target", fail)


def test_a_target_with_another_tokenizer_is_refused_before_it_loads(tiny_data, snapshot_run, tmp_path, monkeypatch):
    progress = json.loads((snapshot_run / "latest" / PROGRESS).read_text())
    no_target_load(monkeypatch)
    # the run's: its checkpoint records the tokenizer it was trained with
    monkeypatch.setattr("drafter_train.run_progress.tokenizer_fingerprint", lambda tok: "0" * 64)
    monkeypatch.setattr("drafter_train.run_progress.check_tokenizer", lambda *a: None)
    with pytest.raises(ConfigError, match=rf"target\.path: .* not the one .*step-6 was trained with .*"
                                          rf"{progress['tokenizer_sha256'][:12]}"):
        train(train_cfg(tiny_data, snapshot_run.parent, "train.max_steps=8", "train.keep_last=1",
                        "train.snapshot_tokens=[1,100]", "train.eval_at_start=false", "eval.num_prompts=1"))
    monkeypatch.undo()
    # the data's: made with another tokenizer than this target's
    no_target_load(monkeypatch)
    data = tmp_path / "data"
    shutil.copytree(tiny_data / "data", data)
    manifest = json.loads((data / "datagen.json").read_text())
    manifest["run"]["tokenizer_sha256"] = "0" * 64
    (data / "datagen.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="target.path: .* another tokenizer"):
        train(train_cfg(tiny_data, tmp_path / "other", f"train.data_dir={data}"))


def test_data_still_being_written_is_refused_in_one_line(tiny_data, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(tiny_data / "data", data)
    manifest = json.loads((data / "datagen.json").read_text())
    manifest["complete"] = False  # what drafter-datagen's datagen.json says until its last shard is saved
    manifest["shards"] = manifest["shards"][:1]
    (data / "datagen.json").write_text(json.dumps(manifest))
    no_target_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"train\.data_dir: .* not finished .*: \d+ of 32 training prompts done "
                                          r"\(1 of \d+ shards\)"):
        train(train_cfg(tiny_data, tmp_path, f"train.data_dir={data}"))


@pytest.mark.parametrize("override, field", [("train.save_every_minutes=-1", "train.save_every_minutes"),
                                             ("train.snapshot_tokens=[0]", "train.snapshot_tokens"),
                                             ("train.snapshot_tokens=[5,5]", "train.snapshot_tokens")])
def test_impossible_long_run_values_name_the_field(tiny_data, tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        train_cfg(tiny_data, tmp_path, override)


# ---- the curve and the pipeline ------------------------------------------------------------------------------------


def test_the_curve_decodes_each_snapshot_as_learning_curve_does_into_its_columns(tiny_data, snapshot_run, tmp_path,
                                                                                monkeypatch):
    from benchmarks import learning_curve as lc
    from benchmarks import long_run

    decoded = []

    def fake_eval(job):  # learning_curve's evaluate builds the job: the same decoder settings as its points
        decoded.append((job.drafter.path, job.eval.prompts, job.eval.draft_len, job.eval.max_new_tokens,
                        job.target.path))
        return {"tau": 1.5, "acceptance_rate": 0.3, "speedup": 1.0, "per_position_acceptance": [0.4, 0.2, 0.1],
                "machine": {"cpu": "Test CPU"}}

    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    run = snapshot_run
    long_run.main(["--run", str(run), "--results-dir", str(tmp_path), "--result-name", "lr"])
    snapshots = snapshot_dirs(run)
    assert decoded == [(str(s / "drafter"), split, lc.DECODE_DEFAULTS["draft_len"],
                        lc.DECODE_DEFAULTS["max_new_tokens"], str(tiny_data / "target"))
                       for s in snapshots for split in ("dev", "test")]
    result = json.loads((tmp_path / "lr.json").read_text())
    assert result["columns"][:len(lc.COLUMNS)] == lc.COLUMNS and result["columns"][-2:] == ["machine kinds", "eval s"]
    tokens = [json.loads((s / PROGRESS).read_text())["tokens_seen"] for s in snapshots]
    assert [r[1] for r in result["rows"]] == tokens and all(r[-2] for r in result["rows"])
    with pytest.raises(ConfigError, match="--run: .* no snapshot"):
        long_run.main(["--run", str(tmp_path / "nothing")])


def test_the_long_run_trains_with_the_main_jobs_recipe_online():
    from drafter_train.pipeline.runner import flat
    from drafter_train.recipes.pipeline import compose_pipeline

    main_job = compose_pipeline(["pipeline=quickstart"]).shared["recipe"]
    cfg = compose_pipeline(["pipeline=long_run", "pipeline.save_every_minutes=5"])
    line = [str(a) for a in flat(cfg.known["train"].run)]
    at = line.index(main_job[0])
    assert line[at:at + len(main_job)] == list(main_job)
    after = line[at + len(main_job):]  # what the long run changes, after the recipe so that it wins
    assert {"drafter.features=online", "train.response=reference", "train.save_every_minutes=5.0",
            "train.group_by_length=64", "train.compile_target=true", "drafter.ttt_steps=3"} <= set(after)
    data = [str(a) for a in flat(cfg.known["datagen"].run)]
    assert {"datagen.generate=false", "datagen.multi_turn=true", "datagen.later_parts=true",
            "datagen.max_prompt_tokens=2048"} <= set(data)


# ---- throughput: batches grouped by length, the feature pass compiled -----------------------------------------------


def test_batches_grouped_by_length_are_a_seeded_permutation_of_similar_lengths_that_resumes_exactly():
    from drafter_train.data.batches import BatchStream

    lengths = torch.randint(1, 2048, (203,), generator=torch.Generator().manual_seed(1)).tolist()
    grouped = BatchStream(len(lengths), 4, seed=3, lengths=lengths, group_by_length=5)
    plain = BatchStream(len(lengths), 4, seed=3)
    batches = [grouped.next_indices() for _ in range(50)]  # one epoch: 50 whole batches of 4, 3 records left out
    assert sorted(i for b in batches for i in b) == sorted(plain._order()[:200].tolist())
    # each window of 5 batches holds the same records as the random order's, sorted by length into its batches
    windows = [set(plain._order()[w:w + 20].tolist()) for w in range(0, 200, 20)]
    for batch in batches:
        window = next(w for w in windows if batch[0] in w)
        assert set(batch) <= window
        inside = sorted((lengths[i] for i in window), reverse=True)
        assert sorted((lengths[i] for i in batch), reverse=True) in [inside[k:k + 4] for k in range(0, 20, 4)]
    padded = lambda bs: sum(len(b) * max(lengths[i] for i in b) for b in bs)  # noqa: E731
    assert padded(batches) < 0.8 * padded([plain.next_indices() for _ in range(50)])
    # the batches come shuffled (not longest first), differ between epochs, and resume mid-epoch exactly
    assert [max(lengths[i] for i in b) for b in batches[:10]] != sorted((max(lengths[i] for i in b)
                                                                          for b in batches[:10]), reverse=True)
    again = BatchStream(len(lengths), 4, seed=3, lengths=lengths, group_by_length=5)
    again.load_state_dict(grouped.state_dict())
    assert [grouped.next_indices() for _ in range(60)] == [again.next_indices() for _ in range(60)]
    assert grouped.epoch == 2  # 110 batches: into the third epoch
    assert [grouped.next_indices() for _ in range(40)] != batches[10:]  # another epoch, drawn anew


def test_group_by_length_is_part_of_what_a_run_is_and_absent_means_off(tiny_data, tmp_path):
    cfg = train_cfg(tiny_data, tmp_path, "train.max_steps=2", "eval.num_prompts=1", "train.eval_at_start=false",
                    "train.group_by_length=2")
    train(cfg)
    with pytest.raises(ConfigError, match=r"train\.group_by_length: 2 -> 0"):
        train(train_cfg(tiny_data, tmp_path, "train.max_steps=3", "eval.num_prompts=1", "train.eval_at_start=false"))
    # a run saved before the option existed has no such key: it was a run with random batches, and resumes as one
    old = train_cfg(tiny_data, tmp_path / "old", "train.max_steps=2", "eval.num_prompts=1", "train.eval_at_start=false")
    train(old)
    saved = tmp_path / "old" / old.train.run_name / "config.yaml"
    saved.write_text("\n".join(l for l in saved.read_text().splitlines() if "group_by_length" not in l))
    train(train_cfg(tiny_data, tmp_path / "old", "train.max_steps=3", "eval.num_prompts=1",
                    "train.eval_at_start=false"))
    with pytest.raises(ConfigError, match=r"train\.group_by_length: must be >= 0"):
        train_cfg(tiny_data, tmp_path, "train.group_by_length=-1")


def test_the_compiled_feature_pass_gives_eager_features_and_decoding_stays_eager(make_tiny_llama):
    import torch._dynamo

    from drafter_train.data.batches import collate
    from drafter_train.drafters.common.conditioned import _compiled, compile_feature_pass, target_signals

    target = make_tiny_llama()
    records = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}, {"prompt_ids": [3, 9], "response_ids": [8]}]
    batches = [collate(records, "response_ids", 64, 0), collate(records[:1], "response_ids", 64, 0)]
    eager = [target_signals(target, b, [0, 1, 2]) for b in batches]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_feature_pass(target)
    try:
        compiled = [target_signals(target, b, [0, 1, 2]) for b in batches]  # two shapes: dynamic, no error
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
        for batch, (f, h), (cf, ch) in zip(batches, eager, compiled):
            real = batch.attention_mask.bool()  # padded positions hold whatever a pass left there: nothing reads them
            torch.testing.assert_close(cf[real], f[real], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ch, h, rtol=1e-4, atol=1e-5)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        target(torch.tensor([[1, 2, 3]]))  # the model itself, as decoding calls it: not compiled
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    finally:
        _compiled.pop(target, None)
        torch._dynamo.reset()


def test_the_logged_rate_leaves_checkpoints_out_but_keeps_the_tokens_trained_before_them():
    from drafter_train.run_progress import TrainingRate

    now = [0.0]
    rate = TrainingRate(clock=lambda: now[0])
    now[0] = 1.0
    rate.add(100)  # a step of 1 s
    with rate.paused():
        now[0] = 5.0  # a checkpoint and its evaluation: 4 s
    now[0] = 6.0
    rate.add(100)  # another step of 1 s
    assert rate.take() == pytest.approx(100.0)  # 200 tokens in 2 s of training: not 200 / 6 s, nor 200 / 1 s
    now[0] = 8.0
    rate.add(50)
    assert rate.take() == pytest.approx(25.0)  # a new window


def test_a_rerun_of_the_curve_keeps_the_seconds_its_snapshots_were_decoded_in(snapshot_run, tmp_path, monkeypatch):
    import time

    from benchmarks import learning_curve as lc
    from benchmarks import long_run

    figures = {"tau": 1.5, "acceptance_rate": 0.3, "speedup": 1.0, "per_position_acceptance": [0.4, 0.2, 0.1],
               "machine": {"cpu": "Test CPU"}}

    def evaluate(drafter, split, args, output):  # decodes once (0.3 s), then reuses what it wrote
        if not output.is_file():
            time.sleep(0.3)
            output.write_text("{}")
        return figures

    monkeypatch.setattr(lc, "evaluate", evaluate)
    run = tmp_path / "run"
    shutil.copytree(snapshot_run, run, symlinks=True)
    seconds = []
    for _ in range(2):
        long_run.main(["--run", str(run), "--results-dir", str(tmp_path), "--result-name", "lr"])
        seconds.append([row[-1] for row in json.loads((tmp_path / "lr.json").read_text())["rows"]])
    assert seconds[0] == seconds[1] and min(seconds[0]) >= 0.6  # not the rerun's ~0 s
