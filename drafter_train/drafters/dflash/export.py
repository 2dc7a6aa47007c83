"""DFlash drafters in the format serving engines load: the DFlash draft-model folder (z-lab's `DFlashDraftModel`).

config.json is a Qwen3 config of the drafter's layers plus `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `target_hidden_size`, `draft_vocab_size` and `dflash_config` {`mask_token_id`,
`target_layer_ids`, `block_size`}; weights `layers.*`, `fc`, `hidden_norm`, `norm`, `lm_head` (+ `d2t` for a
reduced draft vocabulary). Both engines run Qwen3 layers (per-head q/k norms: train with drafter.qk_norm=true) and
fuse with fc then hidden_norm (no per-layer fc_norm).

Layer ids: DFlash's `target_layer_ids` are "output of layer i" (transformers' hidden_states[i + 1]), this project's
convention (features.py), so they are written as they are; the engines add 1 to get their capture points.

- `vllm`: vLLM's `method="dflash"` (model_executor/models/qwen3_dflash.py). A learned mask embedding ships as
  `mask_embedding.pt` ({"mask_token_id", "embedding"}), which vLLM substitutes for the embedding of
  `mask_token_id` in the mask slots; a reduced draft vocabulary ships `d2t`; frozen copies of the target's
  embeddings are left out (vLLM shares the target's).
- `gguf`: llama.cpp's `dflash` architecture (`--spec-type draft-dflash`): the `vllm` folder through llama.cpp's own
  converter (its DFlashDraftModel conversion reads mask_embedding.pt), with the target's folder. A reduced draft
  vocabulary: llama.cpp's dflash graph reads a `d2t` tensor (I64, the target id of each draft row) and scatters the
  draft logits through it, but the converter's DFlash class maps no d2t (only its DSpark subclass writes one), so
  d2t leaves the staged folder and is added to the converted file in that form (`add_d2t`) before quantisation.
- `sglang`: SGLang's DFlashDraftModel takes the embeddings (mask slots included) and the LM head from the target and
  silently ignores other weights: only a drafter with the target's frozen embedding as mask (drafter.learned_mask=
  false), the whole vocabulary and the target's frozen LM head is served as trained; others are refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from drafter_train.drafters.common.export import drafter_weights
from drafter_train.errors import ConfigError
from drafter_train.gguf_file import rewrite_gguf
from drafter_train.llamacpp import GgufJob, convert_staged

# Qwen3 fields the engines read from the layer config (the rest of the backbone's config is dropped).
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act", "attention_bias",
               "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


def engine_config(config: dict, draft_len: int) -> dict:
    """The DFlashDraftModel config.json for a saved drafter's config.json."""
    backbone = config["backbone"]
    if backbone.get("model_type") != "qwen3":
        raise ConfigError(f"export.format: vLLM and SGLang serve DFlash drafters with Qwen3 layers; this one has "
                          f"{backbone.get('model_type')!r} layers (train with drafter.qk_norm=true)")
    if config["fc_norm"]:
        raise ConfigError("export.format: the engines' DFlash fuses with fc then one norm, no per-layer fc_norm "
                          "(they would ignore those weights and draft garbage); train with drafter.fc_norm=false")
    n, size = config["num_layers"], config["block_size"]
    return dict({k: backbone[k] for k in _LAYER_KEYS if backbone.get(k) is not None},
                architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=n,
                layer_types=["full_attention"] * n, use_sliding_window=False, vocab_size=config["vocab_size"],
                tie_word_embeddings=False, block_size=size, num_target_layers=config["target_num_layers"],
                target_hidden_size=config["target_hidden_size"], draft_vocab_size=config["draft_vocab_size"],
                num_speculative_tokens=draft_len,
                dflash_config={"mask_token_id": config["mask_token_id"], "target_layer_ids": config["target_layers"],
                               "block_size": size},
                dtype=config.get("dtype") or config.get("torch_dtype") or "float32")


def _weights(drafter_dir: Path, config: dict, keep_embeddings: bool) -> dict[str, torch.Tensor]:
    weights = drafter_weights(drafter_dir, keep_embeddings)
    weights.pop("t2d", None)  # the engines rebuild it from d2t
    if config["draft_vocab_size"] == config["vocab_size"]:
        weights.pop("d2t", None)  # the whole vocabulary: the engines expect no mapping
    return weights


def _write(out: Path, spec: dict, weights: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_vllm(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool) -> None:
    """vLLM's DFlash folder (method "dflash") for the saved drafter in `drafter_dir`."""
    config = json.loads((drafter_dir / "config.json").read_text())
    spec = engine_config(config, draft_len)
    weights = _weights(drafter_dir, config, keep_embeddings)
    mask = weights.pop("mask_embedding", None)
    _write(out, spec, weights)
    if mask is not None:  # vLLM puts it in the mask slots instead of the embedding of mask_token_id
        torch.save({"mask_token_id": config["mask_token_id"], "embedding": mask.clone()}, out / "mask_embedding.pt")


def write_sglang(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool) -> None:
    """SGLang's DFlash folder for the saved drafter in `drafter_dir`, refused when SGLang would serve another model."""
    config = json.loads((drafter_dir / "config.json").read_text())
    spec = engine_config(config, draft_len)
    problems = [text for bad, text in (
        (config["learned_mask"], "a learned mask embedding (train with drafter.learned_mask=false)"),
        (config["draft_vocab_size"] != config["vocab_size"], "a reduced draft vocabulary (drafter.draft_vocab_size=0)"),
        (not config.get("lm_head_is_target", False), "an LM head of its own (drafter.freeze_lm_head=true, full "
                                                     "vocabulary)"),
        (keep_embeddings, "trained embeddings (drafter.freeze_embeddings=true)")) if bad]
    if problems:
        raise ConfigError(f"export.format=sglang: SGLang's DFlashDraftModel takes embeddings, mask slots and LM head "
                          f"from the target, and this drafter has {'; '.join(problems)}; export.format=vllm serves it")
    weights = _weights(drafter_dir, config, keep_embeddings=False)
    weights.pop("lm_head.weight", None)
    _write(out, spec, weights)


def add_d2t(path: Path, d2t: torch.Tensor) -> None:
    """Rewrite the GGUF at `path` with a `d2t` tensor: I64, draft row i -> target id i + d2t[i] (the offsets this
    project and EAGLE store, made absolute as llama.cpp's graph reads them). Everything else is copied as it is."""
    import gguf  # the gguf package (a dependency)

    ids = d2t.to(torch.int64).numpy() + np.arange(d2t.numel(), dtype=np.int64)
    tmp = path.with_name(path.name + ".d2t-tmp")
    rewrite_gguf(path, tmp, add={"d2t": (ids, gguf.GGMLQuantizationType.I64)})
    os.replace(tmp, path)


def write_gguf(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool,
               job: GgufJob) -> None:
    """drafter.gguf (llama.cpp's dflash architecture, `--spec-type draft-dflash`) and, with job.with_target,
    target.gguf: the vLLM folder (staged inside `out`, removed after) through llama.cpp's converter with the
    target's folder (its vocabulary, and the embeddings a learned mask embedding is written into); a reduced draft
    vocabulary's d2t added after the converter (module doc)."""
    taken: dict[str, torch.Tensor] = {}

    def stage(staging: Path) -> None:
        write_vllm(drafter_dir, staging, draft_len, verifier, keep_embeddings)
        weights = load_file(str(staging / "model.safetensors"))
        if "d2t" in weights:
            taken["d2t"] = weights.pop("d2t")
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})

    convert_staged(job, out, "dflash", stage, finish=lambda path: add_d2t(path, taken["d2t"]) if taken else None)


FORMATS = {"vllm": write_vllm, "sglang": write_sglang, "gguf": write_gguf}
