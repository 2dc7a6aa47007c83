"""Faster fp32 Linear layers for CPU inference: oneDNN matmuls instead of PyTorch's default MKL path.

On this project's reference CPU (2-core AMD EPYC, AVX2; see docs/benchmarks.md "CPU kernels") the default fp32
`F.linear` is slow for the few-row inputs decoding feeds it: one token through SmolLM2's 49,152 x 576 LM head takes
~10 ms, 2-4 tokens cost 2-3x that (MKL's small-matrix path), while oneDNN reads the weight once at memory speed
(~5 ms for 1 token, ~6-7 ms for 2-4). A verification pass of k+1 tokens therefore costs far less relative to a
one-token step, which is exactly the ratio speculative decoding lives on; plain decoding gets faster too, so every
speedup we report is against the faster baseline.

`use_onednn_linears(model)` switches each `nn.Linear` of a model in place. Its forward uses oneDNN only
when nothing needs gradients (inference_mode / no_grad) and the input and weight are fp32 on the CPU; otherwise it
is the ordinary `F.linear`, so training through a patched module is unchanged. Results differ from MKL's by float
rounding (~1e-5), like any change of kernel; both the speculative decoder and its plain-decoding baseline run the
same patched model, so greedy losslessness is unaffected.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

CPU_KERNELS = ("onednn", "default")
# Smaller weights stay on the default kernel: oneDNN's fixed cost per call (~20 us here) outweighs its gain on them
# (a 64 x 64 layer: 3 us default, 28 us oneDNN), which would make tiny targets like stories260K slower.
MIN_ONEDNN_ELEMENTS = 1 << 16


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its fused linear op (a private op: checked, never assumed)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose inference forward runs on oneDNN (set as a layer's class: a deep copy stays itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")


def use_onednn_linears(model: nn.Module, kernels: str = "onednn", min_elements: int = MIN_ONEDNN_ELEMENTS) -> int:
    """Switch `model`'s Linear layers of at least `min_elements` weights to `kernels` ("onednn" | "default");
    returns how many layers use oneDNN.

    Idempotent; "default" undoes it. Only exact `nn.Linear` layers change (their class becomes OneDNNLinear, weights
    and state dict untouched). Models off the CPU or not in fp32 take the default path at call time anyway.
    """
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    if kernels == "onednn" and not onednn_available():
        log.warning("this torch build has no oneDNN linear op: keeping PyTorch's default CPU kernels")
        kernels = "default"
    patched = 0
    for layer in model.modules():
        if kernels == "onednn" and type(layer) is nn.Linear and layer.weight.numel() >= min_elements:
            layer.__class__ = OneDNNLinear
        elif kernels == "default" and type(layer) is OneDNNLinear:
            layer.__class__ = nn.Linear
        patched += type(layer) is OneDNNLinear
    return patched
