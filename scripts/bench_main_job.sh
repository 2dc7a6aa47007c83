#!/usr/bin/env bash
# Benchmark: the main job's decoders side by side, repeated (issue 10 §6). After scripts/quickstart.sh, the
# final drafter is decoded with prompt lookup and then corpus lookup in the job's data (DATA: the target's own
# answers) first (what the job reports), with prompt lookup only first, alone, and the lookups without a drafter
# (prompt lookup at the job's min_ngram 2, and 1, drafter=ngram's default; with the corpus), on the job's held-out
# prompts, interleaved REPEATS times; each evaluation runs plain decoding beside it in the same process. Prints the
# median and range of tau and speedup per decoder, with the load average.
#
#   bash scripts/bench_main_job.sh                       # checkpoints/quickstart-smollm2, 3 repeats
#   RUN=checkpoints/my-run DATA=data/my-data REPEATS=5 NAMES="lookup-alone lookup-alone-n1" bash scripts/bench_main_job.sh
#   EXTRA="drafter.corpus.min_count=1" OUT=... NAMES=lookups-alone bash scripts/bench_main_job.sh  # overrides for all
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
RUN=${RUN:-checkpoints/quickstart-smollm2}
DATA=${DATA:-data/quickstart-smollm2}  # the corpus of corpus lookup: the job's training data
REPEATS=${REPEATS:-3}
OUT=${OUT:-$RUN/bench-main-job}
COMMON=(eval.prompts=prompts/heldout-mix.jsonl eval.num_prompts=${EVAL_PROMPTS:-16} eval.max_new_tokens=48)
EXIT=(eval.draft_exit=0.5 eval.draft_exit_adapt=true)
declare -A DECODERS=(
  [lookups-then-eagle3]="drafter=path drafter.path=$RUN/latest/drafter ${EXIT[*]} eval.lookup.min_ngram=2 eval.lookup.corpus.path=$DATA"
  [lookup-then-eagle3]="drafter=path drafter.path=$RUN/latest/drafter ${EXIT[*]} eval.lookup.min_ngram=2"
  [eagle3-alone]="drafter=path drafter.path=$RUN/latest/drafter ${EXIT[*]}"
  [lookups-alone]="drafter=ngram drafter.min_ngram=2 drafter.corpus.path=$DATA"
  [lookup-alone]="drafter=ngram drafter.min_ngram=2"
  [lookup-alone-n1]="drafter=ngram drafter.min_ngram=1"
)
read -r -a NAMES <<< "${NAMES:-lookups-then-eagle3 lookup-then-eagle3 eagle3-alone lookups-alone lookup-alone lookup-alone-n1}"
mkdir -p "$OUT"
for repeat in $(seq 1 "$REPEATS"); do
  for name in "${NAMES[@]}"; do
    # a finished evaluation is kept: rerunning resumes (delete a json to measure it again, e.g. one run under load)
    [[ -f "$OUT/$name-$repeat.json" ]] && continue
    # shellcheck disable=SC2086  # the decoder's overrides are words
    drafter-eval ${DECODERS[$name]} "${COMMON[@]}" ${EXTRA:-} eval.output="$OUT/$name-$repeat.json" \
      hydra.run.dir="$OUT/hydra/$name-$repeat" > "$OUT/$name-$repeat.log" 2>&1
  done
done
python3 - "$OUT" "${NAMES[@]}" <<'PY'
import json, os, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
print(f"load average at the end: {os.getloadavg()}")
print("| decoder | tau | speedup (median) | speedup (min-max) | proposals (lookup's) |")
print("|---|---|---|---|---|")
for name in sys.argv[2:]:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-*.json"))]
    speed = [m["speedup"] for m in runs]
    m = runs[0]  # greedy: tau and the proposals are the same in every repeat
    print(f"| {name} | {m['tau']:.3f} | {statistics.median(speed):.3f} | {min(speed):.3f}-{max(speed):.3f} | "
          f"{m['proposals']} ({m['lookup_proposals']}) |")
PY
