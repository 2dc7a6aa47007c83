"""DFlash: the block mask, context injection, training == cached decoding, lossless decoding, training, export."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from drafter_train.drafters.dflash.config import DFlashDrafterConfig
from drafter_train.data.batches import collate
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common import conditioned
from drafter_train.drafters.dflash.drafter import DFlashDrafter
from drafter_train.drafters.dflash.model import DFlashModel, block_mask, position_weights, to_anchor_blocks
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.features import FeatureTap, evenly_spaced_layers
from drafter_train.targets import load_causal_lm
from drafter_train.recipes.train import train
from tests.stubs import compose_cfg
from tests.test_eagle3 import eagle3_counts
from tests.test_sampling_exactness import RUNS, chi2_pvalue, enumerate_marginals
from tests.test_train import losses, stories_run, train_cfg

GREEDY = make_verifier("greedy", SamplingParams())


def random_dflash(target, layers=(0, 2), num_layers=2, block_size=6, draft_ids=None, scale=0.3, seed=1,
                  learned_mask=True, qk_norm=True):
    """A DFlash drafter for `target` with large random weights (so that its drafts vary and sometimes match)."""
    cfg = DFlashDrafterConfig(num_layers=num_layers, block_size=block_size, draft_len=block_size - 1,
                              qk_norm=qk_norm, learned_mask=learned_mask)
    ids = torch.arange(target.config.vocab_size) if draft_ids is None else draft_ids
    model = DFlashModel.from_target(target, cfg, list(layers), ids, mask_token_id=3)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if (p.dim() > 1 and not name.startswith("embed_tokens")) or name == "mask_embedding":
            p.data.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def tapped(target, ids, layers):
    """[T, F] the target's features at `layers` for every position of `ids` [T]."""
    with torch.no_grad(), FeatureTap(target, layers) as tap:
        target(input_ids=ids[None])
        return tap.features[0]


# ---------------------------------------------------------------------------------------------------------------
# The block mask and what a block reads


def naive_block_mask(attention_mask, anchors, size):
    batch, length = attention_mask.shape
    n = anchors.shape[1]
    allowed = torch.zeros(batch, n * size, length + n * size, dtype=torch.bool)
    for b in range(batch):
        for m in range(n):
            for r in range(size):
                row = m * size + r
                for j in range(length):  # context strictly before the anchor, real tokens only
                    allowed[b, row, j] = j < int(anchors[b, m]) and bool(attention_mask[b, j])
                for m2 in range(n):  # its own block, in both directions; no other block
                    for r2 in range(size):
                        allowed[b, row, length + m2 * size + r2] = m2 == m
    return allowed


def test_block_mask_equals_a_naive_reference():
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    anchors = torch.tensor([[2, 5, 0], [1, 2, 3]])
    mask = block_mask(attention_mask, anchors, 3, torch.float32)[:, 0]
    assert torch.equal(mask == 0, naive_block_mask(attention_mask, anchors, 3))
    assert mask.min() == torch.finfo(torch.float32).min


@torch.no_grad()
def test_a_block_reads_only_the_context_before_its_anchor_and_its_anchor(make_tiny_llama):
    """Perturbing everything from a block's anchor on (its own future labels, the anchor's and later features)
    changes nothing in that block; the anchor token and the last context feature do change it; another block's
    mask slots (glancing) never reach it."""
    target = make_tiny_llama(num_layers=4)
    model = random_dflash(target)
    ids = torch.randint(3, 64, (2, 14))
    features = torch.randn(2, 14, 128)
    anchors = torch.tensor([[4, 9], [7, 2]])
    ones = torch.ones_like(ids)
    out = model(ids, features, ones, anchors)
    gen = torch.Generator().manual_seed(3)
    for b in range(2):
        for m in range(2):
            a = int(anchors[b, m])
            ids2, features2 = ids.clone(), features.clone()
            ids2[b, a + 1:] = torch.randint(3, 64, (14 - a - 1,), generator=gen)
            features2[b, a:] = torch.randn(14 - a, 128, generator=gen)
            torch.testing.assert_close(model(ids2, features2, ones, anchors)[b, m], out[b, m], rtol=0, atol=1e-6)
            ids3, features3 = ids.clone(), features.clone()
            ids3[b, a] = (ids[b, a] + 1) % 64
            features3[b, a - 1] += 1.0
            for changed in (model(ids3, features, ones, anchors), model(ids, features3, ones, anchors)):
                assert not torch.allclose(changed[b, m], out[b, m])
    glance_ids = torch.full((2, 2, 5), -1)
    glance_ids[:, 0, 1] = 7  # reveal a token in block 0 only
    glanced = model(ids, features, ones, anchors, glance_ids)
    torch.testing.assert_close(glanced[:, 1], out[:, 1], rtol=0, atol=1e-6)
    assert not torch.allclose(glanced[:, 0], out[:, 0])


def _records():
    return [{"prompt_ids": [1, 5, 6], "response_ids": [10, 11, 12, 13, 14, 15, 16]},
            {"prompt_ids": [1, 7], "response_ids": [20, 21, 22]}]


def test_anchor_blocks_learn_the_tokens_after_their_anchor_at_the_same_positions():
    """Row k of a block anchored at position a learns the token AT a + k, whose teacher distribution is the target's
    at a + k - 1; anchors are response tokens with at least one token after them."""
    torch.manual_seed(0)
    batch = collate(_records(), "response_ids", 64, 0)
    blocks = to_anchor_blocks(batch, DFlashDrafterConfig(block_size=4, draft_len=3, blocks_per_sequence=0))
    anchors = blocks.context_lens - 1
    labels, mask, resp_pos = (x.view(2, -1, 3) for x in (blocks.labels, blocks.resp_mask, blocks.resp_pos))
    for b in range(2):
        length = int(batch.attention_mask[b].sum())
        prompt = length - int(batch.resp_mask[b].sum())
        valid = [m for m in range(anchors.shape[1]) if mask[b, m, 0]]
        assert [int(anchors[b, m]) for m in valid] == list(range(prompt, length - 1))  # every response token but last
        for m in valid:
            for k in range(1, 4):
                a = int(anchors[b, m])
                if a + k < length:
                    assert mask[b, m, k - 1] and labels[b, m, k - 1] == batch.input_ids[b, a + k]
                    assert resp_pos[b, m, k - 1] == a + k - 1
                else:
                    assert not mask[b, m, k - 1]


def test_anchors_are_redrawn_every_batch_from_torchs_rng():
    """Each batch draws fresh anchors (over many batches every eligible response token is one) from torch's RNG,
    the state drafter-train checkpoints: the same state gives the same anchors."""
    batch = collate(_records(), "response_ids", 64, 0)
    cfg = DFlashDrafterConfig(block_size=3, draft_len=2, blocks_per_sequence=2)
    torch.manual_seed(0)
    draws = [to_anchor_blocks(batch, cfg).context_lens - 1 for _ in range(40)]
    torch.manual_seed(0)
    assert torch.equal(to_anchor_blocks(batch, cfg).context_lens - 1, draws[0])
    assert len({tuple(d.flatten().tolist()) for d in draws}) > 1
    for b, eligible in ((0, set(range(3, 9))), (1, {2, 3})):  # response tokens with one after them
        assert all(len(set(d[b].tolist())) == 2 and set(d[b].tolist()) <= eligible for d in draws)
        assert set().union(*(d[b].tolist() for d in draws)) == eligible


def test_mask_slots_use_a_learned_embedding_or_the_targets_row(make_tiny_llama):
    """learned_mask: the mask slots hold the drafter's own trainable vector (gradients reach it); the anchor slot
    the target's frozen embedding. learned_mask=false: the target's embedding of mask_token_id, no extra weight."""
    target = make_tiny_llama(num_layers=4)
    table = target.get_input_embeddings().weight
    learned, frozen = random_dflash(target), random_dflash(target, learned_mask=False)
    anchors = torch.tensor([5, 9])
    for model, slot in ((learned, learned.mask_embedding), (frozen, table[3])):
        embeds = model.block_embeds(anchors, 4)
        torch.testing.assert_close(embeds[:, 0], table[anchors], rtol=0, atol=0)
        torch.testing.assert_close(embeds[:, 1:], slot.expand(2, 3, -1), rtol=0, atol=0)
    assert frozen.mask_embedding is None and "mask_embedding" not in frozen.state_dict()
    out = learned(torch.randint(3, 64, (1, 10)), torch.randn(1, 10, 128), torch.ones(1, 10, dtype=torch.long),
                  torch.tensor([[6]]))
    out.sum().backward()
    assert learned.mask_embedding.grad is not None and learned.mask_embedding.grad.abs().sum() > 0


def test_position_weights_follow_dflash():
    torch.testing.assert_close(position_weights(16, None), torch.exp(-torch.arange(15.0) / 7))
    torch.testing.assert_close(position_weights(8, None), torch.exp(-torch.arange(7.0) / 4))
    torch.testing.assert_close(position_weights(10, None), torch.exp(-torch.arange(9.0) / 5))
    assert torch.equal(position_weights(6, 0.0), torch.ones(5))


def test_default_feature_layers_are_evenly_spaced_and_reuse_eagle3s_for_three():
    assert evenly_spaced_layers(30, 3) == [2, 15, 27] and evenly_spaced_layers(30, 1) == [15]
    assert evenly_spaced_layers(30, 2) == [2, 27] and evenly_spaced_layers(30, 5) == [2, 8, 15, 21, 27]


# ---------------------------------------------------------------------------------------------------------------
# Training forward == cached decoding


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_cached_decoding_passes_equal_the_training_forward(make_tiny_llama, draft_len, qk_norm):
    """Each proposal (context keys/values cached over several commits, one pass over [anchor, mask x draft_len])
    gives the distributions the training forward gives a block of draft_len + 1 at the same anchor."""
    target = make_tiny_llama(num_layers=4)
    model = random_dflash(target, draft_ids=torch.arange(5, 60, 2), qk_norm=qk_norm)
    assert hasattr(model.layers[0].self_attn, "k_norm") == qk_norm
    seq = torch.randint(3, 64, (16,))
    features = tapped(target, seq, model.config.target_layers)
    drafter, params, gen = DFlashDrafter(model), SamplingParams(temperature=1.0), torch.Generator()
    drafter.reset()
    verified = 0
    for now in (5, 8, 9, 13):  # verified prefix lengths after the prefill and three target passes
        drafter.commit(now, features[verified:now])
        verified = now
        q = drafter.propose(seq[:now + 1], draft_len, params, gen).q_draft  # anchor: seq[now]
        with torch.no_grad():
            logits = model(seq[None], features[None], torch.ones(1, 16, dtype=torch.long), torch.tensor([[now]]),
                           block_size=draft_len + 1)[0, 0]
        torch.testing.assert_close(q[:, drafter.draft_ids], logits.softmax(-1), rtol=1e-5, atol=1e-6)
        assert q.sum(-1).allclose(torch.ones(draft_len)) and q[:, ~model.t2d].sum() == 0


def test_drafting_more_than_the_block_holds_fails_in_one_line(make_tiny_llama):
    target = make_tiny_llama(num_layers=4)
    drafter = make_drafter(random_dflash(target, block_size=4))
    with pytest.raises(ConfigError, match=r"eval.draft_len: .*blocks of 4 .* at most 3, not 4"):
        generate_speculative(target, drafter, [1, 5, 9], 4, GREEDY, 8)


# ---------------------------------------------------------------------------------------------------------------
# Lossless decoding


@pytest.mark.parametrize("draft_len", range(1, 6))
def test_greedy_with_dflash_drafter_is_lossless_on_tiny_llama(make_tiny_llama, draft_len):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    model = random_dflash(target, draft_ids=torch.tensor([0, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 15]), scale=0.5)
    prompt = [1, 5, 9, 12, 7]
    ar = generate_autoregressive(target, prompt, 40)
    passes = [0] * len(model.layers)  # one drafter pass per proposal: each layer runs once per proposal
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda *_, i=i: passes.__setitem__(i, passes[i] + 1))
    spec = generate_speculative(target, make_drafter(model), prompt, draft_len, GREEDY, 40)
    assert spec.tokens == ar.tokens
    assert spec.stats.accepted > 0  # some drafts were accepted, so the accept path ran
    assert passes == [spec.stats.proposals] * len(model.layers) and spec.stats.proposals > 1


def test_greedy_with_dflash_drafter_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_tokenizer

    target = load_causal_lm(str(stories_path))
    model = random_dflash(target, layers=(1, 2, 3), num_layers=1, block_size=8, draft_ids=torch.arange(300),
                          scale=0.05, learned_mask=False)
    prompt = load_tokenizer(str(stories_path))("Once upon a time").input_ids
    ar = generate_autoregressive(target, prompt, 48)
    for draft_len in (1, 4, 7):
        assert generate_speculative(target, make_drafter(model), prompt, draft_len, GREEDY, 48).tokens == ar.tokens


def _identity_mapped(probs, draft_ids, vocab):
    """Bug: q placed at the draft ids as if they were target ids (a forgotten d2t)."""
    full = probs.new_zeros(probs.shape[0], vocab)
    full[:, : probs.shape[1]] = probs
    return full


@pytest.mark.parametrize("broken", [False, True])
def test_speculative_sampling_with_dflash_matches_tiny_llama_distribution(make_tiny_llama, broken, monkeypatch):
    """q is zero outside the draft vocabulary and the block's drafts are independent draws: speculative sampling
    follows the target exactly. Mapping the draft vocabulary wrongly must fail the same check."""
    target = make_tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    model = random_dflash(target, layers=(1, 2), block_size=4, draft_ids=torch.tensor([1, 2, 4, 5, 7]), scale=0.4)
    if broken:
        monkeypatch.setattr(conditioned, "to_target_vocab", _identity_mapped)
    params, prompt, num_tokens = SamplingParams(temperature=1.0), [1, 5, 3], 3
    counts = eagle3_counts(target, make_drafter(model), prompt, params, RUNS, num_tokens)  # draft_len 2 of block 4
    exact = enumerate_marginals(target, prompt, num_tokens, 8, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


# ---------------------------------------------------------------------------------------------------------------
# Training through drafter-train


def dflash_cfg(tiny_data, out, *overrides):
    return train_cfg(tiny_data, out, "drafter=dflash", "drafter.path=new", "drafter.draft_vocab_size=16",
                     "drafter.block_size=4", "drafter.draft_len=3", "drafter.num_layers=1",
                     "drafter.blocks_per_sequence=4", *overrides)


@pytest.mark.parametrize("features", ["online", "offline"])
def test_dflash_trains_checkpoints_and_resumes_exactly(tiny_data, tmp_path, features, monkeypatch):
    """Interrupted in step 5, resumed from step-3: the same losses and weights as the uninterrupted run (the random
    anchors come from the checkpointed RNG)."""
    from tests.test_train import assert_resumes_exactly

    args = (f"drafter.features={features}", "loss=fkl", "drafter.target_layers=[0,1,2]")
    run_a, _, metrics = assert_resumes_exactly(lambda out: dflash_cfg(tiny_data, out, *args), "dflash", tmp_path,
                                               monkeypatch)
    weights = load_file(run_a / "step-6" / "drafter" / "model.safetensors")
    assert int(weights["t2d"].sum()) == 16 and weights["mask_embedding"].abs().sum() > 0  # trained from zero
    assert metrics["greedy_match"] == 1.0 and "tau" in metrics
    assert losses(run_a)[6] < losses(run_a)[1]


@pytest.mark.parametrize("loss", ["ce", "tvd", "accepted_length"])
def test_every_loss_trains_a_dflash_drafter(tiny_data, tmp_path, loss):
    run = dflash_cfg(tiny_data, tmp_path, f"loss={loss}", "drafter.glancing_ratio=0.5", "train.max_steps=3",
                     "train.save_every=3", "train.eval_at_start=false")
    metrics = train(run)
    assert metrics["greedy_match"] == 1.0
    assert all(v == v for v in losses(tmp_path / run.train.run_name).values())  # finite, no NaN


def test_dflash_reuses_an_eagle3_feature_cache_of_the_same_layers(tiny_data, tmp_path, monkeypatch):
    """Features depend on the data, target and layers only: a DFlash run on an EAGLE-3 run's layers extracts nothing."""
    from drafter_train.data import feature_cache

    cache = tmp_path / "cache"
    common = ("drafter.features=offline", "train.max_steps=1", f"drafter.feature_cache={cache}",
              "drafter.target_layers=[0,1,2]", "train.eval_at_start=false")
    train(train_cfg(tiny_data, tmp_path / "a", "drafter=eagle3", "drafter.path=new", "drafter.draft_vocab_size=16",
                    *common))
    monkeypatch.setattr(feature_cache, "build_cache", lambda *a, **k: pytest.fail("features extracted again"))
    train(dflash_cfg(tiny_data, tmp_path / "b", *common))


def test_dflash_beats_the_spec_drafter_on_stories260k_at_equal_steps(stories_path, stories_data, tmp_path):
    """The same data, trainer, loss and 100 steps, one drafter layer each, draft length 4: reading the target's
    features, DFlash accepts far more than the stand-alone Spec-Drafter cut from the target's first layer
    (measured: tau 2.61 against 1.54)."""
    # the untrained drafters' tau (an evaluation at step 0) is not compared here
    common = ("train.max_steps=100", "train.save_every=100", "drafter.draft_len=4", "loss=fkl",
              "train.eval_at_start=false")
    nar, _, _ = stories_run(stories_path, stories_data, tmp_path / "nar", "drafter=nar", "drafter.path=truncated:1",
                            *common)
    dflash, _, _ = stories_run(stories_path, stories_data, tmp_path / "dflash", "drafter=dflash", "drafter.path=new",
                               "drafter.num_layers=1", "drafter.block_size=8", "drafter.draft_vocab_size=0", *common)
    assert dflash["greedy_match"] == 1.0
    assert dflash["tau"] > nar["tau"] + 0.6, (dflash["tau"], nar["tau"])


# ---------------------------------------------------------------------------------------------------------------
# One-line errors


def test_bad_dflash_settings_fail_in_one_line(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"drafter.block_size: must be >= 2"):
        OmegaConf.to_object(compose_cfg("train", ["drafter=dflash", "drafter.block_size=1", "drafter.draft_len=1"]))
    with pytest.raises(ConfigError, match=r"drafter.draft_len: must be <= block_size - 1 = 7"):
        OmegaConf.to_object(compose_cfg("train", ["drafter=dflash", "drafter.block_size=8", "drafter.draft_len=8"]))
    with pytest.raises(ConfigError, match=r"drafter.num_layers: 4 drafter layers .* the target has 3"):
        train(dflash_cfg(tiny_data, tmp_path, "drafter.num_layers=4"))
    with pytest.raises(ConfigError, match=r"drafter.target_layers: 4 target layers requested, the target has 3"):
        train(dflash_cfg(tiny_data, tmp_path, "drafter.target_layers=[0,1,2,2]"))
    with pytest.raises(ConfigError, match=r"drafter.target_layers: layer ids \[5\] out of range"):
        train(dflash_cfg(tiny_data, tmp_path, "drafter.target_layers=[0,5]"))
    with pytest.raises(ConfigError, match="drafter.path: DFlash drafters are built new"):
        train(dflash_cfg(tiny_data, tmp_path, "drafter.path=truncated:1"))


# ---------------------------------------------------------------------------------------------------------------
# Saving, loading and export


@pytest.fixture(scope="module")
def dflash_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("dfrun")
    cfg = dflash_cfg(tiny_data, out, "train.max_steps=3", "train.save_every=3", "drafter.target_layers=[0,2]")
    train(cfg)
    return out / cfg.train.run_name


def test_hf_export_loads_through_the_project_and_drafts_the_same(dflash_run, tiny_data, tmp_path):
    from drafter_train.config import DrafterConfig
    from drafter_train.drafters.common.loading import load_drafter
    from drafter_train.recipes.export import ExportConfig, export
    from tests.stubs import word_tokenizer

    out = tmp_path / "hf"
    export(ExportConfig(run_dir=str(dflash_run), which="latest", output_dir=str(out)))
    assert json.loads((out / "config.json").read_text())["model_type"] == "dflash_drafter"
    card = (out / "README.md").read_text()
    assert "dflash" in card and "assistant_model" not in card and str(tmp_path) not in card
    target = load_causal_lm(str(tiny_data / "target"))
    loaded = load_drafter(DrafterConfig(path=str(out)), target, word_tokenizer(), "float32")
    trained = load_drafter(DrafterConfig(path=str(dflash_run / "latest" / "drafter")), target, word_tokenizer(),
                           "float32")
    assert isinstance(loaded, DFlashModel)
    prompt = word_tokenizer()("the cat sat on")["input_ids"]
    a = generate_speculative(target, make_drafter(trained), prompt, 3, GREEDY, 20)
    b = generate_speculative(target, make_drafter(loaded), prompt, 3, GREEDY, 20)
    assert a.tokens == b.tokens == generate_autoregressive(target, prompt, 20).tokens
    assert a.stats.accepted == b.stats.accepted


def test_vllm_export_is_the_dflash_draft_model_folder_and_round_trips(dflash_run, tiny_data, tmp_path):
    """config.json as vLLM's DFlash reads it (DFlashDraftModel, block_size, dflash_config with mask_token_id and
    target_layer_ids in DFlash's "output of layer i" convention = ours), and the weights, mask_embedding.pt and the
    target's embeddings rebuild exactly the trained drafter."""
    from drafter_train.recipes.export import ExportConfig, export

    out = tmp_path / "vllm"
    export(ExportConfig(run_dir=str(dflash_run), which="latest", output_dir=str(out), format="vllm",
                        target_id="org/tiny-target"))
    spec = json.loads((out / "config.json").read_text())
    trained_dir = dflash_run / "latest" / "drafter"
    trained_cfg = json.loads((trained_dir / "config.json").read_text())
    assert spec["architectures"] == ["DFlashDraftModel"] and spec["model_type"] == "qwen3"
    assert spec["block_size"] == 4 and spec["num_hidden_layers"] == 1 and spec["num_target_layers"] == 3
    assert spec["dflash_config"] == {"mask_token_id": trained_cfg["mask_token_id"], "target_layer_ids": [0, 2],
                                     "block_size": 4}
    assert spec["draft_vocab_size"] == 16 and spec["target_hidden_size"] == 64 and spec["head_dim"] == 16
    assert spec["rope_parameters"]["rope_theta"] == trained_cfg["backbone"]["rope_parameters"]["rope_theta"]
    weights = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in weights and "t2d" not in weights and "mask_embedding" not in weights
    assert {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
            "norm.weight", "lm_head.weight", "d2t"} <= set(weights)
    mask = torch.load(out / "mask_embedding.pt")
    assert mask["mask_token_id"] == trained_cfg["mask_token_id"]
    # round trip: the exported files plus the target's embeddings are the trained drafter, tensor for tensor
    target = load_causal_lm(str(tiny_data / "target"))
    trained = DFlashModel.from_pretrained(trained_dir)
    rebuilt = DFlashModel(trained.config)
    state = dict(weights, mask_embedding=mask["embedding"], t2d=trained.t2d,
                 **{"embed_tokens.weight": target.get_input_embeddings().weight.data})
    rebuilt.load_state_dict(state, strict=True)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name


def test_sglang_export_refuses_what_sglang_would_serve_differently(dflash_run, tiny_data, tmp_path):
    from drafter_train.recipes.export import ExportConfig, export

    with pytest.raises(ConfigError, match="export.format=sglang: .*a learned mask embedding.*a reduced draft "
                                          "vocabulary.*an LM head of its own"):
        export(ExportConfig(run_dir=str(dflash_run), which="latest", output_dir=str(tmp_path / "x"),
                            format="sglang"))
    cfg = dflash_cfg(tiny_data, tmp_path / "runs", "train.max_steps=1", "train.save_every=1",
                     "drafter.learned_mask=false", "drafter.draft_vocab_size=0", "drafter.freeze_lm_head=true",
                     "train.eval_at_start=false")
    train(cfg)
    out = tmp_path / "sglang"
    export(ExportConfig(run_dir=str(tmp_path / "runs" / cfg.train.run_name), which="latest", output_dir=str(out),
                        format="sglang"))
    spec = json.loads((out / "config.json").read_text())
    assert spec["architectures"] == ["DFlashDraftModel"] and spec["draft_vocab_size"] == spec["vocab_size"]
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights and "d2t" not in weights and not (out / "mask_embedding.pt").exists()


def test_engine_export_refuses_layers_the_engines_do_not_run(tiny_data, tmp_path):
    from drafter_train.recipes.export import ExportConfig, export

    for name, option, message in (("llama", "drafter.qk_norm=false", "Qwen3 layers; this one has 'llama' layers"),
                                  ("fc_norm", "drafter.fc_norm=true", "no per-layer fc_norm")):
        cfg = dflash_cfg(tiny_data, tmp_path / name, "train.max_steps=1", "train.save_every=1", option,
                         "train.eval_at_start=false")
        train(cfg)
        with pytest.raises(ConfigError, match=message):
            export(ExportConfig(run_dir=str(tmp_path / name / cfg.train.run_name), which="latest",
                                output_dir=str(tmp_path / "x"), format="vllm"))


def test_gguf_export_of_a_reduced_vocabulary_adds_d2t_after_llamacpps_converter(dflash_run, tmp_path, monkeypatch):
    """llama.cpp's dflash graph scatters a reduced draft vocabulary's logits through a `d2t` tensor (I64, absolute
    target ids), but its converter's DFlash class maps no d2t ("Can not map tensor 'model.d2t'", measured on the
    1.5B's drafter). So the converter must get the staged folder without d2t, and drafter.gguf must hold it, absolute,
    beside what the converter wrote. The converter is stubbed here (no llama.cpp in the default suite); the opt-in
    test_engine_llamacpp serves a real one."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from drafter_train import llamacpp
    from drafter_train.gguf_file import save_gguf
    from drafter_train.recipes.export import ExportConfig, export

    seen = {}

    def converter(root, model_dir, out_file, outtype, target_dir=None, name="drafter"):
        weights = load_file(str(model_dir / "model.safetensors"))
        seen["names"] = set(weights)
        writer = gguf.GGUFWriter(out_file, "dflash")
        writer.add_tensor("output.weight", weights["lm_head.weight"].float().numpy())
        save_gguf(writer)
        return out_file

    root = tmp_path / "llamacpp"
    (root / "llama.cpp").mkdir(parents=True)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")  # found, never run: convert is the stub above
    monkeypatch.setattr(llamacpp, "convert", converter)
    out = tmp_path / "gguf"
    export(ExportConfig(run_dir=str(dflash_run), which="latest", output_dir=str(out), format="gguf",
                        gguf_type="f32", gguf_target=False, llamacpp=str(root)))
    assert "d2t" not in seen["names"] and "lm_head.weight" in seen["names"]
    trained = load_file(str(dflash_run / "latest" / "drafter" / "model.safetensors"))
    tensors = {t.name: t for t in gguf.GGUFReader(out / llamacpp.DRAFTER_FILE).tensors}
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    expected = trained["d2t"].long() + torch.arange(16)
    assert expected.unique().numel() == 16 and not torch.equal(expected, torch.arange(16))  # a real mapping
    assert np.array_equal(np.asarray(tensors["d2t"].data).reshape(-1), expected.numpy())
    assert np.array_equal(np.asarray(tensors["output.weight"].data), trained["lm_head.weight"].float().numpy())
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".gguf") == [llamacpp.DRAFTER_FILE]
