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

`use_grouped_attention(model)` does the same for attention. With grouped-query attention (SmolLM2: 9 query heads on
3 key/value heads), transformers' sdpa path copies every key/value head for its query group (`repeat_kv`) whenever
a pass carries a mask, i.e. on every multi-token verify pass, over the whole cached prefix, in every layer.
`grouped_sdpa_attention` hands the grouped heads to SDPA as they are (`enable_gqa=True`), on the CPU only: CUDA's
fused kernels take no mask with it, so GPUs keep transformers' path. Same numbers as the copy (SDPA's own GQA
broadcasts the same heads); docs/benchmarks.md, "Grouped attention", has what it saves per pass.
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


# ----------------------------------------------------------------------------------------------------------------
# Attention


GROUPED_ATTENTION = "sdpa_grouped_cpu"  # the attention implementation name it is registered under


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, except for masked passes of grouped-query heads on the CPU: those attend with
    SDPA's `enable_gqa` instead of transformers' copies of the key/value heads. Returns [B, q, heads, D], None."""
    plain = (query.device.type != "cpu" or attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache")))
    if plain:  # transformers' own path (it already uses enable_gqa where no mask is given)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module, kernels: str = "onednn") -> bool:
    """"onednn": a model on transformers' sdpa attention switches to `grouped_sdpa_attention`; "default" switches it
    back. Returns whether the model uses it now. Models on another attention (eager, flash...) are left as they are."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    # transformers is imported here, not with the module: config.py imports CPU_KERNELS and stays light
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)  # the masks transformers builds for sdpa
    current = model.config._attn_implementation
    if kernels == "onednn" and current == "sdpa":
        model.set_attn_implementation(GROUPED_ATTENTION)
    elif kernels == "default" and current == GROUPED_ATTENTION:
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation == GROUPED_ATTENTION
