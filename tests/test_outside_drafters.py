"""EAGLE-3 folders other tools write, loaded by drafter=path (drafters/eagle3/outside.py): speculators' layout and
ModelOpt's, written here by hand as those tools write them (speculators 0.9.0's Eagle3DraftModel.save_pretrained,
ModelOpt 0.47.0's EagleExporter), from a drafter of ours; loaded, they compute what it computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
from drafter_train.drafters.eagle3.modeling import Eagle3Model
from drafter_train.errors import ConfigError
from drafter_train.preflight import check_outside_drafter
from tests.test_eagle3 import random_eagle3
from tests.stubs import word_tokenizer

LAYERS = [0, 1, 3]  # ours: outputs of these target layers


def _weights(model: Eagle3Model, drop=()) -> dict:
    return {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop}


def _layer_config(model: Eagle3Model) -> dict:
    layer = model.config.layer_config().to_dict()
    return {k: v for k, v in layer.items() if k not in ("architectures", "transformers_version", "dtype")}


def speculators_folder(model: Eagle3Model, out: Path, full_vocab: bool = False, **flags) -> Path:
    """speculators 0.9.0's save_pretrained layout: ids name layer inputs (ours + 1), embed_tokens saved."""
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "dtype": "float32",
        "draft_vocab_size": model.lm_head.out_features, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in model.config.target_layers],
        "embed_requires_grad": False, "fc_norm": bool(model.config.fc_norm),
        "norm_before_fc": bool(model.config.norm_before_fc), "norm_before_residual": False,
        "norm_output": bool(model.config.norm_output),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                     "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None}},
        "tie_word_embeddings": False, "transformer_layer_config": _layer_config(model), **flags,
    }
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(_weights(model, ("d2t", "t2d") if full_vocab else ()), str(out / "model.safetensors"))
    return out


def modelopt_folder(model: Eagle3Model, out: Path, rope_scaling=None, **eagle) -> Path:
    """ModelOpt 0.47.0's EagleExporter layout: a flat Llama config (llama_eagle_template_config), ids of the layer
    OUTPUTS it hooked (ours, unchanged), no embeddings, no t2d, d2t only for a reduced vocabulary."""
    layer = _layer_config(model)
    config = {k: layer.get(k) for k in ("bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
                                        "initializer_range", "intermediate_size", "max_position_embeddings",
                                        "num_attention_heads", "num_key_value_heads", "pad_token_id", "rms_norm_eps",
                                        "vocab_size", "attention_bias", "head_dim", "mlp_bias", "pretraining_tp")}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, torch_dtype="float32", use_cache=True, attention_dropout=0.0,
                  draft_vocab_size=model.lm_head.out_features, rope_scaling=rope_scaling,
                  rope_theta=layer["rope_parameters"]["rope_theta"],
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(model.config.target_layers),
                                "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                                "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                                "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1, **eagle})
    full = model.lm_head.out_features == model.embed_tokens.num_embeddings
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(_weights(model, ("embed_tokens.weight", "t2d") + (("d2t",) if full else ())),
              str(out / "model.safetensors"))
    return out


def step_logits(model: Eagle3Model, target, seed: int = 0) -> list[torch.Tensor]:
    """Two training-time-test steps of `model` over random tokens and the target's features: [B, R, Vd] each."""
    from drafter_train.features import FeatureTap

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (2, 12), generator=gen)
    with torch.no_grad(), FeatureTap(target, model.config.target_layers) as tap:
        target.get_decoder()(input_ids=ids)
        features = tap.features
    with torch.no_grad():
        return model(ids, features, torch.ones_like(ids), torch.arange(4, 12).expand(2, -1), 2)


def loaded(folder: Path, target):
    return load_drafter(Eagle3DrafterConfig(path=str(folder), kind="auto"), target, word_tokenizer(), "float32")


@pytest.fixture
def target(make_tiny_llama):
    return make_tiny_llama(num_layers=4)


@pytest.mark.parametrize("norms", ["fc_norm", "norm_before_fc", "none", "norm_output"])
@pytest.mark.parametrize("vocab", ["reduced", "full"])
def test_a_speculators_folder_computes_what_its_drafter_computes(target, tmp_path, norms, vocab):
    draft_ids = torch.arange(3, 63, 3) if vocab == "reduced" else None
    original = random_eagle3(target, LAYERS, draft_ids, fc_norm=norms == "fc_norm",
                             norm_before_fc=norms in ("norm_before_fc", "norm_output"))
    original.config.norm_output = norms == "norm_output"  # speculators' default (EAGLE 3.1)
    model = loaded(speculators_folder(original, tmp_path / "spec", full_vocab=vocab == "full"), target)
    assert type(model) is Eagle3Model and model.config.target_layers == LAYERS
    assert torch.equal(model.d2t, original.d2t) and torch.equal(model.t2d, original.t2d)
    assert model.config.norm_output == original.config.norm_output
    for ours, theirs in zip(step_logits(original, target), step_logits(model, target)):
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", ["reduced", "full"])
def test_a_modelopt_folder_keeps_its_output_layer_ids_and_gets_the_targets_embeddings(target, tmp_path, vocab):
    draft_ids = torch.arange(3, 63, 3) if vocab == "reduced" else None
    original = random_eagle3(target, LAYERS, draft_ids, fc_norm=False)
    model = loaded(modelopt_folder(original, tmp_path / "mo"), target)
    assert model.config.target_layers == LAYERS  # ModelOpt hooked the outputs: no shift
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(model.t2d, original.t2d)  # rebuilt from d2t (or the identity)
    for ours, theirs in zip(step_logits(original, target), step_logits(model, target)):
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_modelopts_injected_yarn_is_run_as_the_folder_says(target, tmp_path):
    """ModelOpt writes YaRN rope scaling into a drafter trained without it; the loaded drafter runs the folder's
    rope (as vLLM does), so its drafts differ from the trained drafter's."""
    original = random_eagle3(target, LAYERS, fc_norm=False)
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}
    model = loaded(modelopt_folder(original, tmp_path / "mo", rope_scaling=yarn), target)
    assert model.config.layer_config().rope_parameters["rope_type"] == "yarn"
    assert not torch.allclose(step_logits(model, target)[1], step_logits(original, target)[1], atol=1e-3)


@pytest.mark.parametrize("change, words", [
    (dict(norm_before_residual=True), "norm_before_residual=true"),
    (dict(eagle_aux_hidden_state_layer_ids=None), "no eagle_aux_hidden_state_layer_ids"),
    (dict(eagle_aux_hidden_state_layer_ids=[0, 2, 4]), "reads the target's embeddings"),
    (dict(speculators_model_type="dflash"), "a speculators 'dflash' drafter"),
    (dict(transformer_layer_config={"model_type": "qwen3"}), "only llama layers map"),
])
def test_what_cannot_map_is_refused_in_one_line_before_the_target_loads(target, tmp_path, change, words):
    folder = speculators_folder(random_eagle3(target, LAYERS), tmp_path / "spec", **change)
    with pytest.raises(ConfigError, match=words) as err:
        check_outside_drafter(str(folder))
    assert "\n" not in str(err.value)


def test_modelopt_layouts_that_cannot_map_are_refused(target, tmp_path):
    original = random_eagle3(target, LAYERS, fc_norm=False)
    with pytest.raises(ConfigError, match="parallel drafting heads"):
        check_outside_drafter(str(modelopt_folder(original, tmp_path / "a", parallel_draft_step=3)))
    with pytest.raises(ConfigError, match="use_last_layernorm=false"):
        check_outside_drafter(str(modelopt_folder(original, tmp_path / "b", use_last_layernorm=False)))
    check_outside_drafter(str(modelopt_folder(original, tmp_path / "c")))  # a good one passes


def test_our_own_vllm_export_loads_back_as_the_drafter_it_came_from(target, tmp_path):
    """export.format=vllm writes the speculators layout: the round trip is exact (embeddings from the target)."""
    from drafter_train.drafters.eagle3.export import write_speculators

    original = random_eagle3(target, LAYERS, torch.arange(3, 63, 3), fc_norm=True)
    original.save_pretrained(tmp_path / "ours")
    write_speculators(tmp_path / "ours", tmp_path / "vllm", 4, "org/target", keep_embeddings=False)
    model = loaded(tmp_path / "vllm", target)
    for ours, theirs in zip(step_logits(original, target), step_logits(model, target)):
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
