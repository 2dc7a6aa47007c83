"""Where a llama.cpp verify step's time goes on this CPU, per target file: each part measured, none estimated.

    python -m benchmarks.verify_split [--target qwen2.5-coder-1.5b] [--files q4_k_m-llama,q4_0,...]
        [--eagle3 DRAFTER.gguf] [--sizes 1,...,8] [--ngram-drafts 1,3,7] [--eagle3-drafts 1,3] [--rounds 2]

A verify step over n tokens (n - 1 drafts) in llama-server is split into
- the target's pass over n tokens with the logits of the last position only (what a plain step computes),
- the output matrix over the n - 1 other rows (the same pass with logits at every position, less the first),
- sampling at the n positions (llama.cpp's common_sampler, as llama-server runs it for a greedy request),
  all three timed in-process by benchmarks/verify_split.cpp against the build's own libllama;
- the rest of llama-server's step (batch building, KV rollback, the HTTP loop): its measured target-only step
  (the `ngram` kind of engines/llamacpp_cost.py: synthetic acceptance 0, so every step is one verify pass) less the
  three parts above;
- for EAGLE-3 (--eagle3): its process() on the verify batch (the `eagle3` kind's step less the target-only step at
  the same n) and its drafting (the server's own drafting time per step).
Everything is given in plain steps of the fastest plain file: llama-server's plain decoding of each file is timed
too, and the baseline is the fastest. Files: the installed Q4_K_M (and its llama re-export, the served one) and the
llama re-export requantised as each of drafter_train.llamacpp.VERIFY_FILES (made once; setup_targets --verify-file
writes them too). Rounds interleave the files; each figure is the median over rounds.
Writes benchmarks/results/verify_split-<cpu kind>.json with `verify_cost_4` (the cheapest 4-token target-only verify
step of any file, in plain steps of the fastest plain file) and `cpu_kind` at its top level.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path
from statistics import median
from typing import Optional

from benchmarks.common import add_results_dir, command_line, write_result
from drafter_train.engines.llamacpp_cost import calibration_prompts, server_curves
from drafter_train.engines.table import acceptance_needed_for
from drafter_train.llamacpp import VERIFY_FILES, llamacpp_dir, verify_file
from drafter_train.machine import kind_slug
from drafter_train.named_targets import installed_gguf, named_target
from drafter_train.targets import cache_root

SOURCE = Path(__file__).with_suffix(".cpp")
QWEN2_FILE = "q4_k_m"  # the installed file under its own architecture: timed plain and target-only (llama.cpp's
# EAGLE-3 reads layer inputs its qwen2 graph does not expose; it serves drafters on the llama re-export)


def harness(root: Path) -> Path:
    """verify_split.cpp compiled against this llama.cpp build (once per source and build)."""
    build = root / "build"
    stamp = hashlib.sha256(SOURCE.read_bytes() + str((build / "bin" / "libllama.so").stat().st_mtime).encode())
    out = build / f"verify_split-{stamp.hexdigest()[:12]}"
    if out.is_file():
        return out
    src = root / "llama.cpp"
    subprocess.run(["c++", "-O2", "-std=c++17", str(SOURCE), "-I", str(src / "include"), "-I",
                    str(src / "ggml" / "include"), "-I", str(src / "common"), "-o", str(out), "-L",
                    str(build / "bin"), "-lllama-common", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{build / 'bin'}", "-pthread"], check=True)
    return out


def in_process(binary: Path, gguf: Path, threads: int, depth: int, sizes: list[int], repeats: int) -> dict:
    """{n: {last_ms, all_ms, sample_ms}} of one file."""
    done = subprocess.run([str(binary), str(gguf), str(threads), str(depth), ",".join(map(str, sizes)),
                           str(repeats), "1"], capture_output=True, text=True, check=True)
    return {int(n): parts for n, parts in json.loads(done.stdout)["sizes"].items()}


def target_files(target_name: str, labels: list[str], root: Path) -> dict[str, Path]:
    """label -> GGUF: the installed file, its llama re-export, and the re-export requantised per VERIFY_FILES."""
    target = named_target(target_name)
    installed = installed_gguf(target, cache_root())
    llama = installed.with_name(target.llama_file)
    files = {"q4_k_m": installed, "q4_k_m-llama": llama}
    return {label: files[label] if label in files else verify_file(root, llama, label) for label in labels}


def one_round(files: dict[str, Path], binary: Path, prompts: list, args, eagle3: Optional[Path]) -> dict:
    """Per file: the in-process parts and llama-server's plain step, target-only steps and EAGLE-3's."""
    out = {}
    for label, gguf in files.items():
        parts = in_process(binary, gguf, args.threads, args.depth, args.sizes, args.repeats)
        drafts = {"ngram": tuple(args.ngram_drafts)}
        if eagle3 is not None and label != QWEN2_FILE:
            drafts["eagle3"] = tuple(args.eagle3_drafts)
        with tempfile.TemporaryDirectory() as tmp:
            served = server_curves(llamacpp_dir() / "build" / "bin", gguf, {"eagle3": eagle3}, prompts,
                                   args.max_new_tokens, args.threads, False, Path(tmp) / "server.log", drafts)
        out[label] = {"parts": parts, "server": served}
        print(f"verify_split: {label}: plain step {served['ms_1']:.1f} ms", flush=True)
    return out


def medians(rounds: list[dict]) -> dict:
    """The median over rounds of every figure, per file."""
    def med(get):
        values = [v for v in (get(r) for r in rounds) if v is not None]
        return median(values) if values else None

    files = {}
    for label in rounds[0]:
        parts = {n: {k: med(lambda r: r[label]["parts"][n][k]) for k in rounds[0][label]["parts"][n]}
                 for n in rounds[0][label]["parts"]}
        kinds = {}
        for kind, first in rounds[0][label]["server"]["kinds"].items():
            kinds[kind] = {field: {n: med(lambda r: r[label]["server"]["kinds"].get(kind, {}).get(field, {}).get(n))
                                   for n in first[field]} for field in ("ms", "draft_ms")}
        files[label] = {"parts": parts, "plain_ms": med(lambda r: r[label]["server"]["ms_1"]), "kinds": kinds}
    return files


def split_rows(files: dict, fastest: float) -> list[list]:
    """One row per file and pass size: each part in plain steps of the fastest plain file."""
    rows = []
    for label, f in files.items():
        ngram, eagle3 = f["kinds"].get("ngram", {}), f["kinds"].get("eagle3", {})
        for n, p in sorted(f["parts"].items()):
            server = f["plain_ms"] if n == 1 else ngram.get("ms", {}).get(n)
            e3 = eagle3.get("ms", {}).get(n) if n > 1 else None  # n = 1: the plain step, no drafting
            e3_draft = eagle3.get("draft_ms", {}).get(n)
            needed = None
            if e3 is not None and e3_draft is not None:
                relative = {1: f["plain_ms"] / fastest, n: e3 / fastest}
                needed = acceptance_needed_for(relative, n - 1, e3_draft / fastest)
            rows.append([label, n, round(f["plain_ms"] / fastest, 3), _steps(p["last_ms"], fastest),
                         _steps(p["all_ms"] - p["last_ms"], fastest), _steps(n * p["sample_ms"], fastest),
                         _steps(server - p["all_ms"] - n * p["sample_ms"], fastest) if server else None,
                         _steps(server, fastest), _steps(e3 - server, fastest) if e3 and server else None,
                         _steps(e3_draft, fastest),
                         _steps(e3 + e3_draft, fastest) if e3 and e3_draft is not None else None,
                         _needed(needed)])
    return rows


def _steps(ms: Optional[float], fastest: float) -> Optional[float]:
    return None if ms is None else round(ms / fastest, 3)


def _needed(needed: Optional[dict]) -> Optional[str]:
    if not needed:
        return None
    return " / ".join("-" if v is None else f"{v:.2f}" for v in needed.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--files", default=",".join(["q4_k_m", "q4_k_m-llama", *VERIFY_FILES]))
    parser.add_argument("--eagle3", help="an EAGLE-3 drafter GGUF for the target (its process() and drafting)")
    parser.add_argument("--sizes", default="1,2,3,4,5,6,7,8", help="pass sizes timed in-process")
    parser.add_argument("--ngram-drafts", default="1,3,7", help="drafts per target-only server step")
    parser.add_argument("--eagle3-drafts", default="1,3", help="EAGLE-3's drafts per server step")
    parser.add_argument("--depth", type=int, default=256, help="cached tokens before each in-process pass")
    parser.add_argument("--repeats", type=int, default=5, help="in-process passes per size and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", default="dev", help="the server runs' prompts (never the test split)")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--result-name", help="default: verify_split-<this CPU's kind>")
    add_results_dir(parser)
    args = parser.parse_args(argv)
    for field in ("sizes", "ngram_drafts", "eagle3_drafts"):
        setattr(args, field, [int(v) for v in getattr(args, field).split(",") if v])
    root = llamacpp_dir()
    files = target_files(args.target, args.files.split(","), root)
    prompts = calibration_prompts(f"embedded:{args.target}", args.prompts, args.num_prompts)
    binary = harness(root)
    eagle3 = Path(args.eagle3) if args.eagle3 else None
    rounds = [one_round(files, binary, prompts, args, eagle3) for _ in range(args.rounds)]
    figures = medians(rounds)
    fastest_label = min(figures, key=lambda label: figures[label]["plain_ms"])
    fastest = figures[fastest_label]["plain_ms"]
    rows = split_rows(figures, fastest)
    four = {label: f["kinds"]["ngram"]["ms"].get(4) for label, f in figures.items() if "ngram" in f["kinds"]}
    four = {label: ms / fastest for label, ms in four.items() if ms is not None}
    kind = kind_slug()
    write_result(
        args.result_name or f"verify_split-{kind}",
        title=f"{named_target(args.target).title} in llama-server: where a verify step's time goes",
        question="A verify step over n tokens split into its measured parts, in plain steps of the fastest plain file "
                 "of the target; which target file verifies cheapest, and what EAGLE-3 would need per position",
        command=command_line("verify_split", argv), split=f"{args.prompts} split, first {args.num_prompts} prompts "
        "(server runs, synthetic acceptance 0); the in-process passes run on fixed pseudo-random tokens",
        baseline=f"llama-server's plain step of the fastest file here ({fastest_label}, {fastest:.1f} ms)",
        columns=["file", "n", "its plain step", "pass (last logits)", "output matrix, other rows", "sampling",
                 "server rest", "verify step (target only)", "EAGLE-3 process()", "EAGLE-3 drafting",
                 "EAGLE-3 step", "EAGLE-3 acceptance needed for 1x / 1.5x / 2x"],
        rows=rows,
        notes="Each cell in plain steps of the fastest file's plain llama-server step. 'pass', 'output matrix' and "
              "'sampling' are timed in-process (benchmarks/verify_split.cpp on the build's libllama, depth "
              f"{args.depth}, median of {args.repeats}); 'verify step' is llama-server's target-only step over n "
              "tokens (ngram kind, every draft rejected) and 'server rest' what is left of it; EAGLE-3's columns "
              "come from its own calibration (process() = its step less the target-only step). Acceptance needed: "
              "per position of a chain of n - 1 drafts, at these costs. Medians of "
              f"{args.rounds} interleaved rounds.",
        data={"files": {label: str(path) for label, path in files.items()}, "figures": figures,
              "rounds": rounds, "eagle3": str(eagle3) if eagle3 else None},
        top={"cpu_kind": kind, "verify_cost_4": min(four.values()) if four else None,
             "verify_cost_4_by_file": four, "fastest_plain": {"file": fastest_label, "ms": fastest}},
        results_dir=args.results_dir)
    for row in rows:
        print(*row)


if __name__ == "__main__":
    main()
