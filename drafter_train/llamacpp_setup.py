"""What scripts/setup_llamacpp.sh asks of Python: the CMake flags for this CPU, and the smoke run.

    python -m drafter_train.llamacpp_setup flags         -> -DGGML_NATIVE=OFF -DGGML_SSE42=ON ... -DGGML_AMX_BF16=OFF
    python -m drafter_train.llamacpp_setup smoke DIR BUILD

flags: on x86-64 each instruction group ggml-cpu has an option for is ON only when a probe (scripts/cpu_probe.c,
compiled with the group's -m flags) runs here: what this process can EXECUTE, not what /proc/cpuinfo lists.
GGML_NATIVE (-march=native) enables whatever CPUID reports; on an Intel Xeon VM that lists AMX, tools built so died
with SIGILL on every pass over 2+ tokens (ggml's AMX kernels use tile instructions only when a matmul has 2+ rows).
stderr gets one line naming the groups found usable and the ones left out. Overrides: LLAMACPP_CMAKE_FLAGS="..." is
printed as given (no probing); LLAMACPP_NATIVE=1 gives -DGGML_NATIVE=ON (the build the probe replaced). Other
architectures get -DGGML_NATIVE=ON: ggml's ARM detection test-compiles.
smoke: llamacpp.smoke_check of the build; a crash or failure is one line and exit status 1.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

PROBE = Path(__file__).resolve().parent.parent / "scripts" / "cpu_probe.c"
# group -> the -m flags ggml-cpu's CMakeLists.txt adds for GGML_<group> (the probe is compiled with the same), in the
# order they are probed
MFLAGS = {
    "SSE42": "-msse4.2", "AVX": "-mavx", "F16C": "-mf16c", "FMA": "-mfma", "AVX2": "-mavx2", "BMI2": "-mbmi2",
    "AVX_VNNI": "-mavxvnni", "AVX512": "-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw",
    "AVX512_VBMI": "-mavx512f -mavx512vbmi", "AVX512_VNNI": "-mavx512f -mavx512vnni",
    "AVX512_BF16": "-mavx512f -mavx512bf16", "AMX_TILE": "-mamx-tile", "AMX_INT8": "-mamx-tile -mamx-int8",
    "AMX_BF16": "-mamx-tile -mamx-bf16"}
# the groups each needs: ggml only uses an AVX-512 extension inside AVX-512 code, and AMX only with AVX512-VNNI
NEEDS = {"F16C": "AVX", "FMA": "AVX", "AVX2": "AVX", "AVX_VNNI": "AVX2", "AVX512": "AVX2", "AVX512_VBMI": "AVX512",
         "AVX512_VNNI": "AVX512", "AVX512_BF16": "AVX512", "AMX_TILE": "AVX512_VNNI", "AMX_INT8": "AMX_TILE",
         "AMX_BF16": "AMX_TILE"}


def cmake_flags(env: Mapping[str, str] = os.environ, probe: Path = PROBE) -> tuple[list[str], str]:
    """The -D flags for this machine, and the one line naming what was usable (empty when not probed)."""
    if env.get("LLAMACPP_CMAKE_FLAGS"):
        return env["LLAMACPP_CMAKE_FLAGS"].split(), ""
    if env.get("LLAMACPP_NATIVE", "0") == "1" or platform.machine() != "x86_64":
        return ["-DGGML_NATIVE=ON"], ""
    usable: list[str] = []
    with tempfile.TemporaryDirectory() as work:
        for group in MFLAGS:
            need = NEEDS.get(group)
            if (need is None or need in usable) and runs_here(group, probe, Path(work), env.get("CC", "cc")):
                usable.append(group)
    flags = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if g in usable else 'OFF'}" for g in MFLAGS)]
    left = [g for g in MFLAGS if g not in usable]
    return flags, f"llamacpp_flags: usable here: {' '.join(usable) or 'none'}; left out: {' '.join(left) or 'none'}"


def runs_here(group: str, probe: Path, work: Path, cc: str) -> bool:
    """Whether the probe of `group`, compiled with its -m flags, runs to the end here (a compiler that cannot emit
    the group leaves it out too; a SIGILL is a negative return code, not a crash of this process)."""
    binary = work / group
    built = subprocess.run([cc, "-O1", *MFLAGS[group].split(), f"-DPROBE_{group}", str(probe), "-o", str(binary)],
                           capture_output=True)
    return built.returncode == 0 and subprocess.run([str(binary)], capture_output=True).returncode == 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["flags"]:
        flags, report = cmake_flags()
        if report:
            print(report, file=sys.stderr)
        print(" ".join(flags))
        return 0
    if args[:1] == ["smoke"] and len(args) == 3:
        from drafter_train.errors import DrafterTrainError
        from drafter_train.llamacpp import smoke_check

        try:
            smoke_check(Path(args[1]), Path(args[2]))
        except DrafterTrainError as error:
            print(f"setup_llamacpp: {error}", file=sys.stderr)
            return 1
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
