"""Bad input is refused in one line before anything heavy loads: paths before the target, and decoder features the
target cannot support (sliding-window KV caches) before any decoding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import BartConfig, Gemma2Config, Gemma2ForCausalLM, T5Config

import drafter_train.recipes.datagen as datagen_recipe
import drafter_train.recipes.evaluate as evaluate_recipe
import drafter_train.recipes.train as train_recipe
from drafter_train.config import EvalConfig, ExportConfig, TreeConfig
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.evaluation import check_decoder
from drafter_train.preflight import check_inputs
from drafter_train.recipes.export import export
from drafter_train.targets import has_sliding_window
from tests.stubs import VOCAB, compose_cfg, run_cli, save_tiny, word_tokenizer
from tests.test_gguf_file import write_gguf


def _never_loads(*args, **kwargs):
    raise AssertionError("the target was loaded before the bad path was reported")


@pytest.mark.parametrize("entry, overrides, error, words", [
    ("eval", ["drafter=path", "drafter.path=/no/such/drafter"], ModelNotFoundError, "drafter.path: /no/such/drafter"),
    ("eval", ["target=local", "target.path=/no/such/target"], ModelNotFoundError, "target.path: /no/such/target"),
    ("eval", ["drafter=ngram", "eval.prompts=/no/such/prompts.jsonl"], ConfigError, "eval.prompts: no such file"),
    ("eval", ["drafter=ngram", "eval.lookup.corpus.path=/no/such/data"], ConfigError, "eval.lookup.corpus.path"),
    ("train", ["train.data_dir=/no/such/data"], ConfigError, "train.data_dir: /no/such/data: no such folder"),
])
def test_bad_paths_fail_before_the_target_loads(monkeypatch, tmp_path, entry, overrides, error, words):
    monkeypatch.setattr(evaluate_recipe, "load_target", _never_loads)
    monkeypatch.setattr(train_recipe, "load_target", _never_loads)
    cfg = OmegaConf.to_object(compose_cfg(entry, [*overrides, f"eval.output={tmp_path / 'm.json'}"]
                                          if entry == "eval" else [*overrides, f"train.output_root={tmp_path}"]))
    run = evaluate_recipe.run_eval_job if entry == "eval" else train_recipe.train
    with pytest.raises(error) as err:
        run(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def tiny_gemma2(sliding: bool) -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    types = ["sliding_attention", "full_attention"] if sliding else ["full_attention"] * 2
    config = Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          layer_types=types)
    return Gemma2ForCausalLM(config).eval()


def test_trees_on_a_sliding_window_target_are_refused_in_one_line():
    sliding, full = tiny_gemma2(True), tiny_gemma2(False)
    assert has_sliding_window(sliding.config) and not has_sliding_window(full.config)
    tree = EvalConfig(tree=TreeConfig(top_k=2, depth=1, total_tokens=2), draft_len=2)
    with pytest.raises(ConfigError, match=r"^eval\.tree \(draft trees\) needs a full KV cache.*gemma2"):
        check_decoder(sliding, tree)
    check_decoder(full, tree)  # a full cache: trees are fine
    check_decoder(sliding, EvalConfig())  # the refusal is specific to trees (chains keep their own checks)


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_before_the_target_loads(monkeypatch, tmp_path):
    """transformers loads a Qwen2 folder's tokenizer as Qwen2Tokenizer whatever class the folder declares; on the
    word tokenizer it adds <|endoftext|> (id 23) as pad, one past a 23-row embedding: datagen padded with it and
    failed as an IndexError in the embedding mid-generate. Now one line before the weights load; the same folder
    with one more embedding row passes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from drafter_train.model_paths import check_tokenizer_fits

    def qwen2(folder, vocab):
        save_tiny(Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
                  folder)
        return str(folder)

    short = qwen2(tmp_path / "short", VOCAB)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the cat"}\n' * 4)
    monkeypatch.setattr(datagen_recipe, "load_target", _never_loads)
    cfg = OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={short}", "target.chat_template=false", f"datagen.prompts={tmp_path / 'prompts.jsonl'}",
        "datagen.num_prompts=2", "datagen.num_eval_prompts=1", f"datagen.output_dir={tmp_path / 'data'}"]))
    with pytest.raises(ConfigError) as err:
        datagen_recipe.run_datagen(cfg, progress=False)
    message = str(err.value)
    assert "\n" not in message and f"<|endoftext|> = {VOCAB}" in message and f"vocab_size is {VOCAB}" in message
    check_tokenizer_fits(qwen2(tmp_path / "fits", VOCAB + 1))


# ---------------------------------------------------------------------------------------------------------------
# Model files that cannot load: a cut GGUF, an encoder-decoder


def seq2seq_folder(folder: Path, family: str = "t5") -> str:
    """A tiny encoder-decoder model folder (config and tokenizer: the refusal comes before any weights are read)."""
    config = (T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2) if family == "t5"
              else BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                              decoder_ffn_dim=32, max_position_embeddings=64))
    config.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return str(folder)


def _job(entry: str, overrides: list[str], tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the cat"}\n' * 4)
    extra = {"eval": [f"eval.output={tmp_path / 'm.json'}"],
             "train": [f"train.output_root={tmp_path / 'runs'}", f"train.data_dir={tmp_path}"],
             "datagen": ["target.chat_template=false", f"datagen.prompts={prompts}", "datagen.num_prompts=2",
                         "datagen.num_eval_prompts=1", f"datagen.output_dir={tmp_path / 'data'}"]}[entry]
    cfg = OmegaConf.to_object(compose_cfg(entry, ["target=local", *overrides, *extra]))
    run = {"eval": evaluate_recipe.run_eval_job, "train": train_recipe.train,
           "datagen": lambda c: datagen_recipe.run_datagen(c, progress=False)}[entry]
    return run, cfg


@pytest.mark.parametrize("entry, option, family", [
    ("eval", "target.path", "t5"), ("eval", "drafter.path", "bart"), ("train", "target.path", "bart"),
    ("train", "drafter.path", "t5"), ("datagen", "target.path", "t5"),
])
def test_an_encoder_decoder_is_refused_before_anything_loads(monkeypatch, tmp_path, make_tiny_llama, entry, option,
                                                             family):
    for recipe in (evaluate_recipe, train_recipe, datagen_recipe):
        monkeypatch.setattr(recipe, "load_target", _never_loads)
    seq2seq = seq2seq_folder(tmp_path / family, family)
    llama = tmp_path / "llama"
    save_tiny(make_tiny_llama(vocab_size=VOCAB, num_layers=2), llama)
    paths = {"target.path": seq2seq, "drafter.path": str(llama)} if option == "target.path" else \
        {"target.path": str(llama), "drafter.path": seq2seq}
    overrides = [f"target.path={paths['target.path']}"]
    if entry != "datagen":
        overrides += ["drafter=path", f"drafter.path={paths['drafter.path']}"]
    run, cfg = _job(entry, overrides, tmp_path)
    with pytest.raises(ConfigError) as err:
        run(cfg)
    message = str(err.value)
    assert message.startswith(f"{option}: {seq2seq}: this {family} model is an encoder-decoder")
    assert "go through drafter-seq2seq" in message and "\n" not in message


@pytest.mark.parametrize("part", ["drafter", "target"])
def test_drafter_export_refuses_an_encoder_decoder_run(tmp_path, make_tiny_llama, part):
    """A step folder whose drafter, or whose run's target, is an encoder-decoder: drafter-seq2seq's export."""
    seq2seq = seq2seq_folder(tmp_path / "t5")
    step = tmp_path / "run" / "step-1"
    if part == "drafter":
        shutil.copytree(seq2seq, step / "drafter")
    else:
        save_tiny(make_tiny_llama(vocab_size=VOCAB, num_layers=2), step / "drafter")
        (step.parent / "config.yaml").write_text(f"target:\n  path: {seq2seq}\n")
    (step / "metrics.json").write_text(json.dumps({"draft_len": 4}))
    with pytest.raises(ConfigError) as err:
        export(ExportConfig(checkpoint=str(step), output_dir=str(tmp_path / "out")))
    field = "export.checkpoint" if part == "drafter" else "the run's target.path"
    assert str(err.value).startswith(f"{field}: ") and "drafter-seq2seq" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry, option", [("eval", "target.path"), ("eval", "drafter.path"),
                                           ("train", "target.path"), ("datagen", "target.path")])
def test_a_cut_gguf_is_refused_before_anything_loads(monkeypatch, tmp_path, make_tiny_llama, entry, option):
    for recipe in (evaluate_recipe, train_recipe, datagen_recipe):
        monkeypatch.setattr(recipe, "load_target", _never_loads)
    intact = write_gguf(tmp_path / "model.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(intact.read_bytes()[:intact.stat().st_size // 2])  # inside the tensor data
    llama = tmp_path / "llama"
    save_tiny(make_tiny_llama(vocab_size=VOCAB, num_layers=2), llama)
    target = cut if option == "target.path" else llama
    overrides = [f"target.path={target}"] + (["drafter=path", f"drafter.path={cut}"] if option == "drafter.path"
                                             else [])
    run, cfg = _job(entry, overrides, tmp_path)
    with pytest.raises(ConfigError) as err:
        run(cfg)
    assert str(err.value).startswith(f"{option}: {cut}: cut short inside its tensor data")
    assert "\n" not in str(err.value)


def test_a_folder_with_a_cut_gguf_file_named_by_gguf_file_is_refused(tmp_path):
    intact = write_gguf(tmp_path / "model.gguf")
    (tmp_path / "cut.gguf").write_bytes(intact.read_bytes()[:1000])  # inside the header
    cfg = OmegaConf.to_object(compose_cfg("eval", ["target=local", f"target.path={tmp_path}",
                                                   "target.gguf_file=cut.gguf", "drafter=ngram"]))
    with pytest.raises(ConfigError, match=r"^target\.path: .*cut\.gguf: cut short inside its header"):
        check_inputs(cfg)


@pytest.mark.parametrize("bad", ["cut_gguf", "t5"])
def test_drafter_eval_on_the_command_line_exits_2_with_one_line(tmp_path, bad):
    """The issue's two tracebacks, through the console script: `head -c`-style cut GGUF and a T5 folder as target."""
    if bad == "cut_gguf":
        intact = write_gguf(tmp_path / "model.gguf")
        target = tmp_path / "cut.gguf"
        target.write_bytes(intact.read_bytes()[:30000])  # what `head -c 30000 model.gguf > cut.gguf` leaves
    else:
        target = seq2seq_folder(tmp_path / "t5")
    done = run_cli("drafter-eval", "target=local", f"target.path={target}",
                   "drafter.path=truncated:1", cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    words = "cut short inside its tensor data" if bad == "cut_gguf" else "go through drafter-seq2seq"
    assert lines[0].startswith(f"drafter-eval: error: target.path: {target}: ") and words in lines[0]


# Each console script with a bad input: its one line. The six run in one interpreter, one command line after another
# (as Hydra allows), which then reports which heavy libraries any of them imported.
CONSOLE_REFUSALS = {
    "train_main": (["train.batch_size=0"], "drafter-train: error: train.batch_size: must be >= 1, got 0"),
    "eval_main": (["target.path=/no/such/target"], "drafter-eval: error: target.path: /no/such/target: no such file or folder"),
    "datagen_main": (["datagen.prompts=/no/such/prompts.jsonl"], "drafter-datagen: error: datagen.prompts: no such file: "
                                                                 "/no/such/prompts.jsonl"),
    "export_main": (["export.run_dir=/no/such/run", "export.output_dir=out"],
                    "drafter-export: error: export.run_dir: /no/such/run: no such folder"),
    "report_main": (["report.input=/no/such/runs"], "drafter-report: error: report.input: /no/such/runs: no such folder"),
    "seq2seq_main": (["target.path=/no/such/t5", "data.path=/no/such/pairs"],
                     "drafter-seq2seq: error: target.path: /no/such/t5 is not a model folder (no config.json)"),
}
HEAVY = ("torch", "transformers", "datasets", "accelerate", "deepspeed")
REFUSE_ALL = f"""
import json, sys
from drafter_train.recipes import cli
for function, (args, _) in {CONSOLE_REFUSALS!r}.items():
    sys.argv = [function, *args]
    try:
        getattr(cli, function)()
    except SystemExit as done:
        print(json.dumps([function, done.code]))
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))))
"""


def test_console_scripts_refuse_bad_input_in_one_line_before_torch_loads(tmp_path):
    """recipes/cli.py: a field's check or a missing path is one line, exit 2, and torch, transformers, datasets,
    accelerate and deepspeed were never imported (the recipes import them; the checks come first)."""
    done = subprocess.run([sys.executable, "-c", REFUSE_ALL], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = done.stdout.strip().splitlines()
    assert [json.loads(line) for line in lines[:-1]] == [[name, 2] for name in CONSOLE_REFUSALS], done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [error for _, error in CONSOLE_REFUSALS.values()]
    assert json.loads(lines[-1]) == []  # none of HEAVY
