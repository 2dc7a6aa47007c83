"""datagen.multi_turn end to end on a tiny ChatML target built in-process: every assistant turn is the target's
own greedy answer to the conversation so far (user turns as the source has them), the stored mask learns exactly
those turns' tokens and their end token, long conversations are cut by the stated rule and counted, bad records are
counted, a run killed mid-conversation resumes to the same data, the vLLM worker (fake engine) gives the HF
backend's data, and every trainable kind trains on the masked positions through drafter-train."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_train.config import DatagenConfig
from drafter_train.data import regenerate
from drafter_train.data.chat import normalize
from drafter_train.data.conversations import open_conversations
from drafter_train.data.store import load_distill_dataset
from drafter_train.errors import ConfigError
from drafter_train.recipes.datagen import run_datagen
from drafter_train.recipes.train import train
from drafter_train.targets import load_target
from tests.chat_templates import family_tokenizer
from tests.conftest import tiny_llama
from tests.test_vllm_backend import cpu_kv_cache, needs_vllm, vllm_python  # noqa: F401  (a fixture)
from tests.stubs import WORDS, compose_cfg

FAKE_VLLM = Path(__file__).with_name("fake_vllm")
NEW_TOKENS, MAX_PROMPT = 6, 70


def line(i: int, n: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))


def conversation(i: int, turns: int, style: str) -> dict:
    pairs = [(line(i + t, 3 + (i + t) % 4), line(i * 3 + t, 4)) for t in range(turns)]
    if style == "sharegpt":
        return {"conversations": [turn for u, a in pairs for turn in ({"from": "human", "value": u},
                                                                        {"from": "gpt", "value": a})]}
    return {"messages": [turn for u, a in pairs for turn in ({"role": "user", "content": u},
                                                             {"role": "assistant", "content": a})]}


LONG = conversation(13, 6, "openai")  # six turns: the later ones cannot fit in max_prompt_tokens
RECORDS = [conversation(i, 1 + i % 3, ("sharegpt", "openai")[i % 2]) for i in range(12)]
RECORDS.insert(2, LONG)  # the first training conversation (two eval ones come first)
RECORDS.insert(4, {"messages": [{"role": "user", "content": "the cat"}, {"role": "tool", "content": "{}"}]})
RECORDS.insert(7, {"conversations": [{"from": "human", "value": "a dog"}]})
DECODE = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    tokenizer = family_tokenizer("smollm2", WORDS)
    model = tiny_llama(vocab_size=len(tokenizer), num_layers=3)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    with torch.no_grad():  # so that some turns end on EOS and others are cut at max_new_tokens
        model.lm_head.weight[eos] *= 2.5
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root


def datagen_job(root: Path, out: Path, *overrides: str):
    return OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=true", f"datagen.prompts={root / 'chats.jsonl'}",
        "datagen.multi_turn=true", f"datagen.output_dir={out}", "datagen.num_eval_prompts=2",
        "datagen.num_prompts=10", f"datagen.max_prompt_tokens={MAX_PROMPT}", f"datagen.max_new_tokens={NEW_TOKENS}",
        "datagen.batch_size=3", "datagen.shard_size=4", *overrides]))


def target_config(root: Path):
    return OmegaConf.to_object(compose_cfg("datagen", [f"target.path={root / 'target'}"])).target


@pytest.fixture(scope="module")
def greedy_data(folders):
    return run_datagen(datagen_job(folders, folders / "greedy"), progress=False)


def test_every_turn_is_the_targets_own_answer_and_only_the_answers_are_learned(folders, greedy_data):
    model, tokenizer = load_target(target_config(folders))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    data = load_distill_dataset(greedy_data)
    turns = sum(m["role"] == "assistant" for r in data["conversation"] for m in json.loads(r))
    assert len(data) == 10 and 0 < sum(data["cut_turns"]) < turns  # some turns stop on EOS, some are cut
    for record in data:
        messages = json.loads(record["conversation"])
        learned = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            assert len(prompt_ids) <= MAX_PROMPT
            answer = generate_autoregressive_ids(model, prompt_ids, eos)
            assert message["content"] == tokenizer.decode(answer[:-1] if answer[-1] == eos else answer, **DECODE)
            stopped = [eos] if answer[-1] == eos else []  # a turn cut at max_new_tokens learns no end token
            learned += tokenizer(message["content"], add_special_tokens=False).input_ids + stopped
        masked = [t for t, m in zip(record["response_ids"], record["response_mask"]) if m]
        assert masked == learned  # each answer and its <|im_end|>: no header, no user turn, no newline
        assert record["prompt_ids"] + record["response_ids"] == tokenizer(
            tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids


def generate_autoregressive_ids(model, prompt_ids, eos) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])  # explicit mask: <unk> (id 0) is in the prompts, not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_long_and_bad_records_are_counted_never_silent(folders, greedy_data):
    manifest = json.loads((greedy_data / "datagen.json").read_text())
    assert manifest["counts"]["skipped"]["unknown_role"] == 1 and manifest["counts"]["skipped"]["no_assistant"] == 1
    data = load_distill_dataset(greedy_data)
    long = data[0]
    assert long["prompt"] == LONG["messages"][0]["content"]
    kept = json.loads(long["conversation"])
    assert len(kept) < len(LONG["messages"]) and long["dropped_turns"] == (len(LONG["messages"]) - len(kept)) // 2
    assert sum(s["dropped_turns"] for s in manifest["shards"]) == sum(data["dropped_turns"]) > 0
    assert sum(s["truncated_conversations"] for s in manifest["shards"]) == sum(n > 0 for n in data["dropped_turns"])
    assert manifest["prompts"]["multi_turn"] is True and manifest["prompts"]["thinking"] == "keep"


def test_reference_only_data_keeps_the_sources_answers(folders, tmp_path, capsys):
    out = run_datagen(datagen_job(folders, tmp_path / "ref", "datagen.generate=false"), progress=True)
    assert "1 conversations cut short by datagen.max_prompt_tokens (" in capsys.readouterr().err
    data = load_distill_dataset(out)
    assert all(r == [] for r in data["response_ids"])
    first = data[0]
    kept = json.loads(first["conversation"])
    answers = [m["content"] for m in kept if m["role"] == "assistant"]
    _, tokenizer = load_target(target_config(folders))
    learned = [t for t, m in zip(first["reference_ids"], first["reference_mask"]) if m]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert learned == [t for a in answers for t in tokenizer(a, add_special_tokens=False).input_ids + [eos]]


def test_a_run_killed_mid_conversation_resumes_to_the_same_data(folders, tmp_path, monkeypatch):
    sampled = ("datagen.temperature=1.0", "datagen.seed=3")
    real_append = regenerate._append
    calls = []

    def killed_in_second_round(path, entry):
        calls.append(entry["round"])
        if len(calls) == 2:
            raise RuntimeError("killed")
        real_append(path, entry)

    monkeypatch.setattr(regenerate, "_append", killed_in_second_round)
    with pytest.raises(RuntimeError, match="killed"):
        run_datagen(datagen_job(folders, tmp_path / "resumed", *sampled), progress=False)
    monkeypatch.undo()
    progress = tmp_path / "resumed" / "shards" / ".shard-00000.turns.jsonl"
    assert [json.loads(x)["round"] for x in progress.read_text().splitlines()] == [0]  # mid-conversation
    asked = {"resumed": [], "straight": []}
    real_generate = regenerate._generate
    for run in ("resumed", "straight"):
        monkeypatch.setattr(regenerate, "_generate",
                            lambda b, asks, f, run=run: asked[run].append(len(asks)) or real_generate(b, asks, f))
        run_datagen(datagen_job(folders, tmp_path / run, *sampled), progress=False)
    monkeypatch.undo()
    assert load_distill_dataset(tmp_path / "resumed").to_list() == load_distill_dataset(tmp_path / "straight").to_list()
    assert not progress.exists()
    assert sum(asked["resumed"]) < sum(asked["straight"])  # the saved round was replayed, not asked again


def test_the_vllm_worker_gives_the_hf_backends_data(folders, greedy_data, tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE_VLLM}" exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    out = run_datagen(datagen_job(folders, tmp_path / "vllm", "datagen.backend=vllm", f"datagen.vllm_python={fake}"),
                      progress=False)
    columns = ("prompt_ids", "response_ids", "response_mask", "conversation")
    assert load_distill_dataset(out).select_columns(columns).to_list() == \
        load_distill_dataset(greedy_data).select_columns(columns).to_list()


def test_conversation_files_and_datasets_folders_read_alike(tmp_path):
    rows = [conversation(i, 2, "openai") for i in range(4)]  # (mixed styles in one file: the e2e data above)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    for name in ("c.jsonl", "c.json", "c.parquet", "folder", "dict"):
        records = open_conversations(DatagenConfig(prompts=str(tmp_path / name), multi_turn=True))
        assert [normalize(r) for r in records] == [normalize(r) for r in rows], name
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="^datagen.prompts: .* not a `datasets` save_to_disk folder"):
        open_conversations(DatagenConfig(prompts=str(tmp_path / "empty"), multi_turn=True))


def test_refusals_name_the_field(folders, tmp_path):
    with pytest.raises(ConfigError, match="^datagen.multi_turn: needs target.chat_template=true"):
        datagen_job(folders, tmp_path / "x", "target.chat_template=false")
    with pytest.raises(ConfigError, match="^datagen.store_topk: not with datagen.multi_turn"):
        datagen_job(folders, tmp_path / "x", "datagen.store_topk=4")
    with pytest.raises(ConfigError, match="^datagen.thinking: must be one of"):
        datagen_job(folders, tmp_path / "x", "datagen.thinking=maybe")


KINDS = {
    "ar": ["drafter.path=truncated:1"],
    "nar": ["drafter=nar", "drafter.path=truncated:1", "drafter.blocks_per_sequence=2"],
    "eagle3": ["drafter=eagle3", "drafter.draft_vocab_size=0", "drafter.ttt_steps=2", "drafter.features=offline"],
    "dflash": ["drafter=dflash", "drafter.draft_vocab_size=0", "drafter.draft_len=3", "drafter.block_size=4",
               "drafter.blocks_per_sequence=2"],
    "layerskip": ["drafter=layerskip", "drafter.draft_len=2", "drafter.search_trials=3", "drafter.search_confirm=1"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_trains_on_multi_turn_data(folders, greedy_data, tmp_path, kind):
    cfg = OmegaConf.to_object(compose_cfg("train", [
        f"target.path={folders / 'target'}", "target.chat_template=true", f"train.data_dir={greedy_data}",
        f"train.output_root={tmp_path}", "train.run_name=run", "train.max_steps=4", "train.batch_size=2",
        "train.save_every=4", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=0", "eval.num_prompts=1",
        "eval.max_new_tokens=4", "eval.warmup=0", *KINDS[kind]]))
    metrics = train(cfg)
    assert metrics["tau"] >= 1.0
    if kind == "layerskip":
        return
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    if kind == "eagle3":  # the feature cache holds the target's hidden states at the learned positions only
        data = load_distill_dataset(greedy_data)
        (manifest,) = (greedy_data / "features").glob("*/features.json")
        hidden = json.loads(manifest.read_text())["hidden_size"]
        shards = sorted((manifest.parent / "shards").glob("shard-*"))
        cached = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in shards])
        assert len(cached) == len(data)
        for row, record in zip(cached, data):
            assert len(row["target_hidden"]) // 2 // hidden == sum(record["response_mask"])


def test_the_sources_whole_conversations_train_eagle3_online_on_their_masks(folders, tmp_path):
    """The long run's data (datagen.generate=false, multi_turn: every assistant turn as the source has it) trains an
    EAGLE-3 head with features made online (train.response=reference): one pass over the records learns exactly the
    tokens their masks select, no user turn and no padding."""
    data = run_datagen(datagen_job(folders, tmp_path / "ref", "datagen.generate=false"), progress=False)
    records = load_distill_dataset(data)
    cfg = OmegaConf.to_object(compose_cfg("train", [
        f"target.path={folders / 'target'}", "target.chat_template=true", f"train.data_dir={data}",
        f"train.output_root={tmp_path}", "train.run_name=run", "train.response=reference", "drafter=eagle3",
        "drafter.features=online", "drafter.draft_vocab_size=0", f"train.max_steps={len(records) // 2}",
        "train.batch_size=2", f"train.save_every={len(records) // 2}", "train.log_every=1", "train.eval_at_start=false",
        "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.warmup=0"]))
    assert len(records) % 2 == 0
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = [r["train/tokens_seen"] for r in rows if "train/tokens_seen" in r]
    assert seen[-1] == sum(sum(mask) for mask in records["reference_mask"]) > 0


@pytest.mark.slow
@needs_vllm
def test_real_vllm_regenerates_conversations_as_the_hf_backend_does(tmp_path, cpu_kv_cache):
    """Opt-in: where scripts/setup_vllm.sh built the environment. Real vLLM regenerates every assistant turn, round
    by round, to the HF backend's data (greedy). The target has heads of 32, which vLLM's CPU attention needs."""
    tokenizer = family_tokenizer("smollm2", WORDS)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=1, pad_token_id=0,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # some turns end on EOS, others are cut at max_new_tokens
        model.lm_head.weight[config.eos_token_id] *= 2.5
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    hf = run_datagen(datagen_job(tmp_path, tmp_path / "hf"), progress=False)
    real = run_datagen(datagen_job(tmp_path, tmp_path / "vllm", "datagen.backend=vllm",
                                   f"datagen.vllm_python={vllm_python()}", "datagen.vllm.enforce_eager=true"),
                       progress=False)
    columns = ("prompt_ids", "response_ids", "response_mask", "conversation")
    assert load_distill_dataset(real).select_columns(columns).to_list() == \
        load_distill_dataset(hf).select_columns(columns).to_list()
    assert json.loads((real / "datagen.json").read_text())["run"]["vllm"]["version"] != "unknown"
