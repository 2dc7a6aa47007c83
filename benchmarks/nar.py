"""Benchmark: Spec-Drafter (NAR, one pass per proposal) against an AR drafter of about the same size.

Both are cut from the target's first layers and trained with the same trainer, data, loss and steps; the AR drafter
once (its training does not depend on draft_len), one NAR drafter per draft_len (its block size). Then, per draft_len,
both are evaluated with the same evaluator on the same held-out prompts, interleaved, `--repeats` times: tau,
acceptance, drafter milliseconds per proposal and speedup over plain AR decoding measured in the same run; medians
are printed as a markdown table and stored in <output-root>/results.json.

    python -m benchmarks.nar --data data/smollm2-sharegpt --steps 180 --draft-lens 2 4 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from drafter_train.recipes.cli import compose_config
from drafter_train.drafters.registry import make_drafter
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.evaluation import evaluate_decoding
from drafter_train.targets import eos_token_ids, load_target
from drafter_train.data.training_data import eval_prompt_ids
from drafter_train.recipes.train import train


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="drafter-datagen output folder")
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--layers", type=int, default=2, help="layers cut from the target for both drafters")
    parser.add_argument("--encoder-layers", type=int, nargs="+", default=[0],
                        help="NAR variants: of the layers, how many only read the context (SpecDec's encoder)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-root", default="checkpoints/nar-bench")
    parser.add_argument("--overrides", nargs="*", default=[], help="drafter-train overrides for every run")
    parser.add_argument("--nar-overrides", nargs="*", default=[], help="extra overrides for the NAR runs")
    args = parser.parse_args()
    common = [f"train.data_dir={args.data}", f"train.output_root={args.output_root}", f"train.max_steps={args.steps}",
              f"train.save_every={args.steps}", "train.eval_at_start=false", "eval.num_prompts=4",
              "eval.max_new_tokens=32", f"drafter.path=truncated:{args.layers}", *args.overrides]
    runs = {"ar": compose_config("train", [*common, "drafter=truncated"])}
    for k in args.draft_lens:
        for enc in args.encoder_layers:
            name = f"nar-k{k}" + (f"-enc{enc}" if len(args.encoder_layers) > 1 else "")
            runs[name] = compose_config("train", [*common, "drafter=nar", f"drafter.draft_len={k}", f"drafter.encoder_layers={enc}",
                                        *([f"train.run_name=nar-k{k}-enc{enc}"] if enc else []), *args.nar_overrides])
    for name, cfg in runs.items():  # resume=auto: a finished run returns at once
        start = time.perf_counter()
        train(cfg)
        print(f"trained {name} in {time.perf_counter() - start:.0f} s", flush=True)

    cfg = runs["ar"]
    eval_cfg = dataclasses.replace(cfg.eval, num_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens)
    target, tokenizer = load_target(cfg.target)
    prompts = eval_prompt_ids(dataclasses.replace(cfg, eval=eval_cfg), tokenizer)[0]
    eos = eos_token_ids(target, tokenizer)
    models = {}
    for name, run_cfg in runs.items():
        best = Path(run_cfg.train.output_root) / run_cfg.train.run_name / "best" / "drafter"
        models[name] = load_drafter(dataclasses.replace(run_cfg.drafter, path=str(best)), target, tokenizer, "float32")
    rows = []
    for k in args.draft_lens:
        samples = {"ar": [], **{name: [] for name in runs if name.startswith(f"nar-k{k}")}}
        for repeat in range(args.repeats):  # interleaved, so a load change hits both drafters alike
            for name in samples:
                metrics = evaluate_decoding(target, make_drafter(models[name]), prompts,
                                            dataclasses.replace(eval_cfg, draft_len=k), eos, progress=False)
                samples[name].append(metrics)
                print(json.dumps({"draft_len": k, "drafter": name, "repeat": repeat,
                                  **{m: metrics[m] for m in ("tau", "speedup", "drafter_ms_per_proposal",
                                                             "greedy_match")}}), flush=True)
        for name, runs_k in samples.items():
            enc = runs[name].drafter.encoder_layers if name != "ar" else 0
            label = "ar" if name == "ar" else f"nar (encoder {enc} + decoder {args.layers - enc})"
            row = {"draft_len": k, "drafter": label, "params": parameter_count(models[name])}
            for metric in ("tau", "acceptance_rate", "speedup", "drafter_ms_per_proposal", "spec_tokens_per_s",
                           "ar_tokens_per_s"):
                row[metric] = statistics.median(m[metric] for m in runs_k)
            row["greedy_match"] = min(m["greedy_match"] for m in runs_k)
            row["per_position_acceptance"] = runs_k[0]["per_position_acceptance"]
            rows.append(row)
    out = Path(args.output_root)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "load_avg": os.getloadavg(), "rows": rows}, indent=2))
    print(f"\nmedians of {args.repeats} runs; load average at the end {os.getloadavg()[0]:.2f}")
    print("| draft_len | drafter | params | tau | acceptance | drafter ms / proposal | speedup | greedy_match |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['draft_len']} | {r['drafter']} | {r['params'] / 1e6:.1f}M | {r['tau']:.2f} | "
              f"{r['acceptance_rate']:.3f} | {r['drafter_ms_per_proposal']:.1f} | {r['speedup']:.2f} | "
              f"{r['greedy_match']:.2f} |")


if __name__ == "__main__":
    main()
