#!/usr/bin/env bash
# Benchmark: the main job's decoders side by side, repeated. After scripts/quickstart.sh, its `best` drafter is
# decoded as the job decodes it (prompt lookup, then corpus lookup in the job's data, then the drafter's 2 siblings:
# the product), alone, and the lookups without a drafter, on the test split (PROMPTS=dev to look at the choosing
# split instead), interleaved REPEATS times; each evaluation runs plain decoding beside it in the same process, on
# every CPU kernel setting, and divides by the fastest. Prints the median and range of tau and speedup per decoder,
# with the load average, and writes benchmarks/results/main_job_repeats.json (python -m benchmarks.main_job repeats).
#
#   bash benchmarks/main_job_repeats.sh                       # checkpoints/quickstart-smollm2, 3 repeats
#   RUN=checkpoints/my-run DATA=data/my-data REPEATS=5 NAMES="lookup-alone lookup-alone-n1" bash benchmarks/main_job_repeats.sh
#   EXTRA="drafter.corpus.min_count=1" OUT=... NAMES=lookups-alone bash benchmarks/main_job_repeats.sh  # overrides for all
#   NAMES="lookups-alone lookups-then-eagle3-tree" TREE_K=3 TREE_NODES=3 bash benchmarks/main_job_repeats.sh  # trees
#   KERNELS="default onednn auto" bash benchmarks/main_job_repeats.sh   # each decoder under each target.cpu_kernels,
#       interleaved; the table adds each setting's plain-decoding tokens/s and the speculative tokens/s over plain
#       decoding on PyTorch's default kernels (the stock baseline a user compares with)
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
COMMAND="bash benchmarks/main_job_repeats.sh"  # the settings given: what reproduces the table
for var in KERNELS TREE_NODES TREE_DEPTH TREE_K EXTRA NAMES DRAFT_LEN EVAL_PROMPTS PROMPTS REPEATS DATA RUN WHICH; do
  if [[ -n ${!var:-} ]]; then COMMAND="$var=$(printf %q "${!var}") $COMMAND"; fi
done
RUN=${RUN:-checkpoints/quickstart-smollm2}
DATA=${DATA:-data/quickstart-smollm2}  # the corpus of corpus lookup: the job's training data
REPEATS=${REPEATS:-3}
WHICH=${WHICH:-best}  # the checkpoint the job reports
OUT=${OUT:-$RUN/bench-main-job}
COMMON=(eval.prompts=${PROMPTS:-test} eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48
        eval.draft_len=${DRAFT_LEN:-2})  # the main job's
EXIT=(eval.draft_exit=0.5 eval.draft_exit_adapt=true)
# the *-tree decoders: an EAGLE-2 topk tree (TREE_K children per expanded node, TREE_DEPTH levels, TREE_NODES
# nodes kept); behind the lookups, a lookup match proposes a chain of up to TREE_NODES drafts instead
TREE=(eval.tree.top_k=${TREE_K:-2} eval.tree.depth=${TREE_DEPTH:-1} eval.tree.total_tokens=${TREE_NODES:-2})
declare -A DECODERS=(
  [lookups-then-eagle3]="drafter=path drafter.path=$RUN/$WHICH/drafter ${EXIT[*]} eval.lookup.min_ngram=2 eval.lookup.corpus.path=$DATA"
  [lookup-then-eagle3]="drafter=path drafter.path=$RUN/$WHICH/drafter ${EXIT[*]} eval.lookup.min_ngram=2"
  [eagle3-alone]="drafter=path drafter.path=$RUN/$WHICH/drafter ${EXIT[*]}"
  [lookups-then-eagle3-noexit]="drafter=path drafter.path=$RUN/$WHICH/drafter eval.lookup.min_ngram=2 eval.lookup.corpus.path=$DATA"
  [lookups-then-eagle3-tree]="drafter=path drafter.path=$RUN/$WHICH/drafter eval.lookup.min_ngram=2 eval.lookup.corpus.path=$DATA ${TREE[*]}"
  [eagle3-tree]="drafter=path drafter.path=$RUN/$WHICH/drafter ${TREE[*]}"
  [lookups-alone]="drafter=ngram drafter.min_ngram=2 drafter.corpus.path=$DATA"
  [lookup-alone]="drafter=ngram drafter.min_ngram=2"
  [lookup-alone-n1]="drafter=ngram drafter.min_ngram=1"
)
# default: the main job's four rows (the product, the drafter alone, prompt lookup, prompt + corpus lookup)
read -r -a NAMES <<< "${NAMES:-lookups-then-eagle3-tree eagle3-tree lookup-alone lookups-alone}"
read -r -a SETTINGS <<< "${KERNELS:-config}"  # "config": the config's own target.cpu_kernels, result names unsuffixed
mkdir -p "$OUT"
TAGS=()
for repeat in $(seq 1 "$REPEATS"); do
  for kernels in "${SETTINGS[@]}"; do
    for name in "${NAMES[@]}"; do
      tag=$name KERNEL_ARGS=()
      [[ $kernels != config ]] && tag=$name@$kernels KERNEL_ARGS=(target.cpu_kernels="$kernels")
      [[ $repeat == 1 ]] && TAGS+=("$tag")
      # a finished evaluation is kept: rerunning resumes (delete a json to measure it again, e.g. one run under load)
      [[ -f "$OUT/$tag-$repeat.json" ]] && continue
      # shellcheck disable=SC2086  # the decoder's overrides are words
      drafter-eval ${DECODERS[$name]} "${COMMON[@]}" "${KERNEL_ARGS[@]}" ${EXTRA:-} eval.output="$OUT/$tag-$repeat.json" \
        hydra.run.dir="$OUT/hydra/$tag-$repeat" > "$OUT/$tag-$repeat.log" 2>&1
    done
  done
done
python3 -m benchmarks.main_job repeats --out "$OUT" --command "$COMMAND" "${TAGS[@]}"
