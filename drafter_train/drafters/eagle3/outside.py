"""EAGLE-3 drafters other tools trained, loaded as this project's Eagle3Model (drafter=path drafter.path=FOLDER).

Two layouts, told apart by config.json:
- `speculators` (speculators' trainer, vLLM's own format; also what export.format=vllm writes):
  `speculators_model_type: eagle3`, the layer's architecture in `transformer_layer_config`, `draft_vocab_size`,
  `target_hidden_size`, `fc_norm` / `norm_before_fc` / `norm_output`, layer ids `eagle_aux_hidden_state_layer_ids`; weights `fc`,
  `fc_norm.i`, `input_norm`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (both absent for a full vocabulary) and
  `embed_tokens` only when it was trained (else the target's are used, as the engines do).
- `modelopt` (nvidia-modelopt's EagleExporter; the original EAGLE-3 release's `LlamaForCausalLMEagle3` layout with
  ModelOpt's `eagle_config` keys): a flat Llama config plus `draft_vocab_size` and `eagle_config`; weights `fc`,
  `layers.0.*`, `norm`, `lm_head`, `d2t` (absent for a full vocabulary), no t2d, no embeddings.

Layer ids: speculators' ids name the INPUT of a target layer, as vLLM reads them (this project's output of layer
i - 1). ModelOpt hooks the OUTPUT of its layers and exports those ids unchanged (this project's convention), though
vLLM reads them as inputs: ModelOpt folders are loaded as trained, and served one layer off by vLLM unless the ids are
shifted. ModelOpt's exporter also injects YaRN rope scaling (`eagle_export_rope_scaling`) into a drafter trained
without it; the loaded drafter runs the folder's rope, as vLLM does (the benchmark's ModelOpt adapter exports with
the injection off where it compares drafters as trained).

What cannot map is refused in one line by `check_folder`, before the target loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from drafter_train.errors import ConfigError

SPECULATORS, MODELOPT = "speculators", "modelopt"
# eagle_config keys only ModelOpt's exporter writes (this project's sglang export writes the other two alone).
_MODELOPT_KEYS = ("use_last_layernorm", "use_input_layernorm_in_first_layer", "next_layer_regular")


def read_config(path: str) -> Optional[dict]:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def layout(config: dict) -> Optional[str]:
    """Which outside layout a folder's config.json is, or None (a folder of this project, or no EAGLE-3)."""
    if config.get("speculators_model_type") is not None:
        return SPECULATORS
    eagle = config.get("eagle_config") or {}
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) and any(k in eagle for k in _MODELOPT_KEYS):
        return MODELOPT
    return None


def _refuse(path: str, why: str) -> None:
    raise ConfigError(f"drafter.path: {path}: {why}")


def check_folder(path: str) -> None:
    """Refuse, in one line, an outside EAGLE-3 folder this project's Eagle3Model cannot run as its tool does."""
    config = read_config(path)
    which = layout(config or {})
    if which == SPECULATORS:
        _check_speculators(path, config)
    elif which == MODELOPT:
        _check_modelopt(path, config)


def _check_speculators(path: str, config: dict) -> None:
    kind = config["speculators_model_type"]
    if kind != "eagle3":
        _refuse(path, f"a speculators {kind!r} drafter; only eagle3 maps to this project's EAGLE-3")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type") != "llama":
        _refuse(path, f"its transformer_layer_config is {layer.get('model_type')!r}; only llama layers map")
    if layer.get("num_hidden_layers", 1) != 1:
        _refuse(path, f"{layer['num_hidden_layers']} drafter layers; this project's EAGLE-3 has one")
    if config.get("norm_before_residual"):
        _refuse(path, "norm_before_residual=true (a normed residual) has no counterpart in this project's EAGLE-3")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        _refuse(path, "no eagle_aux_hidden_state_layer_ids (speculators resolves them from the verifier's hub "
                      "config); write the ids into config.json")
    if min(ids) < 1:
        _refuse(path, f"layer id {min(ids)} reads the target's embeddings (input of layer 0), which this project's "
                      "features cannot")


def _check_modelopt(path: str, config: dict) -> None:
    eagle = config["eagle_config"]
    if config.get("num_hidden_layers", 1) != 1:
        _refuse(path, f"{config['num_hidden_layers']} drafter layers; this project's EAGLE-3 has one")
    if not eagle.get("use_aux_hidden_state", True) or not eagle.get("eagle_aux_hidden_state_layer_ids"):
        _refuse(path, "an EAGLE-1/2 drafter (no auxiliary hidden states); only EAGLE-3 maps")
    if not eagle.get("use_last_layernorm", True):
        _refuse(path, "use_last_layernorm=false; this project's EAGLE-3 always norms before its LM head")
    if (eagle.get("parallel_draft_step") or 1) > 1:
        _refuse(path, "parallel drafting heads (EagleMedusa) have no counterpart here")
