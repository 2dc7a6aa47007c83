"""The target's hidden states at chosen layers: one mechanism for training (online and offline) and decoding.

Index convention, used everywhere in this project: the feature of layer i is the OUTPUT of the target's decoder
layer i (0-based), i.e. the residual stream after it: transformers' `output_hidden_states[i + 1]` for every
i < L - 1 (transformers returns the last layer's output after the final norm; a tap returns it before).
Serving engines capture the INPUT of their layer i instead (vLLM and SGLang `aux_hidden_state_layers`), which is
our i - 1: exports translate (drafters/eagle3_export.py).

A `FeatureTap` hooks the chosen layers while it is open: every forward of the target then leaves its features in
`tap.features` ([B, T, n * H], layers concatenated in the order given), with no second forward. The speculative
decoder opens one around a whole generation for drafters that read features; training opens one around the no-grad
target forward of a batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from drafter_train.errors import ConfigError


def num_layers(target: PreTrainedModel) -> int:
    return len(target.get_decoder().layers)


def default_layers(total: int) -> list[int]:
    """EAGLE-3's low / mid / high choice {2, L // 2, L - 3} for a target of `total` layers (distinct, in range)."""
    return sorted({min(2, total - 1), total // 2, max(total - 3, 0)})


def evenly_spaced_layers(total: int, count: int) -> list[int]:
    """`count` layers spread evenly from EAGLE-3's low layer to its high one (2 .. L - 3; one layer: L // 2), for a
    target of `total` layers (DFlash spaces them from layer 1). Three of them are EAGLE-3's default_layers when L - 5
    is even (e.g. {2, 15, 27} for L = 30). Fewer distinct layers when the target has fewer than `count`."""
    if count == 1:
        return [total // 2]
    low, high = min(2, total - 1), max(total - 3, 0)
    return sorted({min(int(low + i * (high - low) / (count - 1) + 0.5), total - 1) for i in range(count)})


def check_layers(layer_ids: Sequence[int], total: int, field: str = "drafter.target_layers") -> list[int]:
    ids = list(layer_ids)
    if not ids:
        raise ConfigError(f"{field}: name at least one target layer")
    bad = [i for i in ids if not 0 <= i < total]
    if bad:
        raise ConfigError(f"{field}: layer ids {bad} out of range: the target has {total} layers (0..{total - 1})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{field}: layer ids repeat: {ids}")
    return ids


class FeatureTap:
    """Context manager: while open, each target forward stores the outputs of `layer_ids` in `self.features`."""

    def __init__(self, target: PreTrainedModel, layer_ids: Sequence[int]):
        self.layers = target.get_decoder().layers
        self.layer_ids = check_layers(layer_ids, len(self.layers))
        self._outputs: dict[int, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "FeatureTap":
        for i in self.layer_ids:
            self._handles.append(self.layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs.clear()

    def _hook(self, i: int):
        def store(module, args, output):
            # Decoder layers return the hidden states, or a tuple starting with them (older transformers).
            self._outputs[i] = output[0] if isinstance(output, tuple) else output

        return store

    @property
    def features(self) -> Tensor:
        """[B, T, n * H]: the last forward's features, layers concatenated in `layer_ids` order."""
        missing = [i for i in self.layer_ids if i not in self._outputs]
        if missing:
            raise RuntimeError(f"no target forward has run through layers {missing} since the tap opened")
        return torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)


class NoTap:
    """What the decoder uses for drafters that read no features."""

    features: Optional[Tensor] = None

    def __enter__(self) -> "NoTap":
        return self

    def __exit__(self, *exc) -> None:
        pass


def tap_for(target: PreTrainedModel, layer_ids: Sequence[int]):
    return FeatureTap(target, layer_ids) if layer_ids else NoTap()
