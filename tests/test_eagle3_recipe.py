"""EAGLE-3 recipe options (issue 71): feature noise, initialisation from the target, capacity; each against what it
must change and what it must leave alone."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.data.batches import collate
from drafter_train.drafters.common.conditioned import target_signals
from drafter_train.errors import ConfigError
from tests.stubs import compose_cfg
from tests.test_eagle3 import assert_unroll_equals_decoding, random_eagle3


def config_error(*overrides: str) -> None:
    """The train config with these overrides is refused in one line (before anything loads)."""
    with pytest.raises(ConfigError) as err:
        OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", *overrides]))
    assert "\n" not in str(err.value)
    return str(err.value)


def tiny_features(target, model, length=10, seed=0):
    ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(seed))
    batch = collate([{"prompt_ids": ids[0, :4].tolist(), "response_ids": ids[0, 4:].tolist()}], "response_ids", 64, 0)
    return ids, target_signals(target, batch, model.config.target_layers)[0]


# ---------------------------------------------------------------------------------------------------------------
# Feature noise


def fc_inputs(model, features, noise, seed):
    """What fc reads in a training forward with this noise and seed."""
    seen = []
    hook = model.fc.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    ids = torch.arange(3, 3 + features.shape[1])[None]
    torch.manual_seed(seed)
    try:
        logits = model(ids, features, torch.ones_like(ids), torch.arange(1, ids.shape[1])[None], 2, noise)
    finally:
        hook.remove()
    return seen[0], logits


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_feature_noise_is_uniform_at_its_scale_after_the_feature_norm_in_training_only(make_tiny_llama,
                                                                                        norm_before_fc):
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, norm_before_fc=norm_before_fc).train()
    _, features = tiny_features(target, model)
    clean, clean_logits = fc_inputs(model, features, 0.0, seed=0)
    noisy, noisy_logits = fc_inputs(model, features, 0.2, seed=0)
    diff = noisy - clean
    assert diff.abs().max() <= 0.2 + 1e-6 and diff.abs().max() > 0.19  # U(-0.2, 0.2) over ~2k values
    assert abs(float(diff.mean())) < 0.01 and abs(float(diff.std()) - 0.2 / 3 ** 0.5) < 0.01
    assert not torch.allclose(noisy_logits[0], clean_logits[0])
    again, _ = fc_inputs(model, features, 0.2, seed=0)  # train.seed makes it reproducible ...
    other, _ = fc_inputs(model, features, 0.2, seed=1)  # ... and another seed draws other noise
    assert torch.equal(again, noisy) and not torch.equal(other, noisy)
    model.eval()  # evaluation: no noise whatever is asked
    torch.testing.assert_close(fc_inputs(model, features, 0.2, seed=0)[1], clean_logits, rtol=0, atol=0)


@torch.no_grad()
def test_decoding_reads_the_features_without_noise(make_tiny_llama):
    """The decoder's path (fuse) takes no noise, in training mode too: a checkpoint evaluated mid-training drafts as
    the saved drafter will."""
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target).train()
    _, features = tiny_features(target, model)
    torch.testing.assert_close(model.fuse(features), model.fused_input(features), rtol=0, atol=0)


def test_feature_noise_reaches_the_eagle3_loss(make_tiny_llama):
    from drafter_train.drafters.eagle3.model import eagle3_loss

    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target).train()
    ids, _ = tiny_features(target, model)
    batch = collate([{"prompt_ids": ids[0, :4].tolist(), "response_ids": ids[0, 4:].tolist()}], "response_ids", 64, 0)
    losses = {}
    for noise in (0.0, 0.5):
        cfg = OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", f"drafter.feature_noise={noise}"]))
        torch.manual_seed(0)
        losses[noise] = float(eagle3_loss(model, target, batch, cfg).loss_sum.detach())
    assert losses[0.5] != losses[0.0]


def test_bad_feature_noise_is_refused_in_one_line():
    assert "drafter.feature_noise: must be >= 0, got -0.1" in config_error("drafter.feature_noise=-0.1")
    assert "needs the features normalised" in config_error("drafter.feature_noise=0.1", "drafter.fc_norm=false")
    OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", "drafter.feature_noise=0.1", "drafter.fc_norm=false",
                                              "drafter.norm_before_fc=true"]))


# ---------------------------------------------------------------------------------------------------------------
# Top-K distillation (loss.top_k)


def test_top_k_distillation_reaches_the_eagle3_loss(make_tiny_llama):
    from drafter_train.drafters.eagle3.model import eagle3_loss

    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, draft_ids=torch.arange(20) + 3).train()
    ids, _ = tiny_features(target, model)
    batch = collate([{"prompt_ids": ids[0, :4].tolist(), "response_ids": ids[0, 4:].tolist()}], "response_ids", 64, 0)
    losses = {}
    for k in (0, 4, 20):
        cfg = OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", "drafter.draft_vocab_size=20",
                                                        f"loss.top_k={k}"]))
        losses[k] = float(eagle3_loss(model, target, batch, cfg).loss_sum.detach())
    assert losses[20] == pytest.approx(losses[0], rel=1e-6) and losses[4] != pytest.approx(losses[0], rel=1e-3)


def test_bad_top_k_is_refused_in_one_line(tiny_data):
    from drafter_train.preflight import check_inputs

    assert re.search(r"loss.top_k: 9000 is larger than the draft vocabulary \(drafter.draft_vocab_size=\d+\)",
                     config_error("loss.top_k=9000"))
    assert "must be >= 0" in config_error("loss.top_k=-1")
    for loss in ("ce", "greedy_ce", "rkl"):
        assert f"not with loss={loss}" in config_error(f"loss={loss}", "loss.top_k=4")
    # the whole vocabulary (draft_vocab_size=0): against the target's config, before the target loads
    cfg = OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", "drafter.draft_vocab_size=0", "loss.top_k=999",
                                                    f"target.path={tiny_data / 'target'}",
                                                    f"train.data_dir={tiny_data / 'data'}"]))
    with pytest.raises(ConfigError, match=r"^loss.top_k: 999 is larger than the target's vocabulary \(\d+ tokens"):
        check_inputs(cfg)


# ---------------------------------------------------------------------------------------------------------------
# The draft layer initialised from the target's last layer (drafter.init_from_target)


def new_eagle3(target, **fields):
    from drafter_train.drafters.common.loading import load_drafter
    from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
    from tests.stubs import word_tokenizer

    cfg = Eagle3DrafterConfig(path="new", draft_vocab_size=0, target_layers=[0, 1, 2], **fields)
    return load_drafter(cfg, target, word_tokenizer(), "float32", for_training=True)


def norms_not_at_one(target):
    """The target with the norms of its layers away from their init (1), so that a copy shows."""
    gen = torch.Generator().manual_seed(3)
    for name, param in target.named_parameters():
        if name.endswith("layernorm.weight"):
            param.data.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    return target


def test_init_from_target_copies_the_targets_last_layer(make_tiny_llama):
    target = norms_not_at_one(make_tiny_llama(num_layers=4, init=0.5))
    last, width = target.model.layers[-1], target.config.hidden_size
    layer = new_eagle3(target, init_from_target=True).layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):  # [embedding half: zeros; hidden half: the target's]
        weight = getattr(layer.self_attn, name).weight
        assert torch.equal(weight[:, width:], getattr(last.self_attn, name).weight)
        assert torch.equal(weight[:, :width], torch.zeros_like(weight[:, :width]))
    theirs = dict(last.named_parameters())
    for name, param in layer.named_parameters():
        if name.startswith(("self_attn.o_proj", "mlp.", "post_attention_layernorm")):
            assert torch.equal(param, theirs[name]), name
    assert torch.equal(layer.hidden_norm.weight, last.input_layernorm.weight)
    random = new_eagle3(target).layers[0]  # off (the default): the layer is transformers' random init
    assert not torch.equal(random.mlp.down_proj.weight, last.mlp.down_proj.weight)


@torch.no_grad()
def test_a_layer_from_the_target_drafts_what_the_targets_last_layer_computes(make_tiny_llama):
    """With the embedding half at zero, the first step's attention and MLP are the target's last layer's on the
    hidden input: fed the target's own residual stream before that layer, the step gives the target's output."""
    target = norms_not_at_one(make_tiny_llama(num_layers=4, init=0.5))
    model = new_eagle3(target, init_from_target=True).eval()
    ids = torch.randint(3, 64, (1, 7))
    out = target(input_ids=ids, output_hidden_states=True)
    before, after = out.hidden_states[-2], out.hidden_states[-1]  # the last layer's input; final-normed output
    causal = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1)[None, None]
    step = model.step(ids, before, torch.arange(7)[None], causal, model.new_cache())
    torch.testing.assert_close(target.model.norm(step), after, rtol=1e-4, atol=1e-4)


def test_init_from_a_target_of_another_width_or_layer_is_refused(make_tiny_llama):
    from transformers import LlamaConfig, LlamaForCausalLM

    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target)
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(ConfigError, match="^drafter.init_from_target: the target's hidden size is 96, the "
                                          "drafter's 64$"):
        model.copy_target_layers(wide)
    biased = make_tiny_llama(num_layers=4)
    biased.config.attention_bias = True
    biased.model.layers[-1].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ConfigError, match=r"has \['self_attn.q_proj.bias'\], which the drafter's Llama layer"):
        model.copy_target_layers(biased)


# ---------------------------------------------------------------------------------------------------------------
# Capacity: drafter.num_layers, drafter.intermediate_size


@torch.no_grad()
def test_a_two_layer_wider_drafter_unrolls_in_training_as_it_decodes(make_tiny_llama):
    """Training's unrolled step j at row t equals what decoding reaches with the cache (step 0 over rows 0..t, then
    j single-token steps), through both layers and their cache entries."""
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, draft_ids=torch.arange(40) + 10, num_layers=2, intermediate_size=96)
    assert len(model.layers) == 2 and model.layers[1].mlp.up_proj.out_features == 96
    assert model.layers[1].self_attn.q_proj.in_features == 64  # the later layer reads the first one's output only
    ids, features = tiny_features(target, model, length=12)
    cache = assert_unroll_equals_decoding(model, ids, features)
    assert len(cache.layers) == 2


def test_greedy_chains_and_trees_with_a_two_layer_drafter_are_lossless(make_tiny_llama):
    from drafter_train.decoding.autoregressive import generate_autoregressive
    from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
    from drafter_train.decoding.tree import TreeSpec
    from drafter_train.drafters.registry import make_drafter
    from tests.test_eagle3 import GREEDY
    from tests.test_trees import TREE_GREEDY

    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    model = random_eagle3(target, draft_ids=torch.tensor([0, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 15]), scale=0.5,
                          num_layers=2, intermediate_size=96)
    prompt = [1, 5, 9, 12, 7]
    ar = generate_autoregressive(target, prompt, 24).tokens
    chain = generate_speculative(target, make_drafter(model), prompt, 3, GREEDY, 24)
    tree = generate_tree_speculative(target, make_drafter(model), prompt, TreeSpec(3, 4, 12), TREE_GREEDY, 24)
    assert chain.tokens == ar and tree.tokens == ar
    assert chain.stats.accepted >= 3 and tree.stats.accepted >= chain.stats.accepted


def test_a_two_layer_drafter_trains_saves_reloads_and_refuses_the_exports_that_cannot_hold_it(tiny_data, tmp_path):
    import json

    from drafter_train.decoding.autoregressive import generate_autoregressive
    from drafter_train.decoding.speculative import generate_speculative
    from drafter_train.drafters.eagle3 import export as eagle3_export
    from drafter_train.drafters.eagle3.model import load
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.recipes.export import ExportConfig, export
    from drafter_train.recipes.train import train
    from drafter_train.targets import load_causal_lm
    from tests.test_eagle3 import GREEDY, eagle3_cfg
    from tests.test_train import losses

    # three TTT steps (the recipe trains one): both layers learn through the unrolled steps as they decode
    cfg = eagle3_cfg(tiny_data, tmp_path / "runs", "drafter.num_layers=2", "drafter.intermediate_size=96",
                     "drafter.ttt_steps=3", "train.max_steps=4", "train.save_every=4", "eval.max_new_tokens=4", "train.eval_at_start=false")
    metrics = train(cfg)
    run = tmp_path / "runs" / cfg.train.run_name
    assert metrics["greedy_match"] == 1.0 and losses(run)[4] < losses(run)[1]
    model = load(str(run / "latest" / "drafter"), "float32")
    assert len(model.layers) == 2 and model.layers[0].mlp.up_proj.out_features == 96
    target = load_causal_lm(str(tiny_data / "target"))
    prompt = [1, 5, 9, 12]
    assert generate_speculative(target, make_drafter(model), prompt, 3, GREEDY, 16).tokens == \
        generate_autoregressive(target, prompt, 16).tokens
    with pytest.raises(ConfigError, match="^export.format: the engines' EAGLE-3 runs one decoder layer, this drafter "
                                          "has 2"):
        export(ExportConfig(run_dir=str(run), which="latest", output_dir=str(tmp_path / "vllm"), format="vllm"))
    with pytest.raises(ConfigError, match="^export.format=gguf: llama.cpp's EAGLE-3 has one decoder layer"):
        eagle3_export.check_gguf(json.loads((run / "latest" / "drafter" / "config.json").read_text()))


def test_a_wider_mlp_exports_for_vllm_at_its_width(make_tiny_llama, tmp_path):
    import json

    from drafter_train.drafters.eagle3 import export as eagle3_export

    random_eagle3(make_tiny_llama(num_layers=4), intermediate_size=96).save_pretrained(tmp_path / "d")
    eagle3_export.write_speculators(tmp_path / "d", tmp_path / "vllm", 4, "org/tiny-target", False)
    layer = json.loads((tmp_path / "vllm" / "config.json").read_text())["transformer_layer_config"]
    assert layer["intermediate_size"] == 96 and layer["num_hidden_layers"] == 1


def test_bad_capacity_is_refused_in_one_line():
    assert "drafter.num_layers: must be >= 1, got 0" in config_error("drafter.num_layers=0")
    assert "drafter.intermediate_size: must be >= 0" in config_error("drafter.intermediate_size=-1")
    assert "copies the target's MLP" in config_error("drafter.init_from_target=true", "drafter.intermediate_size=96")
