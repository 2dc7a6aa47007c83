"""Distillation experiment: which training signal makes the best drafter for a target?

Trains one drafter per variant with `drafter-train` (in-process, same data, same steps), then evaluates the
untrained drafter and every variant's `best` checkpoint on the same held-out prompts with the same evaluator, and
prints a markdown table: tau, acceptance, speedup, greedy_match, training tokens/s.

    python -m benchmarks.distill --data data/smollm2-sharegpt --steps 150 --variants all

Variants (all on the same cut drafter, draft_len and verification):
  untrained      the cut drafter as is
  ce-reference   plain LM training on the data's own answers (not the target's outputs)
  ce-target      sequence-level KD: CE on the target's own continuations
  tvd, fkl, jsd  token-level KD on online target logits
  accepted_length  minus the expected accepted length per block of draft_len
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from benchmarks.common import median, read_jsonl
from drafter_train.recipes.cli import compose_config
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.evaluation import evaluate_decoding
from drafter_train.targets import eos_token_ids, load_target
from drafter_train.data.training_data import eval_prompt_ids
from drafter_train.recipes.train import train

VARIANTS = {
    "ce-reference": ["loss=ce", "train.response=reference"],
    "ce-target": ["loss=ce"],
    "tvd": ["loss=tvd"],
    "fkl": ["loss=fkl"],
    "jsd": ["loss=jsd"],
    "accepted_length": ["loss=accepted_length"],
}


def training_tokens_per_s(run_dir: Path) -> float:
    rates = [r["train/tokens_per_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/tokens_per_s" in r]
    return median(rates) if rates else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="drafter-datagen output folder")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variants", nargs="+", default=["all"], help=f"'all' or some of {list(VARIANTS)}")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-root", default="checkpoints/experiment")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra drafter-train overrides for every variant")
    args = parser.parse_args()
    names = list(VARIANTS) if args.variants == ["all"] else args.variants
    common = [f"train.data_dir={args.data}", f"train.output_root={args.output_root}", f"train.max_steps={args.steps}",
              "train.eval_at_start=false", "eval.num_prompts=8", "eval.max_new_tokens=48", *args.overrides]
    runs = {}
    for name in names:
        cfg = compose_config("train", [*common, *VARIANTS[name], f"train.run_name={name}"])
        train(cfg)
        runs[name] = Path(args.output_root) / name

    # Final evaluation: every drafter on the same held-out prompts, one process, same target instance.
    cfg = compose_config("train", [*common, f"eval.num_prompts={args.eval_prompts}", f"eval.max_new_tokens={args.max_new_tokens}"])
    target, tokenizer = load_target(cfg.target)
    prompts, eos = eval_prompt_ids(cfg, tokenizer)[0], eos_token_ids(target, tokenizer)
    rows = []
    for name, drafter_cfg in [("untrained", cfg.drafter)] + [
        (n, dataclasses.replace(cfg.drafter, path=str(d / "best" / "drafter"))) for n, d in runs.items()
    ]:
        drafter = load_drafter(drafter_cfg, target, tokenizer, cfg.target.dtype)
        metrics = evaluate_decoding(target, ARDrafter(drafter), prompts, cfg.eval, eos)
        train_tps = training_tokens_per_s(runs[name]) if name in runs else float("nan")
        rows.append({"variant": name, **metrics, "train_tokens_per_s": train_tps})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_position_acceptance"}), flush=True)
    Path(args.output_root).mkdir(parents=True, exist_ok=True)
    (Path(args.output_root) / "results.json").write_text(json.dumps(rows, indent=2))
    print("| variant | tau | acceptance | per-position acceptance | speedup | greedy_match | train tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"| {r['variant']} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | {per_pos} | {r['speedup']:.2f} "
              f"| {r['greedy_match']:.2f} | {r['train_tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
