"""EAGLE-3: target features, the reduced draft vocabulary, training-time test, decoding, saving, training."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from drafter_train import draft_vocab
from drafter_train.data.batches import collate
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.conditioned import target_signals
from drafter_train.drafters.eagle3.model import Eagle3Drafter
from drafter_train.drafters.eagle3.modeling import Eagle3Model, later_rows, ttt_mask
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.features import FeatureTap, default_layers
from drafter_train.targets import load_causal_lm
from drafter_train.recipes.train import train
from tests.stubs import VOCAB, compose_cfg
from tests.test_sampling_exactness import RUNS, chi2_pvalue, enumerate_marginals
from tests.test_train import train_cfg

GREEDY = make_verifier("greedy", SamplingParams())


def random_eagle3(target, layers=(0, 2, 3), draft_ids=None, scale=0.3, seed=1, fc_norm=True, norm_before_fc=False,
                  **capacity):
    """An EAGLE-3 drafter for `target` with large random weights (so that its drafts vary and sometimes match);
    norm_before_fc: llama.cpp's one input norm instead of fc_norm, its weight random too; capacity: num_layers and
    intermediate_size."""
    vocab = target.config.vocab_size
    ids = torch.arange(vocab) if draft_ids is None else draft_ids
    model = Eagle3Model.from_target(target, list(layers), ids, fc_norm and not norm_before_fc, 4, norm_before_fc,
                                    **capacity)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() > 1 and not name.startswith("embed_tokens"):
            p.data.copy_(torch.randn(p.shape, generator=gen) * scale)
        elif name == "input_norm.weight":
            p.data.copy_(1 + torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# Target features


def test_tapped_features_are_the_layer_outputs(make_tiny_llama):
    target = make_tiny_llama(num_layers=4)
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad(), FeatureTap(target, [0, 1, 3]) as tap:
        out = target(input_ids=ids, output_hidden_states=True)
        features = tap.features
    hidden = out.hidden_states  # [embeddings, layer 0, ..., layer 3 after the final norm]
    torch.testing.assert_close(features[..., :64], hidden[1])
    torch.testing.assert_close(features[..., 64:128], hidden[2])
    # transformers normalises its last entry; the tap gives the raw output of the last layer
    torch.testing.assert_close(target.model.norm(features[..., 128:]), hidden[4])
    assert not torch.allclose(features[..., 128:], hidden[4])


def test_default_layers_are_eagle3s_low_mid_high():
    assert default_layers(30) == [2, 15, 27]
    assert default_layers(4) == [1, 2]  # distinct and in range on tiny targets


# ---------------------------------------------------------------------------------------------------------------
# Draft vocabulary


def test_draft_vocab_keeps_the_most_frequent_tokens_and_eos():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = draft_vocab.select_draft_ids(counts, 4, always=[6])
    assert ids.tolist() == [2, 3, 5, 6]  # 9, 9, 7 and the EOS id 6; ties broken by the lower id
    d2t, t2d = draft_vocab.mapping(ids, 8)
    assert (draft_vocab.draft_to_target(d2t) == ids).all() and t2d.nonzero().flatten().tolist() == ids.tolist()
    assert draft_vocab.target_to_draft(d2t, 8).tolist() == [-1, -1, 0, 1, -1, 2, 3, -1]
    assert draft_vocab.coverage(torch.tensor([2, 2, 0, 5]), t2d) == 0.75
    assert draft_vocab.select_draft_ids(counts, 0).tolist() == list(range(8))


def test_a_mapping_that_does_not_fit_the_head_is_refused():
    ids = torch.tensor([1, 4, 6])
    d2t, t2d = draft_vocab.mapping(ids, 8)
    draft_vocab.check_mapping(d2t, t2d, 3)
    with pytest.raises(ConfigError, match="LM head has 4 rows"):
        draft_vocab.check_mapping(d2t, t2d, 4)
    other_t2d = t2d.clone()
    other_t2d[[4, 5]] = torch.tensor([False, True])
    with pytest.raises(ConfigError, match="different target ids"):
        draft_vocab.check_mapping(d2t, other_t2d, 3)


# ---------------------------------------------------------------------------------------------------------------
# Training-time test


def naive_ttt_mask(attention_mask, rows, step):
    batch, length = attention_mask.shape
    width = rows.shape[1]
    allowed = torch.zeros(batch, width, length + step * width, dtype=torch.bool)
    for b in range(batch):
        for w in range(width):
            t = int(rows[b, w])
            for s in range(t + 1):
                allowed[b, w, s] = bool(attention_mask[b, s])
            for j in range(1, step + 1):
                allowed[b, w, length + (j - 1) * width + w] = True
    return allowed


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_mask_equals_a_naive_loop(step):
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    rows = torch.arange(5).expand(2, -1) if step == 0 else torch.tensor([[2, 3, 4], [0, 1, 2]])
    mask = ttt_mask(attention_mask, rows, step, torch.float32)[:, 0]
    assert torch.equal(mask == 0, naive_ttt_mask(attention_mask, rows, step))
    assert mask.min() == torch.finfo(torch.float32).min


def test_later_ttt_steps_skip_prompt_rows_only_where_no_loss_reads_them():
    gather_pos = torch.tensor([[5, 6, 7], [2, 3, 4]])  # first learned target position per row
    rows = later_rows(gather_pos, 9, steps=3)
    assert rows.tolist() == [[2, 3, 4, 5, 6, 7, 8, 8, 8], list(range(9))]


@torch.no_grad()
def test_ttt_unroll_equals_sequential_decoding_steps(make_tiny_llama):
    """Training's unrolled step j at row t gives the logits a decoder reaches after step 0 over rows 0..t (cached)
    and j single-token steps, the training/decoding consistency others' users most often find broken."""
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, draft_ids=torch.arange(40) + 10)
    ids = torch.randint(3, 64, (1, 12))
    features, _ = target_signals(target, collate([{"prompt_ids": ids[0, :4].tolist(),
                                                   "response_ids": ids[0, 4:].tolist()}], "response_ids", 64, 0),
                                 model.config.target_layers)
    assert_unroll_equals_decoding(model, ids, features)


def assert_unroll_equals_decoding(model, ids, features, steps=3):
    """ids [1, 12]: training's unrolled step j at each row t < 8 against step 0 over rows 0..t then j cached
    single-token steps. Returns the last decoding cache."""
    gather = torch.arange(1, 12)[None]  # target positions p: step j learns them at row p - 1 - j
    unrolled = model(ids, features, torch.ones_like(ids), gather, steps)
    for t in range(8):
        cache, length = model.new_cache(), t + 1
        causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
        hidden = model.step(ids[:, 1:length + 1], model.fuse(features[:, :length]), torch.arange(length)[None],
                            causal, cache)[:, -1:]
        for j in range(steps):
            expected = unrolled[j][0, t + j]  # gather column p - 1 = t + j
            torch.testing.assert_close(model.draft_logits(hidden)[0, -1], expected, rtol=1e-4, atol=1e-4)
            hidden = model.step(ids[:, t + 2 + j].view(1, 1), hidden, torch.tensor([[t + 1 + j]]), None, cache)
    return cache


@torch.no_grad()
def test_decoder_side_drafter_proposes_what_training_predicts(make_tiny_llama):
    """The decoder's greedy drafts, fed back to training as data, are exactly training's argmax at every step."""
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, draft_ids=torch.arange(3, 64, 2))
    drafter = Eagle3Drafter(model)
    prompt = torch.tensor([1, 7, 9, 4, 12, 30])
    with FeatureTap(target, model.config.target_layers) as tap:
        target(input_ids=prompt[None])
        drafter.reset()
        drafter.commit(prompt.numel(), tap.features[0])
    seq = torch.cat([prompt, torch.tensor([21])])  # the target's token after the prompt, say
    drafts = drafter.propose(seq, 4, SamplingParams(), None).tokens
    full = torch.cat([seq, drafts])[None]
    features, _ = target_signals(target, collate([{"prompt_ids": full[0].tolist(), "response_ids": [0]}],
                                                 "response_ids", 64, 0), model.config.target_layers)
    row = prompt.numel() - 1  # the last verified position; step j at this row drafts token seq_len + j
    gather = torch.arange(row + 1, row + 5)[None]  # step j reads gather column j: row + 1 + j - 1 - j = row
    unrolled = model(full, features[:, :full.shape[1]], torch.ones_like(full), gather, 4)
    predicted = [draft_vocab.draft_to_target(model.d2t)[unrolled[j][0, j].argmax()] for j in range(4)]
    assert torch.stack(predicted).tolist() == drafts.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Lossless decoding


@pytest.mark.parametrize("draft_len, norm_before_fc", [(k, False) for k in range(1, 9)] + [(1, True), (3, True),
                                                                                           (6, True)])
def test_greedy_with_eagle3_drafter_is_lossless_on_tiny_llama(make_tiny_llama, draft_len, norm_before_fc):
    target = make_tiny_llama(vocab_size=16, num_layers=4, init=0.5)
    model = random_eagle3(target, draft_ids=torch.tensor([0, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 15]), scale=0.5,
                          norm_before_fc=norm_before_fc)
    prompt = [1, 5, 9, 12, 7]
    ar = generate_autoregressive(target, prompt, 40)
    spec = generate_speculative(target, make_drafter(model), prompt, draft_len, GREEDY, 40)
    assert spec.tokens == ar.tokens
    # drafts were accepted at every draft_len (3 or 4 of them), and each target pass gave its accepted drafts + 1 token
    assert spec.stats.accepted >= 3 and spec.stats.target_forward_passes == len(ar.tokens) - spec.stats.accepted


def test_greedy_with_eagle3_drafter_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_tokenizer

    target = load_causal_lm(str(stories_path))
    model = random_eagle3(target, layers=(1, 2, 3), draft_ids=torch.arange(300), scale=0.05)
    prompt = load_tokenizer(str(stories_path))("Once upon a time").input_ids
    ar = generate_autoregressive(target, prompt, 48)
    for draft_len in (1, 3, 8):
        assert generate_speculative(target, make_drafter(model), prompt, draft_len, GREEDY, 48).tokens == ar.tokens


def eagle3_counts(target, drafter, prompt, params, runs, num_tokens):
    counts = torch.zeros(num_tokens, target.config.vocab_size)
    generator = torch.Generator().manual_seed(1234)
    verifier = make_verifier("sample", params)
    for _ in range(runs):
        out = generate_speculative(target, drafter, prompt, 2, verifier, num_tokens, params, generator=generator)
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
    return counts


class IdentityMappedDrafter(Eagle3Drafter):
    """Bug: drafts mapped to target ids, but q reported at the draft ids as if they were target ids (a forgotten
    d2t where the probabilities are scattered, the kind of slip that goes unnoticed under greedy decoding)."""

    def _full_vocab(self, probs):
        full = probs.new_zeros(probs.shape[0], self.draft_vocab.numel())
        full[:, : probs.shape[1]] = probs
        return full


@pytest.mark.parametrize("broken", [False, True])
def test_speculative_sampling_with_eagle3_matches_tiny_llama_distribution(make_tiny_llama, broken):
    """q is zero outside the draft vocabulary: speculative sampling still follows the target exactly. Mapping the
    draft vocabulary wrongly must fail the same check."""
    target = make_tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    model = random_eagle3(target, layers=(1, 2), draft_ids=torch.tensor([1, 2, 4, 5, 7]), scale=0.4)
    params, prompt, num_tokens = SamplingParams(temperature=1.0), [1, 5, 3], 3
    drafter = (IdentityMappedDrafter if broken else Eagle3Drafter)(model)
    counts = eagle3_counts(target, drafter, prompt, params, RUNS, num_tokens)
    exact = enumerate_marginals(target, prompt, num_tokens, 8, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


# ---------------------------------------------------------------------------------------------------------------
# Saving and loading


def test_save_load_round_trip_keeps_the_mapping_and_the_drafts(make_tiny_llama, tmp_path):
    target = make_tiny_llama(num_layers=4)
    model = random_eagle3(target, draft_ids=torch.arange(5, 60, 3))
    model.save_pretrained(tmp_path / "d")
    loaded = make_drafter(Eagle3Model.from_pretrained(tmp_path / "d"))
    assert torch.equal(loaded.model.d2t, model.d2t) and torch.equal(loaded.model.t2d, model.t2d)
    # non-persistent buffers are recomputed, not left uninitialised
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, model.rotary_emb.inv_freq)
    prompt = [1, 5, 9, 12]
    a = generate_speculative(target, make_drafter(model), prompt, 4, GREEDY, 24)
    b = generate_speculative(target, loaded, prompt, 4, GREEDY, 24)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_a_drafter_trained_on_a_bf16_target_loads_whole_in_the_dtype_asked_for(make_tiny_llama, tmp_path):
    # Seen on an H200: a drafter saved from a bf16 run names bfloat16 in its backbone's sub-config, and transformers 5
    # loaded that layer in bf16 under dtype=float32, so an fp32 evaluation failed with a dtype mismatch.
    from drafter_train.drafters.eagle3.model import load

    target = make_tiny_llama(num_layers=4).to(torch.bfloat16)
    target.config.dtype = torch.bfloat16  # as a target loaded in bf16 says: the drafter's backbone config copies it
    random_eagle3(target).to(torch.bfloat16).save_pretrained(tmp_path / "d")
    for dtype in ("float32", "bfloat16"):
        floats = {p.dtype for p in load(str(tmp_path / "d"), dtype).parameters() if p.is_floating_point()}
        assert floats == {getattr(torch, dtype)}


def test_loading_a_folder_whose_mapping_does_not_fit_the_head_is_refused(make_tiny_llama, tmp_path):
    from drafter_train.drafters.eagle3.model import load

    target = make_tiny_llama(num_layers=4)
    random_eagle3(target, draft_ids=torch.arange(5, 60, 3)).save_pretrained(tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    # the mapping of another draft vocabulary of the same size
    weights["d2t"], weights["t2d"] = draft_vocab.mapping(torch.arange(6, 63, 3), 64)
    save_file(weights, tmp_path / "d" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="mapping does not match the LM head .*fingerprint differs"):
        load(str(tmp_path / "d"), "float32")
    weights["d2t"] = weights["d2t"][:-1]  # and one of another size
    save_file(weights, tmp_path / "d" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="weights do not fit its config.json"):
        load(str(tmp_path / "d"), "float32")


# ---------------------------------------------------------------------------------------------------------------
# Training through drafter-train


def eagle3_cfg(tiny_data, out, *overrides):
    """A tiny EAGLE-3 job: the recipe (conf/recipe/eagle3.yaml) with online features unless a test asks for the
    cache, and float32 named (the recipe's auto resolves only inside train(), and a test that reads a feature cache
    back computes its key from this config)."""
    return train_cfg(tiny_data, out, "drafter=eagle3", "drafter.path=new", "drafter.draft_vocab_size=16",
                     "drafter.target_layers=[0,1,2]", "drafter.features=online", "train.mixed_precision=no",
                     *overrides)


@pytest.mark.parametrize("features", ["online", "offline"])
def test_eagle3_trains_checkpoints_and_resumes_exactly(tiny_data, tmp_path, features, monkeypatch):
    from tests.test_train import assert_resumes_exactly, losses

    # offline: with feature noise too, which must come from the generator checkpoints keep (drafter.feature_noise)
    args = (f"drafter.features={features}", "loss=fkl") + (("drafter.feature_noise=0.2",) if features == "offline"
                                                          else ())
    run_a, run_b, metrics = assert_resumes_exactly(lambda out: eagle3_cfg(tiny_data, out, *args), "eagle3", tmp_path,
                                                   monkeypatch)
    a = load_file(run_a / "step-6" / "drafter" / "model.safetensors")
    b = load_file(run_b / "step-6" / "drafter" / "model.safetensors")
    # the draft vocabulary was chosen once, from the data, and the resumed run kept it
    assert torch.equal(a["d2t"], b["d2t"]) and int(a["t2d"].sum()) == 16
    assert metrics["greedy_match"] == 1.0 and "tau" in metrics
    assert losses(run_a)[6] < losses(run_a)[1]


def test_offline_features_equal_online_ones(tiny_data, tmp_path):
    from drafter_train.data import feature_cache
    from drafter_train.data.store import load_distill_dataset
    from drafter_train.drafters.common.conditioned import attach_cached_features, feature_root, feature_spec

    cfg = eagle3_cfg(tiny_data, tmp_path, "drafter.features=offline", "train.max_steps=1")
    train(cfg)
    target = load_causal_lm(str(tiny_data / "target"))
    data = load_distill_dataset(tiny_data / "data")
    spec = feature_spec(cfg, target, "response_ids", [0, 1, 2])
    root = feature_root(cfg, spec)
    manifest = json.loads((root / feature_cache.MANIFEST).read_text())
    assert manifest["records"] == len(data) and manifest["layers"] == [0, 1, 2] and manifest["bytes"] > 0
    cached = feature_cache.load_cache(root, spec, len(data))
    records = [dict(data[i], **cached[i]) for i in range(4)]
    batch = attach_cached_features(collate(records, "response_ids", 512, 0), records, cfg)
    online_features, online_hidden = target_signals(target, collate(records, "response_ids", 512, 0), [0, 1, 2])
    real = batch.attention_mask.bool()
    # The cache holds 16-bit features computed in other batch shapes than this batch's: fp32 sums in another order
    # can round to the neighbouring bf16 value (seen once in 17k values on an AVX2 EPYC), so within one bf16 step.
    one_step = dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(batch.features.float()[real], online_features[real].bfloat16().float(), **one_step)
    torch.testing.assert_close(batch.target_hidden.float()[batch.resp_mask],
                               online_hidden[batch.resp_mask].bfloat16().float(), **one_step)


def test_a_feature_cache_grows_with_train_max_records_and_serves_a_prefix(tiny_data, tmp_path):
    from drafter_train.data import feature_cache
    from drafter_train.data.store import load_distill_dataset

    cache, total = tmp_path / "cache", len(load_distill_dataset(tiny_data / "data"))
    seen = []
    for records in (4, 0, 5):  # a learning curve's points on one cache: 4 records, then all (the short shard is
        train(eagle3_cfg(tiny_data, tmp_path / f"r{records}", "drafter.features=offline", "train.max_steps=1",
                         f"drafter.feature_cache={cache}", f"train.max_records={records}"))  # redone), then a prefix
        seen.append(json.loads((cache / feature_cache.MANIFEST).read_text())["records"])
    assert total > 5 and seen == [4, total, total]


def test_a_feature_cache_is_extracted_again_for_records_datagen_made_anew(tiny_data, tmp_path, capfd):
    """The same target and layers over other records (drafter-datagen run again, here with shorter answers, into the
    folder the cache belongs to): the shards made from the old records are dropped and extracted again, never served
    as the new records' features."""
    from omegaconf import OmegaConf

    from drafter_train.data import feature_cache
    from drafter_train.data.store import load_distill_dataset
    from drafter_train.drafters.common.conditioned import feature_root, feature_spec
    from drafter_train.recipes.datagen import run_datagen
    from tests.stubs import compose_cfg

    cache = tmp_path / "cache"
    train(eagle3_cfg(tiny_data, tmp_path / "a", "drafter.features=offline", "train.max_steps=1",
                     f"drafter.feature_cache={cache}"))
    run_datagen(OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false",
        f"datagen.prompts={tiny_data / 'prompts.jsonl'}",
        "datagen.num_prompts=32", "datagen.num_eval_prompts=4", "datagen.max_new_tokens=5",
        f"datagen.output_dir={tmp_path / 'again'}", "datagen.store_topk=8"])), progress=False)
    capfd.readouterr()
    cfg = eagle3_cfg(tiny_data, tmp_path / "b", "drafter.features=offline", "train.max_steps=1",
                     f"drafter.feature_cache={cache}", f"train.data_dir={tmp_path / 'again'}")
    train(cfg)
    assert "were made from other records than the data holds now" in capfd.readouterr().err
    data = load_distill_dataset(tmp_path / "again")
    spec = feature_spec(cfg, load_causal_lm(str(tiny_data / "target")), "response_ids", [0, 1, 2])
    cached = feature_cache.load_cache(feature_root(cfg, spec), spec, len(data))
    width = 2 * 3 * spec.hidden_size  # bytes per position: three layers in 16 bits
    assert [len(row["features"]) // width for row in cached] == [
        min(len(r["prompt_ids"]) + len(r["response_ids"]), cfg.train.max_seq_len) for r in data]
    assert [len(row["target_hidden"]) // (2 * spec.hidden_size) for row in cached] == [
        len(r["response_ids"]) for r in data]


def test_a_feature_cache_made_by_another_target_or_layer_set_is_refused(tiny_data, tmp_path):
    cache = tmp_path / "cache"
    train(eagle3_cfg(tiny_data, tmp_path / "a", "drafter.features=offline", "train.max_steps=1",
                     f"drafter.feature_cache={cache}"))
    with pytest.raises(ConfigError, match=r"made for something else \(layers: \[0, 1, 2\] != \[0, 2\]"):
        train(eagle3_cfg(tiny_data, tmp_path / "b", "drafter.features=offline", "train.max_steps=1",
                         f"drafter.feature_cache={cache}", "drafter.target_layers=[0,2]"))
    with pytest.raises(ConfigError, match="made for something else .*target"):
        train(eagle3_cfg(tiny_data, tmp_path / "c", "drafter.features=offline", "train.max_steps=1",
                         f"drafter.feature_cache={cache}", f"target.path={tiny_data / 'other_target'}"))


# ---------------------------------------------------------------------------------------------------------------
# One-line errors


def test_bad_eagle3_settings_fail_in_one_line(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"drafter.target_layers: layer ids \[7\] out of range: the target has 3"):
        train(eagle3_cfg(tiny_data, tmp_path, "drafter.target_layers=[0,7]"))
    with pytest.raises(ConfigError, match="draft_vocab_size: 99 is larger than the target's vocabulary"):
        train(eagle3_cfg(tiny_data, tmp_path, "drafter.draft_vocab_size=99"))
    with pytest.raises(ConfigError, match="drafter.features"):
        OmegaConf.to_object(compose_cfg("train", ["drafter=eagle3", "drafter.features=somewhere"]))


def test_a_drafter_trained_for_another_hidden_size_is_refused(make_tiny_llama, tmp_path):
    from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig
    from drafter_train.drafters.common.loading import load_drafter
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.stubs import word_tokenizer

    target = make_tiny_llama(num_layers=4)
    random_eagle3(target).save_pretrained(tmp_path / "d")
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    with pytest.raises(ConfigError, match="hidden size 64, the target's is 96"):
        load_drafter(Eagle3DrafterConfig(path=str(tmp_path / "d")), wide, word_tokenizer(), "float32")


# ---------------------------------------------------------------------------------------------------------------
# Export for serving


@pytest.fixture(scope="module")
def eagle3_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("e3run")
    cfg = eagle3_cfg(tiny_data, out, "train.max_steps=3", "train.save_every=3", "drafter.fc_norm=false")
    train(cfg)
    return out / cfg.train.run_name


def test_vllm_export_is_the_speculators_format_with_engine_layer_ids(eagle3_run, tmp_path):
    from drafter_train.recipes.export import ExportConfig, export

    out = tmp_path / "vllm"
    export(ExportConfig(run_dir=str(eagle3_run), which="latest", output_dir=str(out), format="vllm",
                        target_id="org/tiny-target"))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    # our "output of layer i" is the engines' "input of layer i + 1"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 16 and config["target_hidden_size"] == 64
    assert config["norm_before_residual"] is False and config["fc_norm"] is False  # vLLM defaults the first to true
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB and layer["model_type"] == "llama"
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4 and spec["verifier"]["name_or_path"] == "org/tiny-target"
    exported = load_file(out / "model.safetensors")
    trained = load_file(eagle3_run / "latest" / "drafter" / "model.safetensors")
    assert "embed_tokens.weight" not in exported  # frozen copies of the target's: the engine shares the target's
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(exported)
    for name, tensor in exported.items():  # the trained weights, not a fresh init
        assert torch.equal(tensor, trained[name]), name
    assert exported["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64
    assert "vllm" in (out / "README.md").read_text() and str(tmp_path) not in (out / "README.md").read_text()


def test_full_vocabulary_vllm_export_has_no_d2t_but_gguf_staging_keeps_it(tiny_data, tmp_path):
    """drafter.draft_vocab_size=0: vLLM builds no draft_id_to_target_id for a full-vocabulary head and refuses a
    folder that holds d2t/t2d, so the vllm export leaves them out (the all-zero offsets carry nothing)."""
    from drafter_train.drafters.eagle3 import export as eagle3_export
    from drafter_train.recipes.export import ExportConfig, export

    cfg = eagle3_cfg(tiny_data, tmp_path / "runs", "train.max_steps=1", "train.save_every=1",
                     "drafter.draft_vocab_size=0", "drafter.fc_norm=false", "drafter.norm_before_fc=true")
    train(cfg)
    run = tmp_path / "runs" / cfg.train.run_name
    out = tmp_path / "vllm"
    export(ExportConfig(run_dir=str(run), which="latest", output_dir=str(out), format="vllm"))
    config = json.loads((out / "config.json").read_text())
    exported = load_file(out / "model.safetensors")
    trained = load_file(run / "latest" / "drafter" / "model.safetensors")
    assert config["draft_vocab_size"] == VOCAB and exported["lm_head.weight"].shape[0] == VOCAB
    assert "d2t" not in exported and "t2d" not in exported
    assert not trained["d2t"].any() and set(trained) - set(exported) == {"d2t", "t2d", "embed_tokens.weight"}
    staged = tmp_path / "staged"  # what llama.cpp's converter reads: unchanged
    eagle3_export._speculators_folder(json.loads((run / "latest" / "drafter" / "config.json").read_text()),
                                      run / "latest" / "drafter", staged, 4, "t", False)
    assert {"d2t", "t2d"} <= set(load_file(staged / "model.safetensors"))
    # a reduced vocabulary keeps its mapping
    assert eagle3_export.without_identity_mapping(trained, {"draft_vocab_size": 16, "vocab_size": VOCAB}) is trained


def test_norm_output_trains_exports_for_vllm_and_is_refused_where_engines_lack_it(tiny_data, tmp_path):
    """drafter.norm_output (EAGLE 3.1, speculators' default): every step reads the previous one's normed output."""
    from drafter_train.drafters.eagle3 import export as eagle3_export
    from drafter_train.recipes.export import ExportConfig, export

    cfg = eagle3_cfg(tiny_data, tmp_path / "runs", "train.max_steps=1", "train.save_every=1",
                     "drafter.norm_output=true", "drafter.fc_norm=false", "drafter.norm_before_fc=true")
    train(cfg)
    run = tmp_path / "runs" / cfg.train.run_name
    export(ExportConfig(run_dir=str(run), which="latest", output_dir=str(tmp_path / "vllm"), format="vllm"))
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["norm_output"] is True
    saved = json.loads((run / "latest" / "drafter" / "config.json").read_text())
    with pytest.raises(ConfigError, match="no norm_output"):
        eagle3_export.check_gguf(saved)
    model = Eagle3Model.from_pretrained(run / "latest" / "drafter").eval()
    hidden, tokens, positions = torch.randn(1, 3, 64), torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    with torch.no_grad():
        out = model.step(tokens, hidden, positions, None, model.new_cache())
        model.config.norm_output = False
        raw = model.step(tokens, hidden, positions, None, model.new_cache())
        torch.testing.assert_close(out, model.norm(raw))  # the next step's input: the normed output
        torch.testing.assert_close(model.lm_head(out), model.draft_logits(raw))  # the same drafts


def test_sglang_export_renames_the_layer_and_refuses_what_sglang_would_ignore(eagle3_run, tiny_data, tmp_path):
    from drafter_train.recipes.export import ExportConfig, export

    out = tmp_path / "sglang"
    export(ExportConfig(run_dir=str(eagle3_run), which="latest", output_dir=str(out), format="sglang"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 16
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    weights = load_file(out / "model.safetensors")
    assert "midlayer.hidden_norm.weight" in weights and not any(k.startswith("layers.") for k in weights)
    fc_norm_run = tmp_path / "runs"
    cfg = eagle3_cfg(tiny_data, fc_norm_run, "train.max_steps=1", "train.save_every=1", "drafter.fc_norm=true")
    train(cfg)
    with pytest.raises(ConfigError, match="SGLang's LlamaForCausalLMEagle3 has no fc_norm"):
        export(ExportConfig(run_dir=str(fc_norm_run / cfg.train.run_name), which="latest",
                            output_dir=str(tmp_path / "x"), format="sglang"))
