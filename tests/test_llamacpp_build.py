"""The llama.cpp build's guards, without building it: scripts/llamacpp_flags.sh turns on only the instruction groups a
probe executes here, and smoke_check (the end of scripts/setup_llamacpp.sh, and the opt-in llama.cpp tests' first
step) turns a tool that dies on this CPU into one line naming the fix. The tools are fake scripts that kill
themselves with the signal a build for the wrong CPU dies with."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from drafter_train import targets
from drafter_train.llamacpp import SMOKE_FILE, LlamaCppError, smoke_check
from tests.conftest import REPO

FLAGS = REPO / "scripts" / "llamacpp_flags.sh"
GROUPS = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
          "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
# /proc/cpuinfo's name for a group's first instruction set (GGML_AVX512 needs avx512f and more)
CPUINFO = {"SSE42": "sse4_2", "AVX": "avx", "F16C": "f16c", "FMA": "fma", "AVX2": "avx2", "BMI2": "bmi2",
           "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
           "AVX512_BF16": "avx512_bf16", "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16"}


def flags(**env: str) -> tuple[list[str], str]:
    done = subprocess.run(["bash", str(FLAGS)], capture_output=True, text=True, check=True,
                          env={k: v for k, v in dict(os.environ, **env).items() if v is not None})
    return done.stdout.split(), done.stderr


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None, reason="x86-64 with a C compiler")
def test_flags_turn_on_only_groups_whose_probe_ran_here():
    got, report = flags()
    assert got[0] == "-DGGML_NATIVE=OFF" and sorted(got[1:]) == sorted(
        f"-DGGML_{g}={'ON' if f'-DGGML_{g}=ON' in got else 'OFF'}" for g in GROUPS)  # every group, set explicitly
    listed = set(Path("/proc/cpuinfo").read_text().split())
    on = [g for g in GROUPS if f"-DGGML_{g}=ON" in got]
    # a group runs only where the CPU lists it (the converse is what the probe is for); the pre-AVX-512 groups it
    # lists do run (no probe is broken)
    assert all(CPUINFO[g] in listed for g in on)
    assert {g for g in ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2") if CPUINFO[g] in listed} <= set(on)
    assert ("AVX512" in on) <= ("AVX2" in on) and ("AMX_INT8" in on) <= ("AVX512_VNNI" in on)  # what ggml needs
    assert f"usable here: {' '.join(on)};" in report
    if "avx512f" not in listed:  # this machine: the AVX-512 probe died with SIGILL, so no group above AVX2 is on
        assert not any(g.startswith(("AVX512", "AMX")) for g in on)


def test_flags_overrides():
    assert flags(LLAMACPP_NATIVE="1")[0] == ["-DGGML_NATIVE=ON"]
    assert flags(LLAMACPP_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON")[0] == ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A llama.cpp folder whose llama-quantize copies its input (counting its runs) and whose llama-bench succeeds."""
    shipped = tmp_path / "shipped.gguf"
    shipped.write_bytes(b"GGUF")
    monkeypatch.setattr(targets, "embedded_gguf", lambda path: shipped)
    bin_dir = tmp_path / "llcpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    fake_tool(bin_dir, "llama-quantize", f'echo run >> {tmp_path}/quantized; cp "$2" "$3"')
    fake_tool(bin_dir, "llama-bench", "exit 0")
    return tmp_path / "llcpp"


def test_smoke_check_quantises_once_and_passes(fake_build):
    model = smoke_check(fake_build)
    assert model == fake_build / SMOKE_FILE and model.read_bytes() == b"GGUF"
    smoke_check(fake_build)  # the cached Q4_K_M file: no second quantisation
    assert (fake_build.parent / "quantized").read_text() == "run\n"


@pytest.mark.parametrize("native", [True, False])
def test_a_tool_killed_by_sigill_gives_one_line_naming_the_fix(fake_build, native):
    build = fake_build / "build"
    (build / "CMakeCache.txt").write_text(f"GGML_NATIVE:BOOL={'ON' if native else 'OFF'}\n")
    fake_tool(build / "bin", "llama-bench", f"kill -{signal.SIGILL.value} $$")
    with pytest.raises(LlamaCppError) as error:
        smoke_check(fake_build)
    line = str(error.value)
    assert "\n" not in line and line.startswith("llama.cpp tools crash on this CPU (SIGILL in a 4-token pass")
    assert f"bash scripts/setup_llamacpp.sh {fake_build}" in line
    assert ("without LLAMACPP_NATIVE=1" in line) == native


def test_a_crash_while_quantising_and_a_failing_tool_are_one_line_too(fake_build):
    build = fake_build / "build"
    fake_tool(build / "bin", "llama-quantize", f"kill -{signal.SIGILL.value} $$")
    with pytest.raises(LlamaCppError, match=r"^llama.cpp tools crash on this CPU \(SIGILL in llama-quantize"):
        smoke_check(fake_build)
    assert not (fake_build / SMOKE_FILE).exists()  # nothing half-written is cached
    fake_tool(build / "bin", "llama-quantize", 'cp "$2" "$3"; exit 1')  # a failure after writing its output
    with pytest.raises(LlamaCppError, match="llama-quantize to Q4_K_M failed"):
        smoke_check(fake_build)
    assert sorted(p.name for p in fake_build.iterdir()) == ["build"]  # no partial file left behind either
    fake_tool(build / "bin", "llama-quantize", 'cp "$2" "$3"')
    fake_tool(build / "bin", "llama-bench", "echo 'error: failed to load model' >&2; exit 3")
    with pytest.raises(LlamaCppError, match=r"^llama.cpp smoke run: a 4-token pass of llama-bench failed \(exit 3\): "
                                            "error: failed to load model$"):
        smoke_check(fake_build)
