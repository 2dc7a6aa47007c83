#!/usr/bin/env bash
# The main job (drafter_train/conf/pipeline/quickstart.yaml); arguments are overrides, e.g. pipeline.steps=1500
cd "$(dirname "$0")/.." && DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} exec python3 -m drafter_train.recipes.pipeline pipeline=quickstart "$@"
