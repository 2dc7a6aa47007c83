#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), sized for a 2-core CPU:
#   1. ShareGPT prompts and their reference answers are stored (no generation: EAGLE's recipe of training on fixed
#      responses, because the target's own continuations come at ~60 tokens/s on this CPU),
#   2. an EAGLE-3 drafter (one decoder layer on the target's low/mid/high hidden states, 8192-token draft
#      vocabulary, training-time test) is trained on the target's distribution over those responses; the target's
#      features are extracted once into a 16-bit cache next to the data,
#   3. every checkpoint is evaluated with real speculative decoding on held-out prompts from 8 task categories
#      (prompts/heldout-mix.jsonl), with Draft & Verify's adaptive draft exit (unsure drafts are not verified:
#      a multi-token verify pass costs ~1.6-2x a 1-token one here): tau, acceptance and speedup are printed,
#   4. prompt lookup (drafter=ngram, no training) is evaluated on the same prompts: the free baseline.
# Rerunning continues where it stopped (data, feature cache and training checkpoints resume). Extra arguments are
# passed to drafter-train, e.g. `bash scripts/quickstart.sh train.max_steps=600`.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
DATA=${DATA:-data/quickstart-smollm2-ref}
RUN=quickstart-smollm2-eagle3
PROMPTS=(eval.prompts=prompts/heldout-mix.jsonl eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48)
drafter-datagen datagen.generate=false datagen.num_prompts=${NUM_PROMPTS:-800} datagen.num_eval_prompts=8 \
  datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 datagen.output_dir="$DATA"
drafter-train train.data_dir="$DATA" train.response=reference train.run_name=$RUN drafter=eagle3 \
  drafter.features=offline loss=fkl train.max_steps=${STEPS:-240} train.save_every=${SAVE_EVERY:-120} \
  train.log_every=10 train.batch_size=8 train.lr=2e-3 train.warmup_steps=20 train.eval_at_start=false "${PROMPTS[@]}" \
  eval.draft_exit=0.5 eval.draft_exit_adapt=true "$@"
drafter-eval drafter=ngram "${PROMPTS[@]}" eval.output="checkpoints/$RUN/prompt-lookup.json" \
  > "checkpoints/$RUN/prompt-lookup.log" 2>&1
python3 - "$RUN" <<'PY'
import json, pathlib, sys
run = pathlib.Path("checkpoints") / sys.argv[1]
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
print("\nheld-out prompts (8 task categories), greedy, draft_len 4, adaptive draft exit")
print("step   tau    acceptance  speedup")
for r in rows:
    if "eval/tau" in r:
        print(f"{r['step']:>4}  {r['eval/tau']:.3f}  {r['eval/acceptance_rate']:.3f}       {r['eval/speedup']:.3f}")
lookup = json.loads((run / "prompt-lookup.json").read_text())
print(f"prompt lookup (no training): tau {lookup['tau']:.3f}  acceptance {lookup['acceptance_rate']:.3f}  "
      f"speedup {lookup['speedup']:.3f}")
PY
