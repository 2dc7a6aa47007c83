#!/usr/bin/env bash
# Issue 40's untried lever: more training data for the 1.5B's EAGLE-3, where the target's own answers are dear.
# On 2 cores llama-server writes the 1.5B's answers at ~11 tokens/s and torch extracts its features at 16-33, so
# the served pipeline (scripts/served_qwen.sh) trained EAGLE-3 on 9,213 answer tokens. ShareGPT's own answers cost no
# generation: datagen.generate=false keeps them (reading only the target's tokenizer and configs), and the target
# still labels every position (the fkl loss reads its distribution from the extracted features), as EAGLE's recipe
# trains. Stages (each skipped when its output exists, so a stopped run resumes):
#   data    NUM_PROMPTS ShareGPT prompts with their answers cut to 384 tokens -> DATA
#   train   EAGLE-3 as served_qwen.sh trains it (llama.cpp's layout, draft vocabulary 8192, fkl, lr 5e-4, batch 8),
#           STEPS steps on DATA's reference answers -> OUT/eagle3-refs
#   export  its last step's GGUF quantised to q4_k_m as the served table serves EAGLE-3 (the engine chooses, below:
#           our decoder's checkpoint evaluation of the 1.5B in float32 is minutes per prompt here and only logged)
#           -> OUT/exports/eagle3-refs-q4_k_m
#   dev     on the dev split (never the test split), side by side in llama.cpp at the served settings: plain Q4_K_M
#           (llama re-export), ngram-simple, the pipeline's EAGLE-3 (9k answer tokens) and this one, both at draft
#           length 1 (the length choose kept) -> OUT/lever-data/lever-data.json (tok/s, tau, llama.cpp's acceptance)
# Needs scripts/served_qwen.sh's targets, llamacpp and exports stages. Environment: DATA (data/qwen1.5b-refs384),
# OUT (checkpoints/served-qwen2.5-coder-1.5b), NUM_PROMPTS (200), STEPS (40), ROUNDS (2), STAGES.
# Budget here (2-core AMD EPYC, AVX2): data 30 s, features ~51 min (58k tokens at 16-18 tok/s, with other work
# beside it), training ~25 min, dev ~13 min; docs/lab-notes/served-qwen.md (fifth pass) has the run and its result.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
TARGET=qwen2.5-coder-1.5b
DATA=${DATA:-data/qwen1.5b-refs384}
OUT=${OUT:-checkpoints/served-$TARGET}
STAGES=" ${STAGES:-data train export dev} "
CACHE=${DRAFTER_TRAIN_CACHE:-$HOME/.cache/drafter_train}
stage() { [[ $STAGES == *" $1 "* ]]; }
if stage data; then  # a finished folder is checked and left as it is (drafter-datagen resumes by shard)
  drafter-datagen target=$TARGET datagen.generate=false datagen.num_prompts=${NUM_PROMPTS:-200} \
    datagen.num_eval_prompts=8 datagen.max_prompt_tokens=128 datagen.max_new_tokens=384 datagen.output_dir="$DATA"
fi
if stage train && [[ $(readlink "$OUT/eagle3-refs/latest" 2>/dev/null) != step-${STEPS:-40} ]]; then
  drafter-train target=$TARGET train.data_dir="$DATA" train.response=reference train.output_root="$OUT" \
    train.run_name=eagle3-refs drafter=eagle3 drafter.features=offline drafter.fc_norm=false \
    drafter.norm_before_fc=true drafter.draft_vocab_size=8192 drafter.ttt_steps=1 loss=fkl \
    train.max_steps=${STEPS:-40} train.save_every=20 train.keep_last=1 train.log_every=5 train.batch_size=8 \
    train.lr=5e-4 train.warmup_steps=8 eval.prompts=dev eval.num_prompts=1 eval.max_new_tokens=24 \
    eval.draft_len=2 train.eval_at_start=false
fi
if stage export && [[ ! -d $OUT/exports/eagle3-refs-q4_k_m ]]; then
  rm -rf "$OUT/exports/eagle3-refs-q4_k_m.part"
  drafter-export export.run_dir="$OUT/eagle3-refs" export.format=gguf export.gguf_type=f16 \
    export.drafter_gguf_type=q4_k_m export.gguf_target=false export.which=latest \
    export.output_dir="$OUT/exports/eagle3-refs-q4_k_m.part"
  mv "$OUT/exports/eagle3-refs-q4_k_m.part" "$OUT/exports/eagle3-refs-q4_k_m"
fi
if stage dev; then
  old=$OUT/exports/eagle3-q4_k_m/drafter.gguf@q4_k_m-llama new=$OUT/exports/eagle3-refs-q4_k_m/drafter.gguf@q4_k_m-llama
  python3 -m benchmarks.engines --engines llama.cpp --target embedded:$TARGET \
    --target-gguf "q4_k_m-llama=$CACHE/$TARGET.llama.gguf" --threads 2 --calibration-rounds 0 \
    --prompts dev --per-category 1 --max-new-tokens 64 --rounds ${ROUNDS:-2} --spec-precisions q4_k_m-llama \
    --ngram-modes ngram-simple \
    --draft-gguf "e3-answers9k=$old" --draft-len-of e3-answers9k=1 \
    --draft-gguf "e3-refs47k=$new" --draft-len-of e3-refs47k=1 \
    --output "$OUT/lever-data" --result-name lever-data
fi
