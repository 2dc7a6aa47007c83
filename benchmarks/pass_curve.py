"""What a llama.cpp pass over n tokens costs against a 1-token step on this CPU, per target precision and weight
layout, and the most that speculation could gain with drafts that are always accepted.

    python -m benchmarks.pass_curve [--target qwen2.5-coder-1.5b] [--types q4_0,q8_0,f16] [--tokens 1,2,3,4,8,16]
        [--repack 1,0] [--depth 128] [--repetitions 3] [--threads 2]

The named target's installed GGUF (Q4_K_M) is timed as it is; each of --types is converted once from its dequantised
copy (cached, as the served table's --export-types). Each file is timed by llama-bench (`-n 0 -p N -d DEPTH`: one
pass over N tokens after a DEPTH-token context; the median of --repetitions) with llama.cpp's repacked weight layout
and without it. A verify step over k drafts is a pass over k + 1 tokens, so with every draft accepted it yields
k + 1 tokens for the pass's cost: 'ceiling' is the best (k + 1) / cost(k + 1) over the measured sizes, against the
file's own 1-token step and against the fastest 1-token step measured here (the baseline a served speedup is counted
against). llama-bench computes the logits of a pass's last token only, a verify step those of every position: the
ceilings are upper bounds.
Writes benchmarks/results/pass_curve.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import command_line, write_result
from drafter_train.engines.llamacpp_cost import bench_curve
from drafter_train.llamacpp import llamacpp_dir, target_folder
from drafter_train.named_targets import installed_gguf, named_target
from drafter_train.targets import cache_root


def curve_row(label: str, repack: bool, ms: dict[int, float], fastest_ms_1: float) -> list:
    """label, layout, the 1-token step, the relative cost at each n, and the ceilings (own step, fastest step)."""
    relative = {n: ms[n] / ms[1] for n in sorted(ms)}
    own = max(n / relative[n] for n in relative)
    return [label, "repacked" if repack else "as stored", ms[1], *relative.values(), own,
            own * fastest_ms_1 / ms[1]]


def target_files(target_name: str, types: list[str]) -> dict[str, Path]:
    """Label -> GGUF: the installed file, then each type converted from the dequantised copy (cached)."""
    from drafter_train.engines.export import cached_target_gguf

    target = named_target(target_name)
    files = {"q4_k_m": installed_gguf(target, cache_root())}
    if target.llama_file and (files["q4_k_m"].parent / target.llama_file).is_file():  # the served llama re-export
        files["q4_k_m-llama"] = files["q4_k_m"].parent / target.llama_file
    if types:
        folder = target_folder({"path": f"embedded:{target_name}"}, "--types")
        files.update({t: cached_target_gguf(llamacpp_dir(), folder, t) for t in types})
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--types", default="q4_0,q8_0,f16", help="also these precisions (comma list; '' for none)")
    parser.add_argument("--tokens", default="1,2,3,4,8,16", help="pass sizes (1 is always added)")
    parser.add_argument("--repack", default="1,0", help="weight layouts: 1 repacked (llama.cpp's default), 0 as stored")
    parser.add_argument("--depth", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    tokens = sorted({1, *(int(n) for n in args.tokens.split(","))})
    layouts = [flag == "1" for flag in args.repack.split(",")]
    files = target_files(args.target, [t for t in args.types.split(",") if t])
    bin_dir = llamacpp_dir() / "build" / "bin"
    measured = {(label, repack): bench_curve(bin_dir, path, tokens, args.depth, args.repetitions, args.threads, repack)
                for label, path in files.items() for repack in layouts}
    fastest = min(ms[1] for ms in measured.values())
    rows = [curve_row(label, repack, ms, fastest) for (label, repack), ms in measured.items()]
    write_result(
        "pass_curve", title=f"{named_target(args.target).title} in llama.cpp: what a pass over n tokens costs",
        question="Per precision and weight layout: a pass over n tokens against a 1-token step, and the most that "
                 "drafts which are always accepted could gain over the file's own and over the fastest plain step",
        command=command_line("pass_curve", argv), split="none (llama-bench's synthetic tokens)",
        baseline="each file's own 1-token step; the last column: the fastest 1-token step measured here",
        columns=["precision", "weights", "1-token step (ms)", *(f"n={n}" for n in tokens),
                 "ceiling x own plain", "ceiling x fastest plain"], rows=rows,
        notes=f"llama-bench -n 0 -p {','.join(map(str, tokens))} -d {args.depth} -r {args.repetitions} "
              f"-t {args.threads}, --repack {args.repack}: n = tokens in one pass (a verify step over n - 1 drafts); "
              "ceiling = best n / cost(n) over these n, every draft accepted and drafting free. llama-bench's pass "
              "computes the logits of its last token only, a verify step those of every position (the served "
              "table prices steps by llama-server's own), so these ceilings are upper bounds.",
        data={"files": {label: str(path) for label, path in files.items()}})
    for row in rows:
        print(*row)


if __name__ == "__main__":
    main()
