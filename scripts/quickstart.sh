#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), sized for a 2-core CPU:
#   1. the target writes its own continuations of ShareGPT prompts (held-out eval prompts split off first),
#   2. its first 2 layers (embeddings + LM head frozen) are trained on those continuations (sequence-level KD: on
#      a 2-core CPU it raises tau fastest per minute; see docs/benchmarks.md for the token-level losses),
#   3. every checkpoint is evaluated with real speculative decoding: tau, acceptance and speedup are printed.
# Rerunning continues where it stopped (datagen shards and training checkpoints resume). Extra arguments are
# passed to drafter-train, e.g. `bash scripts/quickstart.sh loss=tvd train.max_steps=300`.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
DATA=${DATA:-data/quickstart-smollm2}
drafter-datagen datagen.num_prompts=${NUM_PROMPTS:-256} datagen.num_eval_prompts=8 datagen.max_new_tokens=96 \
  datagen.max_prompt_tokens=128 datagen.batch_size=16 datagen.output_dir="$DATA"
drafter-train train.data_dir="$DATA" train.run_name=quickstart-smollm2 drafter.path=truncated:2 loss=ce \
  train.max_steps=${STEPS:-120} train.save_every=30 train.log_every=10 train.batch_size=8 train.lr=2e-3 \
  eval.num_prompts=8 eval.max_new_tokens=48 "$@"
python3 - <<'PY'
import json, pathlib
rows = [json.loads(l) for l in pathlib.Path("checkpoints/quickstart-smollm2/metrics.jsonl").read_text().splitlines()]
print("\nstep   tau    acceptance  speedup   (held-out prompts, greedy, draft_len 4)")
for r in rows:
    if "eval/tau" in r:
        print(f"{r['step']:>4}  {r['eval/tau']:.3f}  {r['eval/acceptance_rate']:.3f}       {r['eval/speedup']:.3f}")
PY
