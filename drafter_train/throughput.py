"""What a token costs against what the machine can do (issue 72; python -m benchmarks.throughput): the machine's
matmul peak on its threads, the FLOPs of the target's feature pass, and medians of repeated timings.

FLOPs are counted as useful work only, so padding and recomputation show as a lower fraction of the peak:
- linear: 2 x (the weights of the decoder's nn.Linear layers) x the real (non-pad) tokens. The feature pass runs the
  decoder alone (drafters/common/conditioned.py: target_signals), so neither the LM head nor the embedding lookup
  counts;
- attention: per layer, 2 x 2 x (heads x head_dim) x T (T + 1) / 2 for a sequence of T real tokens (QK^T and the
  weighted sum of V, over the causal half of the square).
Norms, activations and rotary embeddings are left out (O(T x H), < 1 % here).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

# [rows, inner, cols] of the peak's matmuls: a square one, and the shapes of a 135M-class decoder's projections over
# a batch of ~2k tokens (576 -> 1536 MLP up, 1536 -> 576 down). The peak is the fastest of them.
PEAK_SHAPES = ((2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576))


def matmul_tflops(dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]] = PEAK_SHAPES, repeats: int = 5) -> float:
    """The machine's matmul peak in `dtype` on torch's current threads: the fastest of `shapes` (best of `repeats`
    after one warm-up each), in TFLOPS."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        seconds = min(timings(lambda: a @ b, repeats))
        best = max(best, 2 * m * k * n / seconds / 1e12)
    return best


def timings(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    return statistics.median(timings(fn, repeats, warmup))


def linear_weights(decoder: nn.Module) -> int:
    """Weights of the decoder's Linear layers (each multiplies once per token)."""
    return sum(m.weight.numel() for m in decoder.modules() if isinstance(m, nn.Linear))


def decoder_flops(decoder: nn.Module, config, lengths: Sequence[int]) -> dict:
    """Useful FLOPs of one decoder pass over sequences of `lengths` real tokens (module docstring): linear,
    attention and total."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads_dim = config.num_attention_heads * head_dim
    linear = 2 * linear_weights(decoder) * sum(lengths)
    attention = 4 * config.num_hidden_layers * heads_dim * sum(t * (t + 1) // 2 for t in lengths)
    return {"linear": linear, "attention": attention, "total": linear + attention}


def of_peak(flops: float, seconds: float, peak_tflops: float) -> float:
    """The fraction of `peak_tflops` that `flops` in `seconds` reach."""
    return flops / seconds / (peak_tflops * 1e12)
