#!/usr/bin/env bash
# Every artifact the engine table (python -m benchmarks.engines) and the llama.cpp engine checks
# (python -m benchmarks.engine_check --engine llamacpp) read, made from the main job's data folder (DATA: the
# drafter-datagen output of scripts/quickstart.sh, with its feature cache). Into OUT:
#   nbf/          the main job's EAGLE-3 recipe (scripts/quickstart.sh's drafter-train line, `best` on the dev split)
#                 in llama.cpp's layout (drafter.fc_norm=false drafter.norm_before_fc=true), STEPS steps; then, as
#                 the quickstart does, its test-split evaluations: nbf/product.json and nbf/drafter-alone.json
#   ar2/          a stand-alone AR drafter: the target's first 2 layers trained AR_STEPS steps with loss=ce (cheap:
#                 the table needs a draft model llama.cpp serves, not a good one)
#   exports/{f32,f16,q8_0}/   drafter-export export.format=gguf of nbf (target.gguf + drafter.gguf)
#   exports/corpus.lookup     DATA's answers as llama.cpp's static n-gram cache (llama-lookup-create)
#   ar-exports/{f32,f16,q8_0}/drafter.gguf   ar2 as GGUF (export.gguf_target=false: the targets are exports/'s,
#                 linked in as target.gguf, so each folder serves as engine_check --exported)
#   exports/vllm/ drafter-export export.format=vllm of nbf, where the exporter takes norm_before_fc (else skipped)
# Rerunnable: a stage whose output exists is skipped, an export is written to <dir>.part and renamed when complete.
# Environment: DATA (data/quickstart-smollm2), OUT (checkpoints/eng-smollm2), STEPS (600), SAVE_EVERY (300),
# AR_STEPS (100), EVAL_PROMPTS (16), DRAFT_LEN (2), STAGES (all, in order: nbf nbf-test ar2 exports lookup ar-exports
# vllm; name a few to split the work). Extra arguments go to nbf's drafter-train. llama.cpp: scripts/setup_llamacpp.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
DATA=${DATA:-data/quickstart-smollm2}
OUT=${OUT:-checkpoints/eng-smollm2}
STEPS=${STEPS:-600}
AR_STEPS=${AR_STEPS:-100}
DRAFT_LEN=${DRAFT_LEN:-2}
STAGES=" ${STAGES:-nbf nbf-test ar2 exports lookup ar-exports vllm} "
PRECISIONS=(f32 f16 q8_0)
for s in $STAGES; do
  case $s in nbf|nbf-test|ar2|exports|lookup|ar-exports|vllm) ;;
    *) echo "engine_artifacts: STAGES: unknown stage $s (nbf nbf-test ar2 exports lookup ar-exports vllm)" >&2; exit 2;;
  esac
done
if [[ ! -f $DATA/datagen.json ]]; then
  echo "engine_artifacts: DATA=$DATA is not a drafter-datagen folder (no datagen.json): run scripts/quickstart.sh" >&2
  exit 2
fi
# the main job's evaluation settings (scripts/quickstart.sh)
SETTINGS=(eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48 eval.draft_len=$DRAFT_LEN)
TREE=(eval.tree.top_k=$DRAFT_LEN eval.tree.depth=1 eval.tree.total_tokens=$DRAFT_LEN)
LOOKUPS=(eval.lookup.min_ngram=2 eval.lookup.corpus.path="$DATA")
NBF=$OUT/nbf
mkdir -p "$OUT"

stage() { [[ $STAGES == *" $1 "* ]]; }
trained() { [[ $(readlink "$1/latest" 2>/dev/null) == "step-$2" && -e $1/best/drafter ]]; }
# drafter-export into DIR.part, renamed to DIR when it succeeds; skipped when DIR exists
export_to() {
  local dir=$1; shift
  if [[ -d $dir ]]; then echo "engine_artifacts: $dir exists, skipped"; return 0; fi
  rm -rf "$dir.part"
  drafter-export "$@" export.output_dir="$dir.part" && mv "$dir.part" "$dir"
}

if stage nbf && ! trained "$NBF" "$STEPS"; then
  drafter-train train.data_dir="$DATA" train.output_root="$OUT" train.run_name=nbf drafter=eagle3 \
    drafter.features=offline drafter.fc_norm=false drafter.norm_before_fc=true drafter.draft_vocab_size=4096 \
    drafter.ttt_steps=1 loss=fkl train.max_steps=$STEPS train.save_every=${SAVE_EVERY:-300} train.log_every=10 \
    train.batch_size=8 train.lr=2e-3 train.warmup_steps=20 train.eval_at_start=false eval.prompts=dev \
    "${SETTINGS[@]}" "${TREE[@]}" "${LOOKUPS[@]}" "$@"
fi
if stage nbf-test; then  # the quickstart's product and drafter-alone evaluations, test split, at `best`
  [[ -f $NBF/product.json ]] || drafter-eval drafter=path drafter.path="$NBF/best/drafter" eval.prompts=test \
    "${SETTINGS[@]}" "${TREE[@]}" "${LOOKUPS[@]}" eval.output="$NBF/product.json" > "$NBF/product.log" 2>&1
  [[ -f $NBF/drafter-alone.json ]] || drafter-eval drafter=path drafter.path="$NBF/best/drafter" eval.prompts=test \
    "${SETTINGS[@]}" "${TREE[@]}" eval.output="$NBF/drafter-alone.json" > "$NBF/drafter-alone.log" 2>&1
fi
if stage ar2 && ! trained "$OUT/ar2" "$AR_STEPS"; then
  drafter-train train.data_dir="$DATA" train.output_root="$OUT" train.run_name=ar2 drafter=ar \
    drafter.path=truncated:2 drafter.draft_len=$DRAFT_LEN loss=ce train.max_steps=$AR_STEPS \
    train.save_every=$AR_STEPS train.log_every=10 train.batch_size=8 train.eval_at_start=false eval.prompts=dev \
    "${SETTINGS[@]}"
fi
if stage exports; then
  for p in "${PRECISIONS[@]}"; do
    export_to "$OUT/exports/$p" export.run_dir="$NBF" export.format=gguf export.gguf_type=$p
  done
fi
if stage lookup; then
  if [[ -f $OUT/exports/corpus.lookup ]]; then echo "engine_artifacts: $OUT/exports/corpus.lookup exists, skipped"
  else
    python3 -c 'import sys; from pathlib import Path
from drafter_train.config import TargetConfig
from drafter_train.llamacpp import llamacpp_dir, write_lookup_cache
from drafter_train.targets import load_target_tokenizer
target, corpus, out = map(Path, sys.argv[1:])
write_lookup_cache(llamacpp_dir(), target, corpus, out, load_target_tokenizer(TargetConfig()))' \
      "$OUT/exports/f32/target.gguf" "$DATA" "$OUT/exports/corpus.lookup"
  fi
fi
if stage ar-exports; then
  for p in "${PRECISIONS[@]}"; do
    export_to "$OUT/ar-exports/$p" export.run_dir="$OUT/ar2" export.format=gguf export.gguf_type=$p \
      export.gguf_target=false
    # the target beside it (a link), so the folder is what engine_check --exported serves
    [[ ! -f $OUT/exports/$p/target.gguf ]] || ln -sfn "../../exports/$p/target.gguf" "$OUT/ar-exports/$p/target.gguf"
  done
fi
if stage vllm; then
  log=$(mktemp)
  if ! export_to "$OUT/exports/vllm" export.run_dir="$NBF" export.format=vllm > "$log" 2>&1; then
    if grep -q norm_before_fc "$log"; then
      echo "engine_artifacts: exports/vllm skipped: the vLLM exporter refuses norm_before_fc ($(grep -m1 norm_before_fc "$log"))"
      rm -rf "$OUT/exports/vllm.part"
    else
      cat "$log" >&2; rm -f "$log"; exit 1
    fi
  else
    cat "$log"
  fi
  rm -f "$log"
fi
echo "engine_artifacts: done ($OUT)"
