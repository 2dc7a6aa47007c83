"""Benchmark: DFlash drafters (block sizes x depths) against EAGLE-3 and the stand-alone Spec-Drafter (nar), all
trained for the same wall-clock on the same data, then decoded with the same evaluator on held-out prompts.

1. Equal training wall-clock: each configuration first runs --calibration-steps steps in a throwaway run (after one
   warm-up step) to measure its seconds per step on this machine now; its real run gets
   max_steps = --minutes * 60 / (seconds per step), so every drafter trains for about --minutes minutes (the LR
   schedule fits the steps). DFlash and EAGLE-3 read the offline feature cache of the same target layers (extracted
   once, shared); nar computes its teacher online (it reads no features), which is part of its cost.
2. Evaluation: every drafter at every draft length it supports from --draft-lens (DFlash: <= block - 1; nar: <= the
   draft length it was trained for), greedy, interleaved with AR decoding prompt by prompt (speedup measured in the
   same run); then each drafter at its best greedy draft length (highest speedup) with verify=sample at
   temperature 1. Reported: tau, per-position acceptance, drafter ms per proposal, speedup, greedy_match.

    python scripts/bench_dflash.py --data data/ref1k --minutes 10
Results: <output-root>/results.json and a markdown table on stdout (with the load average).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from drafter_train.config import CONF_DIR, register_configs  # noqa: E402
from drafter_train.drafters.loading import load_drafter  # noqa: E402
from drafter_train.drafters.registry import make_drafter  # noqa: E402
from drafter_train.evaluate import evaluate_decoding  # noqa: E402
from drafter_train.targets import eos_token_ids, load_target  # noqa: E402
from drafter_train.train import eval_prompt_ids, train  # noqa: E402


def compose_train(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose("train", overrides=overrides))


def configurations(args) -> dict[str, list[str]]:
    """name -> drafter-train overrides of each drafter compared."""
    layers = f"drafter.target_layers=[{','.join(map(str, args.target_layers))}]"
    features = ["drafter.features=offline", layers, f"drafter.draft_vocab_size={args.draft_vocab_size}"]
    runs = {"eagle3": ["drafter=eagle3", "drafter.path=new", f"drafter.draft_len={args.eagle3_draft_len}",
                       *features],
            "nar": ["drafter=nar", f"drafter.path=truncated:{args.nar_layers}", f"drafter.draft_len={args.nar_draft_len}"]}
    for block in args.blocks:
        for depth in args.layers:
            runs[f"dflash-b{block}-l{depth}"] = [
                "drafter=dflash", "drafter.path=new", f"drafter.block_size={block}", f"drafter.num_layers={depth}",
                f"drafter.draft_len={block - 1}", *features]
    return {name: overrides for name, overrides in runs.items() if not args.only or name in args.only}


def seconds_per_step(common: list[str], overrides: list[str], root: Path, steps: int) -> float:
    """Wall-clock of `steps` optimizer steps after one warm-up step, in a throwaway run (from the times metrics.jsonl
    logs every step)."""
    shutil.rmtree(root, ignore_errors=True)
    cfg = compose_train([*common, *overrides, f"train.output_root={root}", "train.run_name=calibrate",
                         f"train.max_steps={steps + 1}", f"train.save_every={steps + 1}", "train.log_every=1"])
    train(cfg)
    rows = [json.loads(line) for line in (root / "calibrate" / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["time"] for r in rows if "train/loss" in r]
    shutil.rmtree(root, ignore_errors=True)
    return (seconds[-1] - seconds[0]) / steps


def supported(name: str, cfg, draft_lens: list[int]) -> list[int]:
    limit = cfg.drafter.draft_len if name == "nar" else cfg.drafter.block_size - 1 if name.startswith("dflash") \
        else max(draft_lens)
    return [k for k in draft_lens if k <= limit]


def evaluate(target, drafter, prompts, eval_cfg, eos, **changes) -> dict:
    metrics = evaluate_decoding(target, make_drafter(drafter), prompts[0], dataclasses.replace(eval_cfg, **changes),
                                eos, progress=False, categories=prompts[1])
    keep = ("tau", "acceptance_rate", "per_position_acceptance", "drafter_ms_per_proposal", "verify_ms_per_step",
            "speedup", "spec_tokens_per_s", "ar_tokens_per_s", "greedy_match", "out_of_draft_vocab", "verify",
            "draft_len")
    return {k: metrics.get(k) for k in keep}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="drafter-datagen output folder")
    parser.add_argument("--response", default="reference", help="train.response: target or reference")
    parser.add_argument("--minutes", type=float, default=10.0, help="training wall-clock per drafter")
    parser.add_argument("--calibration-steps", type=int, default=3)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3], help="DFlash depths")
    parser.add_argument("--target-layers", type=int, nargs="+", default=[2, 15, 27],
                        help="target layers DFlash and EAGLE-3 fuse (one feature cache for all)")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--eagle3-draft-len", type=int, default=4, help="EAGLE-3's training draft length")
    parser.add_argument("--nar-layers", type=int, default=2)
    parser.add_argument("--nar-draft-len", type=int, default=7, help="nar's mask queries (its longest draft)")
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[3, 7, 15])
    parser.add_argument("--prompts", default="prompts/heldout-mix.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-root", default="checkpoints/dflash-bench")
    parser.add_argument("--only", nargs="*", default=[], help="run only these configurations (names as reported)")
    parser.add_argument("--overrides", nargs="*", default=[], help="drafter-train overrides for every run")
    args = parser.parse_args()
    root = Path(args.output_root)
    common = [f"train.data_dir={args.data}", f"train.response={args.response}", "loss=fkl", "train.batch_size=8",
              "train.lr=2e-3", "train.warmup_steps=5", "train.eval_at_start=false", "eval.num_prompts=1",
              "eval.max_new_tokens=8", f"eval.prompts={args.prompts}", *args.overrides]
    results_file = root / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {"training": {}, "rows": []}

    # ---- 1. train every drafter for the same wall-clock ----
    runs = {}
    for name, overrides in configurations(args).items():
        cfg = compose_train([*common, *overrides, f"train.output_root={root}", f"train.run_name={name}"])
        if name not in results["training"]:
            per_step = seconds_per_step(common, overrides, root / "calibration", args.calibration_steps)
            steps = max(int(args.minutes * 60 / per_step), 1)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps, save_every=steps))
            began = time.perf_counter()
            train(cfg)
            results["training"][name] = {"seconds_per_step": per_step, "steps": steps,
                                         "train_seconds": time.perf_counter() - began, "load_avg": os.getloadavg()}
            results_file.parent.mkdir(parents=True, exist_ok=True)
            results_file.write_text(json.dumps(results, indent=2))
            print(f"trained {name}: {steps} steps at {per_step:.1f} s/step", flush=True)
        runs[name] = cfg

    # ---- 2. evaluate: greedy at every supported draft length, then sampling at the best ----
    any_cfg = next(iter(runs.values()))
    eval_cfg = dataclasses.replace(any_cfg.eval, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                                   warmup=1)
    target, tokenizer = load_target(any_cfg.target)
    prompts = eval_prompt_ids(dataclasses.replace(any_cfg, eval=eval_cfg), tokenizer)
    eos = eos_token_ids(target, tokenizer)
    done = {(r["drafter"], r["draft_len"], r["verify"]) for r in results["rows"]}
    for name, cfg in runs.items():
        best = root / name / "best" / "drafter"
        drafter = load_drafter(dataclasses.replace(cfg.drafter, path=str(best)), target, tokenizer, "float32")
        greedy = []
        for k in supported(name, cfg, args.draft_lens):
            if (name, k, "greedy") not in done:
                results["rows"].append(dict(evaluate(target, drafter, prompts, eval_cfg, eos, draft_len=k),
                                            drafter=name, load_avg=os.getloadavg()))
                results_file.write_text(json.dumps(results, indent=2))
                print(json.dumps(results["rows"][-1]), flush=True)
            greedy += [r for r in results["rows"] if r["drafter"] == name and r["verify"] == "greedy"
                       and r["draft_len"] == k]
        k_best = max(greedy, key=lambda r: r["speedup"])["draft_len"]
        if (name, k_best, "sample") not in done:
            results["rows"].append(dict(evaluate(target, drafter, prompts, eval_cfg, eos, draft_len=k_best,
                                                 verify="sample", temperature=1.0), drafter=name,
                                        load_avg=os.getloadavg()))
            results_file.write_text(json.dumps(results, indent=2))

    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; training: "
          + ", ".join(f"{n} {t['steps']} steps x {t['seconds_per_step']:.1f} s" for n, t in results["training"].items()))
    print("| drafter | verify | draft_len | tau | per-position acceptance | drafter ms / proposal | speedup | greedy_match |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        pp = ", ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        match = "" if r["greedy_match"] is None else f"{r['greedy_match']:.2f}"
        print(f"| {r['drafter']} | {r['verify']} | {r['draft_len']} | {r['tau']:.2f} | {pp} | "
              f"{r['drafter_ms_per_proposal']:.1f} | {r['speedup']:.2f} | {match} |")


if __name__ == "__main__":
    main()
