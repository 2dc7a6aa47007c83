"""What a figure was measured on: the CPU's model and listed extensions, and what this process was PROBED able to use.

The two differ. A virtual machine's CPU can list AMX (amx_tile, amx_bf16) while its kernel refuses the process the
AMX register state, and then a tool compiled to use AMX dies with SIGILL; torch's bf16 matmuls are native only where
avx512_bf16 or usable AMX is there, and emulated (linear in the tokens, never cheap) elsewhere. So every result file
(drafter-eval's and a checkpoint's metrics.json, datagen.json, the benchmarks' files) records both. The probe is
cheap (no timing: /proc/cpuinfo, torch's dispatch level, one syscall) and done once per process. What a choice
needs beyond it is measured, not inferred from the probe: bf16_matmul_speedup (train.mixed_precision=auto) times
real matmuls, once per device and process. The record follows the rule llamacpp_flags builds by (docs/cpu-kernels.md,
"Which CPU features pick what"): AMX is "usable" only where it is listed AND the kernel grants its state.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import time
from typing import Optional

import torch

from drafter_train.devices import device_name, synchronize

# The instruction-set extensions that decide which CPU kernels are fast (fp32 FMA width, bf16 / AMX units)
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

# Linux x86-64: ask the kernel for the AMX tile-data state (what oneDNN and ggml do before using AMX).
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def machine_info(device: torch.device, dtype: str) -> dict:
    """What the costs were measured on: the CPU as listed, what was probed usable, threads, torch, load."""
    return {"cpu": cpu_model(), "cpu_features": cpu_features(), "usable": probe_cpu(),
            "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device_name(device), "dtype": dtype,
            "torch": torch.__version__, "platform": platform.platform(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


@functools.lru_cache(maxsize=4)
def bf16_matmul_speedup(device: torch.device) -> float:
    """How many times faster a bf16 matmul runs than a float32 one on `device`, measured now (best of 5 each, a
    [512, 1024] x [1024, 4096] product; ~0.1 s): AMX or avx512_bf16 and GPUs > 1, emulated bf16 (AVX2) < 1."""

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(512, 1024, device=device).to(dtype)
        w = torch.randn(4096, 1024, device=device).to(dtype)
        times = []
        for _ in range(6):
            synchronize(device)
            start = time.perf_counter()
            a @ w.T
            synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])  # the first warms the kernels up

    return best(torch.float32) / best(torch.bfloat16)


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """Which of FEATURES /proc/cpuinfo lists (what the CPU reports, not what this process can execute)."""
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in FEATURES if f in flags]


@functools.lru_cache(maxsize=1)
def probe_cpu() -> dict:
    """What this process can use: torch's CPU dispatch level (DEFAULT, AVX2, AVX512 ...; what the OS lets it run),
    whether AMX is usable (listed AND granted by the kernel), and how bf16 matmuls run: on AMX, on avx512_bf16
    instructions, or emulated."""
    features = set(cpu_features())
    capability = torch.backends.cpu.get_cpu_capability()
    amx = _amx_state(features)
    if amx == "usable" and "amx_bf16" in features:
        bf16 = "native (AMX)"
    elif "avx512_bf16" in features and capability.startswith("AVX512"):
        bf16 = "native (avx512_bf16)"
    else:
        bf16 = "emulated"
    return {"torch_capability": capability, "amx": amx, "bf16_matmul": bf16}


def kind_slug(machine: Optional[dict] = None) -> str:
    """A file-name-safe name for a machine's kind (default: this one's): its CPU model and the widest vector extension
    it lists, e.g. 'amd-epyc-avx512' (result files measured on two kinds of CPU keep apart by it)."""
    record = {"cpu": "", "cpu_features": [], **(machine or {"cpu": cpu_model(), "cpu_features": cpu_features()})}
    features = set(record["cpu_features"])
    widest = next((name for name, flag in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2"))
                   if flag in features), "generic")
    model = re.sub(r"\(r\)|\(tm\)|\bcpu\b|@.*|\d+-core processor", "", record["cpu"].lower())
    words = re.findall(r"[a-z0-9]+", model)[:3] or ["unknown"]
    return "-".join([*words, widest])


def describe_usable(machine: dict) -> str:
    """One phrase for a result line: 'AVX512, AMX refused by the kernel, bf16 matmul native (avx512_bf16)'."""
    usable = machine.get("usable")
    if not usable:
        return "usable extensions not probed"
    return (f"torch {usable['torch_capability']}, AMX {usable['amx']}, bf16 matmul {usable['bf16_matmul']}")


def _amx_state(features: set[str]) -> str:
    """'usable', 'refused by the kernel' (listed, but the process may not use the tile state) or 'not listed'."""
    if "amx_tile" not in features:
        return "not listed"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "not probed"
    libc = ctypes.CDLL(None, use_errno=True)
    granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    return "usable" if granted else f"refused by the kernel (errno {ctypes.get_errno()})"


def _cpuinfo(field: str) -> Optional[str]:
    """The first /proc/cpuinfo line's value for `field` (None off Linux or without it)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
