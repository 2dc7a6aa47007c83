"""benchmarks/throughput.py's pure parts: the useful FLOPs of a decoder pass (against torch's own FLOP counter on a
tiny Llama), the fraction of the peak, and the result file's headline fields. No timing, no real model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import make_results
from benchmarks import throughput as bench
from benchmarks.common import write_result
from drafter_train import throughput
from tests.conftest import tiny_llama


def counted_matmuls(decoder, length: int) -> int:
    """torch's FLOP count of the matmuls of one pass over `length` tokens (its counter leaves SDPA out here)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        decoder(input_ids=torch.randint(3, 64, (1, length)))
    counts = counter.get_flop_counts()["Global"]
    return sum(n for op, n in counts.items() if "attention" not in str(op))


@pytest.mark.parametrize("length", [1, 7, 33])
def test_decoder_flops_match_torchs_counter(length):
    model = tiny_llama()
    decoder, config = model.get_decoder(), model.config
    ours = throughput.decoder_flops(decoder, config, [length])
    assert ours["linear"] == counted_matmuls(decoder, length)  # no LM head: the feature pass runs the decoder alone
    # the query at position t meets t + 1 keys: 2 FLOPs a product for QK^T and again for the weighted sum of V
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    naive = sum(2 * 2 * width * (t + 1) for t in range(length)) * config.num_hidden_layers
    assert ours["attention"] == naive
    assert ours["total"] == ours["linear"] + ours["attention"]


def test_decoder_flops_add_up_over_sequences():
    model = tiny_llama()
    decoder = model.get_decoder()
    one = [throughput.decoder_flops(decoder, model.config, [n])["total"] for n in (5, 9)]
    assert throughput.decoder_flops(decoder, model.config, [5, 9])["total"] == sum(one)


def test_of_peak():
    assert throughput.of_peak(2e12, 4.0, 1.0) == pytest.approx(0.5)


def measurement() -> dict:
    """What benchmarks/throughput.py's measure() returns, with made-up figures."""
    return {"precision": "bf16", "precision_why": "auto", "peak_dtype": "bfloat16",
            "peaks_tflops": {"float32": 0.1, "bfloat16": 0.4},
            "seconds": {"feature_pass": 2.0, "feature_pass_padded": 2.5, "step_online": 2.5, "step_offline": 0.5},
            "flops": {"linear": 4e11, "attention": 0.0, "total": 4e11}, "tokens": 1000, "padded_tokens": 1250,
            "batches": 2, "batch_size": 8, "records": 16}


def test_summary_has_the_issues_headline_fields(tmp_path):
    m = measurement()
    top = bench.summarize(m)
    assert top["feature_pass_of_peak"] == pytest.approx(0.5)  # 4e11 FLOPs in 2 s against 0.4 TFLOPS
    assert top["step_over_feature_pass"] == pytest.approx(1.25)
    assert top["drafter_step_over_feature_pass"] == pytest.approx(0.25)
    assert top["feature_pass_tokens_per_s"] == pytest.approx(500)
    assert top["padding"] == pytest.approx(0.2)
    rows = bench.rows(m, top)
    path = write_result("throughput-test", title="t", question="q", command="c", split="s", baseline="b",
                        columns=["pass", "tokens/s", "TFLOPS (useful)", "of peak", "time / feature pass"], rows=rows,
                        machine={"cpu": "Test CPU"}, results_dir=tmp_path, top=top)
    record = json.loads(path.read_text())
    assert 0 < record["feature_pass_of_peak"] < 1 and record["step_over_feature_pass"] >= 1
    page = make_results.section("throughput-test", record)  # docs/results.md's section: the aims, then the table
    assert "Feature pass at 50.0% of the matmul peak (aim: 60 %); a training step costs 1.25x" in page


# ----------------------------------------------------------------------------------------------------------------
# The feature pass: a right-padded batch without its mask gives what the masked pass gave at every real position


def masked_reference(target, batch, layers):
    """The feature pass as it was: the padded batch with its attention mask."""
    from drafter_train.drafters.common.conditioned import target_signals

    return target_signals(target, batch, layers, causal_only=False)


def right_padded_batch():
    from drafter_train.data.batches import collate

    gen = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(3, 64, (p,), generator=gen).tolist(),
                "response_ids": torch.randint(3, 64, (r,), generator=gen).tolist()} for p, r in ((3, 9), (7, 2), (1, 5))]
    return collate(records, "response_ids", 64, 0)


def masks_seen(target, run) -> list:
    """The attention_mask each decoder forward of `run()` was given."""
    seen = []
    handle = target.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


def test_causal_only_feature_pass_equals_the_masked_one():
    from drafter_train.drafters.common.conditioned import right_padded, target_signals

    target, batch, layers = tiny_llama(), right_padded_batch(), [0, 2, 3]
    assert right_padded(batch.attention_mask) and not batch.attention_mask.all()  # rows of 12, 9 and 6 tokens
    features, hidden = target_signals(target, batch, layers)
    want_features, want_hidden = masked_reference(target, batch, layers)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(features[real], want_features[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden[batch.resp_mask], want_hidden[batch.resp_mask], atol=1e-6, rtol=1e-6)
    assert masks_seen(target, lambda: target_signals(target, batch, layers)) == [None]  # the mask was dropped


def test_a_mask_that_is_not_right_padding_is_kept():
    from drafter_train.drafters.common.conditioned import right_padded, target_signals

    target, batch, layers = tiny_llama(), right_padded_batch(), [1]
    batch.attention_mask[0, 0] = 0  # a hole at the start: not collate's layout
    assert not right_padded(batch.attention_mask)
    for got, want in zip(target_signals(target, batch, layers), masked_reference(target, batch, layers)):
        torch.testing.assert_close(got, want)
    assert masks_seen(target, lambda: target_signals(target, batch, layers))[0] is batch.attention_mask


def test_datagen_records_are_the_folders_first_records_longest_first_with_their_masks(monkeypatch):
    import datasets

    rows = [{"prompt_ids": [1] * p, "reference_ids": [2] * r, "reference_mask": [1, 0] * (r // 2)}
            for p, r in ((3, 4), (1, 10), (5, 2), (9, 8))]
    monkeypatch.setattr("drafter_train.data.store.load_distill_dataset", lambda d: datasets.Dataset.from_list(rows))
    records = bench.datagen_records("folder", 3, max_seq_len=12)  # the 4th record is past the count
    assert [(len(r["prompt_ids"]), len(r["response_ids"])) for r in records] == [(1, 10), (3, 4), (5, 2)]
    assert records[0]["response_mask"] == [1, 0] * 5
