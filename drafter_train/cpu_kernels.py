"""Faster fp32 Linear layers for CPU inference: for each number of rows, the faster of PyTorch's default MKL path
and oneDNN on pre-packed weights, measured on the machine.

Decoding feeds Linear layers few rows: 1 for a plain step, k+1 for a verify pass. Which kernel is faster at those
sizes depends on the CPU (docs/benchmarks.md, "CPU kernels" and "CPU kernels chosen by measurement"):
- on a 2-core AMD EPYC (AVX2), MKL's small-matrix path made 2-5 rows cost 1.7-2.2x one row (SmolLM2's 49,152 x 576
  LM head: 10 ms for 1 row, 27 ms for 2), while oneDNN reads each weight once;
- on a 2-core Intel Xeon with AVX-512 and a 480 MiB L3, MKL is the fastest up to 3 rows (a whole SmolLM2 forward
  33.6 ms against 47.4 ms on oneDNN with plain weights), and oneDNN on packed weights from ~4 rows on.

`use_onednn_linears(model, kernels)` switches each `nn.Linear` of at least MIN_ONEDNN_ELEMENTS weights in place:
- "auto" (calibrate): times the model's own patched layers (a sample of each shape, CALIBRATION_BYTES in all, each
  counted for its twins) at a few row counts with both kernels and records, per row count, the faster one
  (`RowPolicy`); rows between two measured counts take the smaller count's choice, rows past the largest take the
  largest's;
- "onednn": oneDNN at every row count;
- "default": PyTorch's F.linear (undoes the patch).
oneDNN runs on a copy of the weight packed into its blocked layout once (`packed_weight`; repacked when the
weight changes, e.g. after an optimizer step), so a layer that uses it holds its weight twice. The patched forward
uses the policy only when nothing needs gradients (inference_mode / no_grad) and input and weight are fp32 on the CPU;
otherwise it is the ordinary `F.linear`, so training through a patched module is unchanged. Results differ between
the kernels by float rounding (~1e-5), as with any change of kernel; plain decoding (1 row) uses the fastest
one-row kernel, so every speedup is against the fastest plain decoding measured here, and greedy decoding stays
lossless up to such rounding at exact near-ties (the evaluator's greedy_match reports it).

"auto"'s choice is a timing, so it can differ between two loads on the same machine (docs/benchmarks.md, "Data
passes on fixed kernels"). Passes whose numbers become training data (datagen's generation, the target's features
and teacher logits) run inside `stock_kernels()`: PyTorch's own kernel whatever the policy, so two runs of the same
job write the same data and train the same drafter. Only decoding, which is timed, follows the policy.

`use_grouped_attention(model)` does the same for attention. With grouped-query attention (SmolLM2: 9 query heads on
3 key/value heads), transformers' sdpa path copies every key/value head for its query group (`repeat_kv`) whenever
a pass carries a mask, i.e. on every multi-token verify pass, over the whole cached prefix, in every layer.
`grouped_sdpa_attention` hands the grouped heads to SDPA as they are (`enable_gqa=True`), on the CPU only: CUDA's
fused kernels take no mask with it, so GPUs keep transformers' path. Same numbers as the copy (SDPA's own GQA
broadcasts the same heads); docs/benchmarks.md, "Grouped attention", has what it saves per pass.
"""

from __future__ import annotations

import logging
import time
import weakref
from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from drafter_train.config import CPU_KERNELS
from drafter_train.devices import on_cpu

log = logging.getLogger(__name__)

# Smaller weights stay on the default kernel: oneDNN's fixed cost per call (~20 us here) outweighs its gain on them
# (a 64 x 64 layer: 3 us default, 28 us oneDNN), which would make tiny targets like stories260K slower.
MIN_ONEDNN_ELEMENTS = 1 << 16
# Row counts "auto" times: plain steps (1), chains and small trees (2-17), batches (32 and more take its choice).
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)
# "auto" times a sample of the layers, each shape's members in turn until the sample holds this many weight bytes:
# far past any CPU's last-level cache, so the timed passes stream their weights from memory as a forward does. A
# 1.5B fp32 target's ~6 GB of linear weights took minutes to time whole at every load on 2 cores.
CALIBRATION_BYTES = 256 << 20


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its fused linear op (a private op: checked, never assumed)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class RowPolicy:
    """Per measured row count (increasing), whether oneDNN is the faster kernel there."""

    rows: tuple[int, ...] = (1,)
    onednn: tuple[bool, ...] = (True,)

    def __post_init__(self) -> None:
        # the answer for 0 .. rows[-1] rows, looked up on every call (a decoding forward makes ~200 of them)
        table = tuple(self.onednn[max(bisect_right(self.rows, n) - 1, 0)] for n in range(self.rows[-1] + 1))
        object.__setattr__(self, "_table", table)

    def uses_onednn(self, rows: int) -> bool:
        table = self._table
        return table[rows] if rows < len(table) else table[-1]

    def describe(self) -> str:
        """e.g. "default 1-3, onednn 4-16, default 17+": the kernel per range of rows."""
        spans, start = [], 0
        for i in range(1, len(self.rows) + 1):
            if i == len(self.rows) or self.onednn[i] != self.onednn[start]:
                first = self.rows[start]
                span = f"{first}+" if i == len(self.rows) else \
                    f"{first}" if self.rows[i] - 1 == first else f"{first}-{self.rows[i] - 1}"
                spans.append(f"{'onednn' if self.onednn[start] else 'default'} {span}")
                start = i
        return ", ".join(spans)


ALWAYS_ONEDNN = RowPolicy()

# id(weight) -> (weakref to it, its version and data pointer when packed, the packed copy)
_PACKED: dict[int, tuple] = {}


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, packed once and again only when the weight has changed (an
    in-place update, a new storage); freed with the weight."""
    try:
        state = (weight._version, weight.data_ptr())
    except RuntimeError:  # an inference tensor (made under inference_mode) has no version counter; it cannot change
        state = (0, weight.data_ptr())
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != state:
        if entry is None or entry[0]() is not weight:
            weakref.finalize(weight, _PACKED.pop, key, None)
        entry = (weakref.ref(weight), state, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        _PACKED[key] = entry
    return entry[2]


_stock_depth = 0  # > 0 inside stock_kernels()


@contextmanager
def stock_kernels() -> Iterator[None]:
    """Inside (a `with` block or a decorated function), every patched layer runs PyTorch's default kernel: the
    passes that produce training data must not depend on a per-load timing (module docstring)."""
    global _stock_depth
    _stock_depth += 1
    try:
        yield
    finally:
        _stock_depth -= 1


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose inference forward runs oneDNN at the row counts its `row_policy` gives it (set as a layer's
    class: a deep copy stays itself, with its own packed weight)."""

    row_policy: RowPolicy = ALWAYS_ONEDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (torch.is_grad_enabled() or _stock_depth or not x.is_cpu or x.dtype is not torch.float32
                or w.dtype is not torch.float32 or not self.row_policy.uses_onednn(x.numel() // self.in_features)):
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), self.bias, "none", [], "")


def use_onednn_linears(model: nn.Module, kernels: str = "auto", min_elements: int = MIN_ONEDNN_ELEMENTS) -> int:
    """Switch `model`'s Linear layers of at least `min_elements` weights to `kernels` ("auto" | "onednn" |
    "default"); returns how many layers may use oneDNN.

    Idempotent ("auto" measures again); "default" undoes it. Only exact `nn.Linear` layers change (their class
    becomes OneDNNLinear, weights and state dict untouched). Models off the CPU or not in fp32 take the default path
    at call time anyway, and are not timed.
    """
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    if kernels != "default" and not onednn_available():
        log.warning("this torch build has no oneDNN linear op: keeping PyTorch's default CPU kernels")
        kernels = "default"
    layers = []
    for layer in model.modules():
        if kernels != "default" and type(layer) in (nn.Linear, OneDNNLinear) and layer.weight.numel() >= min_elements:
            layer.__class__ = OneDNNLinear
            layer.row_policy = ALWAYS_ONEDNN
            layers.append(layer)
        elif kernels == "default" and type(layer) is OneDNNLinear:
            layer.__class__ = nn.Linear
            layer.__dict__.pop("row_policy", None)
    if kernels == "auto" and layers and on_cpu(layers[0].weight.device) and layers[0].weight.dtype == torch.float32:
        policy = calibrate_rows(layers)
        for layer in layers:
            layer.row_policy = policy
    return len(layers)


def row_policy(model: nn.Module) -> Optional[RowPolicy]:
    """The policy of the model's patched layers (None: none patched)."""
    return next((m.row_policy for m in model.modules() if type(m) is OneDNNLinear), None)


@dataclass(frozen=True)
class KernelState:
    """Which kernel each Linear layer of one model runs (its class, and its row policy when patched) and which
    attention it uses: what `apply_kernel_state` puts back exactly, an `auto` policy included, without timing again."""

    linears: tuple[tuple[nn.Module, Optional[RowPolicy]], ...]
    attention: str


def kernel_state(model: nn.Module) -> KernelState:
    linears = tuple((m, m.row_policy if type(m) is OneDNNLinear else None) for m in model.modules()
                    if type(m) in (nn.Linear, OneDNNLinear))
    return KernelState(linears, model.config._attn_implementation)


def apply_kernel_state(model: nn.Module, state: KernelState) -> None:
    """Put `model` back on the kernels `state` recorded (~0.1 ms: cheap enough between two timed decodes)."""
    for layer, policy in state.linears:
        if policy is None and type(layer) is OneDNNLinear:
            layer.__class__ = nn.Linear
            layer.__dict__.pop("row_policy", None)
        elif policy is not None:
            layer.__class__ = OneDNNLinear
            layer.row_policy = policy
    if model.config._attn_implementation != state.attention:
        model.set_attn_implementation(state.attention)


def kernels_in_use(model: nn.Module) -> str:
    """The CPU_KERNELS name of the state `model` is in: "default" when no layer is patched and attention is
    transformers' own; "onednn" when every patched layer always runs oneDNN; "auto" otherwise (also for a model whose
    layers are all too small to patch but whose attention is grouped: auto and onednn are the same on it)."""
    state = kernel_state(model)
    policies = {policy for _, policy in state.linears if policy is not None}
    if not policies:
        return "auto" if state.attention == GROUPED_ATTENTION else "default"
    return "onednn" if policies == {ALWAYS_ONEDNN} else "auto"


def kernel_states(model: nn.Module, current: str, settings: tuple[str, ...]) -> dict[str, KernelState]:
    """The state each of `settings` (CPU_KERNELS names) puts `model` in, `current` being the one it is on now (kept
    as it is: its `auto` policy is not timed again); the model is left on `current`'s state."""
    states = {current: kernel_state(model)}
    try:
        for kernels in settings:
            if kernels not in states:
                use_onednn_linears(model, kernels)
                use_grouped_attention(model, kernels)
                states[kernels] = kernel_state(model)
    finally:
        apply_kernel_state(model, states[current])
    return states


def calibration_sample(layers: list[nn.Linear], min_bytes: int = CALIBRATION_BYTES) -> list[tuple[nn.Linear, float]]:
    """The layers "auto" times, in `layers`' order, each with how many of `layers` it stands for: layers are grouped
    by weight shape, and each group gives its next member in turn until the sample holds `min_bytes` of weights (or
    every layer). A group's members are alike (same shape, same kernel path), so each timed member counts for
    len(group) / members timed; the weighted sum estimates a pass over all of `layers`."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(layers):
        groups.setdefault((tuple(m.weight.shape), m.weight.dtype, m.bias is not None), []).append(i)
    taken: dict[tuple, int] = dict.fromkeys(groups, 0)
    chosen, size = [], 0
    while size < min_bytes and len(chosen) < len(layers):
        for key, members in groups.items():
            if taken[key] < len(members) and (size < min_bytes or taken[key] == 0):
                i = members[taken[key]]
                taken[key] += 1
                chosen.append(i)
                size += layers[i].weight.numel() * layers[i].weight.element_size()
    group_of = {i: key for key, members in groups.items() for i in members}
    return [(layers[i], len(groups[group_of[i]]) / taken[group_of[i]]) for i in sorted(chosen)]


@torch.inference_mode()
def calibrate_rows(layers: list[nn.Linear], rows: tuple[int, ...] = CALIBRATION_ROWS, repeats: int = 5,
                   margin: float = 0.05, min_bytes: Optional[int] = None) -> RowPolicy:
    """Per row count, whether oneDNN on packed weights runs `layers` (one after the other, as a forward does) faster
    than F.linear by more than `margin`: the fastest of `repeats` interleaved timings of each (interference from
    other work only ever slows a run down, so the minimum is the steadiest estimate). Within the margin PyTorch's own
    kernel stays: plain decoding then runs as it would without this project. Timed on `calibration_sample` (at least
    `min_bytes` of weights, default CALIBRATION_BYTES; each shape's time scaled to its count): ~5 s for SmolLM2-135M
    on 2 cores."""
    generator = torch.Generator().manual_seed(0)  # its own: timing must not move the training run's random stream
    sample = calibration_sample(layers, CALIBRATION_BYTES if min_bytes is None else min_bytes)
    inputs = {n: {m.in_features: torch.randn(n, m.in_features, generator=generator) for m, _ in sample}
              for n in rows}

    def run(n: int, onednn: bool) -> float:
        total = 0.0
        for m, count in sample:
            x = inputs[n][m.in_features]
            start = time.perf_counter()
            if onednn:
                torch.ops.mkldnn._linear_pointwise(x, packed_weight(m.weight), m.bias, "none", [], "")
            else:
                F.linear(x, m.weight, m.bias)
            total += count * (time.perf_counter() - start)
        return total

    for n in rows:  # packs the weights; warms both paths at every size
        run(n, True), run(n, False)
    times = {(n, k): [] for n in rows for k in (True, False)}
    for _ in range(repeats):
        for n in rows:
            for k in (True, False):
                times[n, k].append(run(n, k))
    policy = RowPolicy(tuple(rows), tuple(min(times[n, True]) < (1 - margin) * min(times[n, False]) for n in rows))
    log.info("cpu kernels by rows: %s", policy.describe())
    return policy


# ----------------------------------------------------------------------------------------------------------------
# Attention


GROUPED_ATTENTION = "sdpa_grouped_cpu"  # the attention implementation name it is registered under


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, except for masked passes of grouped-query heads on the CPU: those attend with
    SDPA's `enable_gqa` instead of transformers' copies of the key/value heads. Returns [B, q, heads, D], None.

    Inside stock_kernels() it is transformers' own path, as the linear layers are: training data must not depend on
    a kernel choice. It is also the faster one there: on datagen's left-padded batches of 1-token steps transformers
    folds each key/value head's query heads into one SDPA call (`pack_gqa`), which `enable_gqa` does not (SmolLM2-135M
    in bf16, 64 rows, 24 new tokens on an AVX-512 EPYC: the attention kernel's time 1.6 s against 4.1 s;
    docs/lab-notes/acceptance.md, eleventh session)."""
    plain = (_stock_depth or not on_cpu(query.device) or attention_mask is None
             or getattr(module, "num_key_value_groups", 1) == 1
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache")))
    if plain:  # transformers' own path (it already uses enable_gqa where no mask is given)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module, kernels: str = "auto") -> bool:
    """"auto" / "onednn": a model on transformers' sdpa attention switches to `grouped_sdpa_attention`; "default"
    switches it back. Returns whether the model uses it now. Models on another attention (eager, flash...) are left as they are."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"cpu kernels must be one of {CPU_KERNELS}, got {kernels!r}")
    # transformers is imported here, on first use: the rest of this module needs torch alone
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)  # the masks transformers builds for sdpa
    current = model.config._attn_implementation
    if kernels != "default" and current == "sdpa":
        model.set_attn_implementation(GROUPED_ATTENTION)
    elif kernels == "default" and current == GROUPED_ATTENTION:
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation == GROUPED_ATTENTION
