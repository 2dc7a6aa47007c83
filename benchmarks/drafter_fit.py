"""Benchmark (issue 10 §7, "measure why"): where does an EAGLE-3 drafter's first draft go wrong?

Teacher-forced, on the target's own greedy output: at every response position the drafter reads the target's
features and the next token (as in decoding, one TTT step) and proposes its top 1 and top 2 for the token after it;
a proposal is right when it is the target's greedy token. That is the first-draft acceptance of a chain (top 1) and
of two sibling drafts (top 2), without the decoder's timing or the lookups. Three sources:
- train: the first responses of the drafter's training data (what it fitted);
- held-out sharegpt: datagen's held-out prompts (the training distribution, prompts it never saw), answered greedily;
- held-out mix: the evaluation prompts (8 task categories), answered greedily, also per category.
Prints a markdown table and writes --output (JSON).

    python -m benchmarks.drafter_fit --drafter checkpoints/quickstart-smollm2/latest/drafter \
        --data data/quickstart-smollm2
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import datasets
import torch

from drafter_train import draft_vocab
from drafter_train.config import TargetConfig
from drafter_train.data.prompts import load_prompt_records
from drafter_train.decoding.autoregressive import generate_autoregressive
from drafter_train.drafters.eagle3 import model as eagle3
from drafter_train.features import FeatureTap
from drafter_train.targets import encode_prompt, eos_token_ids, load_target


@torch.no_grad()
def score(target, model, prompt_ids: list[int], response_ids: list[int]) -> dict:
    """Counts of right top-1 / top-2 first drafts over the response positions (after its first token)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with FeatureTap(target, model.config.target_layers) as tap:
        greedy = target(input_ids=ids).logits[0].argmax(-1)  # the target's token after each position
        features = tap.features
    # row p - 1 reads token p and learns the token after position p (eagle3.Eagle3Model.forward)
    positions = torch.arange(len(prompt_ids), ids.shape[1] - 1)[None]
    logits = model(ids, features, torch.ones_like(ids), positions, 1)[0][0]
    top2 = draft_vocab.draft_to_target(model.d2t)[logits.topk(2, dim=-1).indices]
    want = greedy[positions[0]]
    outside = ~model.t2d[want]
    return {"top1": int((top2[:, 0] == want).sum()), "top2": int((top2 == want[:, None]).any(-1).sum()),
            "tokens": int(want.numel()), "outside": int(outside.sum())}


def total(counts: list[dict]) -> dict:
    summed = {k: sum(c[k] for c in counts) for k in ("top1", "top2", "tokens", "outside")}
    n = max(summed["tokens"], 1)
    return {**summed, "top1_rate": summed["top1"] / n, "top2_rate": summed["top2"] / n,
            "outside_rate": summed["outside"] / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="an EAGLE-3 drafter folder")
    parser.add_argument("--data", required=True, help="its drafter-datagen folder (shards/, eval_prompts.jsonl)")
    parser.add_argument("--prompts", default="heldout-mix")
    parser.add_argument("--mix-prompts", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=16)
    parser.add_argument("--train-tokens", type=int, default=96, help="response tokens scored per training row")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy answer length of held-out prompts")
    parser.add_argument("--output", default="drafter-fit.json")
    args = parser.parse_args()

    target_cfg = TargetConfig()
    target, tokenizer = load_target(target_cfg)
    model = eagle3.load(args.drafter, target_cfg.dtype)
    eos = eos_token_ids(target, tokenizer)

    def answer(prompt_ids: list[int]) -> list[int]:  # the evaluator's plain greedy decoding
        return generate_autoregressive(target, prompt_ids, args.new_tokens, eos_token_ids=eos).tokens

    def held_out(path: str, num: int) -> dict:  # category -> counts of each prompt, answered greedily
        counts = defaultdict(list)
        for text, category in load_prompt_records(path, num):
            ids = encode_prompt(tokenizer, text, target_cfg.chat_template)
            counts[category].append(score(target, model, ids, answer(ids)))
        return counts

    shards = sorted((Path(args.data) / "shards").iterdir())
    train = datasets.concatenate_datasets([datasets.load_from_disk(str(shard)) for shard in shards])
    rows = train.select(range(min(args.train_rows, len(train))))
    results = {"train": total([score(target, model, r["prompt_ids"], r["response_ids"][:args.train_tokens])
                               for r in rows])}
    sharegpt = held_out(f"{args.data}/eval_prompts.jsonl", 10**6)
    results["held-out sharegpt"] = total([c for cs in sharegpt.values() for c in cs])
    by_category = held_out(args.prompts, args.mix_prompts)
    results["held-out mix"] = total([c for cs in by_category.values() for c in cs])
    for category, cs in by_category.items():
        results[f"  mix: {category}"] = total(cs)

    print(f"drafter {args.drafter}, {torch.get_num_threads()} threads")
    print("| responses | tokens | top-1 right | top-2 right | outside the draft vocabulary |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokens']} | {r['top1_rate']:.3f} | {r['top2_rate']:.3f} | {r['outside_rate']:.3f} |")
    with open(args.output, "w") as f:
        json.dump({"drafter": args.drafter, "data": args.data, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
