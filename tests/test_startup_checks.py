"""Bad input is refused in one line before anything heavy loads: paths before the target, and decoder features the
target cannot support (sliding-window KV caches) before any decoding."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Gemma2Config, Gemma2ForCausalLM

import drafter_train.recipes.evaluate as evaluate_recipe
import drafter_train.recipes.train as train_recipe
from drafter_train.config import EvalConfig, TreeConfig
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.evaluation import check_decoder
from drafter_train.targets import has_sliding_window
from tests.stubs import compose_cfg


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
    import drafter_train.recipes.datagen as datagen_recipe
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from drafter_train.targets import check_tokenizer_fits
    from tests.stubs import VOCAB, save_tiny

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
