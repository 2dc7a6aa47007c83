"""CPU Linear kernels for inference (cpu_kernels.py): oneDNN gives F.linear's numbers up to rounding, "auto" picks
the kernel per row count by timing, packed weights follow weight updates, training is untouched, copies keep their
own weights, undo works, decoding stays lossless, bad settings are refused."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from drafter_train.config import TargetConfig
from drafter_train import cpu_kernels
from drafter_train.cpu_kernels import (GROUPED_ATTENTION, OneDNNLinear, RowPolicy, onednn_available, row_policy,
                                      use_grouped_attention, use_onednn_linears)
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(240, 400), nn.GELU(), nn.Linear(400, 180, bias=False))


def test_small_layers_keep_the_default_kernel():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(256, 512))
    assert use_onednn_linears(model) == 1
    assert type(model[0]) is nn.Linear and type(model[1]) is OneDNNLinear
    assert use_onednn_linears(nn.Sequential(nn.Linear(64, 64)), min_elements=0) == 1


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_inference_output_matches_the_default_kernel(rows):
    model, x = mlp(), torch.randn(1, rows, 240)
    with torch.inference_mode():
        reference = model(x)
        assert use_onednn_linears(model, "onednn") == 2
        assert all(type(m) is OneDNNLinear for m in (model[0], model[2]))
        out = model(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def test_oneDNN_is_what_runs_at_inference_and_not_in_training():
    model, x = mlp(), torch.randn(3, 240)
    use_onednn_linears(model, "onednn")
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: model(x))
    assert "mkldnn::_linear_pointwise" not in ops_run(lambda: model(x))  # grads enabled: the ordinary kernel
    use_onednn_linears(model, "default")
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in ops_run(lambda: model(x))


def test_training_through_a_patched_model_is_unchanged():
    ref, patched = mlp(), mlp()
    use_onednn_linears(patched)
    x = torch.randn(4, 240)
    ref(x).square().sum().backward()
    patched(x).square().sum().backward()
    for a, b in zip(ref.parameters(), patched.parameters()):
        assert torch.equal(a.grad, b.grad)  # bit-identical: the same F.linear runs when grads are needed


def test_a_deep_copy_computes_with_its_own_weights():
    model = mlp()
    use_onednn_linears(model, "onednn")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    x = torch.randn(2, 240)
    with torch.inference_mode():
        assert not torch.allclose(twin(x), model(x))
        use_onednn_linears(model, "default")
        torch.testing.assert_close(twin[0](x), 2 * model[0](x), rtol=1e-5, atol=1e-5)


def test_default_undoes_it_and_a_second_patch_is_a_no_op():
    model = mlp()
    assert use_onednn_linears(model) == 2 and use_onednn_linears(model) == 2
    assert use_onednn_linears(model, "default") == 0
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert "forward" not in model[0].__dict__ and model.state_dict().keys() == mlp().state_dict().keys()


def test_speculative_decoding_on_onednn_target_and_drafter_stays_lossless(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=3, init=0.5, seed=1)
    assert use_onednn_linears(target, "onednn", min_elements=0) > 0  # tiny layers: forced onto oneDNN for the test
    draft_model = make_tiny_llama(vocab_size=32, num_layers=1, init=0.5, seed=2)
    use_onednn_linears(draft_model, "onednn", min_elements=0)
    drafter = make_drafter(draft_model, "onednn")
    assert type(drafter.lm.model.lm_head) is OneDNNLinear
    for prompt in ([1, 2, 3], [7, 7, 4, 9, 1]):
        ar = generate_autoregressive(target, prompt, 40)
        for draft_len in (1, 3, 5):
            spec = generate_speculative(target, drafter, prompt, draft_len, make_verifier("greedy", SamplingParams()),
                                        40)
            assert spec.tokens == ar.tokens


def test_load_target_applies_the_setting(tmp_path, make_tiny_llama, monkeypatch):
    from drafter_train import targets

    make_tiny_llama(vocab_size=1100, num_layers=1).save_pretrained(tmp_path)  # LM head 1100 x 64: over the size bar
    monkeypatch.setattr(targets, "load_tokenizer", lambda *a: None)  # the folder has no tokenizer; not under test
    fast, _ = targets.load_target(TargetConfig(path=str(tmp_path)))
    plain, _ = targets.load_target(TargetConfig(path=str(tmp_path), cpu_kernels="default"))
    assert type(fast.lm_head) is OneDNNLinear and type(plain.lm_head) is nn.Linear
    assert row_policy(fast).rows == cpu_kernels.CALIBRATION_ROWS  # "auto" (the default) timed the kernels
    assert type(fast.model.layers[0].mlp.up_proj) is nn.Linear  # 64 x 128: below the bar
    assert fast.config._attn_implementation == GROUPED_ATTENTION and plain.config._attn_implementation == "sdpa"
    ids = torch.tensor([[1, 400, 22, 7, 93]])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Grouped-query attention without copied key/value heads


def _cached_pass(model, ids, split, mask=None, position_ids=None):
    """Logits of ids[split:] after a cached pass over ids[:split] (mask/position_ids: a tree-style pass)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :split], past_key_values=cache, use_cache=True)
    return model(input_ids=ids[:, split:], past_key_values=cache, use_cache=True, attention_mask=mask,
                 position_ids=position_ids).logits


@torch.inference_mode()
def test_grouped_attention_equals_sdpa_and_eager_without_copying_kv_heads(make_tiny_llama, monkeypatch):
    """Masked multi-token passes (a verify chain; a tree's additive 4-D mask) give transformers' numbers, and the
    grouped model never copies key/value heads (repeat_kv), which transformers' sdpa does on such passes."""
    import transformers.integrations.sdpa_attention as sdpa_module

    model = make_tiny_llama(vocab_size=64, num_layers=2)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads
    ids = torch.randint(3, 64, (1, 14), generator=torch.Generator().manual_seed(0))
    # a 4-node tree after 10 cached positions: root, two children of it, a grandchild under the first child
    sees = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = torch.cat([torch.zeros(4, 10), torch.zeros(4, 4).masked_fill(~sees, -1e9)], dim=1)[None, None]
    positions = torch.tensor([[10, 11, 11, 12]])
    expected = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        expected[impl] = (_cached_pass(model, ids, 9), _cached_pass(model, ids, 10, tree, positions))
    copies = []
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda x, n: copies.append(n) or x.repeat_interleave(n, dim=1))
    model.set_attn_implementation("sdpa")
    _cached_pass(model, ids, 9)
    assert copies  # transformers' sdpa copies them on a masked multi-token pass (what this replaces)
    copies.clear()
    assert use_grouped_attention(model)
    chain, tree_logits = _cached_pass(model, ids, 9), _cached_pass(model, ids, 10, tree, positions)
    assert not copies
    for impl in ("eager", "sdpa"):
        torch.testing.assert_close(chain, expected[impl][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree_logits, expected[impl][1], rtol=1e-5, atol=1e-5)
    assert not use_grouped_attention(model, "default") and model.config._attn_implementation == "sdpa"


def test_speculative_decoding_with_grouped_attention_stays_lossless(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=3, init=0.5, seed=1)
    drafter = make_drafter(make_tiny_llama(vocab_size=32, num_layers=1, init=0.5, seed=2))
    prompt = [7, 7, 4, 9, 1]
    ar = generate_autoregressive(target, prompt, 40)
    assert use_grouped_attention(target)
    for draft_len in (1, 3, 5):
        spec = generate_speculative(target, drafter, prompt, draft_len, make_verifier("greedy", SamplingParams()), 40)
        assert spec.tokens == ar.tokens


# ---------------------------------------------------------------------------------------------------------------
# "auto": the kernel per row count, by timing


def test_a_row_policy_reads_between_and_past_its_measured_counts():
    policy = RowPolicy((1, 2, 4, 8), (False, True, False, True))
    assert [policy.uses_onednn(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [False, True, True, False, False, True, True]
    assert policy.describe() == "default 1, onednn 2-3, default 4-7, onednn 8+"


def test_auto_picks_the_kernel_that_is_faster_at_each_row_count(monkeypatch):
    """With F.linear made slow from 4 rows on, "auto" must time it so and send those rows to oneDNN, and fewer rows
    to F.linear: checked on what runs."""
    plain_linear = F.linear

    def slow_from_4_rows(x, w, b=None):
        if x.numel() // x.shape[-1] >= 4:
            time.sleep(0.002)
        return plain_linear(x, w, b)

    model = mlp()
    monkeypatch.setattr(F, "linear", slow_from_4_rows)
    assert use_onednn_linears(model, "auto") == 2
    monkeypatch.setattr(F, "linear", plain_linear)
    policy = row_policy(model)
    assert all(policy.uses_onednn(n) for n in (4, 5, 16, 64)), policy.describe()
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: model(torch.randn(5, 240)))
        assert ("mkldnn::_linear_pointwise" in ops_run(lambda: model(torch.randn(2, 240)))) == policy.uses_onednn(2)


def test_auto_times_a_sample_of_each_shape_scaled_to_its_count(monkeypatch):
    """"auto" times one member of each weight shape in turn until the sample holds CALIBRATION_BYTES, counting each
    timed member for its unseen twins: a big target is not timed whole at every load, and the estimate still weighs
    every shape by how often a forward runs it. Checked on which weights the calibration touches, and that a stubbed
    F.linear slow from 4 rows on in one shape only still sends those rows to oneDNN through the scaling."""
    from drafter_train.cpu_kernels import calibration_sample

    wide, narrow = [nn.Linear(256, 1024) for _ in range(6)], [nn.Linear(256, 256, bias=False) for _ in range(6)]
    layers = [m for pair in zip(wide, narrow) for m in pair]  # a forward's order: wide, narrow, wide, narrow ...
    one = 256 * 1024 * 4 + 256 * 256 * 4  # the bytes of one member of each shape
    sample = calibration_sample(layers, min_bytes=2 * one)
    assert [m for m, _ in sample] == [wide[0], narrow[0], wide[1], narrow[1]]  # in order, each shape in turn
    assert [count for _, count in sample] == [3.0, 3.0, 3.0, 3.0]
    assert calibration_sample(layers, min_bytes=1) == [(wide[0], 6.0), (narrow[0], 6.0)]  # each shape at least once
    assert calibration_sample(layers, min_bytes=1 << 40) == [(m, 1.0) for m in layers]  # small models: all of them

    plain_linear, timed = F.linear, []

    def slow_narrow_from_4_rows(x, w, b=None):
        timed.append(w)
        if w.shape[0] == 256 and x.numel() // x.shape[-1] >= 4:
            time.sleep(0.004)
        return plain_linear(x, w, b)

    model = nn.Sequential(*layers)
    monkeypatch.setattr(cpu_kernels, "CALIBRATION_BYTES", one)
    monkeypatch.setattr(F, "linear", slow_narrow_from_4_rows)
    assert use_onednn_linears(model, "auto") == 12
    monkeypatch.setattr(F, "linear", plain_linear)
    assert {id(w) for w in timed} == {id(wide[0].weight), id(narrow[0].weight)}
    assert all(row_policy(model).uses_onednn(n) for n in (4, 8, 32)), row_policy(model).describe()


def test_auto_leaves_the_global_random_stream_alone():
    """Timing draws its inputs from its own generator: a run on "auto" draws the same random numbers afterwards as
    one on another setting, so it trains the same drafter."""
    model = nn.Sequential(nn.Linear(256, 512))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    use_onednn_linears(model, "auto")
    assert torch.equal(torch.rand(4), expected)


def test_packed_weights_follow_in_place_updates():
    """oneDNN runs on a packed copy of each weight: after an optimizer step (in place) or a new tensor, inference must
    use the new weights, not the copy packed before."""
    model, x = mlp(), torch.randn(5, 240)
    use_onednn_linears(model, "onednn")
    with torch.inference_mode():
        model(x)  # packs
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        model[2].weight.data = model[2].weight.data * 3  # a new storage
    with torch.inference_mode():
        out = model(x)
        use_onednn_linears(model, "default")
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_a_bad_setting_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="target.cpu_kernels"):
        TargetConfig(cpu_kernels="mkl")


# ----------------------------------------------------------------------------------------------------------------
# Passes that produce training data run on PyTorch's own kernel whatever "auto" timed


def test_stock_kernels_run_pytorchs_kernel_inside_and_the_policy_again_after():
    model, x = mlp(), torch.randn(3, 240)
    with torch.inference_mode():
        reference = model(x)
        use_onednn_linears(model, "onednn")
        with cpu_kernels.stock_kernels():
            with cpu_kernels.stock_kernels():  # nests
                assert "mkldnn::_linear_pointwise" not in ops_run(lambda: model(x))
            assert "mkldnn::_linear_pointwise" not in ops_run(lambda: model(x))
            assert torch.equal(model(x), reference)  # the same bits as the unpatched model
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: model(x))


@torch.inference_mode()
def test_padded_batched_generation_inside_stock_kernels_is_transformers_sdpa(make_tiny_llama, monkeypatch):
    """datagen's left-padded batches (a padding mask on every step) run transformers' own sdpa path inside
    stock_kernels(), grouped attention on or not: the same tokens, and no `enable_gqa` pass with a mask (another
    rounding, and on batched 1-token steps the slower kernel)."""
    from drafter_train.data.generation import left_pad

    model = make_tiny_llama(vocab_size=64, num_layers=2)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]], 0, torch.device("cpu"))

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              eos_token_id=None)

    reference = generate()
    assert use_grouped_attention(model)
    calls = []
    real_sdpa = cpu_kernels.F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # F is torch.nn.functional: transformers' calls come through here too
        calls.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels.F, "scaled_dot_product_attention", spy)
    generate()
    assert True in calls  # outside, the grouped path runs on these masked passes
    calls.clear()
    with cpu_kernels.stock_kernels():
        assert torch.equal(generate(), reference)
    assert calls and True not in calls  # inside, transformers' own sdpa


def _onednn_everywhere(model):
    """`model` on oneDNN at every row count, however small its layers (tiny models are below the size limit)."""
    assert use_onednn_linears(model, "onednn", min_elements=0) > 0
    return model


def _batch(target, rows=2, prompt=5, response=7):
    from drafter_train.data.batches import Batch

    torch.manual_seed(1)
    ids = torch.randint(3, target.config.vocab_size, (rows, prompt + response))
    resp_pos = torch.arange(prompt - 1, prompt + response - 1).expand(rows, -1)
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), resp_pos=resp_pos,
                 resp_mask=torch.ones_like(resp_pos, dtype=torch.bool), labels=ids[:, prompt:])


def test_datagen_generation_is_the_same_bits_whatever_the_kernel_policy(make_tiny_llama):
    from drafter_train.config import DatagenConfig
    from drafter_train.data.generation import generate_batch

    cfg = DatagenConfig(max_new_tokens=12, store_topk=4)
    prompts = [[1, 5, 9, 14], [1, 7, 3]]
    reference = generate_batch(make_tiny_llama(), prompts, cfg, [2], 0)
    target = _onednn_everywhere(make_tiny_llama())
    assert "mkldnn::_linear_pointwise" not in ops_run(lambda: generate_batch(target, prompts, cfg, [2], 0))
    assert generate_batch(target, prompts, cfg, [2], 0) == reference  # tokens and stored top-k logits


def test_target_features_and_teacher_logits_are_the_same_bits_whatever_the_kernel_policy(make_tiny_llama):
    from drafter_train.config import LossConfig
    from drafter_train.drafters.common.distill import teacher_logits
    from drafter_train.drafters.common.conditioned import target_signals

    plain, patched = make_tiny_llama(), _onednn_everywhere(make_tiny_llama())
    batch, layers = _batch(plain), [0, 2, 3]
    reference = target_signals(plain, batch, layers)
    assert "mkldnn::_linear_pointwise" not in ops_run(lambda: target_signals(patched, batch, layers))
    for got, want in zip(target_signals(patched, batch, layers), reference):
        assert torch.equal(got, want)
    loss = LossConfig(name="fkl", teacher="online")
    assert "mkldnn::_linear_pointwise" not in ops_run(lambda: teacher_logits(patched, batch, loss))
    assert torch.equal(teacher_logits(patched, batch, loss), teacher_logits(plain, batch, loss))
    with torch.inference_mode():  # and a decoding pass outside them still takes the policy
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: patched(input_ids=batch.input_ids))


@pytest.mark.parametrize("kind", ["dflash", "nar"])
def test_glancings_no_grad_guesses_run_on_stock_kernels(tiny_data, tmp_path, monkeypatch, kind):
    """Glancing's guesses (a no-grad drafter pass inside the loss) decide which tokens training reveals: they run
    inside stock_kernels() like every other pass that makes training data. Decoding passes (inference mode) do not."""
    from drafter_train.drafters.dflash.model import DFlashModel
    from drafter_train.drafters.nar.model import SpecDrafter
    from drafter_train.recipes.train import train
    from tests.test_dflash import dflash_cfg
    from tests.test_train import train_cfg

    model_class = DFlashModel if kind == "dflash" else SpecDrafter
    seen, forward = [], model_class.forward

    def spy(self, *args, **kwargs):
        if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            seen.append(cpu_kernels._stock_depth)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "forward", spy)
    steps = ("drafter.glancing_ratio=0.5", "train.max_steps=2", "train.save_every=2", "train.eval_at_start=false")
    cfg = dflash_cfg(tiny_data, tmp_path, "loss=fkl", *steps) if kind == "dflash" else \
        train_cfg(tiny_data, tmp_path, "drafter=nar", "loss=fkl", *steps)
    train(cfg)
    assert len(seen) == 2 and all(depth > 0 for depth in seen), seen  # one guess per step, each on stock kernels
