"""oneDNN Linear kernels for CPU inference (cpu_kernels.py): same numbers as F.linear up to rounding, training
untouched, copies keep their own weights, undo works, decoding stays lossless, bad settings are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from drafter_train.config import TargetConfig
from drafter_train.cpu_kernels import (GROUPED_ATTENTION, OneDNNLinear, onednn_available, use_grouped_attention,
                                      use_onednn_linears)
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
        assert use_onednn_linears(model) == 2
        assert all(type(m) is OneDNNLinear for m in (model[0], model[2]))
        out = model(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def test_oneDNN_is_what_runs_at_inference_and_not_in_training():
    model, x = mlp(), torch.randn(3, 240)
    use_onednn_linears(model)
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
    use_onednn_linears(model)
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
    assert use_onednn_linears(target, min_elements=0) > 0  # tiny layers: forced onto oneDNN for the test
    draft_model = make_tiny_llama(vocab_size=32, num_layers=1, init=0.5, seed=2)
    use_onednn_linears(draft_model, min_elements=0)
    drafter = make_drafter(draft_model)
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


def test_a_bad_setting_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="target.cpu_kernels"):
        TargetConfig(cpu_kernels="mkl")
