"""benchmarks/learning_curve.py: points aligned with the feature cache, the log-tokens fit, resuming, and its result
file, with training and evaluation stubbed (made-up figures, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import learning_curve as lc

MACHINE = {"cpu": "Test CPU", "torch_threads": 2}
# a recipe fixed here, so these figures do not move when the main job's changes
RECIPE = ["drafter=eagle3", "drafter.features=offline", "drafter.draft_vocab_size=4096", "drafter.ttt_steps=1",
          "loss=fkl", "train.batch_size=8", "train.lr=2e-3", "train.warmup_steps=20"]


@pytest.fixture(autouse=True)
def fixed_recipe(monkeypatch):
    monkeypatch.setattr(lc, "main_job_recipe", lambda: list(RECIPE))


def test_the_recipe_is_the_main_jobs_train_stage(monkeypatch):
    """What every point trains with is what scripts/quickstart.sh's train stage runs, read from one place."""
    from drafter_train.pipeline.runner import flat
    from drafter_train.recipes.pipeline import compose_pipeline

    monkeypatch.undo()
    recipe = lc.main_job_recipe()
    train_stage = flat(compose_pipeline(["pipeline=quickstart"]).known["train"].run)
    assert recipe and recipe[0] == "drafter=eagle3" and all(option in train_stage for option in recipe)


def test_a_recipe_is_a_pipeline_stages_drafter_train_options_less_what_a_point_sets(tmp_path, monkeypatch):
    """--recipe served_qwen:ar trains the AR drafter cut from the 0.5B with that stage's own options (its loss, lr,
    batch, layers), each point setting its data, run, steps and saves; the title names the kind and the stage; a
    stage that is not drafter-train, or none, is refused in one line."""
    from drafter_train.pipeline.runner import flat
    from drafter_train.recipes.pipeline import compose_pipeline

    monkeypatch.undo()
    stage = [str(o) for o in flat(compose_pipeline(["pipeline=served_qwen"]).known["ar"].run)]
    recipe = lc.stage_recipe("served_qwen:ar")
    assert recipe == [o for o in stage[1:] if not o.startswith(lc.MANAGED)]
    assert {"drafter=ar", "loss=ce", "drafter.cut_from=qwen2.5-coder-0.5b", "train.lr=5e-4"} <= set(recipe)
    assert not any(o.startswith(("train.data_dir=", "train.max_steps=", "eval.")) for o in recipe)
    for bad, says in (("served_qwen:exports", "no stage 'exports'"), ("served_qwen:datagen", "runs drafter-datagen")):
        with pytest.raises(lc.ConfigError, match=says):
            lc.stage_recipe(bad)

    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"reference_ids": [[0] * 100] * 300})
    trained = []
    monkeypatch.setattr(lc, "train", lambda cfg: trained.append((cfg.drafter.kind, cfg.train.max_records,
                                                                 cfg.train.max_steps, cfg.train.lr, cfg.loss.name)))
    decoded = []

    def fake_eval(cfg):
        decoded.append(cfg.target.path)
        return {"tau": 1.2, "acceptance_rate": 0.2, "speedup": 1.0, "per_position_acceptance": [0.2],
                "machine": MACHINE}

    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    lc.main(["--recipe", "served_qwen:ar", "--data", "d", "--response", "reference", "--points", "10000",
             "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path), "--splits", "test"])
    assert trained == [("ar", 100, 150, 5e-4, "ce")]  # 6 epochs of 100 records at the stage's batch of 4
    # named after the stage, so its points never meet the main job's recipe's points in one --out folder
    assert (tmp_path / "runs" / "served_qwen-ar-r100" / "point.json").is_file()
    # the stage's own target decodes the drafter it trained, not the default one (no --target given)
    qwen = lc.compose_config("train", ["target=qwen2.5-coder-1.5b"]).target.path
    assert decoded == [qwen] and qwen != lc.compose_config("train", []).target.path
    result = json.loads((tmp_path / "learning_curve.json").read_text())
    assert result["title"].startswith("The AR drafter's acceptance against training data on Qwen2.5-Coder-1.5B")
    assert "Training: the served_qwen pipeline's ar stage (drafter=ar" in result["notes"]
    assert "train.warmup_steps=10 target=qwen2.5-coder-1.5b)" in result["notes"]


def test_a_point_trained_with_another_recipe_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"response_ids": [[0] * 100] * 300})
    monkeypatch.setattr(lc, "train", lambda cfg: None)
    monkeypatch.setattr(lc, "run_eval_job", lambda cfg: {"tau": 1.2, "acceptance_rate": 0.2, "speedup": 1.0,
                                                         "per_position_acceptance": [0.2], "machine": MACHINE})
    argv = ["--data", "d", "--points", "25000", "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path)]
    lc.main(argv)
    # the same settings spelled otherwise (the recipe file's own values, an option equal to them): the kept point
    monkeypatch.setattr(lc, "main_job_recipe", lambda: ["drafter=eagle3", "train.optimizer=muon"])
    lc.main(argv)
    monkeypatch.setattr(lc, "main_job_recipe", lambda: [*RECIPE, "train.optimizer=adamw"])
    with pytest.raises(lc.ConfigError, match="another recipe"):
        lc.main(argv)


def test_points_take_the_fewest_records_that_hold_their_tokens_and_stop_at_the_data():
    lengths = [100] * 1000  # 100k tokens
    assert lc.records_for(lengths, 25_000) == 250 and lc.records_for(lengths, 25_001) == 251
    assert lc.records_for(lengths, 100_000) == 1000 and lc.records_for(lengths, 100_001) is None


def test_the_fit_is_a_line_in_log_tokens():
    fit = lc.fit_log_tokens([(1e4, 0.2), (1e5, 0.3), (1e6, 0.4)])
    assert fit == pytest.approx((-0.2, 0.1))
    assert lc.tokens_for(fit, 0.6) == pytest.approx(1e8)
    assert lc.tokens_for((0.3, 0.0), 0.6) is None and lc.fit_log_tokens([(1e4, 0.2)]) is None
    # a nearly flat fit (0.176 at 10k and 20k: the AR curve's) says so instead of printing a 150-digit figure
    flat = lc.fit_log_tokens([(10_183, 0.1757), (20_099, 0.1764)])
    assert lc._tokens(lc.tokens_for(flat, 0.5)).startswith("more than 1,000,000M")
    assert lc._tokens(2.5e7) == "25.0M"


def test_each_point_trains_once_and_the_result_file_says_where_the_curve_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"response_ids": [[0] * 100] * 1100})  # 110k
    trained = []

    def fake_train(cfg):
        trained.append((cfg.train.max_records, cfg.train.max_steps, cfg.drafter.ttt_steps))
        # saved every 100 steps and at the end (a stopped point resumes), the last save the point's drafter
        assert cfg.train.save_every == 100 and cfg.train.resume == "auto"

    def fake_eval(cfg):
        assert cfg.drafter.path.endswith(("r250/step-188/drafter", "r500/step-375/drafter"))
        records = int(cfg.drafter.path.split("/")[-3].split("-r")[-1])
        first = 0.1 * (records // 250) + (0.05 if "ttt3" in cfg.drafter.path else 0)
        metrics = {"tau": 1 + first, "acceptance_rate": first, "per_position_acceptance": [first, first / 2],
                   "speedup": 1.0, "machine": MACHINE}
        return metrics

    monkeypatch.setattr(lc, "train", fake_train)
    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    argv = ["--data", "d", "--points", "25000", "50000", "400000", "--out", str(tmp_path / "runs"),
            "--results-dir", str(tmp_path / "results")]
    lc.main(argv)
    assert trained == [(250, 188, 1), (500, 375, 1)]  # 6 epochs of 8-sequence steps; 400k is beyond the data
    result = json.loads((tmp_path / "results" / "learning_curve.json").read_text())
    assert result["columns"][1:3] == ["response tokens", "records"] and result["machine"] == MACHINE
    first = result["rows"][0]  # its train seconds (index 4) are the stub's wall time: under load, not always 0
    assert first[:4] + first[5:] == ["main-job", 25000, 250, 188, 0.1, 0.1, 0.05, None, 1.1] and first[4] >= 0
    assert "Not reached (the data is too small): 400k" in result["notes"]
    assert "0.6 at ~" in result["notes"] and "test split" in result["split"]
    lc.main(argv)  # finished points are not trained again
    assert len(trained) == 2
    lc.main([*argv[:5], *argv[6:], "--result-name", "ablations", "--variant", "main-job=",
             "--variant", "ttt3=drafter.ttt_steps=3"])
    assert trained[2:] == [(250, 188, 3), (500, 375, 3)]
    ablations = json.loads((tmp_path / "results" / "ablations.json").read_text())
    assert "ablations" in ablations["title"] and "dev split's best first-position acceptance is ttt3's" in \
        ablations["notes"]


def test_the_dev_choice_says_whether_its_margin_exceeds_two_standard_errors():
    """0.30 against 0.29 over 450 first drafts each is noise (2 SE of the difference ~0.061); 0.40 against 0.29 is
    not. Points kept before the counts were recorded name the best alone."""
    def point(variant, first, tested):
        dev = {"per_position_acceptance": [first]}
        if tested:
            dev["per_position_tested"] = [tested]
        return {"variant": variant, "dev": dev}

    close = lc.choice_note([point("a", 0.29, 450), point("b", 0.30, 450)])
    assert close == ("the dev split's best first-position acceptance is b's (0.300): 0.010 above a's (two standard "
                     "errors of the difference 0.061: within noise); binomial over the first drafts each tested, a "
                     "lower bound on the noise")
    clear = lc.choice_note([point("a", 0.29, 450), point("b", 0.40, 450), point("c", 0.36, 450)])
    assert "b's (0.400): 0.040 above c's (two standard errors of the difference 0.065: within noise), 0.110 above " \
           "a's (two standard errors of the difference 0.063: beyond noise)" in clear
    assert lc.choice_note([point("a", 0.29, 0), point("b", 0.30, 0)]) == \
        "the dev split's best first-position acceptance is b's (0.300)"


def test_a_variant_sets_its_own_epochs_and_reference_data_counts_the_sources_answers(tmp_path, monkeypatch):
    data = {"response_ids": [[]] * 1000, "reference_ids": [[0] * 100] * 1000}  # a datagen.generate=false folder
    monkeypatch.setattr(lc, "load_distill_dataset", lambda path: data)
    trained = []

    def fake_train(cfg):
        trained.append((cfg.train.max_records, cfg.train.max_steps, cfg.train.response, cfg.train.lr))

    metrics = {"tau": 1.2, "acceptance_rate": 0.2, "per_position_acceptance": [0.2], "speedup": 1.0,
               "machine": MACHINE}
    monkeypatch.setattr(lc, "train", fake_train)
    monkeypatch.setattr(lc, "run_eval_job", lambda cfg: metrics)
    lc.main(["--data", "d", "--response", "reference", "--points", "40000", "--out", str(tmp_path / "runs"),
             "--results-dir", str(tmp_path / "results"), "--variant", "ep6=", "--variant",
             "ep1.5=epochs=1.5 train.lr=1e-3", "--variant", "b4=train.batch_size=4"])
    # 400 records of 100 reference tokens; 6 epochs = 300 steps of 8, 1.5 epochs = 75 (the lr override still
    # applies); at batch 4, 6 epochs are 600 steps
    assert trained == [(400, 300, "reference", 2e-3), (400, 75, "reference", 1e-3), (400, 600, "reference", 2e-3)]
    result = json.loads((tmp_path / "results" / "learning_curve.json").read_text())
    assert [r[:4] for r in result["rows"]] == [["ep6", 40000, 400, 300], ["ep1.5", 40000, 400, 75],
                                                ["b4", 40000, 400, 600]]
    # an ablation's further columns: the tokens each trained on, and its dev figure against the first variant's
    assert result["columns"][-3:] == ["tokens seen", "dev diff vs baseline", "2 SE of diff"]
    assert [r[-3:] for r in result["rows"]] == [[240000, 0.0, None], [60000, 0.0, None], [240000, 0.0, None]]


def test_a_deadline_skips_the_points_the_measured_pace_says_would_end_late(tmp_path, monkeypatch):
    """--deadline: the first point always runs; a later one runs only if the seconds per step and per evaluation
    measured so far say it ends in time; a skipped point is reported as not reached in time, and the rows are in
    token order whatever order --points ran them in."""
    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"response_ids": [[0] * 100] * 2000})  # 200k
    clock, trained = [0.0], []
    monkeypatch.setattr(lc.time, "perf_counter", lambda: clock[0])

    def fake_train(cfg):
        trained.append(cfg.train.max_steps)
        clock[0] += cfg.train.max_steps * 1.0  # 1 s a step

    def fake_eval(cfg):
        clock[0] += 10.0  # 10 s an evaluation (dev and test: 20 s a point)
        return {"tau": 1.2, "acceptance_rate": 0.2, "per_position_acceptance": [0.2], "speedup": 1.0,
                "machine": MACHINE}

    monkeypatch.setattr(lc, "train", fake_train)
    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    # 100k = 1000 records = 750 steps; 50k = 375 steps; 200k = 1500 steps; 25k = 188 steps.
    # After 100k (770 s) 430 s are left: 50k needs 375 + 20 = 395 (runs), then 35 s are left: 200k and 25k are skipped
    lc.main(["--data", "d", "--points", "100000", "50000", "200000", "25000", "--deadline", "1200",
             "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "results")])
    assert trained == [750, 375]
    result = json.loads((tmp_path / "results" / "learning_curve.json").read_text())
    assert [r[1] for r in result["rows"]] == [50000, 100000]
    assert "Not reached in time (--deadline 1200 s): 25k, 200k response tokens." in result["notes"]


def test_another_target_trains_and_decodes_on_it_and_its_points_are_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"response_ids": [[0] * 100] * 300})
    seen = []
    monkeypatch.setattr(lc, "train", lambda cfg: seen.append(("train", cfg.target.path)))

    def fake_eval(cfg):
        seen.append(("eval", cfg.target.path))
        return {"tau": 1.2, "acceptance_rate": 0.2, "speedup": 1.0, "per_position_acceptance": [0.2],
                "machine": MACHINE}

    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    argv = ["--data", "d", "--points", "25000", "--out", str(tmp_path / "runs"), "--results-dir", str(tmp_path)]
    lc.main([*argv, "--target", "qwen2.5-coder-1.5b"])
    assert seen == [("train", "embedded:qwen2.5-coder-1.5b")] + [("eval", "embedded:qwen2.5-coder-1.5b")] * 2
    title = json.loads((tmp_path / "learning_curve.json").read_text())["title"]
    assert title == "EAGLE-3's acceptance against training data on Qwen2.5-Coder-1.5B-Instruct"
    with pytest.raises(lc.ConfigError, match="another recipe"):  # the same folder, the main job's target
        lc.main(argv)


def test_a_test_only_curve_in_bf16_decodes_once_and_a_point_decoded_otherwise_is_decoded_again(tmp_path, monkeypatch):
    monkeypatch.setattr(lc, "load_distill_dataset", lambda data: {"response_ids": [[0] * 100] * 300})
    trained, decoded = [], []
    monkeypatch.setattr(lc, "train", lambda cfg: trained.append(cfg.train.max_records))

    def fake_eval(cfg):
        decoded.append((cfg.eval.prompts, cfg.target.dtype))
        out = {"tau": 1.2, "acceptance_rate": 0.2, "per_position_acceptance": [0.2], "speedup": 1.0,
               "machine": MACHINE, "config": {"target": {"dtype": cfg.target.dtype},
                                              "eval": {k: getattr(cfg.eval, k) for k in lc.DECODE_DEFAULTS}}}
        Path(cfg.eval.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.eval.output).write_text(json.dumps(out))
        return out

    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    argv = ["--data", "d", "--points", "10000", "--out", str(tmp_path / "runs"), "--results-dir",
            str(tmp_path / "results")]
    lc.main([*argv, "--splits", "test", "--eval-dtype", "bfloat16", "--points", "10000", "20000", "--aims", "0.5"])
    assert trained == [100, 200] and decoded == [("test", "bfloat16")] * 2  # no dev split: one variant chooses nothing
    result = json.loads((tmp_path / "results" / "learning_curve.json").read_text())
    assert result["rows"][0][5] is None and "decodes in bfloat16" in result["notes"]
    assert "dev split beside it" not in result["split"] and "would 0.5 take?" in result["question"]
    assert "nothing is chosen here" in result["notes"]
    assert "0.5 at ~" in result["notes"] and "0.6 at" not in result["notes"]  # the aims asked for
    lc.main([*argv, "--splits", "test", "--eval-dtype", "bfloat16"])  # done: nothing again
    lc.main(argv)  # asked in float32 with dev: both decoded again, the training kept
    assert trained == [100, 200] and decoded[2:] == [("dev", "float32"), ("test", "float32")]
    assert json.loads((tmp_path / "results" / "learning_curve.json").read_text())["rows"][0][5] == 0.2
    lc.main([*argv, "--num-prompts", "8"])  # decoded on other prompts than asked: decoded again, not reused
    assert trained == [100, 200] and decoded[4:] == [("dev", "float32"), ("test", "float32")]
    lc.main([*argv, "--num-prompts", "8"])
    assert len(decoded) == 6


def test_an_ablation_row_gives_its_dev_difference_from_the_baseline_with_two_standard_errors(monkeypatch):
    monkeypatch.setattr(lc, "_batch", lambda recipe, overrides: 8)

    def point(variant, first, tested):
        split = {"per_position_acceptance": [first, 0.1], "per_position_tested": [tested, 50], "tau": 1.3}
        return {"variant": variant, "response_tokens": 100_000, "records": 600, "steps": 450, "train_s": 500.0,
                "recipe": [], "overrides": [], "dev": split, "test": split}

    base, other = point("main-job", 0.30, 900), point("noise", 0.36, 900)
    row = lc.ablation_row(other, base)
    assert row[-3] == 600_000 and row[-2] == pytest.approx(0.06)
    assert row[-1] == pytest.approx(2 * (0.30 * 0.70 / 900 + 0.36 * 0.64 / 900) ** 0.5)


class Records:
    """A datagen folder's dataset as learning_curve reads it: columns by name, records by index."""

    def __init__(self, **columns):
        self.columns = columns

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        return {name: values[key] for name, values in self.columns.items()}


def test_a_peer_variant_trains_the_same_records_with_the_peer_and_decodes_its_drafter_the_same_way(tmp_path,
                                                                                                    monkeypatch):
    import benchmarks.peers as peers
    import drafter_train.engines.vllm_cpu as vllm_cpu

    data = Records(prompt_ids=[[1, 2]] * 1000, response_ids=[[]] * 1000,
                   reference_ids=[[3 + i % 5] * 100 for i in range(1000)])
    monkeypatch.setattr(lc, "load_distill_dataset", lambda path: data)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    monkeypatch.setattr(vllm_cpu, "local_target", lambda path, cache_dir=None: str(target))
    monkeypatch.setattr(peers, "check_venv", lambda name: None)
    calls, decoded = [], []

    def fake_speculators(target_dir, rows, layers, out, settings, timeout=None):
        calls.append((target_dir, [json.loads(line) for line in rows.read_text().splitlines()], layers, settings))
        (out / "drafter").mkdir(parents=True)
        return {"optimizer_steps": 77, "train_wall_s": 10.0, "features_wall_s": 2.5}

    def fake_eval(cfg):
        decoded.append(cfg.drafter.path)
        return {"tau": 1.3, "acceptance_rate": 0.3, "per_position_acceptance": [0.3], "speedup": 1.0,
                "machine": MACHINE}

    monkeypatch.setattr(peers, "train_speculators", fake_speculators)
    monkeypatch.setattr(lc, "train", lambda cfg: None)
    monkeypatch.setattr(lc, "run_eval_job", fake_eval)
    argv = ["--data", "d", "--response", "reference", "--points", "20000", "--out", str(tmp_path / "runs"),
            "--results-dir", str(tmp_path / "results"), "--variant", "main-job=",
            "--variant", "speculators=peer=speculators:defaults-bf16"]
    lc.main(argv)
    # the point's 200 records (100 reference tokens each), as rows: prompt masked, answer learned
    (target_dir, rows, layers, settings), = calls
    assert target_dir == target and layers == [2, 15, 27]
    assert len(rows) == 200 and rows[7] == {"input_ids": [1, 2] + [5] * 100, "loss_mask": [0, 0] + [1] * 100}
    assert settings["epochs"] == 6 and settings["draft_vocab_size"] == 4096 and settings["total_seq_len"] == 512
    assert settings["hidden_states_dtype"] == "bfloat16" and settings["optimizer"] == "muon"  # the peer's own
    peer_folder = str(tmp_path / "runs" / "speculators-r200" / "speculators" / "drafter")
    assert decoded[-2:] == [peer_folder, peer_folder]  # dev and test, as ours are decoded
    result = json.loads((tmp_path / "results" / "learning_curve.json").read_text())
    assert [r[:5] for r in result["rows"]] == [["main-job", 20000, 200, 150, result["rows"][0][4]],
                                                ["speculators", 20000, 200, 77, 12]]
    assert result["rows"][1][-3] == 120000  # tokens seen: 6 passes over 20k
    lc.main(argv)  # a rerun trains nothing again
    assert len(calls) == 1
    monkeypatch.setattr(lc, "load_distill_dataset", None)  # refused before any data loads
    with pytest.raises(lc.ConfigError, match="peer=speculators:nope: not a peer trainer's settings"):
        lc.main([*argv[:-1], "bad=peer=speculators:nope"])
    with pytest.raises(lc.ConfigError, match="whole passes"):
        lc.main([*argv[:-1], "bad=peer=speculators:defaults epochs=1.5"])


def test_the_question_says_how_the_targets_answers_were_made(tmp_path):
    """Greedy answers and sampled ones are different data: a result names which it was trained on."""
    assert lc.how_generated(str(tmp_path)) == "greedy"  # no manifest: datagen's default
    (tmp_path / "datagen.json").write_text(json.dumps({"generation": {"temperature": 0.8, "samples_per_prompt": 2}}))
    assert lc.how_generated(str(tmp_path)) == "sampled at temperature 0.8, 2 a prompt"
    (tmp_path / "datagen.json").write_text(json.dumps({"generation": {"temperature": 0.0}}))
    assert lc.how_generated(str(tmp_path)) == "greedy"
