"""The machine record: the CPU as listed and what this process was probed able to use. AMX listed but refused by
the kernel (a VM) must not read as usable, and bf16 matmuls are native only on usable AMX or avx512_bf16."""

from __future__ import annotations

import ctypes

import pytest
import torch

from drafter_train import machine
from drafter_train.machine import describe_usable, machine_info, probe_cpu


@pytest.fixture
def fresh_probe():
    probe_cpu.cache_clear()
    yield
    probe_cpu.cache_clear()  # later tests see this machine's own probe


def _cpu(monkeypatch, flags: str, capability: str, granted: bool = True) -> dict:
    """probe_cpu on a CPU listing `flags`, torch dispatching at `capability`, the AMX request granted or not."""
    monkeypatch.setattr(machine, "_cpuinfo", lambda field: flags if field == "flags" else "Test CPU")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(machine.platform, "system", lambda: "Linux")
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    calls = []

    class Libc:
        def syscall(self, *args):
            calls.append(args)
            return 0 if granted else -1

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(ctypes, "get_errno", lambda: 1)
    probe_cpu.cache_clear()
    usable = probe_cpu()
    assert calls == ([(158, 0x1023, 18)] if "amx_tile" in flags else [])  # arch_prctl(REQ_XCOMP_PERM, XTILEDATA)
    return usable


def test_amx_listed_and_granted_makes_bf16_native(monkeypatch, fresh_probe):
    usable = _cpu(monkeypatch, "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "AVX512")
    assert usable == {"torch_capability": "AVX512", "amx": "usable", "bf16_matmul": "native (AMX)"}


def test_amx_listed_but_refused_is_not_usable(monkeypatch, fresh_probe):
    """The Xeon VM of issue 38: AMX in the flags, the kernel refuses the tile state; avx512_bf16 still runs."""
    usable = _cpu(monkeypatch, "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "AVX512", granted=False)
    assert usable == {"torch_capability": "AVX512", "amx": "refused by the kernel (errno 1)",
                      "bf16_matmul": "native (avx512_bf16)"}


@pytest.mark.parametrize("flags, capability, bf16", [
    ("avx2 avx512f avx512_bf16", "AVX512", "native (avx512_bf16)"),  # the EPYC with avx512_bf16
    ("avx2 avx512f avx512_bf16", "AVX2", "emulated"),  # listed, but torch does not run AVX-512 here
    ("avx2", "AVX2", "emulated"),
])
def test_without_amx_bf16_is_native_only_with_usable_avx512_bf16(monkeypatch, fresh_probe, flags, capability, bf16):
    assert _cpu(monkeypatch, flags, capability) == {"torch_capability": capability, "amx": "not listed",
                                                     "bf16_matmul": bf16}


def test_this_machine_is_probed_once_and_recorded(fresh_probe):
    info = machine_info(torch.device("cpu"), "float32")
    assert info["usable"] is probe_cpu()  # cached: one probe per process
    assert info["usable"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["cpu"] and set(info["cpu_features"]) <= set(machine.FEATURES)
    assert describe_usable(info).startswith(f"torch {info['usable']['torch_capability']}, AMX ")
    assert describe_usable({"cpu": "old record"}) == "usable extensions not probed"


@pytest.mark.parametrize("cpu, features, slug", [
    ("AMD EPYC", ["avx2"], "amd-epyc-avx2"),
    ("AMD EPYC", ["avx2", "avx512f", "avx512_bf16"], "amd-epyc-avx512"),
    ("AMD EPYC 7B13 64-Core Processor", ["avx2"], "amd-epyc-7b13-avx2"),
    ("Intel(R) Xeon(R) CPU @ 2.10GHz", ["avx2", "avx512f", "amx_bf16", "amx_tile"], "intel-xeon-amx"),
    ("", [], "unknown-generic"),
])
def test_the_kind_slug_names_the_cpu_and_its_widest_extension(cpu, features, slug):
    """Result files measured on two kinds of CPU are named apart by it (scripts/served_qwen.sh's table)."""
    assert machine.kind_slug({"cpu": cpu, "cpu_features": features}) == slug
