"""What one speculative step costs inside llama-server, measured through llama-server itself, beside llama-bench's
pass curve (the measurement: drafter_train/engines/llamacpp_cost.py).

    python -m benchmarks.llamacpp_cost --exports DIR [--ar-exports AR_DIR] [--precisions f32,q8_0] \
        [--prompts dev --num-prompts 4 --max-new-tokens 32] --output FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import load_average
from drafter_train.engines.llamacpp_cost import (NGRAM_DRAFTS, PRECISIONS, bench_curve, calibration_prompts,
                                                 median_server_curves, server_curves)


def main(argv=None) -> int:
    from drafter_train.config import EMBEDDED_TARGET
    from drafter_train.data.prompts import DEV
    from drafter_train.engines.llamacpp_server import server_bin
    from drafter_train.llamacpp import llamacpp_dir


    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--exports", type=Path, required=True, help="DIR/<precision>/target.gguf (+ drafter.gguf)")
    parser.add_argument("--ar-exports", type=Path, default=None, help="AR_DIR/<precision>/drafter.gguf")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--llamacpp", default=None)
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--prompts", default=DEV, help="calibration prompts (default: the dev split)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--drafts", default="1,2,4,8", help="draft lengths of the drafter kinds' calibration")
    parser.add_argument("--depth", type=int, default=128, help="llama-bench's cached prefix, for comparison")
    parser.add_argument("--sizes", default="1,2,3,4,5,6,8,9,16,32,49", help="llama-bench pass sizes, for comparison")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    bin_dir = server_bin(llamacpp_dir(args.llamacpp), "llamacpp_cost --llamacpp", ("llama-server", "llama-bench"))
    prompts = calibration_prompts(args.target, args.prompts, args.num_prompts)
    record = {"load_average_before": load_average(), "precisions": {}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for precision in args.precisions.split(","):
        folder = args.exports / precision
        drafters = {"eagle3": folder / "drafter.gguf",
                    "ar": args.ar_exports / precision / "drafter.gguf" if args.ar_exports else None}
        drafters = {k: v for k, v in drafters.items() if v is not None and v.is_file()}
        drafts = {"ngram": NGRAM_DRAFTS, **{k: tuple(int(n) for n in args.drafts.split(",")) for k in drafters}}
        rounds = [server_curves(bin_dir, folder / "target.gguf", drafters, prompts, args.max_new_tokens, args.threads,
                                precision == "f32", args.output.with_suffix(".log"), drafts)
                  for _ in range(args.rounds)]
        bench = bench_curve(bin_dir, folder / "target.gguf", [int(n) for n in args.sizes.split(",")], args.depth, 3,
                            args.threads)
        record["precisions"][precision] = {"server": median_server_curves(rounds), "rounds": rounds,
                                           "llama_bench_ms": bench}
        print(json.dumps({precision: record["precisions"][precision]["server"]}, default=str), file=sys.stderr)
    record.update(load_average_after=load_average(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  prompts=args.prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
    args.output.write_text(json.dumps(record, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
