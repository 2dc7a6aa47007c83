"""drafter.cut_from: a stand-alone AR drafter cut from another model than the target (the family's 0.5B for a 1.5B
target), whole or its first N layers: its weights are that model's, never the target's; a model on another
vocabulary, too few layers, a missing folder, an unknown or uninstalled named model and the option on another
kind or path are one line each, the path checks before any model loads. Tiny models only."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.drafters.ar.config import CUT_FROM_TARGET, ARDrafterConfig
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.errors import ConfigError, ModelNotFoundError, VocabMismatchError
from drafter_train.preflight import check_inputs
from drafter_train.recipes.train import train
from drafter_train.targets import load_causal_lm, load_tokenizer
from tests.test_train import train_cfg


def _build(tiny_data, cut_from: str, layers: int, for_training: bool = False):
    target = load_causal_lm(str(tiny_data / "target"))
    cfg = ARDrafterConfig(kind="ar", path=f"truncated:{layers}", cut_from=cut_from)
    return load_drafter(cfg, target, load_tokenizer(str(tiny_data / "target")), "float32", for_training), target


def test_the_default_cuts_the_target():
    assert ARDrafterConfig().cut_from == CUT_FROM_TARGET == "target"


def test_a_cut_from_another_model_has_its_layers_not_the_targets(tiny_data):
    other = load_causal_lm(str(tiny_data / "other_target")).state_dict()
    drafter, target = _build(tiny_data, str(tiny_data / "other_target"), 2, for_training=True)
    assert drafter.config.num_hidden_layers == 2
    state = drafter.state_dict()
    for key in ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        torch.testing.assert_close(state[key], other[key])
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           target.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert all(p.requires_grad for p in drafter.model.layers.parameters())  # trained, the target untouched
    assert not any(p.requires_grad for p in target.parameters())
    whole, _ = _build(tiny_data, str(tiny_data / "other_target"), 3)  # N = its layer count: the whole model
    assert whole.config.num_hidden_layers == 3
    torch.testing.assert_close(whole.state_dict()["model.layers.2.mlp.up_proj.weight"],
                               other["model.layers.2.mlp.up_proj.weight"])


def test_another_vocabulary_or_too_few_layers_is_one_line(tiny_data):
    with pytest.raises(VocabMismatchError, match="must share the target's vocabulary") as err:
        _build(tiny_data, str(tiny_data / "other_vocab"), 1)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"truncated:N needs 1 <= N < 3 \(drafter.cut_from=.*other_target's layers\)"):
        _build(tiny_data, str(tiny_data / "other_target"), 4)


def test_the_option_on_another_kind_or_path_is_one_line():
    for fields in ({"kind": "ar", "path": "scratch"}, {"kind": "nar", "path": "truncated:1"}):
        with pytest.raises(ConfigError, match="^drafter.cut_from: cuts an AR drafter's truncated:N") as err:
            ARDrafterConfig(cut_from="/models/other", **fields)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="drafter.cut_from: must name a model"):
        ARDrafterConfig(cut_from="")


def test_bad_models_are_refused_before_anything_loads(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTER_TRAIN_CACHE", str(tmp_path / "cache"))
    for value, error, words in [
        (str(tmp_path / "missing"), ModelNotFoundError, "drafter.cut_from: .*missing: no such file or folder"),
        ("embedded:nope", ModelNotFoundError, "drafter.cut_from: embedded:nope: unknown embedded model"),
        ("qwen2.5-coder-0.5b", ModelNotFoundError,
         "drafter.cut_from: target qwen2.5-coder-0.5b is not installed .* scripts/setup_targets.sh"),
    ]:
        cfg = train_cfg(tiny_data, tmp_path / "runs", "drafter=ar", "drafter.path=truncated:1",
                        f"drafter.cut_from={value}")
        with pytest.raises(error, match=words) as err:
            check_inputs(cfg)
        assert "\n" not in str(err.value)
    (tmp_path / "text.gguf").write_text("no")
    with pytest.raises(ConfigError, match="drafter.cut_from: .*text.gguf: not a GGUF file"):
        check_inputs(train_cfg(tiny_data, tmp_path / "runs", "drafter=ar", "drafter.path=truncated:1",
                               f"drafter.cut_from={tmp_path / 'text.gguf'}"))


def test_a_drafter_cut_from_another_model_trains_and_saves(tiny_data, tmp_path):
    cfg = train_cfg(tiny_data, tmp_path / "runs", "drafter=ar", "drafter.path=truncated:2",
                    f"drafter.cut_from={tiny_data / 'other_target'}", "train.run_name=cut")
    train(cfg)
    saved = load_causal_lm(str(tmp_path / "runs" / "cut" / "latest" / "drafter"))
    assert saved.config.num_hidden_layers == 2
    config = OmegaConf.load(tmp_path / "runs" / "cut" / "config.yaml")
    assert config.drafter.cut_from == str(tiny_data / "other_target")
