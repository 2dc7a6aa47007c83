"""The dev and test prompt splits (dev chooses, test only reports), and the overlap check between evaluation prompts
and training data: flagged before drafter-eval and the trainer evaluate, dropped by drafter-datagen's exclude."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from omegaconf import OmegaConf

from drafter_train.config import PROMPTS_DIR
from drafter_train.data.overlap import NGRAM_WORDS, OverlapIndex, find_overlap
from drafter_train.data.prompts import load_prompt_records, load_prompts, split_name
from drafter_train.data.store import load_distill_dataset
from drafter_train.errors import ConfigError
from drafter_train.recipes.datagen import run_datagen
from drafter_train.recipes.evaluate import run_eval_job
from drafter_train.recipes.train import train
from tests.stubs import WORDS, compose_cfg

# ---- the shipped splits --------------------------------------------------------------------------------------------


def test_dev_is_the_former_heldout_mix_and_test_is_public_attributed_and_disjoint():
    dev, old_name = load_prompt_records("dev", 1000), load_prompt_records("heldout-mix", 1000)
    assert dev == old_name and len(dev) == 48 and len({c for _, c in dev}) == 8
    rows = [json.loads(line) for line in (PROMPTS_DIR / "test.jsonl").read_text().splitlines()]
    assert len(rows) >= 80 and len(Counter(r["category"] for r in rows)) >= 8
    assert all(set(r) == {"prompt", "category", "source", "license"} and r["prompt"] for r in rows)
    assert {r["license"] for r in rows} <= {"Apache-2.0", "MIT"}
    assert len({r["prompt"] for r in rows}) == len(rows)
    # the first 16 cover at least 8 categories, so a short run still spans the task mix
    assert len({r["category"] for r in rows[:16]}) >= 8
    assert find_overlap([r["prompt"] for r in rows], [("dev", [t for t, _ in dev], [])]).prompts == []


@pytest.mark.parametrize("path, split", [
    ("dev", "dev"), ("heldout-mix", "dev"), ("prompts/heldout-mix.jsonl", "dev"), ("test", "test"),
    ("test.jsonl", "test"), (str(PROMPTS_DIR / "test.jsonl"), "test"), (None, "builtin"), ("my/own.jsonl", "my/own.jsonl"),
])
def test_results_name_their_split_whatever_name_reached_it(path, split):
    assert split_name(path) == split


# ---- nothing that chooses reads the test split ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [[], ["drafter=layerskip"]])
def test_training_refuses_to_pick_best_on_the_test_split(tmp_path, overrides):
    cfg = OmegaConf.to_object(compose_cfg("train", [*overrides, "eval.prompts=test", f"train.output_root={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"^eval.prompts: drafter-train \(picking best\) chooses, and the test split"):
        train(cfg)
    assert not list(tmp_path.iterdir())  # refused before anything was written or loaded


def test_training_evaluates_on_dev_by_default():
    assert OmegaConf.to_object(compose_cfg("train", [])).eval.prompts == "dev"


def test_calibration_refuses_the_test_split(tmp_path):
    cfg = OmegaConf.to_object(compose_cfg("eval", ["drafter=ngram", "eval.prompts=test", "eval.calibration.enabled=true",
                                                   f"eval.output={tmp_path / 'm.json'}"]))
    with pytest.raises(ConfigError, match=r"^eval.prompts: eval.calibration chooses"):
        run_eval_job(cfg)


# ---- the overlap index ---------------------------------------------------------------------------------------------


def run_of(start: int, length: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + length))


def test_overlap_index_flags_exact_matches_and_long_shared_runs_only():
    long_prompt = f"Please explain this: {run_of(0, 20)}"
    index = OverlapIndex(["What is the capital of Australia?", long_prompt, "A clean prompt about tea."])
    assert index.exact_matches("  what is the CAPITAL of australia ") == {0}  # case, spacing, punctuation
    assert index.exact_matches("What is the capital of Austria?") == set()
    assert index.shared_ngrams(f"an answer quoting {run_of(5, NGRAM_WORDS)} and more") == {1}
    assert index.shared_ngrams(f"an answer quoting {run_of(5, NGRAM_WORDS - 1)} only") == set()  # one word short
    assert index.shared_ngrams("What is the capital of Australia? It is Canberra.") == set()  # short: exact only


def test_find_overlap_counts_each_prompt_once_and_answers_by_ngram_only():
    prompts = ["the same prompt", run_of(0, 15), run_of(100, 15), "nothing shared here"]
    report = find_overlap(prompts, [
        ("a", ["The same prompt!", run_of(0, 15)], ["the same prompt"]),  # an answer equal to a prompt: no n-gram
        ("b", [], [f"x {run_of(101, 13)} y"]),
    ])
    assert report.exact == {0, 1} and report.ngram == {2} and report.prompts == [0, 1, 2]
    assert report.summary().startswith("overlap: 3 of 4 eval prompts overlap the training data (2 exact")
    assert report.record()["count"] == 3 and report.record()["checked"] == ["a", "b"]
    assert find_overlap(prompts[3:], [("a", ["the same prompt"], [run_of(0, 15)])]).prompts == []


# ---- before evaluation: drafter-eval and the trainer ---------------------------------------------------------------


def training_prompt(tiny_data) -> str:
    return load_distill_dataset(tiny_data / "data")[0]["prompt"]


def eval_job(tiny_data, tmp_path, prompts: list[str], *overrides: str, drafter: str = "drafter=ngram"):
    file = tmp_path / "prompts.txt"
    file.write_text("".join(p + "\n" for p in prompts))
    return OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false", drafter, f"eval.prompts={file}",
        f"eval.output={tmp_path / 'metrics.json'}", "eval.max_new_tokens=4", "eval.warmup=0",
        f"eval.num_prompts={len(prompts)}", *overrides,
    ]))


def test_drafter_eval_reports_overlap_with_the_corpus_data_in_one_line(tiny_data, tmp_path, capsys):
    prompts = ["happy day and night", training_prompt(tiny_data)]
    corpus = f"eval.lookup.corpus.path={tiny_data / 'data'}"
    metrics = run_eval_job(eval_job(tiny_data, tmp_path, prompts, corpus))
    assert metrics["overlap"]["count"] == 1 and metrics["overlap"]["exact"] == [1]
    assert metrics["split"] == str(tmp_path / "prompts.txt")
    lines = [line for line in capsys.readouterr().err.splitlines() if "overlap" in line]
    assert len(lines) == 1 and "overlap: 1 of 2 eval prompts" in lines[0] and str(tiny_data / "data") in lines[0]
    with pytest.raises(ConfigError, match=r"^eval.overlap: overlap: 1 of 2 eval prompts"):
        run_eval_job(eval_job(tiny_data, tmp_path, prompts, f"eval.overlap_with=[{tiny_data / 'data'}]",
                              "eval.overlap=refuse"))


def test_drafter_eval_of_clean_prompts_flags_nothing(tiny_data, tmp_path, capsys):
    metrics = run_eval_job(eval_job(tiny_data, tmp_path, ["happy day and night"], "eval.overlap=refuse",
                                    f"eval.overlap_with=[{tiny_data / 'data'}]"))
    assert metrics["overlap"] == {"count": 0, "prompts": [], "exact": [], "ngram_words": NGRAM_WORDS,
                                  "checked": [str(tiny_data / "data")]}
    assert "overlap" not in capsys.readouterr().err


def train_job(tiny_data, tmp_path, *overrides: str):
    return OmegaConf.to_object(compose_cfg("train", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false", "drafter.path=truncated:1",
        f"train.data_dir={tiny_data / 'data'}", f"train.output_root={tmp_path}", "train.max_steps=1",
        "train.batch_size=2", "train.save_every=1", "train.eval_at_start=false", "eval.num_prompts=2",
        "eval.max_new_tokens=4", "eval.warmup=0", *overrides,
    ]))


def test_trainer_checks_its_eval_prompts_against_train_data_dir(tiny_data, tmp_path):
    cfg = train_job(tiny_data, tmp_path / "clean")
    metrics = train(cfg)  # dev: nothing in common with the tiny data
    assert metrics["split"] == "dev" and metrics["overlap"]["count"] == 0
    assert metrics["overlap"]["checked"] == [str(tiny_data / "data")]
    # drafter-eval of the checkpoint finds the data it was trained on in its run folder's config.yaml
    best = tmp_path / "clean" / cfg.train.run_name / "best" / "drafter"
    evaluated = run_eval_job(eval_job(tiny_data, tmp_path, ["happy day and night", training_prompt(tiny_data)],
                                      drafter=f"drafter.path={best}"))
    assert evaluated["overlap"]["checked"] == [str(tiny_data / "data")] and evaluated["overlap"]["exact"] == [1]
    file = tmp_path / "overlapping.txt"
    file.write_text(f"happy day and night\n{training_prompt(tiny_data)}\n")
    with pytest.raises(ConfigError, match=r"^eval.overlap: overlap: 1 of 2 eval prompts"):
        train(train_job(tiny_data, tmp_path / "refused", f"eval.prompts={file}", "eval.overlap=refuse"))


# ---- drafter-datagen's exclude ---------------------------------------------------------------------------------------


def test_datagen_drops_prompts_overlapping_the_excluded_evaluation_files(tiny_data, tmp_path):
    rows = ["the cat sat on the mat", "a big red house", "the dog", " ".join(WORDS), "happy day", "the sun"]
    source, excluded = tmp_path / "source.jsonl", tmp_path / "excluded.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    # an exact match after normalisation, and a 13-word run of the long prompt inside a longer evaluation prompt
    excluded.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                ["A big red HOUSE.", f"tell me: {' '.join(WORDS[2:2 + NGRAM_WORDS])} please"]))
    out = tmp_path / "data"
    cfg = OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false", f"datagen.prompts={source}",
        f"datagen.output_dir={out}", "datagen.num_eval_prompts=1", "datagen.num_prompts=10",
        "datagen.max_new_tokens=2", f"datagen.exclude=[{excluded},dev,test]",
    ]))
    run_datagen(cfg, progress=False)
    kept = [json.loads(line)["prompt"] for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    kept += load_distill_dataset(out)["prompt"]
    assert kept == ["the cat sat on the mat", "the dog", "happy day", "the sun"]
    manifest = json.loads((out / "datagen.json").read_text())
    assert manifest["counts"]["skipped"] == {"empty": 0, "duplicate": 0, "too_long": 0, "excluded": 2}
    assert manifest["prompts"]["exclude"] == [str(excluded), "dev", "test"]
    assert load_prompts("dev", 1)  # the shipped names resolve for exclude as for eval.prompts


def test_datagen_exclude_names_the_option_on_a_missing_file(tiny_data, tmp_path):
    cfg = OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={tiny_data / 'target'}", f"datagen.output_dir={tmp_path / 'd'}",
        f"datagen.exclude=[{tmp_path / 'nope.jsonl'}]",
    ]))
    with pytest.raises(ConfigError, match=r"^datagen.exclude: no such file: .*nope.jsonl$"):
        run_datagen(cfg, progress=False)


def test_a_missing_overlap_folder_is_one_line_naming_the_option(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"^eval.overlap_with: .*nowhere: no such folder$"):
        run_eval_job(eval_job(tiny_data, tmp_path, ["happy day"], f"eval.overlap_with=[{tmp_path / 'nowhere'}]"))
