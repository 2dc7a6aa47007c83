"""Benchmark: AR decoding vs HF assisted generation vs drafter_train's speculative decoder, side by side.

For each (target, drafter, dtype): every repeat decodes the same prompts with
  ar   - drafter_train's KV-cached AR baseline (the reference for speedup)
  hf   - transformers `generate(assistant_model=drafter)`, greedy, constant draft length = draft_len
  ours - drafter_train's `generate_speculative`, greedy verification, same draft_len
interleaved per prompt, and reports medians over repeats of tokens/s, ratios, tau (tokens per target forward,
counted with a forward hook for HF too) and whether all three outputs are token-identical.

    python scripts/bench_decode.py --targets smollm2 stories260k --dtypes float32 bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from drafter_train.config import DrafterConfig, TargetConfig  # noqa: E402
from drafter_train.data.prompts import load_prompts  # noqa: E402
from drafter_train.decoding.autoregressive import generate_autoregressive  # noqa: E402
from drafter_train.decoding.drafter import ARDrafter  # noqa: E402
from drafter_train.decoding.speculative import generate_speculative  # noqa: E402
from drafter_train.decoding.verify import verify_greedy  # noqa: E402
from drafter_train.drafters.common.loading import load_drafter  # noqa: E402
from drafter_train.targets import encode_prompt, eos_token_ids, load_target  # noqa: E402

STORIES = os.environ.get("DRAFTER_TRAIN_STORIES260K", str(Path(__file__).resolve().parents[2] / "shared/models/stories260K"))
TARGETS = {
    "smollm2": (TargetConfig(), "truncated:2", None),
    "stories260k": (TargetConfig(path=STORIES, chat_template=False), "truncated:4", "stories"),
}
STORY_PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to play", "Tom saw a big", "One day, a girl"]


class ForwardCounter:
    """Counts forward calls of a module (one per target pass, HF's loop included)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def hf_assisted(target, drafter, prompt, draft_len, max_new_tokens, eos, temperature=0.0):
    # Same work as ours: a constant draft length and no confidence-based early stop of the drafter.
    drafter.generation_config.num_assistant_tokens = draft_len
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.tensor([prompt], device=target.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else \
        {"do_sample": False}
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=eos[0], **sampling,
    )
    return out[0, len(prompt):].tolist()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


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
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    med.update(
        target=target_name, drafter=drafter_path, dtype=dtype, draft_len=args.draft_len,
        ours_vs_ar=statistics.median(r["ours_tok_s"] / r["ar_tok_s"] for r in rows),
        hf_vs_ar=statistics.median(r["hf_tok_s"] / r["ar_tok_s"] for r in rows),
        ours_vs_hf=statistics.median(r["ours_tok_s"] / r["hf_tok_s"] for r in rows),
    )
    return med


def markdown(rows):
    head = ("| target | drafter | dtype | k | AR tok/s | HF assisted tok/s | ours tok/s | ours/AR | HF/AR | ours/HF "
            "| tau ours | tau HF | identical |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['drafter']} | {r['dtype']} | {r['draft_len']} | {r['ar_tok_s']:.1f} "
            f"| {r['hf_tok_s']:.1f} | {r['ours_tok_s']:.1f} | {r['ours_vs_ar']:.2f} | {r['hf_vs_ar']:.2f} "
            f"| {r['ours_vs_hf']:.2f} | {r['ours_tau']:.2f} | {r['hf_tau']:.2f} | {r['identical']:.2f} |"
        )
    return "\n".join(lines)


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
    print(markdown(rows))
    print(f"\nload average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; "
          f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
