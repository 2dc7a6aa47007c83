"""What differs between launches (one process, DDP, DeepSpeed ZeRO-2/3, FSDP2), so that train.py stays one loop for
all.

- The Accelerator: gloo on CPU, and the trainer's batch size, accumulation and clipping written into DeepSpeed's
  config (train.* is the single source of these numbers; an accelerate config's own values for them are replaced).
- Models load whole (transformers is not told about ZeRO-3): the target is never prepared and keeps its weights, a
  frozen full copy on every rank under every launch (only the drafter is sharded).
- The drafter's full weights on the main process, for evaluation and saving: under ZeRO-3 and FSDP every rank holds a
  slice,
  so all ranks gather and the main process works on a plain copy (evaluating the partitioned model on one rank
  would wait forever for the others).
- The optimizer state of a checkpoint: one state_dict (DDP and single process: identical on all ranks) or
  DeepSpeed's / FSDP's partitioned files, written by every rank into the checkpoint's temporary folder.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from drafter_train.config import TrainConfig
from drafter_train.errors import ConfigError
from drafter_train.machine import bf16_matmul_speedup

# Inside step-<N>/: DeepSpeed's or FSDP's model and optimizer partitions (accelerator.save_state), one set per rank.
SHARDED_STATE = "sharded_state"


def make_accelerator(tcfg: TrainConfig, log_with: Optional[str], run_dir: Path) -> Accelerator:
    """The run's Accelerator, checked to really run as many processes as were launched."""
    check_launch_precision(tcfg.mixed_precision)
    # accelerate keeps one AcceleratorState per process: reset it (not the process group) so that consecutive jobs
    # of a Hydra -m sweep, or tests, can change mixed precision or trackers.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    # DeepSpeed on CPU would pick its own backend (ccl) and fail (DDP on CPU picks gloo itself; a backend given to
    # a run that is not distributed at all makes accelerate fail).
    deepspeed_on_cpu = asks_for_deepspeed() and not torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else []
    accelerator = Accelerator(
        mixed_precision=tcfg.mixed_precision, log_with=log_with, project_dir=str(run_dir), kwargs_handlers=handlers
    )
    # accelerator.accumulate() counts micro-batches against this (accelerate launch --use_deepspeed would impose
    # its own count).
    accelerator.gradient_accumulation_steps = tcfg.grad_accum
    check_launch(accelerator)
    # Under ZeRO-3, accelerate registers its DeepSpeed config with transformers (whatever zero3_init_flag says), and
    # transformers then partitions every model it creates and gathers weights inside save_pretrained: the target
    # would lose its weights, and the main process saving alone would wait forever for the other ranks. Here models
    # are partitioned by accelerator.prepare only.
    unset_hf_deepspeed_config()
    if uses_deepspeed(accelerator):
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = tcfg.batch_size
        ds["train_batch_size"] = tcfg.batch_size * tcfg.grad_accum * accelerator.num_processes
        ds["gradient_accumulation_steps"] = tcfg.grad_accum
        ds["gradient_clipping"] = tcfg.max_grad_norm  # DeepSpeed clips inside its step; 0 turns it off
        ds.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    return accelerator


# train.mixed_precision=auto takes bf16 where a bf16 matmul measures at least this many times a float32 one: autocast
# casts weights at every forward, so a small gain is not worth the rounding.
AUTO_BF16_SPEEDUP = 1.5


def resolve_mixed_precision(mixed_precision: str, device: Callable[[], torch.device]) -> tuple[str, str]:
    """(no or bf16, why) for train.mixed_precision: auto follows an accelerate launch config's precision, else what
    bf16 measures on `device()` now; no and bf16 are taken as given. `device` is asked only to measure: accelerate's
    process state must not be made before the Accelerator of a launched run."""
    if mixed_precision != "auto":
        return mixed_precision, "as configured"
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched in ("no", "bf16"):
        return launched, "the accelerate launch config's"
    pays, why = bf16_pays(device())
    return ("bf16" if pays else "no"), why


def bf16_pays(where: torch.device) -> tuple[bool, str]:
    """(whether bf16 is worth taking on `where`, why): a bf16 matmul measured now at >= AUTO_BF16_SPEEDUP x
    float32; what every `auto` precision (train.mixed_precision, datagen.dtype) decides by."""
    speedup = bf16_matmul_speedup(where)
    return speedup >= AUTO_BF16_SPEEDUP, f"auto: a bf16 matmul ran {speedup:.1f}x float32 on this {where.type}"


def check_launch_precision(mixed_precision: str) -> None:
    """accelerate launch exports its config's precision; the trainer's own setting is the one applied."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched and launched != mixed_precision:
        raise ConfigError(f"train.mixed_precision: the accelerate launch config asks for {launched} but "
                          f"train.mixed_precision={mixed_precision}; set train.mixed_precision={launched}")


def check_launch(accelerator: Accelerator) -> None:
    """Refuse launches that would silently train something else than asked (see README, Scaling out)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:  # N processes that did not join one group: N separate models
        raise ConfigError(
            f"accelerate launch: {launched} processes were started but accelerate runs {accelerator.num_processes} "
            "as one job (on CPU, DDP needs ACCELERATE_USE_CPU=1 in the environment)"
        )
    if asks_for_deepspeed() and not uses_deepspeed(accelerator):
        raise ConfigError("accelerate launch: DeepSpeed was asked for but accelerate runs "
                          f"{accelerator.distributed_type} (unset ACCELERATE_USE_CPU for DeepSpeed launches)")
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and not uses_fsdp(accelerator):
        raise ConfigError("accelerate launch: FSDP was asked for but accelerate runs "
                          f"{accelerator.distributed_type.value} (accelerate runs FSDP on GPUs only; on CPUs use a "
                          "DDP or DeepSpeed config)")


def asks_for_deepspeed() -> bool:
    """Whether accelerate launch was given a DeepSpeed config (what Accelerator() then makes of it may differ)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def uses_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def is_zero3(accelerator: Accelerator) -> bool:
    return uses_deepspeed(accelerator) and accelerator.state.deepspeed_plugin.zero_stage == 3


def uses_fsdp(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def shards_weights(accelerator: Accelerator) -> bool:
    """Whether each rank holds only a slice of the drafter's weights (ZeRO-3, FSDP)."""
    return is_zero3(accelerator) or uses_fsdp(accelerator)


def partitions_state(accelerator: Accelerator) -> bool:
    """Whether the optimizer state is partitioned over the ranks (DeepSpeed, FSDP): saved by every rank."""
    return uses_deepspeed(accelerator) or uses_fsdp(accelerator)


def full_drafter(accelerator: Accelerator, module: nn.Module,
                 hf_model: Callable[[nn.Module], PreTrainedModel]) -> Optional[PreTrainedModel]:
    """The HF drafter with all its weights on the main process, None elsewhere. Call it on ALL ranks.

    Without sharding that is the live model itself. Under ZeRO-3 and FSDP the weights are gathered (a collective)
    and the main process gets a plain copy, which evaluates and saves like any HF model. `hf_model` is the drafter
    kind's inverse of its training module (drafters/registry.py).
    """
    unwrapped = accelerator.unwrap_model(module)
    drafter = hf_model(unwrapped)
    if not shards_weights(accelerator):
        return drafter if accelerator.is_main_process else None
    state = accelerator.get_state_dict(module)  # keys of the training module; filled on the main process only
    if not accelerator.is_main_process:
        return None
    prefix = next(name for name, sub in unwrapped.named_modules() if sub is drafter)
    prefix = f"{prefix}." if prefix else ""
    plain = type(drafter)(copy.deepcopy(drafter.config)).to(dtype=drafter.dtype)
    plain.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    return plain.eval()


def optimizer_state(accelerator: Accelerator, optimizer) -> Optional[dict]:
    """What training_state.pt holds of the optimizer: its state_dict, or None where DeepSpeed / FSDP partition it."""
    return None if partitions_state(accelerator) else optimizer.state_dict()


def save_sharded_state(accelerator: Accelerator, partial_step_dir: Path) -> None:
    """All ranks: write DeepSpeed's / FSDP's partitioned model and optimizer state into the checkpoint being written."""
    if partitions_state(accelerator):
        accelerator.save_state(str(partial_step_dir / SHARDED_STATE))


def load_sharded_state(accelerator: Accelerator, step_dir: Path, saved: dict) -> None:
    """After prepare, on all ranks: restore DeepSpeed's / FSDP's partitions; refuse a checkpoint of the other kind."""
    sharded = (step_dir / SHARDED_STATE).is_dir()
    if partitions_state(accelerator) != sharded or (saved["optimizer"] is None) != sharded:
        kind = "a DeepSpeed or FSDP" if sharded else "a DDP or one-process"
        raise ConfigError(f"train.resume: {step_dir} was written by {kind} launch; resume it with the same kind "
                          "of launch, or start a new train.run_name")
    if sharded:
        accelerator.load_state(str(step_dir / SHARDED_STATE))
