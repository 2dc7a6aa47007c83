#!/usr/bin/env bash
# Builds llama.cpp for CPU from the source the PyPI sdist of llama-cpp-python vendors (pinned), for
# `drafter-export export.format=gguf` and the llama.cpp side of benchmarks/engine_check.py:
#   bash scripts/setup_llamacpp.sh [DIR]        (default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp in the repo)
# DIR then holds llama.cpp/ (the vendored source, unpatched: convert_hf_to_gguf.py and gguf-py), build/bin/ (the
# tools, built for the instruction groups a probe found this CPU executes), the smoke run's Q4_K_M file and venv/
# (this Python plus sentencepiece, which the converter imports even for BPE tokenizers).
# Then:  drafter-export export.format=gguf export.run_dir=checkpoints/<run> export.output_dir=exports/<name>
#        python -m benchmarks.engine_check --engine llamacpp --run checkpoints/<run>
# The download happens here only (pip, from PyPI); nothing is fetched at run time. About 6-10 min on 2 cores.
# The script ends with a smoke run (a 4-token pass of llama-bench) and exits non-zero with one line when the tools crash.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="$(realpath -m "${1:-${DRAFTER_TRAIN_LLAMACPP:-$PWD/.llamacpp}}")"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
TOOLS=(llama-speculative-simple llama-server llama-completion llama-bench llama-quantize llama-lookup
       llama-lookup-create llama-lookup-merge llama-lookup-stats)
mkdir -p "$DIR"

# 1. The source: the sdist (not a wheel: it carries vendor/llama.cpp whole), unpacked once.
if [ ! -f "$DIR/llama.cpp/convert_hf_to_gguf.py" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$DIR/llama.cpp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DIR/llama.cpp"
  echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" > "$DIR/SOURCE"
fi

# 2. The converter's interpreter: this Python's packages (torch, transformers, numpy) plus sentencepiece.
if [ ! -x "$DIR/venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$DIR/venv"
  PIP_CONSTRAINT="$PWD/constraints-cpu.txt" "$DIR/venv/bin/pip" install -q --no-deps sentencepiece
fi

# 3. The tools, CPU only, for the instruction groups this machine executes (scripts/llamacpp_flags.sh probes each
# one; LLAMACPP_NATIVE=1 or LLAMACPP_CMAKE_FLAGS="..." override it). No networking (LLAMA_OPENSSL=OFF), no web UI
# download, no tests. LLAMACPP_BUILD: another build folder for the same source (relative to DIR; default build).
BUILD="$(cd "$DIR" && realpath -m "${LLAMACPP_BUILD:-build}")"
FLAGS="$(bash scripts/llamacpp_flags.sh)"
# shellcheck disable=SC2086  # FLAGS is a list of -D options
cmake -S "$DIR/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $FLAGS \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF \
  > "$BUILD.cmake.log"
# The ninja CMake configured with, every time: another one on PATH (pip's ninja wheel) has another build-log version
# and would rebuild everything ("build log version is too old; starting over").
NINJA="$(sed -n 's/^CMAKE_MAKE_PROGRAM:FILEPATH=//p' "$BUILD/CMakeCache.txt")"
# The targets this llama.cpp version has (the lookup tools' names move between versions). Listed once into a
# variable: `ninja ... | grep -q` would end ninja with SIGPIPE, which pipefail counts as a failure.
TARGETS="$("$NINJA" -C "$BUILD" -t targets all)"
AVAILABLE=()
for tool in "${TOOLS[@]}"; do
  if grep -q "^$tool:" <<< "$TARGETS"; then AVAILABLE+=("$tool"); fi
done
"$NINJA" -C "$BUILD" -j "$JOBS" "${AVAILABLE[@]}"

# 4. The smoke run, every time (an up-to-date build too): a multi-token pass on a quantised GGUF. Tools built for an
# instruction the CPU lists but does not execute pass `--help` and die on their first real pass. On failure:
# one line naming the fix, and a non-zero exit. Then the speculative tool's flags.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c '
import sys
from pathlib import Path
from drafter_train.errors import DrafterTrainError
from drafter_train.llamacpp import smoke_check
try:
    smoke_check(Path(sys.argv[1]), Path(sys.argv[2]))
except DrafterTrainError as error:
    sys.exit(f"setup_llamacpp: {error}")
' "$DIR" "$BUILD"
"$BUILD/bin/llama-speculative-simple" --help 2>&1 | grep -q -- "--spec-type" \
  || { echo "setup_llamacpp: llama-speculative-simple has no --spec-type" >&2; exit 1; }
echo "llama.cpp ($(cat "$DIR/SOURCE")) ready in $DIR (tools in $BUILD/bin; $FLAGS; smoke run passed): ${AVAILABLE[*]}"
