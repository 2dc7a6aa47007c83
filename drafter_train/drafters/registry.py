"""Drafter kinds. Each kind is ONE folder, drafters/<kind>/ (ar, nar, eagle3, dflash, layerskip, ngram ...), whose
model module registers a `DrafterKind` on import: its typed config, build/load, the training module and its loss on a
batch, the decoder-side drafter and its export formats. The trainer, the evaluator and the exporter call these and
never ask "which kind am I?". The kinds are found by looking: the model module of every sub-package of drafters/
except common/ is imported once, on first use; no list of names is kept anywhere. A kind defined outside the package
(a plugin, a test) calls `register` itself (docs/add-a-drafter.md).

The console scripts check a job's config before torch loads: `kind_schemas` finds each kind's typed config through
its folder's config module alone (which imports no model code), and this module imports torch only for type hints.

A saved drafter folder says its kind through config.json's `model_type` (a kind's own model class), and any other
causal LM is an AR drafter.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from drafter_train.config import DrafterConfig
from drafter_train.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from drafter_train.config import TrainJobConfig
    from drafter_train.data.batches import Batch
    from drafter_train.decoding.drafter import Drafter
    from drafter_train.losses import LossOutput


@dataclass
class BuildContext:
    """What building a drafter may need besides its own config."""

    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    dtype: str  # "float32" | "bfloat16": the dtype saved drafters are loaded in
    for_training: bool = False
    # Training only: token counts of the training responses ([target vocab] long), for kinds that derive something
    # from the data when built new (EAGLE-3's draft vocabulary). Called at most once, lazily.
    token_counts: Optional[Callable[[], torch.Tensor]] = None


def _identity(x):
    return x


@dataclass
class DrafterKind:
    """The functions one drafter kind provides (see the module doc)."""

    name: str
    # What it is, in words ("an autoregressive drafter"), for messages.
    description: str
    # config.json `model_type` of this kind's saved folders; None: any other causal LM (the AR kind).
    model_type: Optional[str]
    # Its typed config (the schema of its `drafter` config group entry).
    config_class: type
    # (cfg, BuildContext) -> the drafter model: new (truncated:N / scratch / new, as the kind supports) or loaded.
    build: Callable[[DrafterConfig, BuildContext], PreTrainedModel]
    # A saved folder of this kind -> model, in eval mode with gradients off.
    load: Callable[[str, str], PreTrainedModel]
    # (model) -> what the decoder drafts with (decoding/drafter.py: Drafter).
    decoder_drafter: Callable[[PreTrainedModel], "Drafter"]
    # (training module, target, batch, job config) -> LossOutput (sum over the batch's tokens, token count).
    loss: Callable[[nn.Module, PreTrainedModel, "Batch", "TrainJobConfig"], "LossOutput"]
    # (model) -> the module accelerate prepares (its forward must carry the training computation, so DDP/DeepSpeed
    # hooks run); hf_model undoes it on the unwrapped module.
    training_module: Callable[[PreTrainedModel], nn.Module] = _identity
    hf_model: Callable[[nn.Module], PreTrainedModel] = _identity
    # (collated batch, its records, job config) -> the batch the loss reads (e.g. draft blocks), still on the CPU.
    prepare_batch: Callable[["Batch", list, "TrainJobConfig"], "Batch"] = lambda batch, records, cfg: batch
    # (job config, dataset, response column, target, tokenizer, accelerator) -> the dataset training draws from:
    # kinds that need more than the records (EAGLE-3's offline features) extend it once, before training.
    prepare_data: Callable = lambda cfg, data, response_key, target, tokenizer, accelerator: data
    # export.format -> writer(step_dir, out_dir, info): formats besides the project's own HF folder.
    export_formats: Mapping[str, Callable] = field(default_factory=dict)
    # export.format -> (the drafter's config as a dict) -> None: refuses, in one line, a layout that format's engine
    # cannot run (checked before any conversion, and before training with train.eval_engine).
    export_checks: Mapping[str, Callable[[dict], None]] = field(default_factory=dict)
    # Whether transformers' assisted generation can drive it (its export then carries assistant settings).
    hf_assistant: bool = False
    # export.format -> the engine's name for the method that serves this kind (vLLM `speculative_config.method`,
    # SGLang `--speculative-algorithm`, llama.cpp `--spec-type` for gguf), for model cards.
    engine_methods: Mapping[str, str] = field(
        default_factory=lambda: {"vllm": "draft_model", "sglang": "STANDALONE", "gguf": "draft-simple"})
    # For model cards: a sentence on what it is, and Hub tags.
    summary: str = ""
    card_tags: tuple[str, ...] = ()
    # Whether its saved folders hold weights (prompt lookup and layer skipping save settings only).
    has_weights: bool = True
    # (config.json as a dict) -> whether another tool wrote the folder as this kind (EAGLE-3: speculators' and
    # ModelOpt's layouts); `build` then loads it, and check_folder(path) refuses in one line what cannot map, before
    # the target loads (preflight).
    outside_folder: Optional[Callable[[dict], bool]] = None
    check_folder: Optional[Callable[[str], None]] = None
    # (job config, the entry point's input check) -> the last metrics: a kind whose "training" is not gradient descent
    # (layerskip's search) runs its own recipe under drafter-train, and calls the check (drafter_train.preflight's
    # check_inputs, which sits above the kinds) once its own config is known to fit; None: train.py's loop with `loss`.
    fit: Optional[Callable[["TrainJobConfig", Callable[["TrainJobConfig"], None]], dict]] = None


# drafter.path values that name a way to build a drafter rather than a saved one.
BUILT_PATHS = ("scratch", "new", "lookup", "skips")
# Sub-packages of drafters/ that are not kinds.
NOT_KINDS = ("common",)


class _Registry:
    """The registered kinds by name, filled by `register` (each kind's model module on import, or a plugin)."""

    def __init__(self) -> None:
        self.kinds: dict[str, DrafterKind] = {}
        self.modules: dict[str, str] = {}
        self.discovered = False

    def discover(self) -> None:
        """Import the model module of every kind folder of drafters/ once (each registers its kind on import)."""
        if self.discovered:
            return
        self.discovered = True
        for folder in _kind_folders():
            importlib.import_module(f"{folder}.model")


_REGISTRY = _Registry()


def _kind_folders() -> list[str]:
    """The kind folders of drafters/, as module names (every sub-package but NOT_KINDS)."""
    package = importlib.import_module("drafter_train.drafters")
    return [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
            if info.ispkg and info.name not in NOT_KINDS]


def register(kind: DrafterKind, module: Optional[str] = None) -> DrafterKind:
    """Make `kind` known to every command (drafter.kind=<name>); returns it, so a module can write
    `KIND = register(DrafterKind(...))`. Registering a name again replaces the earlier kind (reloading a module).
    `module`: the module that defines the kind, which a saved folder's loading snippet imports first (default: the
    module that calls register)."""
    _REGISTRY.kinds[kind.name] = kind
    _REGISTRY.modules[kind.name] = module or sys._getframe(1).f_globals["__name__"]
    return kind


def module_name(kind: DrafterKind) -> str:
    """The module that defines a kind (importing it registers its model classes with transformers)."""
    return _REGISTRY.modules[kind.name]


def kind_names() -> list[str]:
    _REGISTRY.discover()
    return list(_REGISTRY.kinds)


def get_kind(name: str) -> DrafterKind:
    _REGISTRY.discover()
    if name not in _REGISTRY.kinds:
        raise ConfigError(f"drafter.kind: unknown kind {name!r} (known: {', '.join(_REGISTRY.kinds)}, or auto)")
    return _REGISTRY.kinds[name]


def all_kinds() -> list[DrafterKind]:
    _REGISTRY.discover()
    return list(_REGISTRY.kinds.values())


def kind_schemas() -> dict[str, type]:
    """Each kind's typed config by kind name, found without importing any model: the DrafterConfig subclass that each
    kind folder's config module defines (its `kind` default is the kind's name), and the config of every kind
    registered so far (a plugin's; the same class for a folder whose model module has been imported)."""
    schemas = {}
    for folder in _kind_folders():
        module = importlib.import_module(f"{folder}.config")
        (schema,) = [value for value in vars(module).values() if isinstance(value, type)
                     and issubclass(value, DrafterConfig) and value.__module__ == module.__name__]
        schemas[schema.kind] = schema
    return schemas | {kind.name: kind.config_class for kind in _REGISTRY.kinds.values()}


def folder_kind(path: str) -> Optional[DrafterKind]:
    """The kind a local drafter folder holds (from config.json's model_type); None for a hub id or no config."""
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a hub id, or a folder the loaders will explain
    model_type = config.get("model_type")
    special = [kind for kind in all_kinds() if kind.model_type is not None and kind.model_type == model_type]
    special += [kind for kind in all_kinds() if kind.outside_folder is not None and kind.outside_folder(config)]
    return special[0] if special else get_kind("ar")


def model_kind(model: nn.Module) -> DrafterKind:
    """The kind of a drafter model (by its config's model_type; any other model is an AR drafter)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    special = [kind for kind in all_kinds() if kind.model_type is not None and kind.model_type == model_type]
    return special[0] if special else get_kind("ar")


def resolve_kind(cfg: DrafterConfig) -> DrafterKind:
    """The kind a drafter config builds: its own, or (kind=auto) the one its saved folder holds; a folder holding
    another kind than asked for is refused in one line."""
    held = folder_kind(cfg.path)
    if cfg.kind == "auto":
        return held or get_kind("ar")
    kind = get_kind(cfg.kind)
    if held is not None and held.name != kind.name:
        raise ConfigError(f"drafter.kind={cfg.kind}: {cfg.path} holds {held.description}, not "
                          f"{kind.description} (drafter.kind=auto loads whatever a folder holds)")
    return kind


def kind_config(cfg: DrafterConfig, kind: DrafterKind) -> DrafterConfig:
    """`cfg` as the kind's own schema: a kind=auto config (drafter=path) gets the kind's defaults for its fields."""
    if isinstance(cfg, kind.config_class):
        return cfg
    common = {name: getattr(cfg, name) for name in ("path", "draft_len", "freeze_embeddings", "freeze_lm_head")}
    return kind.config_class(kind=kind.name, **common)


def is_saved_drafter(path: str) -> bool:
    """Whether drafter.path names a saved drafter (a folder or hub id), not a way to build one."""
    return path not in BUILT_PATHS and not path.startswith("truncated:")


def make_drafter(model: PreTrainedModel, cpu_kernels: str = "auto") -> "Drafter":
    """The decoder-side drafter for a loaded drafter model, its Linear layers on `cpu_kernels` (cpu_kernels.py:
    inference only, training through the same model is unaffected)."""
    from drafter_train.cpu_kernels import use_onednn_linears  # torch: not before a console script's checks

    use_onednn_linears(model, cpu_kernels)
    return model_kind(model).decoder_drafter(model)
