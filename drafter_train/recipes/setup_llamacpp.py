"""Build llama.cpp for CPU from the source the pinned llama-cpp-python sdist vendors, and end in tools that RUN here.

    python -m drafter_train.recipes.setup_llamacpp [DIR] [--build BUILD] [--jobs N]

scripts/setup_llamacpp.sh runs it (its header says what DIR holds). The instruction groups come from
drafter_train/llamacpp_flags.py: a group is on where /proc/cpuinfo lists it AND a probe of it runs. A probe cannot
decide everything: on an Intel Xeon VM that lists AMX, a C program runs the tile instructions in 4 threads, yet
ggml's AMX kernels die with SIGILL in an OpenMP worker on the first pass over 2+ rows. So the build is judged by its
smoke run (a 4-token llama-bench pass). When that run dies of a signal, the groups most likely at fault are left out, in
FALLBACKS' order, ggml-cpu is rebuilt (about 30 s), and the smoke run is tried again; one line says what was left out
and why. The flags that passed are recorded in the build folder (RECORD) with the CPU they passed on, so a rerun on
the same CPU builds with them and never probes its way back into the crash; another CPU is probed afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from drafter_train.errors import DrafterTrainError
from drafter_train.llamacpp import LlamaCppCrash, LlamaCppError, llamacpp_dir, smoke_check
from drafter_train.llamacpp_flags import NATIVE, cmake_flags, listed_flags
from drafter_train.machine import cpu_model
from drafter_train.recipes.cli import one_line_errors

REPO = Path(__file__).resolve().parents[2]
SOURCE_VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp ($LLAMA_CPP_PYTHON_VERSION overrides)
TOOLS = ("llama-speculative-simple", "llama-server", "llama-completion", "llama-bench", "llama-quantize",
         "llama-lookup", "llama-lookup-create", "llama-lookup-merge", "llama-lookup-stats")
RECORD = "setup-flags.json"
# What a crashing build leaves out, one step at a time: the AMX groups first (the crash seen on a Xeon VM), then the
# newest AVX-512 extensions, then AVX-512 itself and the VNNI that AVX2 code may use. A step is tried only when it
# turns off a group that was on.
FALLBACKS = (("AMX_TILE", "AMX_INT8", "AMX_BF16"), ("AVX512_BF16", "AVX512_VNNI", "AVX512_VBMI"),
             ("AVX512", "AVX_VNNI"))
COMMON = ("-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_CUDA=OFF",
          "-DGGML_METAL=OFF")


def cpu_fingerprint() -> str:
    """The CPU a build passed on: its model and every flag /proc/cpuinfo lists (a VM moved to another host, or given
    other flags, is another CPU)."""
    digest = hashlib.sha256(" ".join(sorted(listed_flags(os.environ))).encode()).hexdigest()[:16]
    return f"{cpu_model()} [{digest}]"


def fetch_source(root: Path) -> None:
    """The sdist's vendor/llama.cpp into root/llama.cpp (once), and the converter's venv (this Python's packages plus
    sentencepiece, which convert_hf_to_gguf.py imports even for BPE tokenizers)."""
    if not (root / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        version = os.environ.get("LLAMA_CPP_PYTHON_VERSION", SOURCE_VERSION)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], check=True)
            with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as sdist:
                sdist.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            shutil.rmtree(root / "llama.cpp", ignore_errors=True)
            vendored.rename(root / "llama.cpp")
        (root / "SOURCE").write_text(f"llama-cpp-python=={version}\n")
    if not (root / "venv" / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], check=True)
        subprocess.run([str(root / "venv" / "bin" / "pip"), "install", "-q", "--no-deps", "sentencepiece"], check=True,
                       env=dict(os.environ, PIP_CONSTRAINT=str(REPO / "constraints-cpu.txt")))


def initial_flags(build: Path) -> tuple[list[str], bool]:
    """The -D flags to build with, and whether a crash may fall back from them: LLAMACPP_CMAKE_FLAGS as given (no
    fallback: the user chose), else the flags recorded as passing on this very CPU, else the probe's."""
    given = os.environ.get("LLAMACPP_CMAKE_FLAGS")
    if given:
        return given.split(), False
    record = read_record(build)
    if record and record.get("cpu_model") == cpu_fingerprint():
        print(f"setup_llamacpp: building with the flags that passed on this CPU before ({build / RECORD})")
        return list(record["flags"]), True
    flags, report = cmake_flags()
    if report:
        print(report, file=sys.stderr)
    return flags, NATIVE not in flags


def read_record(build: Path) -> Optional[dict]:
    try:
        return json.loads((build / RECORD).read_text())
    except (OSError, ValueError):
        return None


def next_fallback(flags: list[str]) -> Optional[tuple[list[str], list[str]]]:
    """The flags with the next FALLBACKS step's groups turned off, and those groups; None when no step turns off a
    group that is on."""
    for step in FALLBACKS:
        on = [group for group in step if f"-DGGML_{group}=ON" in flags]
        if on:
            off = {f"-DGGML_{group}=ON": f"-DGGML_{group}=OFF" for group in on}
            return [off.get(flag, flag) for flag in flags], on
    return None


def build_tools(root: Path, build: Path, flags: list[str], jobs: int) -> list[str]:
    """Configure (log in BUILD.cmake.log) and build the tools this llama.cpp version has; a reconfigure with other
    flags rebuilds ggml-cpu only."""
    with open(f"{build}.cmake.log", "w") as log:
        subprocess.run(["cmake", "-S", str(root / "llama.cpp"), "-B", str(build), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", *flags, *COMMON], check=True, stdout=log, stderr=log)
    # the ninja CMake configured with: another one on PATH (pip's ninja wheel) has another build-log version and
    # would rebuild everything
    cache = (build / "CMakeCache.txt").read_text()
    ninja = next(line.split("=", 1)[1] for line in cache.splitlines()
                 if line.startswith("CMAKE_MAKE_PROGRAM:FILEPATH="))
    targets = subprocess.run([ninja, "-C", str(build), "-t", "targets", "all"], check=True, capture_output=True,
                             text=True).stdout
    names = {line.split(":", 1)[0] for line in targets.splitlines()}
    available = [tool for tool in TOOLS if tool in names]
    subprocess.run([ninja, "-C", str(build), "-j", str(jobs), *available], check=True)
    return available


def run(root: Path, build: Path, jobs: int) -> list[str]:
    """Fetch, build, smoke-run, fall back on a crash, record: the -D flags of a build whose smoke run passed."""
    root.mkdir(parents=True, exist_ok=True)
    fetch_source(root)
    flags, may_fall_back = initial_flags(build)
    left_out: list[str] = []
    why = ""
    while True:
        build_tools(root, build, flags, jobs)
        try:
            smoke_check(root, build)
            break
        except LlamaCppCrash as crash:
            fallback = next_fallback(flags) if may_fall_back else None
            if fallback is None:
                tried = f" (already left out: {' '.join(left_out)})" if left_out else ""
                raise LlamaCppError(f"{crash}{tried}") from None
            flags, groups = fallback
            left_out += groups
            why = f"{crash.signal_name} in {crash.what}"
            print(f"setup_llamacpp: the smoke run died ({why}) with {' '.join(groups)} on: rebuilding without them",
                  file=sys.stderr)
    record = {"cpu_model": cpu_fingerprint(), "flags": flags, "left_out": left_out, "why": why}
    (build / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    if left_out:
        print(f"setup_llamacpp: left out {' '.join(left_out)} ({why} with them on); the smoke run passes without "
              f"them, recorded in {build / RECORD}")
    check_speculative(build)
    return flags


def check_speculative(build: Path) -> None:
    done = subprocess.run([str(build / "bin" / "llama-speculative-simple"), "--help"], capture_output=True, text=True)
    if "--spec-type" not in done.stdout + done.stderr:
        raise LlamaCppError("llama-speculative-simple has no --spec-type")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="setup_llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", help="the llama.cpp folder (default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp)")
    parser.add_argument("--build", default=os.environ.get("LLAMACPP_BUILD", "build"),
                        help="the build folder, relative to DIR (default: build; $LLAMACPP_BUILD)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("JOBS", os.cpu_count() or 1)))
    args = parser.parse_args(argv)
    root = llamacpp_dir(args.dir)
    build = (root / args.build).resolve()
    with one_line_errors("setup_llamacpp"):
        try:
            flags = run(root, build, args.jobs)
        except subprocess.CalledProcessError as error:
            raise DrafterTrainError(f"{Path(str(error.cmd[0])).name} failed (exit {error.returncode})") from None
    print(f"llama.cpp ({(root / 'SOURCE').read_text().strip()}) ready in {root} (tools in {build / 'bin'}; "
          f"{' '.join(flags)}; smoke run passed)")


if __name__ == "__main__":
    main()
