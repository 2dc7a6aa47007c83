#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), sized for a 2-core CPU:
#   1. the target answers 800 ShareGPT prompts itself (greedy, up to 192 tokens, batches of 32: ~200 tokens/s, ~11
#      min on this CPU): the drafter's training data and the lookup corpus are what the target would write,
#   2. an EAGLE-3 drafter (one decoder layer on the target's low/mid/high hidden states) is trained on the target's
#      distribution over those answers; the target's features are extracted once into a 16-bit cache next to the
#      data. Sized for the CPU budget: a 4096-token draft vocabulary and 1 training-time-test step (0.55-1 s/step
#      instead of ~3.5 s with 8192 and 3 steps), 600 steps of 8 (docs/benchmarks.md, "The main job's recipe" and
#      "The main job on the target's own answers"),
#   3. every checkpoint is evaluated with real speculative decoding on held-out prompts from 8 task categories
#      (prompts/heldout-mix.jsonl): prompt lookup first (eval.lookup.min_ngram=2: where the last 2-3 tokens occurred
#      earlier, their continuation is the proposal and the drafter is not run), then corpus lookup in the target's
#      answers of step 1 (eval.lookup.corpus.path: SuffixDecoding's rule), elsewhere the drafter's two most likely
#      next tokens as siblings (eval.tree: both verified in the one target pass, which here costs a 1-token pass
#      up to 3 rows): tau, acceptance and speedup are printed,
#   4. the final drafter alone, prompt lookup alone, and prompt + corpus lookup without the drafter are evaluated
#      on the same prompts: where the gain comes from.
# Rerunning continues where it stopped (data, feature cache and training checkpoints resume). Extra arguments are
# passed to drafter-train, e.g. `bash scripts/quickstart.sh train.max_steps=1500`. Environment: NUM_PROMPTS (800),
# DATA (its folder), RUN (the run name), STEPS (600), SAVE_EVERY (300), EVAL_PROMPTS (16), DRAFT_LEN (2).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
DATA=${DATA:-data/quickstart-smollm2}
RUN=${RUN:-quickstart-smollm2}
# draft_len 2: on the Xeon measured 2026-11-24 a 3-token verify pass cost 1.08x a 1-token pass, a 5-token one 1.38x
# (docs/benchmarks.md, "CPU kernels chosen by measurement"); the lookups' best length there
DRAFT_LEN=${DRAFT_LEN:-2}
PROMPTS=(eval.prompts=prompts/heldout-mix.jsonl eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48
         eval.draft_len=$DRAFT_LEN)
# DRAFT_LEN drafts per verify pass: lookup chains of up to DRAFT_LEN tokens where they match, elsewhere the drafter's
# DRAFT_LEN most likely next tokens as siblings (a 1-level tree: the same pass as a chain, more often right than a
# chain's second draft). Measured against the chain with adaptive draft exit, the old setting: docs/benchmarks.md,
# "Sibling drafts instead of a chain"
TREE=(eval.tree.top_k=$DRAFT_LEN eval.tree.depth=1 eval.tree.total_tokens=$DRAFT_LEN)
LOOKUPS=(eval.lookup.min_ngram=2 eval.lookup.corpus.path="$DATA")
drafter-datagen datagen.num_prompts=${NUM_PROMPTS:-800} datagen.num_eval_prompts=8 datagen.batch_size=32 \
  datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 datagen.output_dir="$DATA"
drafter-train train.data_dir="$DATA" train.run_name=$RUN drafter=eagle3 drafter.features=offline \
  drafter.draft_vocab_size=4096 drafter.ttt_steps=1 loss=fkl train.max_steps=${STEPS:-600} \
  train.save_every=${SAVE_EVERY:-300} train.log_every=10 train.batch_size=8 train.lr=2e-3 train.warmup_steps=20 \
  train.eval_at_start=false "${PROMPTS[@]}" "${TREE[@]}" "${LOOKUPS[@]}" "$@"
drafter-eval drafter=path drafter.path="checkpoints/$RUN/latest/drafter" "${PROMPTS[@]}" "${TREE[@]}" \
  eval.output="checkpoints/$RUN/drafter-alone.json" > "checkpoints/$RUN/drafter-alone.log" 2>&1
drafter-eval drafter=ngram drafter.min_ngram=2 "${PROMPTS[@]}" eval.output="checkpoints/$RUN/prompt-lookup.json" \
  > "checkpoints/$RUN/prompt-lookup.log" 2>&1
drafter-eval drafter=ngram drafter.min_ngram=2 drafter.corpus.path="$DATA" "${PROMPTS[@]}" \
  eval.output="checkpoints/$RUN/corpus-lookup.json" > "checkpoints/$RUN/corpus-lookup.log" 2>&1
python3 - "$RUN" "$DRAFT_LEN" <<'PY'
import json, pathlib, sys
run = pathlib.Path("checkpoints") / sys.argv[1]
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
print(f"\nheld-out prompts (8 task categories), greedy, {sys.argv[2]} drafts per pass (the drafter's as siblings)")
print("                                         step   tau    acceptance  speedup")
for r in rows:
    if "eval/tau" in r:
        print(f"lookups, then EAGLE-3 (the product)      {r['step']:>4}  {r['eval/tau']:.3f}  "
              f"{r['eval/acceptance_rate']:.3f}       {r['eval/speedup']:.3f}")
for name, label in (("drafter-alone", "EAGLE-3 alone (final checkpoint)"), ("prompt-lookup", "prompt lookup alone (no training)"),
                    ("corpus-lookup", "prompt + corpus lookup (no drafter)")):
    m = json.loads((run / f"{name}.json").read_text())
    print(f"{label:<40}        {m['tau']:.3f}  {m['acceptance_rate']:.3f}       {m['speedup']:.3f}")
PY
