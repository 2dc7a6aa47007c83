"""EAGLE-3 drafters in the formats serving engines load.

- `vllm`: vLLM's speculators format (`speculators_model_type: eagle3`): config.json with the layer's architecture as
  `transformer_layer_config`, weights `fc`, `fc_norm.*`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (no
  `embed_tokens` when the embeddings were frozen copies of the target's: the engine shares the target's).
- `sglang`: SGLang's `LlamaForCausalLMEagle3` (the original EAGLE-3 release format, which vLLM loads too): a Llama
  config plus `draft_vocab_size` and `eagle_config`, the layer's weights under `midlayer.*`.

Layer ids: vLLM and SGLang capture the INPUT of their layer i (the residual stream before it), this project the
OUTPUT of layer i (features.py), so an exported id is ours + 1. vLLM's speculators reader defaults
`norm_before_residual` to true when the key is absent, so it is always written. A `norm_before_fc` drafter (one
RMSNorm over the whole concatenation, llama.cpp's layout) keeps its `input_norm.weight`: vLLM's speculators reader
takes `norm_before_fc` from the top level of config.json (algos.update_eagle3) and its Eagle3 Llama model applies
`input_norm` before `fc` (llama_eagle3.py), as speculators' own Eagle3 model does. SGLang's loader knows no `fc_norm`
and a fixed 3-layer fc, and silently ignores weights it does not know: such drafters are refused for it.
- `gguf`: llama.cpp's eagle3 architecture, converted by llama.cpp's own converter from the speculators folder (with
  the target's folder for vocabulary and shapes). llama.cpp knows no per-layer fc_norm, only `norm_before_fc` (one
  RMSNorm over the whole concatenation, tensor `input_norm` -> `enc_output_norm`) and exactly 3 fused layers: other
  drafters are refused, never converted into something that drafts differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from safetensors.torch import save_file

from drafter_train.drafters.common.export import drafter_weights
from drafter_train.errors import ConfigError
from drafter_train.llamacpp import GgufJob, convert_staged

# Llama-architecture fields the engines read from the layer config (the rest of the target's config is dropped).
_LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
               "vocab_size", "hidden_act", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
               "pad_token_id", "initializer_range", "pretraining_tp")
SUPPORTED_ARCHITECTURES = ("llama",)


def engine_layer_ids(layer_ids: list[int]) -> list[int]:
    """Our 'output of layer i' ids -> the engines' 'input of layer i' ids."""
    return [i + 1 for i in layer_ids]


def _layer_config(config: dict) -> dict:
    backbone = config["backbone"]
    if backbone.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"export.format: EAGLE-3 export supports {SUPPORTED_ARCHITECTURES} targets, this drafter's "
                          f"target is {backbone.get('model_type')!r}")
    if config.get("num_layers", 1) != 1:  # vLLM's and SGLang's EAGLE-3 Llama models: one 2H-wide layer
        raise ConfigError(f"export.format: the engines' EAGLE-3 runs one decoder layer, this drafter has "
                          f"{config['num_layers']} (drafter.num_layers); evaluate it with our decoder")
    layer = {k: backbone[k] for k in _LAYER_KEYS if backbone.get(k) is not None}
    if config.get("intermediate_size"):  # drafter.intermediate_size: the engines build the MLP from the layer config
        layer["intermediate_size"] = config["intermediate_size"]
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, vocab_size=config["vocab_size"],
                 architectures=["LlamaForCausalLM"])
    return layer


def write_speculators(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool) -> None:
    """vLLM's speculators-format folder (config.json + model.safetensors) for the saved drafter in `drafter_dir`."""
    config = json.loads((drafter_dir / "config.json").read_text())
    _speculators_folder(config, drafter_dir, out, draft_len, verifier, keep_embeddings, vllm=True)


def full_vocabulary(config: dict) -> bool:
    """A drafter whose LM head covers the target's whole vocabulary (drafter.draft_vocab_size=0): d2t is all zeros."""
    return config["draft_vocab_size"] in (0, config["vocab_size"])


def without_identity_mapping(weights: dict, config: dict) -> dict:
    """The weights vLLM loads: a full-vocabulary drafter's vLLM model has no draft_id_to_target_id parameter, and
    vLLM refuses a folder holding d2t/t2d for it ("no module or parameter named 'draft_id_to_target_id'")."""
    if not full_vocabulary(config):
        return weights
    return {name: tensor for name, tensor in weights.items() if name not in ("d2t", "t2d")}


def verifier_architectures(verifier: str, config: dict) -> list:
    """The target's own architectures (speculators refuses a config without them): from its config.json when the
    target is a local folder, else the drafter layer's (a Llama target's own config; a non-Llama target's drafter
    layer is a Llama layer that names none, and a hub id is not looked up offline)."""
    local = Path(verifier) / "config.json"
    if local.is_file():
        return json.loads(local.read_text()).get("architectures") or []
    return config["backbone"].get("architectures") or []


def full_attention_in_vllm(config: dict, layer: dict) -> dict:
    """Layer-config fields that keep the drafter's attention full in vLLM. vLLM gives every attention layer without
    a per-layer window the target's model-wide one (CacheConfig.sliding_window: a target config with a sliding_window
    and no layer_types, e.g. Mistral), the EAGLE-3 drafter's layer included, though it was trained with full
    attention (measured: docs/targets.md). A per-layer window as long as the model's context is full attention that
    vLLM does not override; other targets need nothing."""
    context = layer.get("max_position_embeddings")
    if not config.get("target_sliding_window") or not context:
        return {}
    return {"layer_types": ["sliding_attention"], "sliding_window": context}


def _speculators_folder(config: dict, drafter_dir: Path, out: Path, draft_len: int, verifier: str,
                        keep_embeddings: bool, vllm: bool = False) -> None:
    layer = _layer_config(config)
    spec = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": dict(layer, **full_attention_in_vllm(config, layer)),
        "draft_vocab_size": config["draft_vocab_size"] or config["vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(config["target_layers"]),
        "norm_before_residual": False,
        "norm_before_fc": bool(config.get("norm_before_fc", False)),
        "fc_norm": bool(config["fc_norm"]),
        "norm_output": bool(config.get("norm_output", False)),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_len,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier, config)},
        },
        "dtype": config.get("dtype") or config.get("torch_dtype") or "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    weights = drafter_weights(drafter_dir, keep_embeddings)
    if vllm:  # llama.cpp's converter (gguf, staged through this folder) keeps reading d2t as before
        weights = without_identity_mapping(weights, config)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_sglang(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool) -> None:
    """SGLang's LlamaForCausalLMEagle3 folder for the saved drafter in `drafter_dir`."""
    config = json.loads((drafter_dir / "config.json").read_text())
    if config.get("norm_before_fc"):
        raise ConfigError("export.format=sglang: SGLang's LlamaForCausalLMEagle3 has no norm_before_fc; export "
                          "export.format=gguf for llama.cpp")
    if config.get("norm_output"):
        raise ConfigError("export.format=sglang: SGLang's LlamaForCausalLMEagle3 has no norm_output; export "
                          "export.format=vllm")
    if config["fc_norm"]:
        raise ConfigError("export.format=sglang: SGLang's LlamaForCausalLMEagle3 has no fc_norm (it would ignore "
                          "those weights and draft garbage); train with drafter.fc_norm=false, or export "
                          "export.format=vllm")
    if len(config["target_layers"]) != 3:
        raise ConfigError(f"export.format=sglang: SGLang's EAGLE-3 fuses exactly 3 target layers, this drafter "
                          f"fuses {len(config['target_layers'])}")
    layer = _layer_config(config)
    sglang = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=config["draft_vocab_size"],
                  target_hidden_size=config["target_hidden_size"], num_speculative_tokens=draft_len,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": engine_layer_ids(config["target_layers"]),
                                "use_aux_hidden_state": True},
                  dtype=config.get("dtype") or config.get("torch_dtype") or "float32")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(sglang, indent=2) + "\n")
    weights = drafter_weights(drafter_dir, keep_embeddings)
    weights = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def check_gguf(config: dict) -> None:
    """Refuse, in one line, an EAGLE-3 drafter llama.cpp would run differently from how it was trained."""
    if config.get("num_layers", 1) != 1 or config.get("intermediate_size"):
        raise ConfigError("export.format=gguf: llama.cpp's EAGLE-3 has one decoder layer of the target's MLP width; "
                          "train with drafter.num_layers=1 drafter.intermediate_size=0 (a wider MLP exports as "
                          "export.format=vllm)")
    if config.get("norm_output"):
        raise ConfigError("export.format=gguf: llama.cpp's EAGLE-3 has no norm_output (each step would read its "
                          "output unnormed); train with drafter.norm_output=false, or export export.format=vllm")
    if config.get("fc_norm"):
        raise ConfigError("export.format=gguf: llama.cpp's EAGLE-3 has no per-layer fc_norm (only norm_before_fc, one "
                          "norm over all fused layers); train with drafter.fc_norm=false drafter.norm_before_fc=true")
    if len(config.get("target_layers") or (0, 0, 0)) != 3:  # unset: the default low/mid/high three
        raise ConfigError(f"export.format=gguf: llama.cpp's EAGLE-3 fuses exactly 3 target layers, this drafter "
                          f"fuses {len(config['target_layers'])}")


def write_gguf(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool,
               job: GgufJob) -> None:
    """drafter.gguf (llama.cpp's eagle3 architecture) and, with job.with_target, target.gguf: the speculators folder
    (staged inside `out`, removed after) through llama.cpp's converter with the target's folder."""
    config = json.loads((drafter_dir / "config.json").read_text())
    check_gguf(config)
    _layer_config(config)  # the architecture check, before any conversion
    convert_staged(job, out, "eagle3", lambda staging: _speculators_folder(config, drafter_dir, staging, draft_len,
                                                                           verifier, keep_embeddings))


FORMATS = {"vllm": write_speculators, "sglang": write_sglang, "gguf": write_gguf}
