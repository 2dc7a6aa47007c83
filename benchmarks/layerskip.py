"""Benchmark: the self-speculative layer-skipping drafter (`drafter=layerskip`) searched for SmolLM2, then evaluated.

1. drafter-datagen: the target's own greedy continuations of `--search-prompts` ShareGPT prompts (the text the
   search's proxy reads) plus `--confirm-prompts` held-out prompts for the search's confirmation runs.
2. drafter-train drafter=layerskip: `--trials` TPE trials on SWIFT's proxy, the best `--confirm` decoded for real
   (adaptive draft exit); wall-clock timed.
3. drafter-eval of the chosen skip set on `--prompts` (default the test split, which neither step saw)
   with draft exit adapting gamma from the searched folder's, against plain decoding in the same process.

Prints tau, drafter ms per drafted token, speedup, the search's wall-clock and the chosen skip set, with the load
average, and writes them to <output-root>/results.json:

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.layerskip --trials 40 --output-root checkpoints/bench-layerskip
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from drafter_train.recipes.cli import compose_config
from drafter_train.recipes.datagen import run_datagen
from drafter_train.recipes.evaluate import run_eval_job
from drafter_train.recipes.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2")
    parser.add_argument("--output-root", default="checkpoints/bench-layerskip")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--confirm", type=int, default=2)
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--search-prompts", type=int, default=8)
    parser.add_argument("--confirm-prompts", type=int, default=3)
    parser.add_argument("--prompts", default="test")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=float, default=0.6, help="draft exit's starting gamma in the search")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(args.output_root)
    data, target = root / "data", [f"target.path={args.target}"]

    if not (data / "datagen.json").is_file():
        run_datagen(compose_config("datagen", [*target, f"datagen.num_prompts={args.search_prompts}",
                                         f"datagen.num_eval_prompts={args.confirm_prompts}",
                                         "datagen.max_new_tokens=128", f"datagen.output_dir={data}"]))
    start = time.perf_counter()
    train(compose_config("train", [*target, "drafter=layerskip", f"drafter.draft_len={args.draft_len}",
                             f"drafter.search_trials={args.trials}", f"drafter.search_confirm={args.confirm}",
                             f"drafter.search_sequences={args.search_prompts}", f"train.data_dir={data}",
                             f"train.output_root={root}", "train.run_name=search", f"train.seed={args.seed}",
                             f"eval.num_prompts={args.confirm_prompts}", "eval.max_new_tokens=48",
                             f"eval.draft_exit={args.gamma}", "eval.draft_exit_adapt=true"]))
    search_s = time.perf_counter() - start
    folder = root / "search" / "best" / "drafter"
    chosen = json.loads((folder / "config.json").read_text())
    metrics = run_eval_job(compose_config("eval", [
        *target, "drafter=path", f"drafter.path={folder}", f"eval.draft_len={args.draft_len}",
        f"eval.prompts={args.prompts}", f"eval.num_prompts={args.num_prompts}",
        f"eval.max_new_tokens={args.max_new_tokens}", f"eval.draft_exit={max(chosen['exit_threshold'], 0.01)}",
        "eval.draft_exit_adapt=true", f"eval.output={root / 'heldout-metrics.json'}"]))
    draft_ms_per_token = metrics["drafter_ms_per_proposal"] / max(metrics["draft_tokens_per_step"], 1e-9)
    results = {
        "command": f"python -m benchmarks.layerskip --trials {args.trials} --confirm {args.confirm} --draft-len "
                   f"{args.draft_len} --num-prompts {args.num_prompts} --max-new-tokens {args.max_new_tokens}",
        "load_average_end": os.getloadavg(), "torch_threads": metrics["torch_threads"],
        "search_wall_clock_s": search_s, "trials": args.trials,
        "skip_attn": chosen["skip_attn"], "skip_mlp": chosen["skip_mlp"], "num_layers": chosen["num_layers"],
        "search": chosen["search"], "gamma_searched": chosen["exit_threshold"],
        "tau": metrics["tau"], "acceptance_rate": metrics["acceptance_rate"], "speedup": metrics["speedup"],
        "drafter_ms_per_token": draft_ms_per_token, "draft_tokens_per_step": metrics["draft_tokens_per_step"],
        "verify_ms_per_step": metrics["verify_ms_per_step"], "spec_tokens_per_s": metrics["spec_tokens_per_s"],
        "ar_tokens_per_s": metrics["ar_tokens_per_s"], "greedy_match": metrics["greedy_match"],
        "draft_exit_final": metrics["draft_exit_final"],
    }
    (root / "results.json").write_text(json.dumps(results, indent=2))
    print(f"search: {args.trials} trials in {search_s / 60:.1f} min; chose {len(chosen['skip_attn'])} attention + "
          f"{len(chosen['skip_mlp'])} MLP sub-layers skipped of {chosen['num_layers']} layers: attn "
          f"{chosen['skip_attn']} mlp {chosen['skip_mlp']} (proxy {chosen['search']['proxy']:.3f}, cost "
          f"{chosen['search']['cost']:.3f}, gamma {chosen['exit_threshold']:.3f})")
    print(f"held-out ({args.num_prompts} prompts of {args.prompts}, draft_len {args.draft_len}, draft exit adapt): "
          f"tau {metrics['tau']:.3f}, acceptance {metrics['acceptance_rate']:.3f}, drafter {draft_ms_per_token:.1f} ms "
          f"per drafted token ({metrics['draft_tokens_per_step']:.2f} per step), verify "
          f"{metrics['verify_ms_per_step']:.1f} ms per step, speedup {metrics['speedup']:.3f} "
          f"({metrics['spec_tokens_per_s']:.1f} vs {metrics['ar_tokens_per_s']:.1f} tok/s), greedy_match "
          f"{metrics['greedy_match']}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
