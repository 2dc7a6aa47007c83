"""Benchmark (issue #12): draft chains vs draft trees for each trained drafter kind, and the calibrated pick.

For every drafter (name=folder) and verification mode (greedy; sample = temperature 1): calibration
(`drafter_train/calibrate.py`, on prompts after the evaluated ones) picks a chain length or tree size, then every
prompt is decoded with plain AR decoding and, in turn, with every setting of the grid (chains, topk trees, an iid
SpecTr tree under sampling, the calibrated pick), interleaved prompt by prompt so load changes hit all of them alike.
For the AR kind, transformers' assisted generation (chains only) runs in the same loop as the reference.
Per setting: tau, acceptance, speedup over AR (tokens/s ratio on the same prompts), verify ms and drafter ms per step.

    python -m benchmarks.trees --drafter ar=checkpoints/bench/ar-ce-ref/best/drafter \\
        --drafter nar=checkpoints/bench/nar-ce-ref/best/drafter --drafter eagle3=/path/to/eagle3/drafter \\
        --output checkpoints/bench/trees.json --markdown checkpoints/bench/trees.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import (ForwardCounter, add_prompt_args, command_line, hf_assisted, load_target_and_prompts,
                               split_name, write_result)
from drafter_train.calibrate import calibrate
from drafter_train.config import CalibrationConfig, DrafterConfig, EvalConfig, TargetConfig, TreeConfig
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.registry import make_drafter, model_kind
from drafter_train.evaluation import calibration_decoder, sampling_params, speculative_runner


def settings(args, mode: str, max_depth: int) -> dict[str, EvalConfig]:
    """The grid: name -> eval config (verify mode, chain or tree), at most max_depth drafts deep."""
    base = EvalConfig(verify="greedy" if mode == "greedy" else "sample", temperature=1.0,
                      max_new_tokens=args.max_new_tokens)
    grid = {f"chain k={k}": replace(base, draft_len=k) for k in args.chains if k <= max_depth}
    for text in args.trees:
        top_k, depth, total = (int(x) for x in text.split("x"))
        if depth <= max_depth:
            grid[f"tree {top_k}x{depth} n={total}"] = replace(base, draft_len=depth,
                                                              tree=TreeConfig(top_k, depth, total))
    if mode == "sample" and args.spectr:
        top_k, depth = (int(x) for x in args.spectr.split("x"))
        depth = min(depth, max_depth)
        grid[f"spectr iid {top_k}x{depth}"] = replace(base, verify="spectr", draft_len=depth,
                                                      tree=TreeConfig(top_k, depth, branching="iid"))
    return grid


def calibrated(args, target, drafter, prompts, eos, mode: str, max_depth: int):
    cal = CalibrationConfig(enabled=True, draft_lens=[k for k in args.chains if k <= max_depth],
                            tree_top_k=args.cal_top_k, tree_depth=[d for d in args.cal_depth if d <= max_depth],
                            tree_sizes=args.cal_sizes, num_prompts=len(prompts),
                            max_new_tokens=args.max_new_tokens, repeats=args.cal_repeats)
    cfg = EvalConfig(verify="greedy" if mode == "greedy" else "sample", temperature=1.0,
                     max_new_tokens=args.max_new_tokens, calibration=cal)
    started = time.perf_counter()
    candidates, costs = calibrate(target, prompts, cfg, calibration_decoder(target, drafter, prompts, eos, cfg))
    return candidates, costs, time.perf_counter() - started


def measure(args, target, drafter, hf_drafter, prompts, eos, grid: dict[str, EvalConfig], mode: str) -> dict:
    """Every setting (and HF assisted generation) on every prompt, interleaved with AR decoding."""
    params = sampling_params(next(iter(grid.values())))
    runners = {name: speculative_runner(target, drafter, cfg, eos) for name, cfg in grid.items()}
    stats = {name: new_stats() for name, (_, new_stats) in runners.items()}
    seconds = {name: 0.0 for name in [*grid, "ar", *(["hf"] if hf_drafter is not None else [])]}
    tokens, matches = dict.fromkeys(seconds, 0), dict.fromkeys(grid, 0)
    counter, hf_passes = ForwardCounter(target), 0
    hf_k = max((cfg.draft_len for name, cfg in grid.items() if name.startswith("chain")), default=4)
    for name, (run, _) in runners.items():  # untimed warm-up of each setting
        run(prompts[0], args.seed)
    for i, prompt in enumerate(prompts):
        gen = torch.Generator().manual_seed(args.seed + i)
        started = time.perf_counter()
        ar = generate_autoregressive(target, prompt, args.max_new_tokens, params, eos, gen).tokens
        seconds["ar"] += time.perf_counter() - started
        tokens["ar"] += len(ar)
        for name, (run, _) in runners.items():
            started = time.perf_counter()
            out = run(prompt, args.seed + i)
            seconds[name] += time.perf_counter() - started
            tokens[name] += len(out.tokens)
            stats[name].merge(out.stats)
            matches[name] += out.tokens == ar
        if hf_drafter is not None:
            torch.manual_seed(args.seed + i)
            before, started = counter.calls, time.perf_counter()
            hf = hf_assisted(target, hf_drafter, prompt, hf_k, args.max_new_tokens, eos,
                             0.0 if mode == "greedy" else 1.0)
            seconds["hf"] += time.perf_counter() - started
            tokens["hf"] += len(hf)
            hf_passes += counter.calls - before
        print(f"  [{mode}] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    counter.handle.remove()
    ar_rate = tokens["ar"] / seconds["ar"]
    rows = {}
    for name, s in stats.items():
        summary = s.summary()
        rows[name] = {"tau": summary["tau"], "acceptance_rate": summary["acceptance_rate"],
                      "speedup": tokens[name] / seconds[name] / ar_rate,
                      "verify_ms": summary["verify_ms_per_step"], "drafter_ms": summary["drafter_ms_per_proposal"],
                      "draft_tokens_per_step": summary["draft_tokens_per_step"],
                      "identical_to_ar": matches[name] / len(prompts) if mode == "greedy" else None}
    if hf_drafter is not None:
        rows[f"HF assisted k={hf_k}"] = {"tau": tokens["hf"] / max(hf_passes, 1),
                                         "speedup": tokens["hf"] / seconds["hf"] / ar_rate}
    return {"ar_tokens_per_s": ar_rate, "rows": rows}


def summarize(result: dict, pick: str) -> dict:
    rows = result["rows"]
    chains = {n: r for n, r in rows.items() if n.startswith("chain")}
    trees = {n: r for n, r in rows.items() if n.startswith(("tree", "spectr"))}
    ours = {n: r for n, r in rows.items() if not n.startswith("HF")}
    best_chain = max(chains, key=lambda n: chains[n]["speedup"])
    best_tree = max(trees, key=lambda n: trees[n]["speedup"])
    best = max(ours, key=lambda n: ours[n]["speedup"])
    return {"best_chain": best_chain, "best_tree": best_tree, "best": best,
            "tree_tau_gain": trees[best_tree]["tau"] / chains[best_chain]["tau"] - 1,
            "max_tree_tau_gain": max(t["tau"] for t in trees.values()) / max(c["tau"] for c in chains.values()) - 1,
            "tree_speedup_gain": trees[best_tree]["speedup"] / chains[best_chain]["speedup"] - 1,
            "pick": pick, "pick_vs_best": rows[pick]["speedup"] / ours[best]["speedup"]}


def markdown(report: dict) -> str:
    lines = []
    for entry in report["results"]:
        lines += [f"### {entry['drafter']} ({entry['kind']}), {entry['mode']}", "",
                  f"AR {entry['ar_tokens_per_s']:.2f} tok/s. Calibration picked **{entry['pick']}** (predicted "
                  f"speedup {entry['pick_predicted_speedup']:.3f}; {entry['calibration_s']:.0f} s).", "",
                  "| setting | τ | α | draft tokens / step | verify ms | drafter ms | speedup | identical |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in entry["rows"].items():
            cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else "–" for k in
                     ("tau", "acceptance_rate", "draft_tokens_per_step", "verify_ms", "drafter_ms", "speedup",
                      "identical_to_ar")]
            lines.append(f"| {name}{' (pick)' if name == entry['pick'] else ''} | " + " | ".join(cells) + " |")
        s = entry["summary"]
        lines += ["", f"Best chain {s['best_chain']}, best tree {s['best_tree']}: τ {s['tree_tau_gain']:+.1%} "
                      f"(largest tree τ over largest chain τ: {s['max_tree_tau_gain']:+.1%}), speedup "
                      f"{s['tree_speedup_gain']:+.1%}. Calibrated pick at {s['pick_vs_best']:.1%} of the best "
                      f"measured setting ({s['best']}).", ""]
    return "\n".join(lines)


TABLE_COLUMNS = ["drafter", "kind", "verify", "setting", "tau", "acceptance", "draft tokens / step", "verify ms",
                 "drafter ms", "speedup", "identical to AR", "calibrated pick"]


def table_rows(report: dict) -> list[list]:
    """One row per drafter, verification mode and setting (the result file's table)."""
    return [[e["drafter"], e["kind"], e["mode"], name, *(r.get(k) for k in (
        "tau", "acceptance_rate", "draft_tokens_per_step", "verify_ms", "drafter_ms", "speedup", "identical_to_ar")),
        "yes" if name == e["pick"] else ""] for e in report["results"] for name, r in e["rows"].items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", action="append", required=True, help="name=folder (repeatable)")
    parser.add_argument("--target", default=TargetConfig.path, help="target.path (default: embedded SmolLM2-135M)")
    parser.add_argument("--no-chat-template", action="store_true")
    add_prompt_args(parser, num_prompts=8)
    parser.add_argument("--calibration-prompts", type=int, default=4, help="taken after the evaluated prompts")
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
    parser.add_argument("--chains", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--trees", nargs="+", default=["2x4x8", "4x4x16", "4x6x24", "8x4x32"],
                        help="top_k x depth x total_tokens")
    parser.add_argument("--spectr", default="4x4", help="top_k x depth of an iid SpecTr tree (sample mode)")
    parser.add_argument("--cal-top-k", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--cal-depth", nargs="+", type=int, default=[4, 6])
    parser.add_argument("--cal-sizes", nargs="+", type=int, default=[4, 6, 8, 12, 16, 24, 32])
    parser.add_argument("--cal-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench_trees.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    target_cfg = TargetConfig(path=args.target, chat_template=not args.no_chat_template)
    target, tokenizer, eos, ids, categories = load_target_and_prompts(target_cfg, args.prompts,
                                                                      args.num_prompts + args.calibration_prompts)
    prompts, cal_prompts = ids[: args.num_prompts], ids[args.num_prompts:]
    report = {"args": vars(args), "categories": sorted({c for c in categories[: args.num_prompts] if c}),
              "torch_threads": torch.get_num_threads(), "results": []}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        model = load_drafter(DrafterConfig(path=path), target, tokenizer, "float32")
        kind = model_kind(model).name
        hf_drafter = model if kind == "ar" else None
        # one-pass kinds draft at most as deep as their trained block (their mask queries)
        max_depth = model.config.draft_len if kind in ("nar", "dflash") else 1 << 30
        for mode in args.modes:
            drafter = make_drafter(model)
            print(f"{name} ({kind}), {mode}: calibrating", file=sys.stderr, flush=True)
            with torch.inference_mode():
                candidates, costs, cal_s = calibrated(args, target, drafter, cal_prompts, eos, mode, max_depth)
                grid = settings(args, mode, max_depth)
                pick = next((n for n, c in grid.items() if c.verify != "spectr" and
                             c.draft_len == candidates[0].draft_len and c.tree == candidates[0].apply(c).tree), None)
                if pick is None:
                    pick = f"pick: {candidates[0].name}"
                    grid[pick] = candidates[0].apply(replace(next(iter(grid.values())), tree=TreeConfig()))
                result = measure(args, target, drafter, hf_drafter, prompts, eos, grid, mode)
            entry = {"drafter": name, "path": path, "kind": kind, "mode": mode, **result, "pick": pick,
                     "pick_predicted_speedup": candidates[0].predicted_speedup, "calibration_s": cal_s,
                     "calibration": {"ar_ms_per_token": costs["ar_ms_per_token"],
                                     "verify_cost_ms": costs["verify_cost_ms"],
                                     "top": [c.name for c in candidates[:5]]}}
            entry["summary"] = summarize(result, pick)
            report["results"].append(entry)
            Path(args.output).write_text(json.dumps(report, indent=2))
    report["load_average"] = {"before": load_before, "after": os.getloadavg()}
    Path(args.output).write_text(json.dumps(report, indent=2))
    text = markdown(report) + (f"\nload average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
                               f"torch threads {torch.get_num_threads()}\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    write_result(
        "trees", title="Draft chains against draft trees, and the calibrated pick",
        question="For each drafter kind, do draft trees beat chains, and how close does calibration's pick come to the "
                 "best measured setting?",
        command=command_line("trees"), split=split_name(args.prompts, args.num_prompts) + (
            f"; calibration on the {args.calibration_prompts} prompts after them"),
        baseline="plain decoding in this project's decoder, interleaved prompt by prompt in the same process",
        columns=TABLE_COLUMNS, rows=table_rows(report),
        notes=f"{args.max_new_tokens} new tokens per prompt; sample mode: temperature 1, seed {args.seed}.")


if __name__ == "__main__":
    main()
