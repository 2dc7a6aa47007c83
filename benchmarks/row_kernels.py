"""Benchmark: can another fp32 Linear kernel flatten the verify-cost curve on this CPU?

The verify pass over n tokens costs ~1.5x a 1-token pass at n = 5 on PyTorch's default MKL path, ~1.4x on the
oneDNN kernel `target.cpu_kernels=auto` picks there (docs/benchmarks.md, "CPU kernels chosen by measurement"). Two
more kernels, each timed as one SmolLM2 forward over n new tokens after a cached 256-token prefix
(benchmarks.common.forward_ms), interleaved with the default path, medians over repeats:
- "mkl-packed": MKL's packed GEMM (torch.ops.mkl._mkl_linear) on weights packed once for exactly n rows: the
  weight layout MKL would otherwise repack at every call;
- "split": the rows cut into MKL calls of at most 3 (the row counts whose kernel streams the weights once).

    python -m benchmarks.row_kernels --sizes 1 3 4 5 8 9 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import describe_machine, forward_ms
from drafter_train.config import TargetConfig
from drafter_train.cpu_kernels import use_grouped_attention
from drafter_train.targets import load_target

STOCK = torch.nn.Linear.forward


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def split_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Rows in MKL calls of at most 3 (the untimed 256-row prefill keeps the stock path)."""
    if rows_of(x) > 16:
        return STOCK(self, x)
    flat = x.reshape(rows_of(x), x.shape[-1])
    out = torch.cat([F.linear(chunk, self.weight, self.bias) for chunk in flat.split(3)])
    return out.reshape(*x.shape[:-1], -1)


def packed_forward(packs: dict, rows: int):
    """MKL's packed GEMM on the weights packed for `rows` rows (other row counts: the stock path)."""
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        packed = packs.get(self)
        if packed is None or rows_of(x) != rows:
            return STOCK(self, x)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, packed, self.weight, self.bias, rows)
        return out.reshape(*x.shape[:-1], -1)
    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 4, 5, 8, 9])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(describe_machine())
    target, _ = load_target(TargetConfig(cpu_kernels="default"))
    use_grouped_attention(target, "onednn")  # as every setting of benchmarks/kernels.py but `default`
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    ms: dict[tuple[str, int], list[float]] = {}
    for n in args.sizes:
        packs = {m: torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), n) for m in linears}
        settings = {"default": STOCK, "mkl-packed": packed_forward(packs, n), "split": split_forward}
        for rep in range(args.repeats):
            for name, forward in settings.items():
                torch.nn.Linear.forward = forward
                try:
                    ms.setdefault((name, n), []).append(forward_ms(target, n, seed=rep))
                finally:
                    torch.nn.Linear.forward = STOCK
        del packs, settings  # ~2.7 GB of packed weights per row count
    print(f"load average at the end: {os.getloadavg()}")
    print("| setting | " + " | ".join(f"n = {n}" for n in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    base = statistics.median(ms[("default", args.sizes[0])])
    for name in ("default", "mkl-packed", "split"):
        cells = [statistics.median(ms[(name, n)]) for n in args.sizes]
        print(f"| {name} | " + " | ".join(f"{c:.1f} ms (×{c / base:.2f})" for c in cells) + " |")


if __name__ == "__main__":
    main()
