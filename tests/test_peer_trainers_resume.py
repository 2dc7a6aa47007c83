"""benchmarks/peer_trainers.py without the peers: each (trainer, settings) is trained and evaluated once, its rows
kept, and the result file is rewritten after each, so a stopped comparison resumes and its finished rows render."""

from __future__ import annotations

import argparse
import json

from benchmarks import make_results
from benchmarks import peer_trainers as pt


def test_a_finished_trainer_is_not_run_again_and_the_result_file_grows_after_each(tmp_path, monkeypatch):
    runs = []

    def fake_train(trainer, args, target_dir, rows, subset, records, settings, out):
        runs.append((trainer, settings["lr"]))
        return out / "drafter", {"optimizer_steps": 19, "train_wall_s": 60.0}

    def fake_evaluate(folder, target_dir, target, eos, prompts, args, out):
        return [{"engine": "ours", "acceptance_length": 1.25, "per_position_acceptance": [0.2, 0.05],
                 "tau": 1.25, "output_identical_to_plain": True}]

    monkeypatch.setattr(pt, "train_peer", fake_train)
    monkeypatch.setattr(pt, "evaluate", fake_evaluate)
    args = argparse.Namespace(output=tmp_path / "runs", result=tmp_path / "results" / "peer_trainers.json",
                              prompts="test", num_prompts=24, max_new_tokens=64, draft_len=3, target="t",
                              layers=[2, 15, 27], draft_vocab_size=0, max_seq_len=512, data="d",
                              response="target")
    found = []
    for name in ("defaults", "matched"):
        found += pt.run_one("ours", name, args, "t", None, [0], [], tmp_path / "rows", tmp_path / "subset", 152,
                            25000)
        pt.write_result(args, ["--data", "d"], found)
        assert len(json.loads(args.result.read_text())["rows"]) == len(found)
    assert runs == [("ours", 5e-4), ("ours", 1e-3)]
    again = pt.run_one("ours", "defaults", args, "t", None, [0], [], tmp_path / "rows", tmp_path / "subset", 152,
                       25000)
    assert runs == [("ours", 5e-4), ("ours", 1e-3)] and again == found[:1]
    assert again[0]["settings"]["name"] == "defaults" and again[0]["tokens_seen"] == 25000
    page = make_results.results_page(make_results.load_results(args.result.parent))
    assert "| ours | defaults: loss fkl, lr 0.0005, ttt_steps 3" in page
    assert "| 19 | 25000 | 60 | ours | 1.250 | 0.20 / 0.05 | True |" in page


def test_hidden_states_made_apart_count_in_the_wall_and_old_rows_take_them_from_train_info(tmp_path, monkeypatch):
    """speculators computes hidden states before it trains (features_wall_s); ours computes them inside the train
    wall. The table adds the two, so the wall-clock is compared on equal terms, also for rows kept before."""
    def fake_train(trainer, args, target_dir, rows, subset, records, settings, out):
        return out / "drafter", {"optimizer_steps": 85, "train_wall_s": 60.0, "features_wall_s": 40.0}

    monkeypatch.setattr(pt, "train_peer", fake_train)
    monkeypatch.setattr(pt, "evaluate", lambda *a: [{"engine": "ours", "acceptance_length": 1.2,
                                                     "per_position_acceptance": [0.2], "tau": 1.2,
                                                     "output_identical_to_plain": True}])
    args = argparse.Namespace(output=tmp_path / "runs", result=tmp_path / "results" / "peer_trainers.json",
                              prompts="test", num_prompts=24, max_new_tokens=64, draft_len=3, target="t",
                              layers=[2, 15, 27], draft_vocab_size=0, max_seq_len=512, data="d",
                              response="target")
    rows = pt.run_one("speculators", "defaults", args, "t", None, [0], [], tmp_path / "r", tmp_path / "s", 152, 25000)
    assert rows[0]["features_wall_s"] == 40.0
    kept = tmp_path / "runs" / "speculators-defaults"
    old = [{k: v for k, v in rows[0].items() if k != "features_wall_s"}]  # a rows.json from before
    (kept / "rows.json").write_text(json.dumps(old))
    (kept / "speculators").mkdir()
    (kept / "speculators" / "train_info.json").write_text(json.dumps({"features_wall_s": 72.5}))
    again = pt.run_one("speculators", "defaults", args, "t", None, [0], [], tmp_path / "r", tmp_path / "s", 152,
                       25000)
    assert again[0]["features_wall_s"] == 72.5
    measured_under = {"cpu": "then", "load_average": [5.3, 5.5, 6.5]}  # the file the kept rows were written to
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps({"machine": measured_under}))
    pt.write_result(args, ["--data", "d"], again, measured=False)  # a rewrite that ran nothing
    assert json.loads(args.result.read_text())["machine"] == measured_under
    page = make_results.results_page(make_results.load_results(args.result.parent))
    assert "| 85 | 25000 | 132 | ours | 1.200 | 0.20 | True |" in page


def test_ours_ablation_settings_reach_drafter_train_as_composed_options(tmp_path, monkeypatch):
    """Each ablation's batch, warmup, optimizer and ttt_decay arrive in the config drafter-train runs, and the steps
    are one pass at that batch."""
    from drafter_train.recipes import train as train_recipe

    seen = []
    monkeypatch.setattr(train_recipe, "train", lambda cfg: seen.append(cfg))
    args = argparse.Namespace(batch_size=8, layers=[2, 15, 27], draft_vocab_size=0, max_seq_len=512,
                              response="target")
    folder, info = pt.train_ours(args, "t", tmp_path / "rows", dict(pt.SETTINGS[("ours", "steps-muon-decay1")]),
                                 tmp_path / "out", 152)
    cfg = seen[0]
    assert (cfg.train.batch_size, cfg.train.max_steps, cfg.train.warmup_steps) == (2, 76, 1)
    assert cfg.train.optimizer == "muon" and cfg.drafter.ttt_decay == 1.0 and cfg.drafter.ttt_steps == 3
    assert cfg.train.response == "target"  # --response's default: the target's answers
    assert info["optimizer_steps"] == 76 and folder == tmp_path / "out" / "ours" / "latest" / "drafter"
    pt.train_ours(args, "t", tmp_path / "rows", dict(pt.SETTINGS[("ours", "matched")]), tmp_path / "out", 152)
    pt.train_ours(args, "t", tmp_path / "rows", dict(pt.SETTINGS[("ours", "steps-muon-decay1-linear")]),
                  tmp_path / "out", 152)
    assert seen[2].train.lr_schedule == "linear" and seen[1].train.lr_schedule == "cosine"
    assert seen[1].train.batch_size == 8 and seen[1].drafter.ttt_decay == 0.8  # as it was measured
    pt.train_ours(args, "t", tmp_path / "rows", dict(pt.SETTINGS[("ours", "steps-muon-decay1-auto-linear")]),
                  tmp_path / "out", 152)
    assert (seen[3].train.mixed_precision, seen[3].train.lr_schedule) == ("auto", "linear")
    assert seen[2].train.mixed_precision == "no" and seen[3].drafter.features == "online"
    pt.train_ours(args, "t", tmp_path / "rows", dict(pt.SETTINGS[("ours", "steps-muon-decay1-auto-linear-offline")]),
                  tmp_path / "out", 152)
    assert seen[4].drafter.features == "offline"


def test_another_split_evaluates_the_trained_drafter_again_without_training_it(tmp_path, monkeypatch):
    """The dev split chooses among ours' ablations: --prompts dev evaluates each finished training on the dev prompts
    (rows-dev.json), keeps its steps and walls, and trains nothing, also for runs from before train.json was kept."""
    runs, seen_prompts = [], []

    def fake_train(trainer, args, target_dir, rows, subset, records, settings, out):
        runs.append(trainer)
        return out / "drafter", {"optimizer_steps": 76, "train_wall_s": 478.0, "ignored": 1}

    def fake_evaluate(folder, target_dir, target, eos, prompts, args, out):
        seen_prompts.append((args.prompts, folder))
        return [{"engine": "ours", "acceptance_length": 1.3 if args.prompts == "dev" else 1.2,
                 "per_position_acceptance": [0.2], "tau": 1.2, "output_identical_to_plain": True}]

    monkeypatch.setattr(pt, "train_peer", fake_train)
    monkeypatch.setattr(pt, "evaluate", fake_evaluate)
    args = argparse.Namespace(output=tmp_path / "runs", result=tmp_path / "r.json", prompts="test", num_prompts=24,
                              max_new_tokens=64, draft_len=3)
    test_rows = pt.run_one("ours", "steps-muon", args, "t", None, [0], [], tmp_path / "r", tmp_path / "s", 152, 25000)
    old = tmp_path / "runs" / "ours-steps-muon-decay1"  # trained and evaluated before train.json existed
    old.mkdir(parents=True)
    (old / "rows.json").write_text(json.dumps([dict(test_rows[0], train_wall_s=500.0)]))
    args.prompts = "dev"
    dev = pt.run_one("ours", "steps-muon", args, "t", None, [0], [], tmp_path / "r", tmp_path / "s", 152, 25000)
    dev_old = pt.run_one("ours", "steps-muon-decay1", args, "t", None, [0], [], tmp_path / "r", tmp_path / "s", 152,
                         25000)
    assert runs == ["ours"]  # only the first training ran
    assert dev[0]["acceptance_length"] == 1.3 and dev[0]["train_wall_s"] == 478.0 and "ignored" not in dev[0]
    assert dev_old[0]["train_wall_s"] == 500.0 and dev_old[0]["optimizer_steps"] == 76
    assert seen_prompts[-1] == ("dev", old / "ours" / "latest" / "drafter")
    assert (tmp_path / "runs" / "ours-steps-muon" / "rows-dev.json").is_file()
    assert json.loads((tmp_path / "runs" / "ours-steps-muon" / "rows.json").read_text())[0]["acceptance_length"] == 1.2


def test_plain_decoding_runs_once_per_engine_and_prompt_set_and_reads_back_the_same(tmp_path):
    """Every drafter of a comparison is checked against the same plain decoding: it is decoded once per engine and
    prompt set, kept, and read back equal."""
    from drafter_train.engines.base import Served

    class Engine:
        calls = 0

        def decode(self, prompts, new_tokens, speculative):
            assert prompts == [[1]] and new_tokens == 64 and not speculative  # the prompts' tokens, as given
            Engine.calls += 1
            return Served(tokens=[[5, 6, 7]], tokens_per_s=9.5, steps=[(0, 0)])

    args = argparse.Namespace(output=tmp_path, prompts="dev", num_prompts=24, max_new_tokens=64, target="smollm2")
    first = pt.plain_decode(Engine(), "ours", [[1]], args)
    again = pt.plain_decode(Engine(), "ours", [[1]], args)
    other = pt.plain_decode(Engine(), "vLLM-cpu", [[1]], args)
    assert Engine.calls == 2 and again.tokens == first.tokens == other.tokens == [[5, 6, 7]]
    assert again.tokens_per_s == 9.5 and len(list(tmp_path.glob("plain-ours-dev-24x64-*.json"))) == 1
    pt.plain_decode(Engine(), "ours", [[1]], argparse.Namespace(**dict(vars(args), target="qwen")))
    assert Engine.calls == 3  # another target's plain decoding is never read back


def test_settings_apply_to_each_trainer_that_has_them_or_to_the_one_named():
    assert pt.runs("ours,speculators", "defaults,matched") == [
        ("ours", "defaults"), ("ours", "matched"), ("speculators", "defaults"), ("speculators", "matched")]
    assert pt.runs("ours,speculators", "steps-muon,defaults") == [
        ("ours", "steps-muon"), ("ours", "defaults"), ("speculators", "defaults")]
    assert pt.runs("ours,speculators,modelopt", "ours:steps-muon-decay1,speculators:defaults") == [
        ("ours", "steps-muon-decay1"), ("speculators", "defaults")]


def test_the_subset_ours_trains_on_is_a_finished_datagen_folder(tmp_path):
    """drafter-train refuses a datagen folder not finished: the subset of a finished 2-shard folder must be one."""
    from drafter_train.data.store import DatagenStore, load_distill_dataset, unfinished

    records = [{"prompt_index": i, "prompt": f"p{i}", "prompt_ids": [1, 2 + i], "response_ids": [3 + i] * 4,
                "reference_ids": []} for i in range(6)]
    source = DatagenStore.open(str(tmp_path / "data"))
    source.start({"generation": {"store_topk": 0}, "counts": {"train_prompts": 6, "shards_total": 2}}, [])
    source.write_shard(0, records[:3], 0)
    source.write_shard(1, records[3:], 0)
    source.finish()
    pt.subset_store(tmp_path / "data", tmp_path / "subset", [4, 1])
    assert unfinished(tmp_path / "subset") is None
    assert load_distill_dataset(tmp_path / "subset")["prompt"] == ["p4", "p1"]
    assert json.loads((tmp_path / "subset" / "datagen.json").read_text())["counts"]["train_prompts"] == 2
