"""Benchmark: PyTorch's default CPU kernels vs the project's (target.cpu_kernels), side by side in one process.

Settings: "default" (PyTorch's MKL Linear, transformers' sdpa attention), "onednn-linears" (oneDNN Linear layers,
transformers' sdpa attention), "onednn" (oneDNN Linear layers and grouped attention: target.cpu_kernels=onednn) and
"auto" (per row count the faster of the two Linear kernels, timed at load, and grouped attention:
target.cpu_kernels=auto, the default).
1. The verify-cost curve: one target forward over n new tokens after a cached 256-token prefix, relative to n = 1
   (the ratio speculative decoding lives on), for every setting, interleaved, medians over repeats.
2. Plain decoding tokens/s and speculative decoding (evaluate_decoding: tau, speedup over plain decoding with the
   SAME kernels) for each drafter given, per setting, interleaved over repeats.
3. With --profile N...: where a forward over N new tokens spends its time (torch.profiler, self CPU time per op):
   Linear layers, attention, and everything else, per setting.

    python -m benchmarks.kernels --drafters ngram checkpoints/RUN/best/drafter --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.common import add_prompt_args, command_line, forward_ms, split_name, write_result
from drafter_train.machine import machine_info
from drafter_train.config import DrafterConfig, EvalConfig, TargetConfig
from drafter_train.cpu_kernels import row_policy, use_grouped_attention
from drafter_train.data.prompts import load_prompt_records
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.drafters.registry import make_drafter
from drafter_train.evaluation import evaluate_decoding
from drafter_train.targets import encode_prompt, eos_token_ids, load_target

SIZES = (1, 2, 3, 5, 9, 17)
# setting -> (target.cpu_kernels, grouped attention)
SETTINGS = {"default": ("default", False), "onednn-linears": ("onednn", False), "onednn": ("onednn", True),
            "auto": ("auto", True)}


# profiler op names -> the part of a forward they belong to (self time; anything else is "other")
OP_PARTS = {"linear": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"),
            "attention": ("scaled_dot_product", "flash_attention")}


def time_split(target, n: int, passes: int = 5) -> dict:
    """Milliseconds per forward over n new tokens in Linear layers, attention and the rest: profiler self CPU time,
    the mean of `passes` profiled forwards."""
    from torch.profiler import ProfilerActivity, profile

    forward_ms(target, n, seed=7)  # warm-up
    parts = {"linear": 0.0, "attention": 0.0, "other": 0.0}
    for i in range(passes):
        prof = profile(activities=[ProfilerActivity.CPU])
        forward_ms(target, n, seed=100 + i, profiler=prof)
        for event in prof.key_averages():
            part = next((k for k, names in OP_PARTS.items() if any(x in event.key for x in names)), "other")
            parts[part] += event.self_cpu_time_total / 1000 / passes
    return parts


def drafter_cfg(spec: str):
    """"ngram" or a saved drafter folder (any kind) -> the drafter config that loads it."""
    return NgramDrafterConfig() if spec == "ngram" else DrafterConfig(kind="auto", path=spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=TargetConfig().path)
    parser.add_argument("--drafters", nargs="*", default=["ngram"], help='"ngram" or a saved drafter folder')
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--curve-repeats", type=int, default=15, help="forwards per size and repeat")
    add_prompt_args(parser)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--eval", nargs="*", default=[], help="EvalConfig fields as key=value (e.g. draft_exit=0.5)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--profile", nargs="*", type=int, default=[], help="token counts to split by op")
    parser.add_argument("--output", default="bench_kernels.json")
    args = parser.parse_args()

    targets = {}
    for name in args.settings:
        kernels, grouped = SETTINGS[name]
        targets[name] = load_target(TargetConfig(path=args.target, cpu_kernels=kernels))
        use_grouped_attention(targets[name][0], "onednn" if grouped else "default")
    curve = {k: {n: [] for n in SIZES} for k in targets}
    for repeat in range(args.repeats):  # interleaved: a load change hits both settings alike
        for k, (target, _) in targets.items():
            forward_ms(target, 1, seed=99)  # warm-up
            for n in SIZES:
                curve[k][n] += [forward_ms(target, n, seed=repeat * 1000 + i) for i in range(args.curve_repeats)]
    result = {"machine": machine_info(torch.device("cpu"), "float32"), "load_avg": os.getloadavg(), "curve": {},
              "decoding": [], "kernels_by_rows": {}}
    for k, (target, _) in targets.items():
        policy = row_policy(target)
        result["kernels_by_rows"][k] = policy.describe() if policy else "default"
        print(k, "Linear kernels by rows:", result["kernels_by_rows"][k], flush=True)
    for k in targets:
        one = statistics.median(curve[k][1])
        result["curve"][k] = {"n1_ms": one, **{f"x{n}": statistics.median(curve[k][n]) / one for n in SIZES[1:]}}
        print(k, f"n=1 {one:.1f} ms", " ".join(f"n={n} x{statistics.median(curve[k][n]) / one:.2f}"
                                             for n in SIZES[1:]), flush=True)

    result["profile"] = {k: {n: time_split(target, n) for n in args.profile} for k, (target, _) in targets.items()}
    for k, rows in result["profile"].items():
        for n, parts in rows.items():
            total = sum(parts.values())
            print(k, f"n={n}: {total:.1f} ms profiled,",
                  ", ".join(f"{part} {ms:.1f} ms ({ms / total:.0%})" for part, ms in parts.items()), flush=True)

    fields = {key: type(getattr(EvalConfig(), key))(value) for key, value in (kv.split("=", 1) for kv in args.eval)}
    # speedup over plain decoding with the SAME kernels: this benchmark compares the settings themselves
    eval_cfg = EvalConfig(prompts=args.prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                          draft_len=args.draft_len, **{"baseline_kernels": "same", **fields})
    any_target, tokenizer = next(iter(targets.values()))  # every setting loads the same model and tokenizer
    records = load_prompt_records(args.prompts, args.num_prompts, None)
    prompts = [encode_prompt(tokenizer, text, True) for text, _ in records]
    eos = eos_token_ids(any_target, tokenizer)
    for spec in args.drafters:
        runs = {k: [] for k in targets}
        drafters = {k: make_drafter(load_drafter(drafter_cfg(spec), target, tok, "float32"), SETTINGS[k][0])
                    for k, (target, tok) in targets.items()}  # loaded once per setting, reused by every repeat
        for repeat in range(args.repeats):
            for k, (target, _) in targets.items():
                metrics = evaluate_decoding(target, drafters[k], prompts, eval_cfg, eos, progress=False)
                runs[k].append(metrics)
                print(json.dumps({"drafter": spec, "kernels": k, "repeat": repeat,
                                  **{m: round(metrics[m], 3) for m in ("tau", "speedup", "ar_tokens_per_s")}}),
                      flush=True)
        for k, rs in runs.items():
            row = {"drafter": spec, "kernels": k, **{m: statistics.median(r[m] for r in rs) for m in (
                "tau", "speedup", "ar_tokens_per_s", "spec_tokens_per_s", "drafter_ms_per_proposal",
                "verify_ms_per_step")}, "greedy_match": min(r["greedy_match"] or 0 for r in rs)}
            result["decoding"].append(row)
            print(json.dumps({m: round(v, 3) if isinstance(v, float) else v for m, v in row.items()}), flush=True)
    result["load_avg_end"] = os.getloadavg()
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    write_result(
        "kernels", title="CPU kernels: PyTorch's defaults against target.cpu_kernels",
        question="How much do the project's CPU kernel choices flatten the verify-cost curve and speed decoding up?",
        command=command_line("kernels"), split=split_name(args.prompts, args.num_prompts),
        baseline="plain decoding in this project's decoder with the SAME kernels, same process; 'verify n / 1': a "
                 "forward over n new tokens after a cached 256-token prefix against a 1-token one",
        columns=KERNEL_COLUMNS, rows=kernel_rows(result), machine={**result["machine"], "load_average":
                                                                   [round(x, 2) for x in result["load_avg_end"]]},
        notes=f"Medians of {args.repeats} interleaved repeats; draft_len {args.draft_len}, "
              f"{args.max_new_tokens} new tokens per prompt.")


KERNEL_COLUMNS = ["drafter", "kernels", "tau", "speedup", "plain tok/s", "verify 3 / 1", "verify 5 / 1",
                  "verify 9 / 1"]


def kernel_rows(result: dict) -> list[list]:
    """Per drafter and setting: tau, speedup and plain tokens/s, with the setting's verify-cost ratios."""
    return [[row["drafter"], row["kernels"], row["tau"], row["speedup"], row["ar_tokens_per_s"],
             *(result["curve"][row["kernels"]][f"x{n}"] for n in (3, 5, 9))] for row in result["decoding"]]


if __name__ == "__main__":
    main()
