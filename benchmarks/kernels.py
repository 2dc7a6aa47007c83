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

    python scripts/bench_kernels.py --drafters ngram checkpoints/RUN/best/drafter --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from drafter_train.calibrate import machine_info  # noqa: E402
from drafter_train.config import DrafterConfig, EvalConfig, TargetConfig  # noqa: E402
from drafter_train.drafters.ngram.config import NgramDrafterConfig
from drafter_train.cpu_kernels import row_policy, use_grouped_attention  # noqa: E402
from drafter_train.data.prompts import load_prompt_records  # noqa: E402
from drafter_train.drafters.common.loading import load_drafter  # noqa: E402
from drafter_train.drafters.registry import make_drafter  # noqa: E402
from drafter_train.recipes.evaluate import evaluate_decoding  # noqa: E402
from drafter_train.targets import encode_prompt, eos_token_ids, load_target  # noqa: E402

SIZES = (1, 2, 3, 5, 9, 17)
# setting -> (target.cpu_kernels, grouped attention)
SETTINGS = {"default": ("default", False), "onednn-linears": ("onednn", False), "onednn": ("onednn", True),
            "auto": ("auto", True)}


# profiler op names -> the part of a forward they belong to (self time; anything else is "other")
OP_PARTS = {"linear": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"),
            "attention": ("scaled_dot_product", "flash_attention")}


@torch.inference_mode()
def forward_ms(target, n: int, prefix: int = 256, seed: int = 0, profiler=None) -> float:
    """One forward over n new tokens after a cached prefix of random tokens, milliseconds (only that forward runs
    inside `profiler`, a torch.profiler.profile, when given)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.get_input_embeddings().num_embeddings
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen), past_key_values=cache, use_cache=True,
           logits_to_keep=1)
    ids = torch.randint(0, vocab, (1, n), generator=gen)
    if profiler is not None:
        profiler.start()
    start = time.perf_counter()
    target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=n)
    elapsed = (time.perf_counter() - start) * 1000
    if profiler is not None:
        profiler.stop()
    return elapsed


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
    parser.add_argument("--prompts", default="prompts/heldout-mix.jsonl")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
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
    eval_cfg = EvalConfig(prompts=args.prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                          draft_len=args.draft_len, **fields)
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


if __name__ == "__main__":
    main()
