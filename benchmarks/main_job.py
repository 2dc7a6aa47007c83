"""The main job's figures (scripts/quickstart.sh), as a table and as result files.

    python -m benchmarks.main_job summarize --run checkpoints/quickstart-smollm2 --draft-len 2

summarize: the quickstart's final table, all on the test split: the product at the `best` checkpoint (product.json:
lookups first, then the EAGLE-3 drafter's siblings; `best` was picked on the dev split during training) and the
evaluations that show where the gain comes from (drafter-alone.json, drafter-chain.json, prompt-lookup.json,
corpus-lookup.json), decoded side by side by the main job's test stage (drafter-compare); writes
benchmarks/results/main_job.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common import OUR_BASELINE, RESULTS_DIR, dev_note, evaluation_split, write_result

PRODUCT = "lookups, then EAGLE-3 (the product)"
# the quickstart's evaluations after training: file name -> label. drafter-chain: the drafter's top-1 tokens as a
# chain of draft_len, the only row whose per-position acceptance is the drafter's at positions 1, 2, ... (the other
# drafter rows verify draft_len siblings at depth 1); runs from before it have no such file and no such row.
BASELINES = (("drafter-alone", "EAGLE-3 alone (best checkpoint)"),
             ("drafter-chain", "EAGLE-3 alone, chain (top-1)"),
             ("prompt-lookup", "prompt lookup alone (no training)"),
             ("corpus-lookup", "prompt + corpus lookup (no drafter)"))
SUMMARY_COLUMNS = ["decoder", "step", "tau", "acceptance", "speedup", "acceptance per position"]


# ----------------------------------------------------------------------------------------------------------------
# summarize: the quickstart's table


def summary_rows(run: Path) -> list[list]:
    """[decoder, step, tau, acceptance, speedup, acceptance per position]: the product at the `best` checkpoint,
    then the evaluations that take it apart (no step)."""
    product = json.loads((run / "product.json").read_text())
    best = int((run / "best").resolve().name.removeprefix("step-"))
    rows = [[PRODUCT, best, *_figures(product)]]
    for name, label in BASELINES:
        if name == "drafter-chain" and not (run / f"{name}.json").is_file():
            continue
        rows.append([label, None, *_figures(json.loads((run / f"{name}.json").read_text()))])
    return rows


def _figures(m: dict) -> list:
    return [m["tau"], m["acceptance_rate"], m["speedup"], m.get("per_position_acceptance")]


def summary_text(rows: list[list], draft_len: int, split: str) -> str:
    """The table the quickstart prints at its end (its columns and spacing are what users have seen since)."""
    lines = [f"\n{split}, greedy, {draft_len} drafts per pass (the drafter's as siblings, except in the chain's row)",
             "                                         step   tau    acceptance  speedup  per position"]
    for label, step, tau, acceptance, speedup, per_position in rows:
        where = f"{label:<41}{step:>4}" if step is not None else f"{label:<40}      "
        positions = " ".join(f"{a:.3f}" for a in per_position or [])
        lines.append(f"{where}  {tau:.3f}  {acceptance:.3f}       {speedup:.3f}    {positions}".rstrip())
    return "\n".join(lines)


def summarize(args) -> None:
    run = Path(args.run)
    rows = summary_rows(run)
    last = json.loads((run / "corpus-lookup.json").read_text())  # evaluated last, with the job's eval settings
    split = evaluation_split(last, args.num_prompts)
    print(summary_text(rows, args.draft_len, split))
    config = last.get("config", {})
    new_tokens = config.get("eval", {}).get("max_new_tokens", 48)
    write_result(
        "main_job", results_dir=Path(args.results_dir), command=args.command, columns=SUMMARY_COLUMNS, rows=rows,
        title="The main job: EAGLE-3 behind prompt and corpus lookup on SmolLM2-135M",
        question="How much faster than plain decoding does the quickstart's product decode, and where does the gain "
                 "come from?", split=split, machine=last.get("machine"),
        baseline=OUR_BASELINE.format(kernels=config.get("target", {}).get("cpu_kernels", "auto")),
        notes=f"Greedy, {args.draft_len} drafts per verify pass (the drafter's as siblings, except the chain's: its "
              "top-1 tokens, so its per-position acceptance is the drafter's at positions 1, 2, ...; in the sibling "
              f"rows it is per depth), {new_tokens} new tokens per prompt; {_timing(last)}; `best` was picked on the "
              "dev split." + dev_note(split))


def _timing(metrics: dict) -> str:
    """How the rows were timed: side by side against one plain decoding (drafter-compare), or each on its own."""
    together = metrics.get("side_by_side")
    if together:
        return (f"the {len(together)} decoders decoded side by side against one plain decoding (drafter-compare: each "
                "prompt's plain and speculative runs interleaved), once, not repeated")
    return "one evaluation each, not repeated"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("summarize", help="the quickstart's final table (and benchmarks/results/main_job.json)")
    one.add_argument("--run", required=True, help="the run folder, checkpoints/<run>")
    one.add_argument("--draft-len", type=int, default=2, help="the job's eval.draft_len (for the heading)")
    one.add_argument("--num-prompts", type=int, default=16, help="the job's eval.num_prompts, if the JSONs lack it")
    one.add_argument("--command", default="bash scripts/quickstart.sh", help="the command that made the run")
    one.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the result file goes")
    summarize(parser.parse_args(argv))


if __name__ == "__main__":
    main()
