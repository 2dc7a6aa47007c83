#!/usr/bin/env bash
# Opt-in: pinned environments for the peer EAGLE-3 trainers that benchmarks/peer_trainers.py compares ours with.
#   bash scripts/setup_peers.sh [ROOT]     (default ROOT: the repo; makes ROOT/.venv-speculators, ROOT/.venv-modelopt)
# Each peer pins its own transformers, so each gets its own venv; drafter_train never imports them (the benchmark's
# adapters run in those venvs as standalone scripts). Nothing else in the project needs them; the tests that do skip
# without them ($DRAFTER_TRAIN_SPECULATORS_VENV, $DRAFTER_TRAIN_MODELOPT_VENV override the paths).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-$PWD}"
SPEC="${DRAFTER_TRAIN_SPECULATORS_VENV:-$ROOT/.venv-speculators}"
MODELOPT="${DRAFTER_TRAIN_MODELOPT_VENV:-$ROOT/.venv-modelopt}"
CONSTRAINTS="$PWD/constraints-cpu.txt"

venv_with_cpu_torch() {
  python3 -m venv "$1"
  "$1/bin/pip" install -q --upgrade pip
  # torch first (the CPU wheel): an unpinned torch, or a package needing torch installed before it, pulls CUDA builds
  "$1/bin/pip" install -q torch==2.13.0
}

# speculators 0.9.0 without its declared deps: they name torchvision/torchaudio (CUDA-linked wheels that break on CPU
# and that EAGLE-3 training never imports) and mooncake; hs-connectors is its hidden-state transport package.
venv_with_cpu_torch "$SPEC"
"$SPEC/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
PIP_CONSTRAINT="$CONSTRAINTS" "$SPEC/bin/pip" install -q "transformers>=5.0,<=5.19.0" "datasets>=4.0,<=5.1.0" \
  "loguru>=0.7.2,<=0.7.3" "openai>=2.0" aiohttp click httpx huggingface-hub "numpy>=2.0,<=2.5.4" protobuf psutil \
  "pydantic>=2.0" pydantic-settings rich safetensors "tqdm>=4.66.3,<=4.70.1" "typer>=0.12"
HF_HUB_OFFLINE=1 "$SPEC/bin/python" -c "import speculators.train.trainer; print('speculators ready in $SPEC')"

# nvidia-modelopt 0.47.0 and the part of its [hf] extra EAGLE training imports (transformers <5.15 as it pins; not
# deepspeed, which compiles, nor diffusers/peft/nltk). Its example trainer is not in the wheel: the benchmark's
# adapter drives modelopt.torch.speculative and transformers' Trainer directly.
venv_with_cpu_torch "$MODELOPT"
PIP_CONSTRAINT="$CONSTRAINTS" "$MODELOPT/bin/pip" install -q "nvidia-modelopt==0.47.0" "transformers>=4.57,<5.15" \
  "accelerate>=1.0" "datasets>=3.0" safetensors requests
HF_HUB_OFFLINE=1 "$MODELOPT/bin/python" -c "import modelopt.torch.speculative; print('modelopt ready in $MODELOPT')"
