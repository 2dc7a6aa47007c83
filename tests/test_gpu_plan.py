"""benchmarks/gpu_plan.py: the memory per GPU docs/gpu.md states, checked against what training really allocates on
tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from benchmarks import gpu_plan
from benchmarks.gpu_plan import (
    LLAMA_31_8B, at_length, eagle3_drafter, eagle3_job, eagle3_loss_activations, eagle3_step_flops,
    feature_bytes_per_token, memory_plan, model_sizes, saved_bytes,
)

TINY_ARGS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=300, tie_word_embeddings=False)
TINY = LlamaConfig(**TINY_ARGS)
LAYERS = [0, 1, 2]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_llama_31_8b_sizes_and_its_feature_cache_per_token():
    sizes = model_sizes(LlamaConfig(**LLAMA_31_8B), 32000, [2, 16, 29])
    assert sizes.target == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert feature_bytes_per_token(sizes) == 3 * 4096 * 2  # 24 KiB per token
    assert feature_bytes_per_token(sizes, response=True) == 4 * 4096 * 2  # + the final hidden state
    plan = memory_plan(sizes, "ddp", 8)
    assert plan["target"] == 2 * 8_030_261_248 and plan["optimizer"] == 2 * plan["gradients"] == 8 * sizes.trainable


def test_weights_gradients_and_adamw_state_are_what_training_allocates():
    """One real AdamW step on the drafter drafter-train builds: its fp32 weights, gradients and optimizer moments
    take exactly the bytes the plan says for one GPU, and 1/N of them where the launch shards them."""
    from drafter_train.data.batches import Batch
    from drafter_train.drafters.eagle3.model import eagle3_loss
    from tests.conftest import tiny_llama

    target = tiny_llama(vocab_size=300, num_layers=4)
    drafter = eagle3_drafter(target, 100, LAYERS)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    ids = torch.randint(0, 300, (2, 12))
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), resp_pos=torch.arange(11).expand(2, -1),
                  resp_mask=torch.ones(2, 11, dtype=torch.bool), labels=ids[:, 1:])
    cfg = eagle3_job(100, LAYERS)
    eagle3_loss(drafter, target, batch, cfg).loss_sum.backward()
    optimizer.step()

    sizes = model_sizes(target.config, 100, LAYERS)
    assert sizes.target == sum(p.numel() for p in target.parameters())
    plan = memory_plan(sizes, "ddp", 1)
    assert plan["drafter"] == nbytes(drafter.parameters())
    assert plan["gradients"] == nbytes(p.grad for p in drafter.parameters() if p.grad is not None)
    assert plan["optimizer"] == nbytes(s for state in optimizer.state.values() for s in state.values() if s.dim())
    assert plan["target"] == nbytes(target.parameters()) // 2  # counted in bf16, the GPU recipe's target dtype
    sharded, zero2 = memory_plan(sizes, "fsdp", 8), memory_plan(sizes, "zero2", 8)
    assert sharded["drafter"] == -(-plan["drafter"] // 8) and zero2["drafter"] == plan["drafter"]
    assert zero2["optimizer"] == sharded["optimizer"] == -(-plan["optimizer"] // 8)


def test_saved_bytes_counts_each_kept_storage_once_and_no_weights():
    x = torch.randn(1000, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(1000))

    def fn():
        y = x.exp()  # keeps y (4000 bytes)
        (y.sin() * weight).sum()  # sin keeps y again (counted once); the product keeps sin(y) and the weight
        return {weight.untyped_storage().data_ptr()}

    assert saved_bytes(fn) == 2 * 4000


def test_activations_grow_as_the_quadratic_through_three_lengths():
    """The extension from short sequences to the run's length is exact on the real loss: predicted at 96 tokens from
    16/32/64, against measured at 96."""
    measure = lambda t: eagle3_loss_activations(TINY, 100, LAYERS, t)  # noqa: E731
    assert at_length(measure, (16, 32, 64), 96) == pytest.approx(measure(96), rel=1e-3)
    assert measure(64) > measure(32) > 0
    flops = lambda t: eagle3_step_flops(TINY, 100, LAYERS, t)  # noqa: E731
    assert at_length(flops, (16, 32, 64), 96) == pytest.approx(flops(96), rel=1e-6)


def test_the_command_prints_a_row_per_launch(capsys, monkeypatch):
    monkeypatch.setattr(gpu_plan, "LLAMA_31_8B", TINY_ARGS)
    gpu_plan.main(["--gpus", "2", "--seq-len", "64", "--draft-vocab-size", "100", "--lengths", "8", "16", "32"])
    out = capsys.readouterr().out
    assert all(f"| {launch} |" in out for launch in ("ddp", "zero2", "zero3", "fsdp"))


def test_docs_table_is_what_the_plan_computes():
    """docs/gpu.md's memory table: its weight, gradient and optimizer columns are memory_plan's for Llama-3.1-8B."""
    from tests.conftest import REPO

    sizes = model_sizes(LlamaConfig(**LLAMA_31_8B), 32000, [2, 16, 29])
    lines = (REPO / "docs" / "gpu.md").read_text().splitlines()
    table = {cells[0]: cells[1:] for cells in (line.strip("|").replace(" ", "").split("|") for line in lines)
             if cells[0] in gpu_plan.SHARDED}
    assert sorted(table) == sorted(gpu_plan.SHARDED)
    for launch, *row in gpu_plan.plan_rows(sizes, 8, 0):
        assert table[launch][:4] == row[:4], launch  # target, drafter, gradients, optimizer (GiB)
