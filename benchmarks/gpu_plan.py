"""How much memory does an EAGLE-3 run on a large target take per GPU, how much work is each trained token, and
how big is its offline feature cache?

Nothing here runs on a GPU. What each figure rests on:
- weights, gradients and optimizer state are counted from the models as drafter-train builds them (the target and
  the drafter built on the meta device: no memory), at the bytes each launch keeps: the target frozen in bf16, a full
  copy on every GPU (it is never prepared); the drafter in fp32 master weights with fp32 gradients and two fp32 AdamW
  moments per trainable weight, sharded over the GPUs as each launch shards them;
- activations are measured: the bytes autograd keeps for the backward pass of the real EAGLE-3 loss (bf16 autocast,
  offline features), counted with saved_tensors_hooks on the CPU at the model's real widths for three short
  sequence lengths, then extended exactly to the run's length by the quadratic through the three (the per-token
  terms and the attention mask's T x T term). Every position is counted as a response token (an upper bound);
- the work per trained token is counted too: the floating-point operations of the real loss's forward and backward
  (torch's FlopCounterMode, on the CPU at the real widths, extended to the run's length the same way). Operation
  counts do not depend on the device; seconds do, so no GPU speed is claimed from CPU timings: docs/gpu.md turns
  the count into tokens per second only under a stated hardware peak and utilisation;
- the offline feature cache stores 3 target layers x hidden x 2 bytes (bf16) per token, and hidden x 2 bytes more
  per response token (the target's final hidden state).

    python -m benchmarks.gpu_plan                      # Llama-3.1-8B, 8 GPUs, 2 sequences of 2048 tokens per GPU
    python -m benchmarks.gpu_plan --gpus 4 --seq-len 4096 --batch-size 1

It prints a markdown table (docs/gpu.md shows it) and writes no result file: these are sizes and counts, not
timings.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

# Llama-3.1-8B's config.json (the numbers that size a run).
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
# What each launch shards over the GPUs (conf/accelerate/): nothing (DDP), gradients and optimizer state (ZeRO-2),
# everything of the drafter (ZeRO-3, FSDP). The target is never sharded.
SHARDED = {"ddp": (), "zero2": ("gradients", "optimizer"), "zero3": ("drafter", "gradients", "optimizer"),
           "fsdp": ("drafter", "gradients", "optimizer")}
GIB = 2 ** 30


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a target and of the EAGLE-3 drafter drafter-train builds for it."""

    target: int
    drafter: int  # all its weights (its frozen embedding and LM-head copies too)
    trainable: int
    hidden: int
    feature_layers: int


def eagle3_job(draft_vocab_size: int, layer_ids: Sequence[int]):
    """The job config of `drafter-train drafter=eagle3` (the shipped defaults: loss, TTT steps, what is frozen)."""
    from drafter_train.recipes.cli import compose_config

    return compose_config("train", ["drafter=eagle3", f"drafter.draft_vocab_size={draft_vocab_size}",
                                    f"drafter.target_layers=[{','.join(map(str, layer_ids))}]"])


def eagle3_drafter(target, draft_vocab_size: int, layer_ids: Sequence[int], device=None):
    """The EAGLE-3 drafter drafter-train builds for `target` (on `device`, else the target's), in fp32, frozen as
    training freezes it."""
    from drafter_train.drafters.common.loading import freeze
    from drafter_train.drafters.eagle3.modeling import Eagle3Model, new_config

    cfg = eagle3_job(draft_vocab_size, layer_ids).drafter
    with torch.device(device or target.device):
        drafter = Eagle3Model(new_config(target, layer_ids, draft_vocab_size, cfg.fc_norm, cfg.draft_len,
                                         cfg.norm_before_fc))
    drafter.train().requires_grad_(True)
    freeze(drafter, cfg)
    return drafter


def model_sizes(target_config: PretrainedConfig, draft_vocab_size: int, layer_ids: Sequence[int]) -> Sizes:
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(target_config)
    drafter = eagle3_drafter(target, draft_vocab_size, layer_ids)
    return Sizes(target=sum(p.numel() for p in target.parameters()),
                 drafter=sum(p.numel() for p in drafter.parameters()),
                 trainable=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                 hidden=target_config.hidden_size, feature_layers=len(layer_ids))


def memory_plan(sizes: Sizes, launch: str, gpus: int, activations: int = 0, target_bytes: int = 2) -> dict[str, int]:
    """Bytes per GPU: target (frozen, bf16), drafter (fp32 master weights), gradients (fp32), optimizer (AdamW: two
    fp32 moments), activations (as measured, per GPU), and the total."""
    share = {part: (gpus if part in SHARDED[launch] else 1) for part in ("drafter", "gradients", "optimizer")}
    plan = {"target": sizes.target * target_bytes,
            "drafter": -(-sizes.drafter * 4 // share["drafter"]),
            "gradients": -(-sizes.trainable * 4 // share["gradients"]),
            "optimizer": -(-sizes.trainable * 8 // share["optimizer"]),
            "activations": activations}
    return {**plan, "total": sum(plan.values())}


def feature_bytes_per_token(sizes: Sizes, response: bool = False, dtype_bytes: int = 2) -> int:
    """The offline feature cache (data/feature_cache.py) per token: the target's hidden states at the drafter's
    feature layers, and at a response token also the target's final hidden state (its logits over any draft
    vocabulary come from it)."""
    return (sizes.feature_layers + response) * sizes.hidden * dtype_bytes


# ----------------------------------------------------------------------------------------------------------------
# Activations, measured


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward pass while `fn` runs, each storage counted once; weights
    (and views of them) are not activations and are left out, their bf16 autocast copies are counted."""
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        weights = fn()  # the data pointers of the weights
    return sum(size for ptr, size in kept.items() if ptr not in weights)


def eagle3_loss_activations(target_config: PretrainedConfig, draft_vocab_size: int, layer_ids: Sequence[int],
                            seq_len: int, device: Optional[torch.device] = None) -> int:
    """Saved bytes of one EAGLE-3 loss on one sequence of `seq_len` tokens (all response), on the CPU in real
    tensors: the real drafter (fp32 weights) under bf16 autocast, fed offline features as the feature cache feeds
    them, against a teacher of the target's LM head rows (random: values do not change sizes)."""
    run = eagle3_loss_step(target_config, draft_vocab_size, layer_ids, seq_len, device)
    return saved_bytes(lambda: run(backward=False))


def eagle3_step_flops(target_config: PretrainedConfig, draft_vocab_size: int, layer_ids: Sequence[int],
                      seq_len: int) -> int:
    """Floating-point operations of one EAGLE-3 training step (loss forward and backward) on one sequence of
    `seq_len` tokens, as eagle3_loss_activations runs it."""
    from torch.utils.flop_counter import FlopCounterMode

    run = eagle3_loss_step(target_config, draft_vocab_size, layer_ids, seq_len)
    with FlopCounterMode(display=False) as counter:
        run(backward=True)
    return counter.get_total_flops()


def eagle3_loss_step(target_config: PretrainedConfig, draft_vocab_size: int, layer_ids: Sequence[int],
                     seq_len: int, device: Optional[torch.device] = None):
    """`run(backward)`: one EAGLE-3 loss (and its backward pass) on one sequence of `seq_len` tokens, on `device`
    (default the CPU; benchmarks/gpu_check.py measures on the GPU it runs on, whose autocast keeps its own dtypes);
    returns the data pointers of the weights."""
    from drafter_train.data.batches import Batch
    from drafter_train.drafters.eagle3.model import eagle3_loss

    hidden = target_config.hidden_size
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(target_config)
    device = device or torch.device("cpu")
    drafter = eagle3_drafter(shell, draft_vocab_size, layer_ids, device=device)
    head = torch.nn.Linear(hidden, draft_vocab_size, bias=False, dtype=torch.bfloat16, device=device)  # draft rows
    target = types.SimpleNamespace(get_output_embeddings=lambda: head, config=target_config, dtype=torch.bfloat16)
    length, generator = seq_len, torch.Generator().manual_seed(0)
    batch = Batch(input_ids=torch.randint(0, target_config.vocab_size, (1, length), generator=generator),
                  attention_mask=torch.ones(1, length, dtype=torch.long),
                  resp_pos=torch.arange(length - 1)[None], resp_mask=torch.ones(1, length - 1, dtype=torch.bool),
                  labels=torch.randint(0, target_config.vocab_size, (1, length - 1), generator=generator),
                  features=torch.randn(1, length, len(layer_ids) * hidden, dtype=torch.bfloat16),
                  target_hidden=torch.randn(1, length - 1, hidden, dtype=torch.bfloat16)).to(device)
    cfg = eagle3_job(draft_vocab_size, layer_ids)

    def run(backward: bool):
        with torch.autocast(device_type=batch.input_ids.device.type, dtype=torch.bfloat16):
            loss = eagle3_loss(drafter, target, batch, cfg).loss_sum
        if backward:
            loss.backward()
        return {p.untyped_storage().data_ptr() for p in [*drafter.parameters(), head.weight]}

    return run


def at_length(measure, lengths: Sequence[int], seq_len: int) -> int:
    """`measure(T)` extended to T = seq_len by the quadratic through its values at three lengths: exact when it is
    c0 + c1 T + c2 T^2 (saved bytes: per-token tensors and the T x T attention mask; operations: the matmuls and
    attention)."""
    xs = [float(t) for t in lengths]
    ys = [float(measure(t)) for t in lengths]
    total = 0.0
    for i, (x_i, y_i) in enumerate(zip(xs, ys)):  # Lagrange interpolation
        weight = 1.0
        for j, x_j in enumerate(xs):
            if j != i:
                weight *= (seq_len - x_j) / (x_i - x_j)
        total += weight * y_i
    return int(round(total))


# ----------------------------------------------------------------------------------------------------------------
# The table


def plan_rows(sizes: Sizes, gpus: int, activations: int) -> list[list[str]]:
    """One row per launch, GiB per GPU."""
    rows = []
    for launch in SHARDED:
        plan = memory_plan(sizes, launch, gpus, activations)
        rows.append([launch, *(f"{plan[k] / GIB:.2f}" for k in ("target", "drafter", "gradients", "optimizer",
                                                                 "activations", "total"))])
    return rows


def markdown(rows: list[list[str]]) -> str:
    head = ["launch", "target", "drafter", "gradients", "optimizer", "activations", "total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per GPU (train.batch_size)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (train.max_seq_len)")
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--lengths", type=int, nargs=3, default=[16, 32, 64],
                        help="the short sequence lengths activations and operations are measured at")
    args = parser.parse_args(argv)
    config = LlamaConfig(**LLAMA_31_8B)
    layers = [2, config.num_hidden_layers // 2, config.num_hidden_layers - 3]  # EAGLE-3's default low/mid/high
    sizes = model_sizes(config, args.draft_vocab_size, layers)
    per_sequence = at_length(
        lambda t: eagle3_loss_activations(config, args.draft_vocab_size, layers, t), args.lengths, args.seq_len)
    flops = at_length(lambda t: eagle3_step_flops(config, args.draft_vocab_size, layers, t), args.lengths,
                      args.seq_len)
    print(f"Llama-3.1-8B target: {sizes.target / 1e9:.2f}B parameters; EAGLE-3 drafter: {sizes.drafter / 1e6:.0f}M "
          f"({sizes.trainable / 1e6:.0f}M trained); feature cache: {feature_bytes_per_token(sizes)} bytes per prompt "
          f"token, {feature_bytes_per_token(sizes, response=True)} per response token")
    print(f"work per trained token at {args.seq_len} tokens: {flops / (args.seq_len - 1) / 1e9:.2f} GFLOP (EAGLE-3 "
          f"loss forward and backward); the target's feature pass: {2 * sizes.target / 1e9:.2f} GFLOP per token "
          "(2 x parameters, attention not counted)")
    print(f"GiB per GPU, {args.gpus} GPUs, {args.batch_size} x {args.seq_len} tokens per GPU:\n")
    print(markdown(plan_rows(sizes, args.gpus, per_sequence * args.batch_size)))


if __name__ == "__main__":
    main()
