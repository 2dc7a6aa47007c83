"""Seq2seq targets (drafter_train/seq2seq): real loading of tiny random T5 / BART / Marian / Whisper folders, plain
decoding against transformers' `generate`, lossless greedy and chi-square-exact sampling of the speculative decoder
with the AR and NAR drafters, training on the target's outputs, data, the toy task and the assistant export."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from transformers import (AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration, MarianConfig,
                          MarianMTModel, T5Config, T5ForConditionalGeneration, WhisperConfig,
                          WhisperForConditionalGeneration)

from drafter_train import evaluation
from drafter_train.config import EvalConfig, LossConfig
from drafter_train.cpu_kernels import (ALWAYS_ONEDNN, GROUPED_ATTENTION, OneDNNLinear, onednn_available,
                                       use_grouped_attention, use_onednn_linears)
from drafter_train.decoding.sampling import SamplingParams, logits_to_probs
from drafter_train.decoding.verify import make_verifier
from drafter_train.drafters.common.truncated import cut_from_target as truncated_cut
from drafter_train.drafters.registry import make_drafter
from drafter_train.errors import ConfigError
from drafter_train.evaluation import evaluate_decoding
from drafter_train.seq2seq import decoding as seq2seq_decoding
from drafter_train.seq2seq.data import read_pairs, regenerate
from drafter_train.seq2seq.decoding import (evaluate_seq2seq, generate_seq2seq_autoregressive,
                                            generate_seq2seq_speculative)
from drafter_train.seq2seq.drafters import Seq2SeqDrafter, SpecDrafter, cut_from_target, small_from_target
from drafter_train.seq2seq.export import export_assistant
from drafter_train.seq2seq.target import Source, encode, load_seq2seq
from drafter_train.seq2seq.toy import make_dictionary, make_pairs, toy_tokenizer, translate
from drafter_train.seq2seq.training import Example, train_drafter
from tests.conftest import tiny_llama
from tests.test_sampling_exactness import RUNS, chi2_pvalue

VOCAB = 24
SMALL = dict(d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


# Initialisation scales under which each family's random outputs vary (not one token repeated; T5's still do).
INIT = {"t5": 0.1, "bart": 0.1, "marian": 0.1, "whisper": 0.3}


def tiny(family: str, seed: int = 0, init: Optional[float] = None, vocab: int = VOCAB):
    """A tiny random seq2seq model of `family` (3 decoder layers, so a drafter can be cut from it)."""
    torch.manual_seed(seed)
    init = INIT[family] if init is None else init
    ids = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=2, forced_eos_token_id=None,
               tie_word_embeddings=False)  # a tied head mostly repeats the last token: untied outputs vary
    if family == "t5":
        # as many encoder as decoder layers: transformers' generate sizes T5's cache by num_layers
        config = T5Config(vocab_size=vocab, d_model=32, d_kv=16, d_ff=64, num_layers=3, num_decoder_layers=3,
                          num_heads=2, dropout_rate=0.0, initializer_factor=init * 10, **ids)
        model = T5ForConditionalGeneration(config)
    elif family == "bart":
        model = BartForConditionalGeneration(BartConfig(vocab_size=vocab, max_position_embeddings=64,
                                                        init_std=init, forced_bos_token_id=None, **SMALL, **ids))
    elif family == "marian":
        model = MarianMTModel(MarianConfig(vocab_size=vocab, max_position_embeddings=64, init_std=init, **SMALL,
                                           **ids))
    else:
        model = WhisperForConditionalGeneration(WhisperConfig(
            vocab_size=vocab, num_mel_bins=8, max_source_positions=16, max_target_positions=32, init_std=init,
            suppress_tokens=None, begin_suppress_tokens=None, bos_token_id=2, **SMALL, **ids))
    model.generation_config.update(**{k: v for k, v in ids.items() if k != "forced_eos_token_id"})
    return model.eval()


def source_for(model, seed: int = 0) -> Source:
    gen = torch.Generator().manual_seed(seed)
    if model.config.model_type == "whisper":  # log-mel features [1, mel bins, 2 * max_source_positions]
        return Source({"input_features": torch.randn(1, model.config.num_mel_bins, 32, generator=gen)})
    return Source.text(torch.randint(3, VOCAB, (7,), generator=gen).tolist() + [1])


@pytest.fixture(scope="module", params=["t5", "bart", "marian", "whisper"])
def saved(request, tmp_path_factory):
    """(family, the model loaded back through load_seq2seq from a local folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny(request.param).save_pretrained(folder)
    return request.param, load_seq2seq(str(folder))


def test_loading_refuses_a_missing_folder_and_a_decoder_only_model_in_one_line(tmp_path):
    from tests.conftest import tiny_llama

    with pytest.raises(ConfigError, match="target.path: .* is not a model folder"):
        load_seq2seq(str(tmp_path / "missing"))
    tiny_llama().save_pretrained(tmp_path / "llama")
    with pytest.raises(ConfigError, match="target.path: a llama model is not an encoder-decoder"):
        load_seq2seq(str(tmp_path / "llama"))


def uncached_greedy(target, source: Source, max_new_tokens: int) -> list[int]:
    """The reference without generate or a cache: the whole decoder sequence re-run every step, argmax, EOS 1 stops.
    (Whisper's generate inserts its own task/language prompt, so it is not a reference for Whisper.)"""
    encoded = target.get_encoder()(**source.inputs)
    seq = [target.config.decoder_start_token_id]
    while len(seq) <= max_new_tokens and (len(seq) == 1 or seq[-1] != 1):
        logits = target(encoder_outputs=encoded, decoder_input_ids=torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[1:]


def test_plain_decoding_matches_transformers_generate(saved):
    family, target = saved
    source = source_for(target)
    ours = generate_seq2seq_autoregressive(target, source, 12).tokens
    with torch.no_grad():
        assert ours == uncached_greedy(target, source, 12) and len(ours) > 3
    if family == "whisper":
        return
    theirs = target.generate(**source.inputs, max_new_tokens=12, do_sample=False, num_beams=1)[0, 1:].tolist()
    theirs = theirs[: theirs.index(1) + 1] if 1 in theirs else theirs  # generate pads after EOS
    assert ours == theirs


def test_forced_decoder_prefix_is_fed_and_not_generated(saved):
    """Whisper's language/task tokens, NLLB's target language: forced after the decoder start, as generate's
    decoder_input_ids; speculative decoding stays lossless after them."""
    family, target = saved
    source = source_for(target)
    source.decoder_prefix = (5, 6)
    ours = generate_seq2seq_autoregressive(target, source, 10).tokens
    spec = generate_seq2seq_speculative(target, Seq2SeqDrafter(cut_from_target(target, 1), target), source, 3,
                                        make_verifier("greedy", SamplingParams()), 10)
    assert spec.tokens == ours != generate_seq2seq_autoregressive(target, source_for(target), 10).tokens
    if family != "whisper":  # Whisper's generate builds its own prompt
        theirs = target.generate(**source.inputs, decoder_input_ids=torch.tensor([[2, 5, 6]]), max_new_tokens=10,
                                 do_sample=False)[0, 3:].tolist()
        assert ours == (theirs[: theirs.index(1) + 1] if 1 in theirs else theirs)


@pytest.mark.parametrize("kind", ["ar", "nar", "ar-small"])
def test_greedy_speculative_is_lossless(saved, kind):
    """Random drafters reject often: the self-attention cache is cropped on every step, the cross-attention one kept."""
    family, target = saved
    if kind == "nar":
        model = SpecDrafter.from_target(target, draft_len=3)
    else:
        model = cut_from_target(target, 1) if kind == "ar" else small_from_target(target, 1, 1)
    drafter = Seq2SeqDrafter(model, target)
    assert drafter.shares_encoder == (kind != "ar-small")
    for seed in range(3):
        source = source_for(target, seed)
        plain = generate_seq2seq_autoregressive(target, source, 16)
        spec = generate_seq2seq_speculative(target, drafter, source, 3, make_verifier("greedy", SamplingParams()), 16)
        assert spec.tokens == plain.tokens
        assert spec.stats.target_forward_passes <= plain.stats.target_forward_passes


def test_target_as_its_own_drafter_accepts_everything():
    target = tiny("marian")
    target.generation_config.eos_token_id = target.config.eos_token_id = None  # exactly 11 tokens
    drafter = Seq2SeqDrafter(target, target)
    spec = generate_seq2seq_speculative(target, drafter, source_for(target), 4,
                                        make_verifier("greedy", SamplingParams()), 11)
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.target_forward_passes == 3  # 1 + 10 / (4 + 1)


@torch.inference_mode()
def exact_marginals(target, source: Source, num_tokens: int, params: SamplingParams) -> torch.Tensor:
    """[num_tokens, V] the target's exact marginal of each sampled token, by enumerating every decoder prefix."""
    encoded = encode(target, source).last_hidden_state
    prefixes, weights, marginals = torch.tensor([[2]]), torch.ones(1, dtype=torch.float64), []
    vocab = target.config.vocab_size
    for _ in range(num_tokens):
        hidden = encoded.expand(len(prefixes), -1, -1)
        logits = target(encoder_outputs=(hidden,), decoder_input_ids=prefixes).logits[:, -1]
        joint = weights[:, None] * logits_to_probs(logits, params).double()
        marginals.append(joint.sum(0))
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(prefixes))[:, None]],
                             1)
        weights = joint.reshape(-1)
    return torch.stack(marginals)


@pytest.mark.parametrize("kind", ["ar", "nar"])
def test_speculative_sampling_matches_target_distribution(kind):
    target = tiny("marian", init=1.0, vocab=8)  # the first token's distribution differs from the later ones
    target.generation_config.eos_token_id = target.config.eos_token_id = None  # every run yields num_tokens tokens
    model = SpecDrafter.from_target(target, draft_len=2) if kind == "nar" else small_from_target(target, 1, 1)
    if kind == "nar":  # queries far apart, so that the two drafts' distributions differ (a q paired with the wrong
        torch.manual_seed(1)  # draft would then show)
        model.mask_embeds.data.normal_(std=1.0)
    drafter, source = Seq2SeqDrafter(model, target), Source.text([3, 4, 5, 6, 1])
    # Runs, measured with deliberately broken verifiers: with the Spec-Drafter a q paired with the wrong draft fails at
    # p ~ 0 and a correction drawn from p instead of the residual at p < 1e-19 after RUNS runs; with the AR drafter (a
    # new small model with its own encoder) the same bugs move the samples far less, so it keeps 1500.
    params, num_tokens = SamplingParams(temperature=1.0), 4  # 4: a step drafts 2
    runs = RUNS if kind == "nar" else 1500
    counts, generator = torch.zeros(num_tokens, 8), torch.Generator().manual_seed(0)
    verifier = make_verifier("sample", params)
    for _ in range(runs):
        out = generate_seq2seq_speculative(target, drafter, source, 2, verifier, num_tokens, params, generator)
        counts[torch.arange(num_tokens), torch.tensor(out.tokens)] += 1
    exact = exact_marginals(target, source, num_tokens, params)
    pvalues = [chi2_pvalue(counts[j], exact[j]) for j in range(num_tokens)]
    assert min(pvalues) > 1e-3, pvalues


def examples_from(target, count: int = 16) -> list[Example]:
    """The target's own greedy outputs for random sources (what drafters train on)."""
    examples = []
    for seed in range(count):
        source = source_for(target, 100 + seed)
        out = generate_seq2seq_autoregressive(target, source, 10).tokens
        examples.append(Example(source.inputs["input_ids"][0].tolist(), out))
    return examples


@pytest.mark.parametrize("kind,loss", [("ar", "fkl"), ("nar", "accepted_length"), ("nar", "tvd")])
def test_training_on_target_outputs_lowers_loss_and_stays_lossless(kind, loss):
    target = tiny("bart")
    model = SpecDrafter.from_target(target, draft_len=3) if kind == "nar" else cut_from_target(target, 1)
    losses = train_drafter(model, target, examples_from(target), steps=40, loss=LossConfig(name=loss), draft_len=3,
                           pad_id=0, batch_size=8, lr=3e-3)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    drafter = Seq2SeqDrafter(model, target)
    assert drafter.shares_encoder  # trained with the target's encoder frozen
    metrics = evaluate_seq2seq(target, drafter, [source_for(target, s) for s in range(4)], draft_len=3,
                               max_new_tokens=12)
    assert metrics["greedy_match"] == 1.0 and metrics["tau"] >= 1.0


def test_export_works_as_transformers_assistant(tmp_path):
    target = tiny("marian")
    folder = export_assistant(cut_from_target(target, 1), str(tmp_path / "assistant"), draft_len=3)
    assistant = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    assert assistant.config.decoder_layers == 1 and assistant.generation_config.num_assistant_tokens == 3
    for seed in range(3):
        inputs = source_for(target, seed).inputs
        plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        assisted = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=assistant)
        assert assisted.tolist() == plain.tolist()
    with pytest.raises(ConfigError, match="export.format"):
        export_assistant(SpecDrafter.from_target(target, 3), str(tmp_path / "nar"), 3)


def test_spec_drafter_folder_reloads_the_same_drafter(tmp_path):
    target = tiny("bart")
    drafter = SpecDrafter.from_target(target, draft_len=3)
    drafter.save_pretrained(tmp_path)
    reloaded = SpecDrafter.from_pretrained(tmp_path).eval()
    source = source_for(target)
    encoded, prefix, lens = encode(target, source), torch.tensor([[2, 5, 7]]), torch.tensor([3])
    with torch.no_grad():
        torch.testing.assert_close(reloaded.block_logits(encoded, source.attention_mask, prefix, lens),
                                   drafter.block_logits(encoded, source.attention_mask, prefix, lens))
    assert reloaded.draft_len == 3 and Seq2SeqDrafter(reloaded, target).shares_encoder


def test_read_pairs_formats_and_one_line_errors(tmp_path):
    import datasets

    rows = [{"src": "a b", "tgt": "c"}, {"src": "d", "tgt": "e f"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    for name in ("p.jsonl", "p.parquet", "folder"):
        assert read_pairs(str(tmp_path / name), "src", "tgt") == [{"source": "a b", "reference": "c"},
                                                                   {"source": "d", "reference": "e f"}]
    with pytest.raises(ConfigError, match="data.target_key: .* no column 'target'"):
        read_pairs(str(tmp_path / "p.jsonl"), "src", "target")
    with pytest.raises(ConfigError, match="data.path"):
        read_pairs(str(tmp_path / "missing.jsonl"))


def test_regenerate_writes_target_outputs_and_resumes(tmp_path):
    target, tokenizer = tiny("marian", vocab=len(toy_tokenizer())), toy_tokenizer()
    sources = ["de1 dn2 dv3 de0 dn4", "de2 da1 dn3 dv0 de1 dn1 db2", "de0 dn0 dv0 de0 dn0"]
    cache = tmp_path / "out.jsonl"
    first = regenerate(target, tokenizer, sources[:2], str(cache), 8)
    both = regenerate(target, tokenizer, sources, str(cache), 8)  # resumes: the first two are read back
    assert both[:2] == first and len(cache.read_text().splitlines()) == 3
    reference = generate_seq2seq_autoregressive(target, Source.text(tokenizer(sources[2])["input_ids"]), 8).tokens
    assert both[2].output_ids == reference
    with pytest.raises(ConfigError, match="data.output"):
        regenerate(target, tokenizer, sources[::-1], str(cache), 8)


def test_toy_translation_rules(tmp_path):
    dictionary = make_dictionary(0)
    source = "de1 da3 da5 dn7 dv2 de0 dn5 db1"
    expected = dictionary["de1"] + dictionary["dn7"] + dictionary["da5"] + dictionary["da3"] + dictionary["de0"] + \
        dictionary["dn5"] + dictionary["dv2"] + dictionary["db1"]
    assert translate(source, dictionary).split() == expected and "tx" in expected  # dn5: a two-word noun
    second = dictionary["de2"] + dictionary["dn1"] + dictionary["de3"] + dictionary["dn2"] + dictionary["dv0"]
    assert translate(source + " dc1 de2 dn1 dv0 de3 dn2", dictionary).split() == expected + dictionary["dc1"] + second
    paths = make_pairs(tmp_path, sizes={"train": 5, "test": 2})
    row = json.loads(paths["train"].read_text().splitlines()[0])
    tokenizer = toy_tokenizer()
    assert tokenizer.decode(tokenizer(row["target"])["input_ids"], skip_special_tokens=True) == row["target"]
    assert tokenizer.unk_token_id not in tokenizer(row["source"] + " " + row["target"])["input_ids"]


def test_toy_benchmark_runs_end_to_end(tmp_path):
    """The one-command pipeline on a few steps and sources (the figures come from the full run, not from here)."""
    from benchmarks.seq2seq_toy import COLUMNS, main

    main(["--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path), "--target-steps", "3",
          "--train-sources", "4", "--drafter-steps", "2", "--dev-sources", "2", "--test-sources", "2", "--repeats", "1",
          "--max-new-tokens", "6"])
    result = json.loads((tmp_path / "seq2seq_toy.json").read_text())
    assert result["columns"] == COLUMNS and len(result["rows"]) == 7  # AR, NAR: untrained, trained, sampled; HF
    assert all(row[-1] == 1.0 for row in result["rows"] if row[2] == "greedy")  # lossless, HF's assistant too
    assert (tmp_path / "work" / "assistant" / "config.json").is_file()
    for kind in ("ar", "nar"):  # trained through drafter-seq2seq's run(): checkpoints, best, test metrics
        assert (tmp_path / "work" / "runs" / kind / "best" / "drafter").is_dir()
        assert json.loads((tmp_path / "work" / "runs" / kind / "metrics.json").read_text())["split"] == "test"


# plain decoding's seconds per request on each CPU kernel setting, and the speculative run's: onednn is the fastest
# baseline, auto (the speculative run's own) is not (as tests/test_baseline.py's FAKE_SECONDS)
FAKE_SECONDS = {"auto": 3.0, "onednn": 2.0, "default": 5.0, "spec": 1.0}
SPEED_FIELDS = ("ar_tokens_generated", "spec_time_s", "ar_time_s", "spec_tokens_per_s", "ar_tokens_per_s", "speedup",
                "spec_kernels", "speedup_same_kernels", "baseline", "greedy_match")


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")
def test_evaluator_divides_by_the_fastest_plain_decoding_as_evaluate_decoding_does(monkeypatch):
    # vocab 2048 x d_model 32 = 65,536 weights: the LM head is just big enough to be patched, so the settings differ
    target = tiny("marian", vocab=2048)
    use_onednn_linears(target, "auto")
    use_grouped_attention(target, "auto")
    drafter, events = Seq2SeqDrafter(cut_from_target(target, 1), target), []

    def setting() -> str:
        head = target.lm_head
        if type(head) is not OneDNNLinear:
            assert target.config._attn_implementation == "sdpa"
            return "default"
        assert target.config._attn_implementation == GROUPED_ATTENTION
        return "onednn" if head.row_policy is ALWAYS_ONEDNN else "auto"

    for name in ("generate_seq2seq_autoregressive", "generate_seq2seq_speculative"):
        real = getattr(seq2seq_decoding, name)
        monkeypatch.setattr(seq2seq_decoding, name, lambda *a, _real=real, _name=name, **k: (
            events.append(("spec" if "speculative" in _name else "ar", setting())), _real(*a, **k))[1])
    monkeypatch.setattr(evaluation, "_timed", lambda fn, device: (fn(), FAKE_SECONDS[
        "spec" if events[-1][0] == "spec" else events[-1][1]]))
    sources = [source_for(target, s) for s in range(4)]
    metrics = evaluate_seq2seq(target, drafter, sources, draft_len=2, max_new_tokens=6, kernels="auto", warmup=0)
    by_kernels = metrics["baseline"]["by_kernels"]
    assert list(by_kernels) == ["auto", "onednn", "default"]  # every setting timed, the speculative run's first
    assert {kernels for kind, kernels in events if kind == "spec"} == {"auto"}
    assert metrics["baseline"]["kernels"] == max(by_kernels, key=lambda k: by_kernels[k]["tokens_per_s"]) == "onednn"
    assert metrics["ar_tokens_per_s"] == max(b["tokens_per_s"] for b in by_kernels.values())
    assert metrics["speedup"] == pytest.approx(2.0) and metrics["speedup_same_kernels"] == pytest.approx(3.0)
    assert metrics["greedy_match"] == 1.0 and setting() == "auto"  # the target is left on its own kernels
    # which decoder runs first alternates request by request, and the plain settings take turns going first
    assert [e[0] for e in events[:8]] == ["ar", "ar", "ar", "spec", "spec", "ar", "ar", "ar"]
    assert [e[1] for e in events[5:8]] == ["onednn", "default", "auto"]

    same = evaluate_seq2seq(target, drafter, sources[:1], 2, 6, kernels="auto", warmup=0, baseline_kernels="same")
    assert list(same["baseline"]["by_kernels"]) == ["auto"] and same["speedup"] == pytest.approx(3.0)
    # the same field names, and the same shape of `baseline`, as the decoder-only evaluator's metrics
    llama = tiny_llama(num_layers=2)
    decoded = evaluate_decoding(llama, make_drafter(truncated_cut(llama, 1), "default"), [[5, 9, 3]],
                                EvalConfig(draft_len=2, max_new_tokens=3, warmup=0, baseline_kernels="same"), (),
                                progress=False)
    for fields in (metrics, decoded):
        assert set(SPEED_FIELDS) <= set(fields)
        assert set(fields["baseline"]) == {"kernels", "tokens_per_s", "by_kernels"}
        assert all(set(b) == {"tokens_per_s", "time_s", "tokens_generated"}
                   for b in fields["baseline"]["by_kernels"].values())
