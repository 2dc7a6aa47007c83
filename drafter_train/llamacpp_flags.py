"""The CMake flags that pick ggml-cpu's instruction groups for this machine (setup_llamacpp builds with them).

On x86-64 each group ggml-cpu has an option for is ON only where /proc/cpuinfo LISTS the group's flags (CPUINFO)
AND a probe of it (cpu_probe.c beside this file, compiled with the group's -m flags) RUNS here. Either alone is not
enough: a VM can list what its kernel does not let a process run (an Intel Xeon VM listing AMX: tools built with
GGML_NATIVE, -march=native, died with SIGILL on every pass over 2+ tokens), and a hypervisor that hides a feature it
executes does not promise it (an Intel Xeon VM, family 6 model 207, ran AVX_VNNI and AVX512_BF16 without listing
them: a migrated VM can lose them, and a build using them dies at some later run). The one-line report names each
group left out and why: "not listed", "listed, probe died", "runs but not listed", or the group it needs.
Overrides: LLAMACPP_CMAKE_FLAGS="..." is returned as given (no probing); LLAMACPP_NATIVE=1 gives -DGGML_NATIVE=ON
(ggml's own native build); LLAMACPP_CPUINFO=FILE is read instead of /proc/cpuinfo (the tests' fake CPUs). Other
architectures get -DGGML_NATIVE=ON: ggml's ARM detection test-compiles. $CC is the compiler (default cc): one that
cannot emit a group also leaves it out.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Optional

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
# group -> the /proc/cpuinfo flags that must all be listed for it (the instruction sets its -m flags enable)
CPUINFO = {
    "SSE42": "sse4_2", "AVX": "avx", "F16C": "f16c", "FMA": "fma", "AVX2": "avx2", "BMI2": "bmi2",
    "AVX_VNNI": "avx_vnni", "AVX512": "avx512f avx512cd avx512vl avx512dq avx512bw",
    "AVX512_VBMI": "avx512f avx512vbmi", "AVX512_VNNI": "avx512f avx512_vnni", "AVX512_BF16": "avx512f avx512_bf16",
    "AMX_TILE": "amx_tile", "AMX_INT8": "amx_tile amx_int8", "AMX_BF16": "amx_tile amx_bf16"}
# the groups a group needs: ggml only uses an AVX-512 extension inside AVX-512 code, and AMX only with AVX512-VNNI
NEEDS = {"F16C": "AVX", "FMA": "AVX", "AVX2": "AVX", "AVX_VNNI": "AVX2", "AVX512": "AVX2", "AVX512_VBMI": "AVX512",
         "AVX512_VNNI": "AVX512", "AVX512_BF16": "AVX512", "AMX_TILE": "AVX512_VNNI", "AMX_INT8": "AMX_TILE",
         "AMX_BF16": "AMX_TILE"}


def cmake_flags(env: Optional[Mapping[str, str]] = None) -> tuple[list[str], str]:
    """The -D flags for this machine, and one line naming the groups found usable and those left out with why (""
    when nothing was probed: an override, or not x86-64). `env`: the environment to read (default os.environ)."""
    env = os.environ if env is None else env
    if env.get("LLAMACPP_CMAKE_FLAGS"):
        return env["LLAMACPP_CMAKE_FLAGS"].split(), ""
    if env.get("LLAMACPP_NATIVE", "0") == "1" or platform.machine() != "x86_64":
        return [NATIVE], ""
    cc = env.get("CC") or "cc"
    with tempfile.TemporaryDirectory() as work:
        why = left_out(listed_flags(env), lambda group: probe(cc, group, Path(work) / group, env))
    flags = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'OFF' if why[g] else 'ON'}" for g in MFLAGS)]
    return flags, report(why)


def listed_flags(env: Mapping[str, str]) -> set[str]:
    """The flags the first `flags` line of /proc/cpuinfo (or $LLAMACPP_CPUINFO) lists; none where it cannot be
    read (then no group goes on: nothing is listed)."""
    try:
        with open(env.get("LLAMACPP_CPUINFO") or "/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def left_out(listed: set[str], outcome: Callable[[str], str]) -> dict[str, str]:
    """Each group in MFLAGS' order -> why it is left out ("" for a group that goes on): a group goes on only where
    its CPUINFO flags are all listed AND its probe runs (outcome(group): "runs", "died" or "not built") AND the
    group it needs is on. A group whose needed group is off is not probed."""
    why: dict[str, str] = {}
    for group in MFLAGS:
        needed = NEEDS.get(group)
        if needed and why[needed]:
            why[group] = f"needs {needed}"
            continue
        ran = outcome(group)
        if set(CPUINFO[group].split()) <= listed:
            why[group] = {"runs": "", "died": "listed, probe died"}.get(ran, "listed, probe not built")
        else:
            why[group] = "runs but not listed" if ran == "runs" else "not listed"
    return why


def report(why: Mapping[str, str]) -> str:
    """One line: the groups on, then those left out, grouped by why, e.g. '... left out: AVX_VNNI AVX512_BF16 (runs
    but not listed), AMX_TILE (not listed), AMX_INT8 AMX_BF16 (needs AMX_TILE)'."""
    usable = [g for g, reason in why.items() if not reason]
    reasons = dict.fromkeys(reason for reason in why.values() if reason)
    out = ", ".join(f"{' '.join(g for g, r in why.items() if r == reason)} ({reason})" for reason in reasons)
    return f"llamacpp_flags: usable here: {' '.join(usable) or 'none'}; left out: {out or 'none'}"


def probe(cc: str, group: str, binary: Path, env: Mapping[str, str]) -> str:
    """Whether the probe of `group`, compiled with its MFLAGS, "runs" (exits 0), "died" (a SIGILL is a negative
    return code, not a crash of this process) or was "not built" (the compiler cannot emit the group)."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": dict(env)}
    try:
        built = subprocess.run([cc, "-O1", *MFLAGS[group].split(), f"-DPROBE_{group}", str(PROBE), "-o", str(binary)],
                               **quiet)
    except OSError:  # no such compiler
        return "not built"
    if built.returncode != 0:
        return "not built"
    try:
        return "runs" if subprocess.run([str(binary)], **quiet).returncode == 0 else "died"
    except OSError:  # a probe it wrote that cannot be executed
        return "died"
