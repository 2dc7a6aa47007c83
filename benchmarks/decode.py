"""Benchmark: AR decoding vs HF assisted generation vs drafter_train's speculative decoder, side by side.

For each (target, drafter, dtype): every repeat decodes the same prompts with
  ar   - drafter_train's KV-cached AR baseline (the reference for speedup)
  hf   - transformers `generate(assistant_model=drafter)`, greedy, constant draft length = draft_len
  ours - drafter_train's `generate_speculative`, greedy verification, same draft_len
interleaved per prompt, and reports medians over repeats of tokens/s, ratios, tau (tokens per target forward,
counted with a forward hook for HF too) and whether all three outputs are token-identical.

    python -m benchmarks.decode --targets smollm2 stories260k --dtypes float32 bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

from benchmarks.common import ForwardCounter, command_line, hf_assisted, markdown_table, median, timed, write_result
from drafter_train.config import DrafterConfig, TargetConfig
from drafter_train.data.prompts import load_prompts
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.decoding.drafter import ARDrafter
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import verify_greedy
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.targets import encode_prompt, eos_token_ids, load_target

STORIES = os.environ.get("DRAFTER_TRAIN_STORIES260K", str(Path(__file__).resolve().parents[2] / "shared/models/stories260K"))
TARGETS = {
    "smollm2": (TargetConfig(), "truncated:2", None),
    "stories260k": (TargetConfig(path=STORIES, chat_template=False), "truncated:4", "stories"),
}
STORY_PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to play", "Tom saw a big", "One day, a girl"]


def run_repeat(target, drafter, prompts, draft_len, max_new_tokens, eos):
    """One pass over the prompts with all three decoders; returns totals."""
    totals = {name: {"tokens": 0, "time": 0.0, "passes": 0} for name in ("ar", "hf", "ours")}
    identical = 0
    counter = ForwardCounter(target)
    spec_drafter = ARDrafter(drafter)
    for prompt in prompts:
        outputs = {}
        for name, fn in (
            ("ar", lambda: generate_autoregressive(target, prompt, max_new_tokens, eos_token_ids=eos).tokens),
            ("hf", lambda: hf_assisted(target, drafter, prompt, draft_len, max_new_tokens, eos)),
            ("ours", lambda: generate_speculative(target, spec_drafter, prompt, draft_len, verify_greedy,
                                                  max_new_tokens, eos_token_ids=eos).tokens),
        ):
            before = counter.calls
            tokens, seconds = timed(fn)
            totals[name]["tokens"] += len(tokens)
            totals[name]["time"] += seconds
            totals[name]["passes"] += counter.calls - before
            outputs[name] = tokens
        identical += outputs["ar"] == outputs["hf"] == outputs["ours"]
    counter.handle.remove()
    row = {f"{name}_tok_s": t["tokens"] / t["time"] for name, t in totals.items()}
    row.update({f"{name}_tau": t["tokens"] / t["passes"] for name, t in totals.items() if name != "ar"})
    row["identical"] = identical / len(prompts)
    return row


def bench(target_name, dtype, args):
    target_cfg, drafter_path, prompt_kind = TARGETS[target_name]
    target_cfg = dataclasses.replace(target_cfg, dtype=dtype)
    target, tokenizer = load_target(target_cfg)
    drafter_path = args.drafter or drafter_path
    drafter = load_drafter(DrafterConfig(path=drafter_path), target, tokenizer, dtype)
    texts = STORY_PROMPTS[: args.num_prompts] if prompt_kind == "stories" else load_prompts(None, args.num_prompts)
    prompts = [encode_prompt(tokenizer, t, target_cfg.chat_template) for t in texts]
    eos = eos_token_ids(target, tokenizer)
    with torch.inference_mode():
        run_repeat(target, drafter, prompts[:1], args.draft_len, 8, eos)  # warm-up, untimed
        rows = [run_repeat(target, drafter, prompts, args.draft_len, args.max_new_tokens, eos) for _ in range(args.repeats)]
    med = {key: median(r[key] for r in rows) for key in rows[0]}
    med.update(
        target=target_name, drafter=drafter_path, dtype=dtype, draft_len=args.draft_len,
        ours_vs_ar=median(r["ours_tok_s"] / r["ar_tok_s"] for r in rows),
        hf_vs_ar=median(r["hf_tok_s"] / r["ar_tok_s"] for r in rows),
        ours_vs_hf=median(r["ours_tok_s"] / r["hf_tok_s"] for r in rows),
    )
    return med


COLUMNS = ["target", "drafter", "dtype", "draft_len", "AR tok/s", "HF assisted tok/s", "ours tok/s", "ours/AR",
           "HF/AR", "ours/HF", "tau ours", "tau HF", "identical"]
KEYS = ["target", "drafter", "dtype", "draft_len", "ar_tok_s", "hf_tok_s", "ours_tok_s", "ours_vs_ar", "hf_vs_ar",
        "ours_vs_hf", "ours_tau", "hf_tau", "identical"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--drafter", default=None, help="override the drafter (default: per target)")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench_decode.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [bench(t, d, args) for t in args.targets for d in args.dtypes]
    Path(args.output).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))
    table = [[r[key] for key in KEYS] for r in rows]
    print(markdown_table(COLUMNS, table))
    print(f"\nload average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; "
          f"torch threads: {torch.get_num_threads()}")
    write_result(
        "decode", title="Our speculative decoder against transformers' assisted generation",
        question="Given the same target and drafter, how fast is this project's decoder against HF assisted "
                 "generation and plain decoding?",
        command=command_line("decode"),
        split=f"{args.num_prompts} built-in prompts (smollm2), story openings (stories260k)",
        baseline="plain KV-cached decoding in this project's decoder (AR), same process", columns=COLUMNS,
        rows=table, notes=f"Greedy; medians of {args.repeats} interleaved repeats; {args.max_new_tokens} new tokens.")


if __name__ == "__main__":
    main()
