#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), sized for a 2-core CPU:
#   1. datagen: the target answers 800 ShareGPT prompts itself; the answers are the training data and the corpus
#      of corpus lookup,
#   2. train: an EAGLE-3 drafter on the target's distribution over those answers, its features cached once,
#   3. evaluate: each checkpoint decodes the dev split's prompts with prompt lookup, then corpus lookup, then the
#      drafter's top DRAFT_LEN tokens as siblings (the product), which picks `best`; then, on the test split (never
#      used for choosing), the product at `best`, the drafter alone (as siblings, and as a top-1 chain: its
#      per-position acceptance) and the lookups alone,
#   4. summarize: one table of tau, acceptance and speedup over plain decoding, also written to
#      benchmarks/results/main_job.json.
# Why these settings: benchmarks/README.md ("The main job's settings"). Rerunning continues where it stopped.
# Extra arguments go to drafter-train (e.g. `bash scripts/quickstart.sh train.max_steps=1500`). Environment:
# NUM_PROMPTS (800), DATA (its folder), RUN (the run name), STEPS (600), SAVE_EVERY (300), EVAL_PROMPTS (16),
# DRAFT_LEN (2).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
COMMAND="bash scripts/quickstart.sh${*:+ $*}"  # what reproduces this run (for the result file): settings given, arguments
for var in DRAFT_LEN EVAL_PROMPTS SAVE_EVERY STEPS RUN DATA NUM_PROMPTS; do
  if [[ -n ${!var:-} ]]; then COMMAND="$var=$(printf %q "${!var}") $COMMAND"; fi
done
DATA=${DATA:-data/quickstart-smollm2}
RUN=${RUN:-quickstart-smollm2}
DRAFT_LEN=${DRAFT_LEN:-2}
SETTINGS=(eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48 eval.draft_len=$DRAFT_LEN)
DEV=(eval.prompts=dev "${SETTINGS[@]}")  # chooses `best`
TEST=(eval.prompts=test "${SETTINGS[@]}")  # reports
TREE=(eval.tree.top_k=$DRAFT_LEN eval.tree.depth=1 eval.tree.total_tokens=$DRAFT_LEN)
LOOKUPS=(eval.lookup.min_ngram=2 eval.lookup.corpus.path="$DATA")
drafter-datagen datagen.num_prompts=${NUM_PROMPTS:-800} datagen.num_eval_prompts=8 datagen.batch_size=32 \
  datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 datagen.output_dir="$DATA"
drafter-train train.data_dir="$DATA" train.run_name=$RUN drafter=eagle3 drafter.features=offline \
  drafter.draft_vocab_size=4096 drafter.ttt_steps=1 loss=fkl train.max_steps=${STEPS:-600} \
  train.save_every=${SAVE_EVERY:-300} train.log_every=10 train.batch_size=8 train.lr=2e-3 train.warmup_steps=20 \
  train.eval_at_start=false "${DEV[@]}" "${TREE[@]}" "${LOOKUPS[@]}" "$@"
drafter-eval drafter=path drafter.path="checkpoints/$RUN/best/drafter" "${TEST[@]}" "${TREE[@]}" "${LOOKUPS[@]}" \
  eval.output="checkpoints/$RUN/product.json" > "checkpoints/$RUN/product.log" 2>&1
drafter-eval drafter=path drafter.path="checkpoints/$RUN/best/drafter" "${TEST[@]}" "${TREE[@]}" \
  eval.output="checkpoints/$RUN/drafter-alone.json" > "checkpoints/$RUN/drafter-alone.log" 2>&1
drafter-eval drafter=path drafter.path="checkpoints/$RUN/best/drafter" "${TEST[@]}" \
  eval.output="checkpoints/$RUN/drafter-chain.json" > "checkpoints/$RUN/drafter-chain.log" 2>&1  # top-1 chain
drafter-eval drafter=ngram drafter.min_ngram=2 "${TEST[@]}" eval.output="checkpoints/$RUN/prompt-lookup.json" \
  > "checkpoints/$RUN/prompt-lookup.log" 2>&1
drafter-eval drafter=ngram drafter.min_ngram=2 drafter.corpus.path="$DATA" "${TEST[@]}" \
  eval.output="checkpoints/$RUN/corpus-lookup.json" > "checkpoints/$RUN/corpus-lookup.log" 2>&1
python3 -m benchmarks.main_job summarize --run "checkpoints/$RUN" --draft-len "$DRAFT_LEN" --command "$COMMAND"
