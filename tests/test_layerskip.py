"""drafter=layerskip: the target drafting for itself with sub-layers skipped, on its own KV cache; and the search."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from drafter_train.config import TrackerConfig
from drafter_train.drafters.layerskip.config import LayerSkipDrafterConfig
from drafter_train.recipes.datagen import run_datagen
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.cached_lm import CachedLM
from drafter_train.decoding.draft_exit import DraftExit
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.decoding.speculative import generate_speculative, generate_tree_speculative
from drafter_train.decoding.tree import TreeSpec
from drafter_train.decoding.verify import make_tree_verifier, make_verifier, verify_greedy
from drafter_train.drafters.layerskip import model as layerskip
from drafter_train.drafters.layerskip.model import LayerSkipDrafter, keep_first, new_model, skipping
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.recipes.evaluate import run_eval_job
from drafter_train.recipes.export import export
from drafter_train.drafters.layerskip.search import Proxy, SkipSet, expected_speedup, relative_cost
from drafter_train.recipes.report import write_report
from drafter_train.targets import load_causal_lm
from drafter_train.recipes.train import train
from tests.conftest import tiny_llama
from tests.stubs import SENTENCES, VOCAB, WORDS, compose_cfg, save_tiny, word_tokenizer
from tests.test_sampling_exactness import chi2_pvalue, enumerate_marginals, sampled_counts
from tests.test_tree_sampling import tree_counts

GREEDY = make_verifier("greedy", SamplingParams())
PROMPT = [1, 5, 9, 12, 7]


def drafter_for(target, attn=(), mlp=()):
    return make_drafter(new_model(target, attn, mlp))


# ---- drafting on the target's cache --------------------------------------------------------------------------------


def test_with_no_layer_skipped_drafting_is_the_target_and_everything_is_accepted(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    ar = generate_autoregressive(target, PROMPT, 30)
    chain = generate_speculative(target, drafter_for(target), PROMPT, 4, GREEDY, 30)
    tree = generate_tree_speculative(target, drafter_for(target), PROMPT, TreeSpec(2, 3),
                                     make_tree_verifier("greedy", SamplingParams()), 30)
    assert chain.tokens == tree.tokens == ar.tokens
    assert chain.stats.acceptance_rate == 1.0 and chain.stats.proposed > 0
    assert tree.stats.tau > 3  # depth 3: every pass but the shortened last ones accepts a whole path


def fresh_cache(target, tokens: list[int]) -> CachedLM:
    lm = CachedLM(target)
    lm.forward(torch.tensor(tokens), 1)
    return lm


def assert_same_cache(lm: CachedLM, reference: CachedLM) -> None:
    assert [layer.get_seq_length() for layer in lm.cache.layers] == \
        [layer.get_seq_length() for layer in reference.cache.layers]
    for layer, ref in zip(lm.cache.layers, reference.cache.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-4)


def test_after_drafting_and_a_rejection_each_layer_holds_a_fresh_prefixs_cache(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    lm = fresh_cache(target, PROMPT)  # the loop's invariant: the target's cache holds seq[:-1]
    seq = torch.tensor(PROMPT + [3])
    drafter = drafter_for(target, attn=(2, 3), mlp=(1, 4))
    drafter.reset()
    drafter.share_target(lm)
    proposal = drafter.propose(seq, 4, SamplingParams(), None)
    assert_same_cache(lm, fresh_cache(target, PROMPT))  # drafting left the verified prefix as it was
    logits = lm.forward(torch.cat([seq[-1:], proposal.tokens]), proposal.draft_len + 1)
    accepted, _ = verify_greedy(proposal, logits)
    assert accepted < proposal.draft_len  # a rejection
    lm.crop(seq.numel() + accepted)
    drafter.commit(seq.numel() + accepted)
    assert_same_cache(lm, fresh_cache(target, seq.tolist() + proposal.tokens[:accepted].tolist()))


def test_skipped_attention_adds_no_entries_so_a_uniform_crop_would_corrupt_the_cache(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    uniform, per_layer = fresh_cache(target, PROMPT), fresh_cache(target, PROMPT)
    for lm in (uniform, per_layer):
        with skipping(target, (2, 3), (1,)):
            lm.forward(torch.tensor([3, 8, 11]), 1)
    lengths = [layer.get_seq_length() for layer in per_layer.cache.layers]
    assert lengths == [8, 8, 5, 5, 8, 8]  # the cache grew unevenly
    uniform.cache.crop(-3)
    assert [layer.get_seq_length() for layer in uniform.cache.layers] == [5, 5, 2, 2, 5, 5]  # verified entries lost
    keep_first(per_layer.cache, len(PROMPT))
    assert_same_cache(per_layer, fresh_cache(target, PROMPT))


def test_a_uniform_crop_in_the_drafter_breaks_lossless_decoding(make_tiny_llama, monkeypatch):
    """The per-layer restore is what keeps decoding lossless: swapping in a uniform crop changes the output."""
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    ar = generate_autoregressive(target, PROMPT, 30)

    def uniform_crop(cache, length):
        cache.crop(length - cache.layers[0].get_seq_length())

    monkeypatch.setattr(layerskip, "keep_first", uniform_crop)
    try:
        broken = generate_speculative(target, drafter_for(target, attn=(2, 3)), PROMPT, 4, GREEDY, 30).tokens
    except RuntimeError:  # the skipped layers lost verified entries: their keys no longer fit the attention mask
        broken = None
    assert broken != ar.tokens


@pytest.mark.parametrize("attn, mlp", [((2,), (3,)), ((1, 2, 3, 4), (1, 2, 3, 4)), ((2, 3), ()), ((), (1, 4))])
def test_greedy_layerskip_is_lossless_on_tiny_llama(make_tiny_llama, attn, mlp):
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    ar = generate_autoregressive(target, PROMPT, 40)
    drafter = drafter_for(target, attn, mlp)
    for draft_len in (1, 4):
        assert generate_speculative(target, drafter, PROMPT, draft_len, GREEDY, 40).tokens == ar.tokens
    exit = DraftExit(0.5, adapt=True)
    assert generate_speculative(target, drafter, PROMPT, 6, GREEDY, 40, draft_exit=exit).tokens == ar.tokens
    tree = generate_tree_speculative(target, drafter, PROMPT, TreeSpec(2, 3, 6),
                                     make_tree_verifier("greedy", SamplingParams()), 40)
    assert tree.tokens == ar.tokens


def test_greedy_layerskip_is_lossless_on_stories260k(stories_path):
    from drafter_train.targets import load_tokenizer

    target = load_causal_lm(str(stories_path))
    prompt = load_tokenizer(str(stories_path))("Once upon a time").input_ids
    ar = generate_autoregressive(target, prompt, 48)
    drafter = drafter_for(target, attn=(2,), mlp=(3,))
    chain = generate_speculative(target, drafter, prompt, 4, GREEDY, 48)
    assert chain.tokens == ar.tokens and 0 < chain.stats.acceptance_rate < 1
    tree = generate_tree_speculative(target, drafter, prompt, TreeSpec(2, 3, 6),
                                     make_tree_verifier("greedy", SamplingParams()), 48)
    assert tree.tokens == ar.tokens


def test_a_drafter_carries_its_own_draft_exit_threshold(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=6, init=0.3)
    unsure = generate_speculative(target, make_drafter(new_model(target, (2,), (), 0.99999)), PROMPT, 4, GREEDY, 20)
    assert unsure.stats.proposals == 0  # nothing this drafter says is that certain: plain decoding
    assert generate_speculative(target, drafter_for(target, (2,)), PROMPT, 4, GREEDY, 20).stats.proposals > 0


def test_speculative_sampling_with_layerskip_matches_the_target_distribution(make_tiny_llama):
    target = make_tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    params, num_tokens = SamplingParams(temperature=1.0), 3
    counts = sampled_counts(target, new_model(target, (1,), (2,)), [1, 5, 3], 8, make_verifier("sample", params),
                            params, 1200, num_tokens, 2)
    exact = enumerate_marginals(target, [1, 5, 3], num_tokens, 8, params)
    assert min(chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)) > 1e-3


def test_sampled_trees_with_layerskip_match_the_target_distribution(make_tiny_llama):
    target = make_tiny_llama(vocab_size=8, num_layers=4, init=0.4)
    params, model = SamplingParams(temperature=1.0), new_model(target, (2,), (1,))
    counts = tree_counts(target, lambda: LayerSkipDrafter(model), [1, 5, 3], 8, "sample", TreeSpec(3, 2, None, "iid"),
                         params, 600, 3)
    exact = enumerate_marginals(target, [1, 5, 3], 3, 8, params)
    assert min(chi2_pvalue(counts[j], exact[j]) for j in range(3)) > 1e-3


# ---- skip sets: checks and the cost model --------------------------------------------------------------------------


@pytest.mark.parametrize("attn, mlp, message", [
    ((0,), (), r"^drafter\.skip_attn: layer 0 is the first layer, which is never skipped \(skippable: 1\.\.4\)$"),
    ((), (5,), r"^drafter\.skip_mlp: layer 5 is the last layer, which is never skipped \(skippable: 1\.\.4\)$"),
    ((9,), (), r"^drafter\.skip_attn: layer 9 is out of range \(the target has 6 layers, 0\.\.5; skippable: 1\.\.4\)$"),
])
def test_bad_skip_sets_are_one_line_errors(make_tiny_llama, attn, mlp, message):
    target = make_tiny_llama(vocab_size=32, num_layers=6)
    with pytest.raises(ConfigError, match=message):
        new_model(target, attn, mlp)
    with pytest.raises(ConfigError, match=message):
        load_drafter(LayerSkipDrafterConfig(skip_attn=list(attn), skip_mlp=list(mlp)), target, word_tokenizer(),
                     "float32")
    with pytest.raises(ConfigError, match=r"^drafter\.skip_attn: names a layer twice: \[2, 2\]$"):
        LayerSkipDrafterConfig(skip_attn=[2, 2])


def test_cost_counts_the_kept_sub_layers_and_the_head(make_tiny_llama):
    target = make_tiny_llama(vocab_size=32, num_layers=6)
    layer = target.model.layers[0]
    attn, mlp = (sum(p.numel() for p in m.parameters()) for m in (layer.self_attn, layer.mlp))
    total = 6 * (attn + mlp) + target.lm_head.weight.numel()
    assert relative_cost(target, SkipSet((), ())) == 1.0
    assert relative_cost(target, SkipSet((1, 2), (3,))) == pytest.approx((total - 2 * attn - mlp) / total)
    assert expected_speedup(1.0, 0.5, 4) == pytest.approx(5 / 3)  # k=4: 5 tokens for 4 * 0.5 + 1 passes
    assert expected_speedup(0.5, 0.9, 6) == pytest.approx(1.5 / 1.9)  # not worth more than one draft


def test_the_proxy_is_the_share_of_the_targets_argmax_the_skipping_model_predicts(make_tiny_llama):
    target = make_tiny_llama(vocab_size=VOCAB, num_layers=6, init=0.3)
    records = [{"prompt_ids": [1, 5, 9], "response_ids": [4, 7, 3, 8, 2]}, {"prompt_ids": [1, 6], "response_ids": [9, 9]}]
    proxy = Proxy(target, records, "response_ids", 64, 0, batch_size=1)
    assert proxy(SkipSet((), ())) == 1.0
    hits = 0
    for record in records:  # naive reference: full forwards without and with the skips, no padding
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        span = slice(len(record["prompt_ids"]) - 1, ids.shape[1] - 1)
        full = target(ids).logits[0, span].argmax(-1)
        with skipping(target, (2, 3), (4,)):
            skipped = target(ids).logits[0, span].argmax(-1)
        hits += int((full == skipped).sum())
    assert proxy(SkipSet((2, 3), (4,))) == hits / 7


def test_the_target_probe_stays_inside_large_embeddings():
    positions = layerskip.probe_positions(49152 * 576)  # SmolLM2's: float32 steps would index one past the end
    assert positions[0] == 0 and positions[-1] == 49152 * 576 - 1 and bool((positions.diff() > 0).all())


# ---- the search ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def search_data(tmp_path_factory):
    """A 6-layer tiny target, another of the same shape, and drafter-datagen output for the first."""
    root = tmp_path_factory.mktemp("layerskip")
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=6, init=0.1), root / "target")
    save_tiny(tiny_llama(vocab_size=VOCAB, num_layers=6, init=0.1, seed=7), root / "other_target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{s} {w}"}) + "\n" for s in SENTENCES for w in WORDS[:4]))
    run_datagen(OmegaConf.to_object(compose_cfg("datagen", [
        f"target.path={root / 'target'}", "target.chat_template=false", f"datagen.prompts={prompts}",
        "datagen.num_prompts=6", "datagen.num_eval_prompts=2", "datagen.max_new_tokens=16",
        f"datagen.output_dir={root / 'data'}"])), progress=False)
    return root


def search_cfg(root: Path, out: Path, *overrides: str):
    return OmegaConf.to_object(compose_cfg("train", [
        f"target.path={root / 'target'}", "target.chat_template=false", "drafter=layerskip", "drafter.draft_len=3",
        f"train.data_dir={root / 'data'}", f"train.output_root={out}", "train.run_name=search", "train.seed=3",
        "drafter.search_trials=14", "drafter.search_confirm=2", "eval.num_prompts=2", "eval.max_new_tokens=8",
        "eval.warmup=0", *overrides]))


def trials(run_dir: Path) -> list[tuple[dict, float]]:
    from drafter_train.drafters.layerskip.search import completed, open_study

    return [(t.params, t.value) for t in completed(open_study(run_dir, 0))]


def test_an_interrupted_search_resumes_to_the_same_trials_and_skip_set(search_data, tmp_path, monkeypatch):
    whole = train(search_cfg(search_data, tmp_path / "whole"))
    calls, real = {"n": 0}, Proxy.__call__

    def interrupted(self, skips):  # killed inside a prior trial (2nd) and inside a TPE trial (13th)
        calls["n"] += 1
        if calls["n"] in (2, 13):
            raise KeyboardInterrupt
        return real(self, skips)

    monkeypatch.setattr(Proxy, "__call__", interrupted)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            train(search_cfg(search_data, tmp_path / "cut"))
    resumed = train(search_cfg(search_data, tmp_path / "cut"))
    assert len(trials(tmp_path / "cut" / "search")) == 14
    assert trials(tmp_path / "cut" / "search") == trials(tmp_path / "whole" / "search")
    # the same best trials are decoded for real; which one is fastest is a wall-clock measurement (noise may differ)
    assert [c["trial"] for c in resumed["search"]["confirmed"]] == [c["trial"] for c in whole["search"]["confirmed"]]
    assert calls["n"] == 14 + 2  # each trial scored once, plus the two cut off
    rows = [json.loads(line) for line in (tmp_path / "whole" / "search" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "search/proxy" in r] == list(range(1, 15))
    assert all({"search/cost", "search/objective", "search/best_objective"} <= set(r) for r in rows
               if "search/proxy" in r)


def test_other_seeds_search_differently_and_other_settings_are_refused(search_data, tmp_path):
    train(search_cfg(search_data, tmp_path, "drafter.search_trials=12", "drafter.search_confirm=1"))
    other = search_cfg(search_data, tmp_path / "seed4", "drafter.search_trials=12", "drafter.search_confirm=1",
                       "train.seed=4")
    train(other)
    assert trials(tmp_path / "search")[:3] == trials(tmp_path / "seed4" / "search")[:3]  # the priors
    assert trials(tmp_path / "search")[3:] != trials(tmp_path / "seed4" / "search")[3:]
    with pytest.raises(ConfigError, match=r"^train\.resume: .* holds a run with other settings \(train\.seed: 3 -> 5"):
        train(search_cfg(search_data, tmp_path, "train.seed=5"))
    more = train(search_cfg(search_data, tmp_path, "drafter.search_trials=13", "drafter.search_confirm=1"))
    assert more["search"]["trials"] == 13 and (tmp_path / "search" / "step-13").is_dir()


def test_the_searched_folder_evaluates_exports_and_refuses_another_target(search_data, tmp_path):
    metrics = train(search_cfg(search_data, tmp_path, "tracker=tensorboard", "eval.draft_exit=0.5",
                               "eval.draft_exit_adapt=true"))
    run_dir = tmp_path / "search"
    assert list(run_dir.glob("**/events.out.tfevents.*"))
    folder = run_dir / "best" / "drafter"
    saved = json.loads((folder / "config.json").read_text())
    assert (saved["skip_attn"], saved["skip_mlp"]) == (metrics["skip_attn"], metrics["skip_mlp"])
    assert saved["target"]["path"] == str(search_data / "target") and saved["target_config_sha256"]
    evaluated = run_eval_job(OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={search_data / 'target'}", "target.chat_template=false", "drafter=path",
        f"drafter.path={folder}", "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.warmup=0",
        f"eval.output={tmp_path / 'metrics.json'}"])))
    assert evaluated["drafter_kind"] == "layerskip" and evaluated["greedy_match"] == 1.0
    # the folder carries the gamma its confirmation run ended with, and starts from it when eval sets none
    assert saved["exit_threshold"] == metrics["draft_exit_final"] and \
        evaluated["draft_exit"] == saved["exit_threshold"]
    exported = export(OmegaConf.to_object(compose_cfg("export", [f"export.run_dir={run_dir}",
                                                                 f"export.output_dir={tmp_path / 'export'}"])).export)
    card = (exported.folder / "README.md").read_text()
    assert (exported.folder / "config.json").is_file() and "self-speculative" in card
    assert f"| skipped sub-layers | attention {metrics['skip_attn']}, MLP {metrics['skip_mlp']} |" in card
    assert "| search | 14 trials (optuna TPE" in card and "| loss |" not in card
    report = write_report(run_dir, tmp_path / "report", TrackerConfig())
    assert report.results and report.results[0].tau == metrics["tau"]
    other = load_causal_lm(str(search_data / "other_target"))
    with pytest.raises(ConfigError, match=r"^drafter\.path: this layerskip drafter was searched for .*target, not "
                                          r"this target \(its weights differ\); search a skip set for it"):
        load_drafter(OmegaConf.to_object(compose_cfg("eval", ["drafter=path", f"drafter.path={folder}"])).drafter,
                     other, word_tokenizer(), "float32")
    with pytest.raises(ConfigError, match=r"^drafter\.path: .* \(its config differs"):
        make_drafter(layerskip.load(str(folder), "float32")).share_target(CachedLM(tiny_llama(VOCAB, num_layers=5)))


def test_the_search_refuses_a_saved_folder_and_a_bad_configured_skip_set(search_data, tmp_path):
    with pytest.raises(ConfigError, match=r"^drafter\.path: drafter-train drafter=layerskip searches a new skip set"):
        train(search_cfg(search_data, tmp_path, "drafter.path=/some/folder"))
    with pytest.raises(ConfigError, match=r"^drafter\.skip_mlp: layer 5 is the last layer"):
        train(search_cfg(search_data, tmp_path / "bad", "drafter.skip_mlp=[5]"))


def test_the_decoder_hands_the_drafter_the_targets_cache(make_tiny_llama, monkeypatch):
    seen = []
    real = LayerSkipDrafter.share_target
    monkeypatch.setattr(LayerSkipDrafter, "share_target", lambda self, lm: (seen.append(lm), real(self, lm))[1])
    target = make_tiny_llama(vocab_size=32, num_layers=6)
    generate_speculative(target, drafter_for(target, (2,)), PROMPT, 3, GREEDY, 8)
    assert len(seen) == 1 and seen[0].model is target and isinstance(seen[0], CachedLM)
