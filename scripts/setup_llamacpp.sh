#!/usr/bin/env bash
# Builds llama.cpp for CPU from the source the PyPI sdist of llama-cpp-python vendors (pinned), for
# `drafter-export export.format=gguf`, datagen.backend=llamacpp and the llama.cpp benchmarks:
#   bash scripts/setup_llamacpp.sh [DIR]        (default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp in the repo)
# DIR then holds llama.cpp/ (the vendored source, unpatched), build/bin/ (the tools), build/setup-flags.json (the
# instruction groups whose build passed the smoke run on this CPU), the smoke run's Q4_K_M file and venv/ (the
# converter's interpreter). About 6-10 min on 2 cores. The instruction groups: those /proc/cpuinfo lists AND a probe
# runs here (its first line names each group left out and why). Ends with a smoke run (a 4-token llama-bench pass);
# a build that dies there is rebuilt without the likeliest groups (AMX, then the newest AVX-512), one line saying so.
# Overrides: LLAMACPP_CMAKE_FLAGS="..." (as given, no fallback), LLAMACPP_NATIVE=1, LLAMACPP_BUILD, JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m drafter_train.recipes.setup_llamacpp "$@"
