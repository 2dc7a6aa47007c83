"""A drafter cut from the target: its first N decoder layers plus embeddings, final norm and LM head.

Works for any HF decoder-only model whose layers live in a `<prefix>.layers.<i>.` module list (Llama, Qwen2,
Mistral, Gemma, SmolLM...). Untrained, it is the baseline every trained drafter must beat; trained, it starts from
the target's own representations and vocabulary.
"""

from __future__ import annotations

import copy
import re

from transformers import AutoModelForCausalLM, PreTrainedModel

from drafter_train.errors import ConfigError

_LAYER_KEY = re.compile(r"^(.*\.layers)\.(\d+)\.")
TRUNCATED_PREFIX = "truncated:"


def parse_truncated(path: str) -> int | None:
    """'truncated:N' -> N; anything else -> None."""
    if not path.startswith(TRUNCATED_PREFIX):
        return None
    value = path[len(TRUNCATED_PREFIX) :]
    if not value.isdigit():
        raise ConfigError(f"drafter.path: expected truncated:N with an integer N, got {path!r}")
    return int(value)


def cut_from_target(target: PreTrainedModel, num_layers: int, share_weights: bool = True,
                    whose: str = "the target's") -> PreTrainedModel:
    """The target's (or another model's: `whose` names it in errors) first `num_layers` layers as a standalone causal
    LM of the same class.

    share_weights=True reuses the target's tensors (no memory cost; for evaluation). Use False to train the cut
    drafter without touching the target.
    """
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ConfigError(f"drafter.path: truncated:N needs 1 <= N < {total} ({whose} layers), got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding/full) must match the layer count
        config.layer_types = config.layer_types[:num_layers]
    drafter = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    state = {k: v for k, v in target.state_dict().items() if _keep(k, num_layers)}
    if not share_weights:
        state = {k: v.detach().clone() for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        drafter.tie_weights()
    return drafter.to(target.device).eval()


def _keep(key: str, num_layers: int) -> bool:
    match = _LAYER_KEY.match(key)
    return match is None or int(match.group(2)) < num_layers
