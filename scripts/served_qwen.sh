#!/usr/bin/env bash
# The served pipeline (drafter_train/conf/pipeline/served_qwen.yaml); e.g. 'pipeline.stages=[ours,vllm]'
cd "$(dirname "$0")/.." && DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} exec python3 -m drafter_train.recipes.pipeline pipeline=served_qwen "$@"
