#!/usr/bin/env bash
# Benchmark (issue 10 §7): the EAGLE-3 drafter's draft-vocabulary size (tau against drafter ms), and training
# tokens/s with online vs offline target features, on the main job's data (run scripts/quickstart.sh first, or
# point DATA at any drafter-datagen folder with reference answers: it trains on those, not on the target's).
#
#   bash benchmarks/eagle3_recipe.sh                      # vocab 2048 4096 8192 16384, 480 steps each
#   VOCABS="4096 8192" STEPS=240 bash benchmarks/eagle3_recipe.sh
#
# Each vocabulary size trains the main job's recipe (1 TTT step, fkl, offline features) for $STEPS steps, and its
# final checkpoint evaluation (the project's evaluator: held-out mix, 16 prompts x 48 tokens, greedy, draft_len 4,
# adaptive draft exit, no prompt lookup, so the drafter alone is measured) gives tau, drafter ms and speedup.
# Then $PROBE steps with features=online and with features=offline (feature cache already built) give training
# tokens/s for each. Results: a markdown table on stdout and $OUT/results.jsonl; run folders under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
DATA=${DATA:-data/quickstart-smollm2}
OUT=${OUT:-checkpoints/bench-eagle3-recipe}
VOCABS=${VOCABS:-2048 4096 8192 16384}
STEPS=${STEPS:-480}
PROBE=${PROBE:-30}
COMMON=(train.data_dir="$DATA" train.response=reference train.output_root="$OUT" drafter=eagle3 drafter.ttt_steps=1
        loss=fkl train.batch_size=8 train.lr=2e-3 train.warmup_steps=20 train.eval_at_start=false train.log_every=10
        eval.prompts=heldout-mix eval.num_prompts=16 eval.max_new_tokens=48 eval.draft_exit=0.5
        eval.draft_exit_adapt=true)
mkdir -p "$OUT"
done_run() { grep -qs '"eval/tau"' "$OUT/$1/metrics.jsonl"; }  # a finished run is kept: rerunning resumes
for vocab in $VOCABS; do
  done_run "vocab-$vocab" && continue
  drafter-train "${COMMON[@]}" drafter.features=offline drafter.draft_vocab_size="$vocab" train.max_steps="$STEPS" \
    train.save_every="$STEPS" train.run_name="vocab-$vocab" hydra.run.dir="$OUT/hydra/vocab-$vocab" \
    > "$OUT/vocab-$vocab.log" 2>&1
done
for features in offline online; do
  done_run "probe-$features" && continue
  drafter-train "${COMMON[@]}" drafter.features="$features" drafter.draft_vocab_size=4096 train.max_steps="$PROBE" \
    train.save_every="$PROBE" train.run_name="probe-$features" hydra.run.dir="$OUT/hydra/probe-$features" \
    eval.num_prompts=1 eval.max_new_tokens=4 > "$OUT/probe-$features.log" 2>&1
done
python3 - "$OUT" "$VOCABS" "$STEPS" <<'PY'
import json, os, pathlib, statistics, sys
from benchmarks.common import OUR_BASELINE, read_jsonl, write_result
out, vocabs = pathlib.Path(sys.argv[1]), sys.argv[2].split()
def rows(run):
    return read_jsonl(out / run / "metrics.jsonl")
def speed(run):  # median training tokens/s over the logged intervals after the first (warm-up)
    return statistics.median([r["train/tokens_per_s"] for r in rows(run) if "train/tokens_per_s" in r][1:])
results = []
print(f"load average at the end: {os.getloadavg()}")
print("| draft vocabulary | training tokens/s | tau | acceptance | drafter ms per proposal | out of draft vocabulary | speedup |")
print("|---|---|---|---|---|---|---|")
for vocab in vocabs:
    ev = [r for r in rows(f"vocab-{vocab}") if "eval/tau" in r][-1]
    row = dict(vocab=int(vocab), tokens_per_s=speed(f"vocab-{vocab}"), **{k[5:]: ev[k] for k in (
        "eval/tau", "eval/acceptance_rate", "eval/drafter_ms_per_proposal", "eval/out_of_draft_vocab", "eval/speedup")})
    results.append(row)
    print(f"| {vocab} | {row['tokens_per_s']:.0f} | {row['tau']:.3f} | {row['acceptance_rate']:.3f} | "
          f"{row['drafter_ms_per_proposal']:.2f} | {row['out_of_draft_vocab']:.3f} | {row['speedup']:.3f} |")
for features in ("offline", "online"):
    results.append(dict(features=features, tokens_per_s=speed(f"probe-{features}")))
    print(f"training tokens/s with {features} features (4096 vocabulary): {results[-1]['tokens_per_s']:.0f}")
(out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
write_result(
    "eagle3_recipe", title="EAGLE-3's draft vocabulary, and online against offline features",
    question="Which draft-vocabulary size gives the best speedup for the main job's EAGLE-3 recipe, and how much faster "
             "does training run on cached features?",
    command=f"VOCABS='{sys.argv[2]}' STEPS={sys.argv[3]} bash benchmarks/eagle3_recipe.sh",
    split="heldout-mix, first 16 prompts (dev)", baseline=OUR_BASELINE.format(kernels="auto"),
    columns=["draft vocabulary", "training tokens/s", "tau", "acceptance", "drafter ms / proposal",
             "out of draft vocabulary", "speedup"],
    rows=[[r["vocab"], r["tokens_per_s"], r["tau"], r["acceptance_rate"], r["drafter_ms_per_proposal"],
           r["out_of_draft_vocab"], r["speedup"]] for r in results if "vocab" in r],
    notes="Training tokens/s with 4096 vocabulary: " + ", ".join(
        f"{r['features']} features {r['tokens_per_s']:.0f}" for r in results if "features" in r)
          + ". Greedy, draft_len 4 with adaptive draft exit, no lookups: the drafter alone.")
PY
