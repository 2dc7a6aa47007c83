#!/usr/bin/env bash
# Check (not a timing): do the data a job writes and the drafter it trains depend on target.cpu_kernels? A reduced
# main job (48 ShareGPT prompts answered greedily, 64 tokens; the EAGLE-3 feature cache; 20 training steps) runs
# once per setting into OUT/<setting>; prints per setting the checksum of the target's responses, of the feature
# cache and of the trained drafter's weights, and the row policies "auto" timed. Since passes that make training
# data run on PyTorch's own kernel (cpu_kernels.stock_kernels), all three are equal across settings.
#
#   bash benchmarks/check_data_kernels.sh                      # OUT=/tmp/data-kernels, settings default auto onednn
#   OUT=/tmp/dk SETTINGS="auto auto" bash benchmarks/check_data_kernels.sh   # two runs on auto
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
OUT=${OUT:-/tmp/data-kernels}
read -r -a SETTINGS <<< "${SETTINGS:-default auto onednn}"
i=0
for kernels in "${SETTINGS[@]}"; do
  i=$((i + 1)) dir=$OUT/$i-$kernels
  rm -rf "$dir" && mkdir -p "$dir"
  drafter-datagen target.cpu_kernels="$kernels" datagen.num_prompts=48 datagen.num_eval_prompts=2 \
    datagen.batch_size=16 datagen.max_new_tokens=64 datagen.max_prompt_tokens=128 datagen.output_dir="$dir/data" \
    hydra.run.dir="$dir/datagen" > "$dir.log" 2>&1
  drafter-train target.cpu_kernels="$kernels" train.data_dir="$dir/data" train.output_root="$dir/checkpoints" \
    train.run_name=run drafter=eagle3 drafter.features=offline drafter.draft_vocab_size=512 drafter.ttt_steps=1 \
    loss=fkl train.max_steps=20 train.save_every=20 train.batch_size=4 train.eval_at_start=false \
    eval.num_prompts=1 eval.max_new_tokens=4 >> "$dir.log" 2>&1
  python3 - "$dir" "$kernels" <<'PY'
import hashlib, pathlib, re, sys
import datasets
root, kernels = pathlib.Path(sys.argv[1]), sys.argv[2]
responses = hashlib.sha256()
for shard in sorted((root / "data" / "shards").iterdir()):
    responses.update(str(datasets.load_from_disk(str(shard))["response_ids"]).encode())
features = hashlib.sha256()
for arrow in sorted((root / "data" / "features").rglob("*.arrow")):
    features.update(arrow.read_bytes())
drafter = hashlib.sha256((root / "checkpoints/run/latest/drafter/model.safetensors").read_bytes())
policies = re.findall(r"cpu kernels by rows: (.*)", pathlib.Path(f"{root}.log").read_text())
print(f"{kernels:8s} responses {responses.hexdigest()[:16]}  features {features.hexdigest()[:16]}  "
      f"drafter {drafter.hexdigest()[:16]}  timed policies: {'; '.join(policies) or '-'}")
PY
done
