"""Spec-Drafter (drafters/nar.py): the block mask, one-pass drafting with caches, lossless decoding, training,
save/load."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModel

from drafter_train.config import DrafterConfig, EvalConfig
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.drafters.registry import make_drafter
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.nar.model import NARCaches, NARDrafter, SpecDrafter, block_attention_mask
from drafter_train.errors import ConfigError
from drafter_train.recipes.evaluate import evaluate_decoding
from drafter_train.evaluation import target_logprob_sum
from drafter_train.drafters.common.block_distill import block_batch, glance, sample_block_starts
from drafter_train.data.batches import collate
from drafter_train.recipes.train import train
from tests.conftest import tiny_llama
from tests.stubs import compose_cfg, save_tiny, word_tokenizer
from tests.test_train import losses, stories_run, train_cfg


def spec(target, num_layers=2, encoder_layers=0, draft_len=4, seed=0):
    torch.manual_seed(seed)
    return SpecDrafter.from_target(target, num_layers, encoder_layers, draft_len).eval()


# ---- the block mask ------------------------------------------------------------------------------------------------


def test_block_mask_matches_a_naive_reference():
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    context_lens, k = torch.tensor([[2, 4], [5, 1]]), 3
    mask = block_attention_mask(attention_mask, context_lens, k, torch.float32)[:, 0] == 0  # True = may attend
    T, n = 6, 2
    for b in range(2):
        for i in range(T + n * k):
            for j in range(T + n * k):
                if i < T:  # context row: causal over real tokens, never a query
                    want = j < T and j <= i and bool(attention_mask[b, j])
                else:  # query of block m: its context, and its own block's queries
                    m = (i - T) // k
                    want = j < context_lens[b, m] if j < T else (j - T) // k == m
                assert bool(mask[b, i, j]) == want, (b, i, j)


@pytest.mark.parametrize("encoder_layers", [0, 1])
def test_queries_never_see_the_tokens_they_predict(encoder_layers):
    drafter = spec(tiny_llama(num_layers=4), num_layers=3, encoder_layers=encoder_layers)
    ids = torch.randint(3, 64, (1, 12))
    ones, context_lens = torch.ones_like(ids), torch.tensor([[5, 9]])
    with torch.no_grad():
        before = drafter(ids, ones, context_lens)
        changed = ids.clone()
        changed[0, 5:] = (changed[0, 5:] + 7) % 64  # every token block 0 predicts (and more) is different
        after = drafter(changed, ones, context_lens)
    torch.testing.assert_close(after[0, 0], before[0, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[0, 1], before[0, 1])  # block 1 reads tokens 5..8: the mask is not blind


def test_blocks_in_one_forward_equal_blocks_alone():
    drafter = spec(tiny_llama(num_layers=4), num_layers=3, encoder_layers=1)
    ids = torch.randint(3, 64, (2, 30))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 24:] = 0
    context_lens = torch.randint(1, 24, (2, 6))
    with torch.no_grad():
        together = drafter(ids, attention_mask, context_lens)
        for m in range(6):
            alone = drafter(ids, attention_mask, context_lens[:, m : m + 1])
            torch.testing.assert_close(alone[:, 0], together[:, m], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("encoder_layers", [0, 1])
def test_cached_one_pass_drafting_matches_the_training_forward(encoder_layers):
    """Decoding feeds new tokens after the cached context; the queries must see exactly what training showed them."""
    drafter = spec(tiny_llama(num_layers=4), num_layers=3, encoder_layers=encoder_layers)
    ids = torch.randint(3, 64, (1, 11))
    with torch.no_grad():
        reference = drafter(ids, torch.ones_like(ids), torch.tensor([[3, 5, 9, 11]]))[0]
        caches = NARCaches(drafter)
        for m, (start, end) in enumerate([(0, 3), (3, 5), (5, 9), (9, 11)]):
            logits = drafter.draft_logits(ids[0, start:end], caches)
            torch.testing.assert_close(logits, reference[m], rtol=1e-4, atol=1e-4)
            assert caches.length == end and caches.decoder.get_seq_length() == end  # queries dropped again


# ---- decoding --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_len", [1, 2, 3, 4])
@pytest.mark.parametrize("encoder_layers", [0, 1])
def test_greedy_with_nar_drafter_is_lossless_on_tiny_llama(draft_len, encoder_layers):
    target = tiny_llama(num_layers=4)
    drafter = NARDrafter(spec(target, num_layers=3, encoder_layers=encoder_layers))
    for prompt in ([1, 5, 9], [1, 22, 7, 30, 4]):
        ar = generate_autoregressive(target, prompt, 40)
        out = generate_speculative(target, drafter, prompt, draft_len, make_verifier("greedy", SamplingParams()), 40)
        assert out.tokens == ar.tokens
        assert out.stats.target_forward_passes <= ar.stats.target_forward_passes


def test_nar_drafter_with_the_target_layers_accepts_drafts():
    """Sanity of the whole path: a drafter cut from the target proposes something the target accepts sometimes."""
    target = tiny_llama(num_layers=4, init=0.05)  # smooth logits: the cut drafter agrees with the target often
    out = generate_speculative(target, NARDrafter(spec(target, num_layers=3)), [1, 5, 9], 1,
                               make_verifier("greedy", SamplingParams()), 40)
    assert out.stats.acceptance_rate > 0


def test_greedy_with_nar_drafter_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_causal_lm

    target = load_causal_lm(str(stories_path))
    drafter = NARDrafter(spec(target, num_layers=2, draft_len=4))
    for prompt in ([1, 403, 407, 261, 270], [1, 365, 303, 338]):
        ar = generate_autoregressive(target, prompt, 48)
        out = generate_speculative(target, drafter, prompt, 4, make_verifier("greedy", SamplingParams()), 48)
        assert out.tokens == ar.tokens


def test_drafting_more_than_the_mask_queries_is_refused():
    target = tiny_llama(num_layers=4)
    with pytest.raises(ConfigError, match="eval.draft_len: this Spec-Drafter has 2 mask queries"):
        generate_speculative(target, NARDrafter(spec(target, draft_len=2)), [1, 5], 3,
                             make_verifier("greedy", SamplingParams()), 10)


def test_specdec_reports_the_target_likelihood_of_both_outputs():
    target = tiny_llama(num_layers=4)
    drafter = make_drafter(spec(target, num_layers=3))
    prompts = [[1, 5, 9], [1, 22, 7]]
    strict = evaluate_decoding(target, drafter, prompts, EvalConfig(verify="specdec", specdec_top_beta=1,
                               specdec_tolerance=0.0, max_new_tokens=16, warmup=0), [2], progress=False)
    assert strict["greedy_match"] == 1.0  # beta=1, tolerance 0 is greedy verification
    assert strict["spec_target_logprob"] == strict["ar_target_logprob"] < 0
    # the reported value is the mean per-token log-likelihood under the target
    ar = generate_autoregressive(target, prompts[0], 16)
    with torch.no_grad():
        logits = target(torch.tensor([prompts[0] + ar.tokens])).logits[0, len(prompts[0]) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(ar.tokens)[:, None]).sum()
    assert target_logprob_sum(target, prompts[0], ar.tokens) == pytest.approx(float(expected), rel=1e-5)
    relaxed = evaluate_decoding(target, drafter, prompts, EvalConfig(verify="specdec", specdec_top_beta=8,
                                specdec_tolerance=20.0, max_new_tokens=16, warmup=0), [2], progress=False)
    assert relaxed["greedy_match"] < 1.0 and relaxed["spec_target_logprob"] < relaxed["ar_target_logprob"]


# ---- save / load -----------------------------------------------------------------------------------------------------


def test_save_load_round_trip_gives_identical_drafts(tmp_path):
    target = tiny_llama(num_layers=4)
    drafter = spec(target, num_layers=3, encoder_layers=1, draft_len=3)
    save_tiny(drafter, tmp_path / "nar")
    config = json.loads((tmp_path / "nar" / "config.json").read_text())
    assert config["model_type"] == "spec_drafter" and config["draft_len"] == 3 and config["encoder_layers"] == 1
    loaded = load_drafter(DrafterConfig(path=str(tmp_path / "nar")), target, word_tokenizer(), "float32")
    assert isinstance(loaded, SpecDrafter) and isinstance(AutoModel.from_pretrained(tmp_path / "nar"), SpecDrafter)
    params = SamplingParams()
    for prompt in ([1, 5, 9], [1, 30, 2, 7, 7]):
        seq = torch.tensor(prompt)
        a = NARDrafter(drafter).propose(seq, 3, params, None).tokens
        b = NARDrafter(loaded).propose(seq, 3, params, None).tokens
        assert a.tolist() == b.tolist()
    for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_nar_kind_on_an_autoregressive_folder_is_refused(tmp_path):
    target = tiny_llama(num_layers=4)
    save_tiny(tiny_llama(num_layers=1), tmp_path / "ar")
    with pytest.raises(ConfigError, match="drafter.kind=nar: .* holds an autoregressive drafter, not a Spec-Drafter"):
        load_drafter(DrafterConfig(kind="nar", path=str(tmp_path / "ar")), target, word_tokenizer(), "float32")


def test_bad_encoder_split_fails_in_one_line():
    with pytest.raises(ConfigError, match="drafter.encoder_layers"):
        spec(tiny_llama(num_layers=4), num_layers=2, encoder_layers=2)


# ---- training data: blocks -------------------------------------------------------------------------------------------


def _records():
    return [{"prompt_ids": [1, 4, 5], "response_ids": [10, 11, 12, 13, 14, 15]},
            {"prompt_ids": [1, 6], "response_ids": [20, 21, 22]}]


def test_blocks_gather_the_next_draft_len_response_tokens():
    batch = collate(_records(), "response_ids", 64, 0)
    blocks = block_batch(batch, torch.tensor([[0, 4], [1, -1]]), 3)
    assert blocks.context_lens.tolist() == [[3, 7], [3, 2]]  # prompt + response[:start] (row 2's 2nd: no block)
    assert blocks.labels.view(2, 2, 3)[0].tolist() == [[10, 11, 12], [14, 15, 15]]
    assert blocks.resp_mask.view(2, 2, 3).tolist() == [[[True] * 3, [True, True, False]],
                                                       [[True, True, False], [False] * 3]]
    assert blocks.num_tokens == 3 + 2 + 2  # what the blocks predict, not the response length
    # the positions whose TARGET logits predict each block token (the online teacher's)
    assert blocks.resp_pos.view(2, 2, 3)[0, 0].tolist() == [2, 3, 4]


def test_block_starts_are_distinct_response_positions():
    torch.manual_seed(0)
    batch = collate(_records(), "response_ids", 64, 0)
    starts = sample_block_starts(batch.resp_mask, 4)
    assert starts.shape == (2, 4)
    row0, row1 = starts[0].tolist(), starts[1].tolist()
    assert len(set(row0)) == 4 and all(0 <= s < 6 for s in row0)
    assert sorted(s for s in row1 if s >= 0) == [0, 1, 2] and row1.count(-1) == 1
    assert sample_block_starts(batch.resp_mask, 0)[1].tolist() == [0, 1, 2, -1, -1, -1]


def test_glancing_reveals_a_share_of_the_wrong_tokens():
    torch.manual_seed(0)
    drafter = spec(tiny_llama(num_layers=4), num_layers=3, draft_len=3)
    batch = collate(_records(), "response_ids", 64, 0)
    blocks = block_batch(batch, torch.tensor([[0, 3], [0, -1]]), 3)
    labels, mask = blocks.labels.view(2, 2, 3), blocks.resp_mask.view(2, 2, 3)
    with torch.no_grad():
        predicted = drafter(blocks.input_ids, blocks.attention_mask, blocks.context_lens).argmax(-1)
    wrong = (predicted != labels) & mask
    glance_ids, learn = glance(predicted, labels, mask, 1.0)
    revealed = glance_ids >= 0
    assert torch.equal(revealed.sum(-1), wrong.sum(-1))  # ratio 1: as many as are wrong
    assert torch.equal(glance_ids[revealed], labels[revealed]) and not (learn & revealed).any()
    assert torch.equal(learn | revealed, mask)
    none, _ = glance(predicted, labels, mask, 0.2)  # round(0.2 * at most 3) = 0 or 1
    assert ((none >= 0).sum(-1) <= 1).all()


# ---- training through the trainer --------------------------------------------------------------------------------


def test_every_nar_option_composes():
    cfg = OmegaConf.to_object(compose_cfg("train", ["drafter=nar", "drafter.encoder_layers=1",
                                                    "drafter.glancing_ratio=0.5"]))
    assert cfg.drafter.kind == "nar" and cfg.train.run_name == f"nar-{cfg.loss.name}-k4"


@pytest.mark.parametrize("extra", [["loss=ce"], ["loss=fkl", "drafter.glancing_ratio=0.5"],
                                   ["loss=reach_weighted_tvd", "drafter.path=truncated:2", "drafter.encoder_layers=1"],
                                   ["loss=accepted_length", "loss.teacher=offline"]])
def test_tiny_nar_run_trains_checkpoints_and_reloads(tiny_data, tmp_path, extra):
    cfg = train_cfg(tiny_data, tmp_path, "drafter=nar", "train.max_steps=12", "train.save_every=6", *extra)
    metrics = train(cfg)
    run_dir = tmp_path / cfg.train.run_name
    by_step = losses(run_dir)
    assert sum(by_step[s] for s in (10, 11, 12)) < sum(by_step[s] for s in (1, 2, 3))  # blocks are random: smooth
    assert metrics["greedy_match"] == 1.0
    saved = json.loads((run_dir / "latest" / "drafter" / "config.json").read_text())
    assert saved["model_type"] == "spec_drafter"
    # resuming a finished run reloads the Spec-Drafter from its checkpoint and reports the last evaluation
    assert train(cfg)["tau"] == metrics["tau"]


def test_nar_training_raises_tau_on_stories260k(stories_path, stories_data, tmp_path):
    metrics, baseline, _ = stories_run(stories_path, stories_data, tmp_path, "drafter=nar", "drafter.path=truncated:2",
                                       "drafter.glancing_ratio=0.5", "train.max_steps=60", "train.save_every=60")
    assert metrics["tau"] > baseline + 0.4 and metrics["greedy_match"] == 1.0


def test_exported_nar_drafter_loads_and_decodes_losslessly(tiny_data, tmp_path):
    """drafter-export on a NAR run: a folder AutoModel loads (after the import that registers the class), with a card
    that points at the project's decoder instead of assisted generation, and greedy output equal to the target's."""
    from drafter_train.recipes.export import ExportConfig, export
    from drafter_train.targets import load_causal_lm

    cfg = train_cfg(tiny_data, tmp_path / "runs", "drafter=nar", "train.max_steps=3", "train.save_every=3")
    train(cfg)
    out = tmp_path / "out"
    export(ExportConfig(run_dir=str(tmp_path / "runs" / cfg.train.run_name), which="latest", output_dir=str(out)))
    card = (out / "README.md").read_text()
    assert "make_drafter(AutoModel.from_pretrained(" in card and "assistant_model" not in card
    assert "spec-drafter" in card and str(tmp_path) not in card
    assert "num_assistant_tokens" not in (out / "generation_config.json").read_text() \
        if (out / "generation_config.json").exists() else True
    drafter = AutoModel.from_pretrained(out).eval()
    target = load_causal_lm(str(tiny_data / "target"))
    prompt = word_tokenizer()("the cat sat on")["input_ids"]
    ar = generate_autoregressive(target, prompt, 20)
    spec_out = generate_speculative(target, make_drafter(drafter), prompt, 4, make_verifier("greedy", SamplingParams()), 20)
    assert isinstance(drafter, SpecDrafter) and spec_out.tokens == ar.tokens


@pytest.mark.parametrize("tied", [True, False])
def test_nar_drafter_is_the_size_of_the_ar_drafter_cut_from_the_same_layers(tied):
    """Same layers, same (tied or not, as in the target) embeddings and head, plus draft_len query vectors."""
    from drafter_train.drafters.common.truncated import cut_from_target

    target = tiny_llama(num_layers=4)
    target.config.tie_word_embeddings = tied
    if tied:
        target.tie_weights()
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731  (shared tensors count once)
    nar, ar = spec(target, num_layers=2, draft_len=4), cut_from_target(target, 2)
    assert count(nar) == count(ar) + 4 * target.config.hidden_size
