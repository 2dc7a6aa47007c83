"""Where tensors live. accelerate picks the device (the local GPU under `accelerate launch`, else a GPU or MPS when one
is present, else the CPU; ACCELERATE_USE_CPU=1 forces the CPU); the rest of the package follows the device of the
models it is given. This is the one module that names device types, and it only answers questions about a device:
tests/test_devices.py fails on a device string anywhere else in the package."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """The device accelerate gives this process, for entry points that run without an Accelerator (eval, datagen).
    Training moves its models to `accelerator.device`, which is the same device."""
    from accelerate import PartialState  # imported on first use: the rest of this module needs torch alone

    return PartialState().device


def on_cpu(device: torch.device) -> bool:
    """Whether `device` is the CPU: the CPU kernels of cpu_kernels.py apply there only."""
    return device.type == "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (GPU kernels run asynchronously) before reading a clock."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        torch.accelerator.synchronize(device)


def device_name(device: torch.device) -> str:
    """What a result file records as the device: the GPU's model name, else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
