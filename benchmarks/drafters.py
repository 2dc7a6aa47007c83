"""Benchmark: drafter kinds trained for the SAME wall-clock budget, evaluated side by side on held-out prompts.

For each kind (default: eagle3, the best stand-alone AR drafter (`truncated:N`) and the SpecDec `nar` drafter) a
short probe run measures seconds per optimizer step; the kind is then trained for `--budget-min` minutes of wall
clock (for eagle3 with offline features, extracting the feature cache counts in its budget: that is what a user
pays for a first run; with --one-off-outside-budget it is reported but not charged, as for a cache that many runs
reuse). Every trained drafter, plus prompt lookup (`ngram`, untrained), is evaluated at each `--draft-lens` value on
the same prompts with the project's evaluator, `--repeats` times interleaved; the medians of tau, acceptance,
per-position acceptance, drafter ms per proposal, verify ms per step and speedup over plain decoding (measured in the
same run) are printed as a markdown table and stored in <output-root>/results-<verify>.json, with the load average.
A kind whose budget run an earlier invocation finished is not trained again (its bench-training.json), so a
second invocation with `--verify sample` evaluates the same drafters at temperature 1.
`--kinds` also takes the DFlash configurations dflash-b{8,16}-l{1,2,3} (block size, depth; fkl on offline features),
each evaluated at the draft lengths its block holds (<= block - 1):

    python -m benchmarks.drafters --data data/ref1k --budget-min 10 --kinds eagle3 nar dflash-b8-l1 dflash-b16-l1 \
        dflash-b16-l2 dflash-b16-l3 --draft-lens 3 4 7 15

    python -m benchmarks.drafters --data data/ref1k --budget-min 20 --draft-lens 2 3 4 6 8 \
        --prompts test --num-prompts 16 --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import OUR_BASELINE, add_prompt_args, command_line, markdown_table, split_name, write_result
from drafter_train.recipes.cli import compose_config
from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.registry import make_drafter
from drafter_train.evaluation import evaluate_decoding
from drafter_train.targets import eos_token_ids, load_target
from drafter_train.data.training_data import eval_prompt_ids
from drafter_train.recipes.train import train

KINDS = {
    # the main job's recipe (1 TTT step, 4096-token head), and the same with 3 TTT steps for longer chains
    "eagle3": ["drafter=eagle3", "drafter.path=new", "drafter.features=offline", "drafter.ttt_steps=1",
               "drafter.draft_vocab_size=4096", "loss=fkl"],
    "eagle3-t3": ["drafter=eagle3", "drafter.path=new", "drafter.features=offline", "drafter.ttt_steps=3",
                  "drafter.draft_vocab_size=4096", "loss=fkl"],
    "ar": ["drafter=truncated", "drafter.path=truncated:2", "loss=ce"],
    "nar": ["drafter=nar", "drafter.path=truncated:2", "loss=ce"],
}
DEFAULT_KINDS = ["eagle3", "ar", "nar"]
# DFlash (issue 11): block sizes 8 and 16 at depths 1-3, on offline features; each drafts at most block - 1 tokens.
DFLASH_MAX_DRAFT = {f"dflash-b{block}-l{depth}": block - 1 for block in (8, 16) for depth in (1, 2, 3)}
KINDS.update({name: ["drafter=dflash", "drafter.path=new", f"drafter.block_size={limit + 1}",
                     f"drafter.num_layers={name[-1]}", f"drafter.draft_len={limit}", "drafter.features=offline",
                     "loss=fkl"] for name, limit in DFLASH_MAX_DRAFT.items()})
COLUMNS = ["draft_len", "drafter", "tau", "acceptance", "per-position acceptance", "drafter ms / proposal",
           "verify ms / step", "speedup", "greedy_match"]
METRICS = ("tau", "acceptance_rate", "speedup", "drafter_ms_per_proposal", "verify_ms_per_step", "spec_tokens_per_s",
           "ar_tokens_per_s")


def timed_train(overrides: list[str]) -> float:
    start = time.perf_counter()
    train(compose_config("train", overrides))
    return time.perf_counter() - start


def train_for_budget(name: str, overrides: list[str], args) -> dict:
    """Measure the one-off cost (feature extraction: the first run), the fixed cost of a run (loading) and the
    seconds per optimizer step, then train a fresh run for as many steps as the budget leaves."""
    common = [f"train.data_dir={args.data}", f"train.output_root={args.output_root}", "train.eval_at_start=false",
              f"train.response={args.response}", f"train.batch_size={args.batch_size}", f"train.lr={args.lr}",
              "eval.num_prompts=2", "eval.max_new_tokens=8", *overrides, *args.overrides]

    run = f"{name}-budget{args.budget_min:g}m"
    record = Path(args.output_root) / run / "bench-training.json"
    recipe = {"data": str(args.data), "overrides": [*overrides, *args.overrides]}
    if record.exists():  # trained by an earlier invocation: evaluate it again (e.g. sampling), if it is the same recipe
        saved = json.loads(record.read_text())
        if {k: saved.get(k) for k in recipe} != recipe:
            raise SystemExit(f"{record.parent} was trained on other data or overrides; use another --output-root")
        print(f"{name}: reusing {record.parent}", flush=True)
        return {**saved, "cfg": compose_config("train", [*common, f"train.run_name={run}"])}

    def probe(tag: str, steps: int) -> float:
        shutil.rmtree(Path(args.output_root) / f"{name}-{tag}", ignore_errors=True)  # else the run would resume
        return timed_train([*common, f"train.run_name={name}-{tag}", f"train.max_steps={steps}",
                            f"train.save_every={steps}"])

    first, one, many = probe("probe-a", 1), probe("probe-b", 1), probe("probe-c", 1 + args.probe_steps)
    per_step = (many - one) / args.probe_steps
    one_off, fixed = first - one, one - per_step
    charged = 0.0 if args.one_off_outside_budget else one_off
    steps = max(int((args.budget_min * 60 - charged - fixed) / per_step), 1)
    seconds = timed_train([*common, f"train.run_name={run}", f"train.max_steps={steps}", f"train.save_every={steps}"])
    print(f"{name}: one-off {one_off:.0f} s, fixed {fixed:.0f} s, {per_step:.2f} s/step, trained {steps} steps "
          f"in {seconds:.0f} s", flush=True)
    info = {"run": run, "steps": steps, "seconds_per_step": per_step, "one_off_s": one_off, "fixed_s": fixed,
            "train_s": seconds, "one_off_charged": bool(charged), **recipe}
    record.write_text(json.dumps(info, indent=2))
    return {**info, "cfg": compose_config("train", [*common, f"train.run_name={run}"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="drafter-datagen output folder")
    parser.add_argument("--response", default="reference", help="train.response (reference: fixed answers)")
    parser.add_argument("--kinds", nargs="+", default=DEFAULT_KINDS, choices=list(KINDS))
    parser.add_argument("--budget-min", type=float, default=20.0, help="training wall-clock per kind, minutes")
    parser.add_argument("--probe-steps", type=int, default=5)
    parser.add_argument("--one-off-outside-budget", action="store_true",
                        help="do not charge a one-off cost (the feature cache, reused by later runs on the same "
                             "data) to the training budget; it is still reported")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--verify", default="greedy", choices=["greedy", "sample"],
                        help="eval.verify of the evaluations (sample: temperature --temperature)")
    parser.add_argument("--temperature", type=float, default=1.0)
    add_prompt_args(parser, max_new_tokens=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-root", default="checkpoints/drafter-bench")
    parser.add_argument("--overrides", nargs="*", default=[], help="drafter-train overrides for every run")
    args = parser.parse_args()

    # the Spec-Drafter has one mask query per draft: it is trained with as many as the longest draft evaluated
    longest = [f"drafter.draft_len={max(args.draft_lens)}"]
    trained = {name: train_for_budget(name, KINDS[name] + (longest if name == "nar" else []), args)
               for name in args.kinds}
    cfg = next(iter(trained.values()))["cfg"]
    eval_cfg = dataclasses.replace(cfg.eval, prompts=args.prompts, num_prompts=args.num_prompts,
                                   max_new_tokens=args.max_new_tokens, warmup=1, verify=args.verify,
                                   temperature=args.temperature)
    target, tokenizer = load_target(cfg.target)
    prompts, categories = eval_prompt_ids(dataclasses.replace(cfg, eval=eval_cfg), tokenizer)
    eos = eos_token_ids(target, tokenizer)
    models = {"ngram": load_drafter(NgramDrafterConfig(), target, tokenizer, "float32")}
    for name, info in trained.items():
        best = Path(args.output_root) / info["run"] / "best" / "drafter"
        models[name] = load_drafter(dataclasses.replace(info["cfg"].drafter, path=str(best)), target, tokenizer,
                                    "float32")
    out = Path(args.output_root)
    out.mkdir(parents=True, exist_ok=True)
    training = {name: {k: v for k, v in info.items() if k != "cfg"} for name, info in trained.items()}
    rows = []
    for k in args.draft_lens:
        samples = {name: [] for name in models}
        for repeat in range(args.repeats):  # interleaved, so a load change hits every drafter alike
            for name, model in models.items():
                if k > DFLASH_MAX_DRAFT.get(name, k):
                    continue
                metrics = evaluate_decoding(target, make_drafter(model), prompts,
                                            dataclasses.replace(eval_cfg, draft_len=k), eos, progress=False,
                                            categories=categories)
                samples[name].append(metrics)
                print(json.dumps({"draft_len": k, "drafter": name, "repeat": repeat,
                                  **{m: round(metrics[m], 3) for m in ("tau", "speedup", "drafter_ms_per_proposal")}}),
                      flush=True)
        for name, runs in samples.items():
            if not runs:
                continue
            row = {"draft_len": k, "drafter": name, **{m: statistics.median(r[m] for r in runs) for m in METRICS}}
            row["per_position_acceptance"] = [statistics.median(r["per_position_acceptance"][i] for r in runs)
                                              for i in range(k)]
            matches = [r["greedy_match"] for r in runs if r["greedy_match"] is not None]  # None when sampling
            row["greedy_match"] = min(matches) if matches else None
            row["per_category_tau"] = {c: statistics.median(r["per_category"][c]["tau"] for r in runs)
                                       for c in runs[0]["per_category"]}
            row["out_of_draft_vocab"] = runs[0]["out_of_draft_vocab"]
            rows.append(row)
        # written after every draft length, so a run that stops later keeps what it measured
        (out / f"results-{args.verify}.json").write_text(json.dumps(
            {"args": vars(args), "load_avg_end": os.getloadavg(), "training": training, "rows": rows}, indent=2))
    print(f"\nmedians of {args.repeats} runs; load average at the end {os.getloadavg()[0]:.2f}")
    table = [[r["draft_len"], r["drafter"], r["tau"], r["acceptance_rate"],
              " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]), r["drafter_ms_per_proposal"],
              r["verify_ms_per_step"], r["speedup"], r["greedy_match"]] for r in rows]
    print(markdown_table(COLUMNS, table))
    budget = "feature cache outside the budget" if args.one_off_outside_budget else "feature cache charged"
    write_result(
        f"drafters-{args.verify}", title=f"Drafter kinds trained for the same wall clock ({args.verify} verification)",
        question=f"Trained for {args.budget_min:g} minutes each on the same data, which drafter kind decodes "
                 "fastest, at which draft length?",
        command=command_line("drafters"), split=split_name(args.prompts, args.num_prompts),
        baseline=OUR_BASELINE.format(kernels=cfg.target.cpu_kernels), columns=COLUMNS, rows=table,
        notes=f"Medians of {args.repeats} interleaved repeats; {args.max_new_tokens} new tokens per prompt; training "
              f"data {args.data} ({args.response} answers), {budget}; ngram is untrained prompt lookup.")

if __name__ == "__main__":
    main()
