"""The CMake flags that pick ggml-cpu's instruction groups for this machine (setup_llamacpp builds with them).

On x86-64 each group ggml-cpu has an option for is ON only when a probe (cpu_probe.c beside this file, compiled with
the group's -m flags) runs here: what this process can EXECUTE, not what /proc/cpuinfo lists. GGML_NATIVE
(-march=native) enables whatever CPUID reports; on an Intel Xeon VM that lists AMX, tools built so died with SIGILL on
every pass over 2+ tokens (ggml's AMX kernels use tile instructions only when a matmul has 2+ rows).
Overrides: LLAMACPP_CMAKE_FLAGS="..." is returned as given (no probing); LLAMACPP_NATIVE=1 gives -DGGML_NATIVE=ON
(ggml's own native build). Other architectures get -DGGML_NATIVE=ON: ggml's ARM detection test-compiles. $CC is the
compiler (default cc): one that cannot emit a group also leaves it out.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Optional

PROBE = Path(__file__).with_name("cpu_probe.c")
NATIVE = "-DGGML_NATIVE=ON"
# group -> the -m flags ggml-cpu's CMakeLists.txt adds for GGML_<group> (the probe is compiled with the same), in the
# order they are probed
MFLAGS = {
    "SSE42": "-msse4.2", "AVX": "-mavx", "F16C": "-mf16c", "FMA": "-mfma", "AVX2": "-mavx2", "BMI2": "-mbmi2",
    "AVX_VNNI": "-mavxvnni", "AVX512": "-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw",
    "AVX512_VBMI": "-mavx512f -mavx512vbmi", "AVX512_VNNI": "-mavx512f -mavx512vnni",
    "AVX512_BF16": "-mavx512f -mavx512bf16", "AMX_TILE": "-mamx-tile", "AMX_INT8": "-mamx-tile -mamx-int8",
    "AMX_BF16": "-mamx-tile -mamx-bf16"}
# the groups a group needs: ggml only uses an AVX-512 extension inside AVX-512 code, and AMX only with AVX512-VNNI
NEEDS = {"F16C": "AVX", "FMA": "AVX", "AVX2": "AVX", "AVX_VNNI": "AVX2", "AVX512": "AVX2", "AVX512_VBMI": "AVX512",
         "AVX512_VNNI": "AVX512", "AVX512_BF16": "AVX512", "AMX_TILE": "AVX512_VNNI", "AMX_INT8": "AMX_TILE",
         "AMX_BF16": "AMX_TILE"}


def cmake_flags(env: Optional[Mapping[str, str]] = None) -> tuple[list[str], str]:
    """The -D flags for this machine, and one line naming the groups found usable and those left out ("" when
    nothing was probed: an override, or not x86-64). `env`: the environment to read (default os.environ)."""
    env = os.environ if env is None else env
    if env.get("LLAMACPP_CMAKE_FLAGS"):
        return env["LLAMACPP_CMAKE_FLAGS"].split(), ""
    if env.get("LLAMACPP_NATIVE", "0") == "1" or platform.machine() != "x86_64":
        return [NATIVE], ""
    usable = usable_groups(env.get("CC") or "cc", env)
    flags = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if g in usable else 'OFF'}" for g in MFLAGS)]
    left_out = [g for g in MFLAGS if g not in usable]
    return flags, (f"llamacpp_flags: usable here: {' '.join(usable) or 'none'}; "
                   f"left out: {' '.join(left_out) or 'none'}")


def usable_groups(cc: str, env: Mapping[str, str]) -> list[str]:
    """The groups, in MFLAGS' order, whose probe compiles and runs here (compiler and probe run in `env`) and whose
    needed group is usable too."""
    usable: list[str] = []
    with tempfile.TemporaryDirectory() as work:
        for group, mflags in MFLAGS.items():
            needed = NEEDS.get(group)
            if (needed is None or needed in usable) and runs_here(cc, group, mflags, Path(work) / group, env):
                usable.append(group)
    return usable


def runs_here(cc: str, group: str, mflags: str, binary: Path, env: Mapping[str, str]) -> bool:
    """Whether the probe of `group` compiles with `mflags` and exits 0: a SIGILL is a negative return code, not a
    crash of this process."""
    try:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": dict(env)}
        built = subprocess.run([cc, "-O1", *mflags.split(), f"-DPROBE_{group}", str(PROBE), "-o", str(binary)],
                               **quiet)
        return built.returncode == 0 and subprocess.run([str(binary)], **quiet).returncode == 0
    except OSError:  # no such compiler, or a probe it wrote that cannot be executed
        return False
