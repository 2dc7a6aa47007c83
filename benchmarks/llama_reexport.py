"""Is the llama re-export of a named qwen2 target the same model in llama.cpp? Greedy tokens of the original GGUF and
of its re-export (drafter_train/llama_reexport.py) from llama-server, on the dev prompts, and their speeds.

    python -m benchmarks.llama_reexport [--target qwen2.5-coder-1.5b] [--num-prompts 4] [--max-new-tokens 48] [--bench]

Needs the target installed (scripts/setup_targets.sh NAME --as-llama; the re-export is made here if missing) and
llama.cpp built ($DRAFTER_TRAIN_LLAMACPP). Prompts go in as text through the model's chat turn format, so both files
tokenise them with the same (shared) vocabulary. Writes benchmarks/results/llama_reexport.json; with --bench also
llama-bench's 1-token decode (tg) and 4-token pass (pp4) at context depth 256 of both files, in
benchmarks/results/llama_bench.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import DEV, command_line, read_jsonl, write_result
from drafter_train.llama_reexport import reexport_as_llama
from drafter_train.llamacpp import llamacpp_dir
from drafter_train.llamacpp_http import free_port, post, running_server
from drafter_train.named_targets import installed_gguf, named_target
from drafter_train.targets import cache_root

PROMPTS = Path(__file__).resolve().parents[1] / "drafter_train" / "prompts" / f"{DEV}.jsonl"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # Qwen2.5's chat turn (its GGUF's template)


def greedy(model: Path, prompts: list[str], max_new_tokens: int, threads: int, log: Path) -> list[dict]:
    command = [str(llamacpp_dir() / "build" / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(free_port()), "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1"]
    with running_server(command, log) as url:
        return [post(f"{url}/completion", {"prompt": CHAT.format(text), "n_predict": max_new_tokens,
                                           "temperature": 0.0, "top_k": 1, "return_tokens": True,
                                           "cache_prompt": False}) for text in prompts]


def llama_bench(model: Path, threads: int, repetitions: int = 3) -> dict[str, float]:
    """llama-bench at depth 256: tokens/s of a 4-token pass (pp4) and of 1-token decoding (tg, 16 tokens)."""
    done = subprocess.run([str(llamacpp_dir() / "build" / "bin" / "llama-bench"), "-m", str(model), "-t", str(threads),
                           "-p", "4", "-n", "16", "-d", "256", "-r", str(repetitions), "-o", "json"],
                          capture_output=True, text=True, check=True)
    tests = json.loads(done.stdout)
    return {("pp4" if t["n_prompt"] else "tg"): t["avg_ts"] for t in tests}


def bench(target, files: dict[str, Path], threads: int) -> None:
    speeds = {name: llama_bench(path, threads) for name, path in files.items()}
    rows = [[name, s["tg"], s["pp4"], s["tg"] * 4 / s["pp4"]] for name, s in speeds.items()]
    write_result(
        "llama_bench", title=f"{target.title} Q4_K_M in llama-bench: 1-token decode and a 4-token pass",
        question="What does a verify pass over 4 tokens cost against a 1-token decode step on this CPU, for the "
                 "original qwen2 file and its llama re-export?",
        command=command_line("llama_reexport"), split="none (llama-bench's synthetic tokens)",
        baseline="the 1-token decode step (tg)",
        columns=["file", "tg tok/s", "pp4 tok/s", "cost of a 4-token pass / a 1-token pass"], rows=rows,
        notes=f"llama-bench -p 4 -n 16 -d 256 -r 3 -t {threads}: context depth 256.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bench", action="store_true", help="also llama-bench tg / pp4 of both files")
    args = parser.parse_args()
    target = named_target(args.target)
    original = installed_gguf(target, cache_root())
    llama = original.with_name(target.llama_file)
    if not llama.is_file():
        reexport_as_llama(original, llama)
    records = read_jsonl(PROMPTS)[: args.num_prompts]
    with tempfile.TemporaryDirectory() as logs:
        runs = {name: greedy(path, [r["prompt"] for r in records], args.max_new_tokens, args.threads,
                             Path(logs) / f"{name}.log") for name, path in (("qwen2", original), ("llama", llama))}
    rows = []
    for i, record in enumerate(records):
        a, b = runs["qwen2"][i], runs["llama"][i]
        rows.append([i, record["category"], len(a["tokens"]), a["tokens"] == b["tokens"],
                     a["timings"]["predicted_per_second"], b["timings"]["predicted_per_second"]])
    same = sum(row[3] for row in rows)
    write_result(
        "llama_reexport", title=f"{target.title} Q4_K_M re-exported as llama: same greedy output in llama.cpp",
        question="Does the qwen2 -> llama re-export (q/k rows permuted for the NORM rope) decode exactly as the "
                 "original file in llama-server?",
        command=command_line("llama_reexport"), split=f"{DEV} (first {len(records)})",
        baseline="the original qwen2 GGUF in the same llama-server build",
        columns=["prompt", "category", "tokens", "same greedy tokens", "qwen2 tok/s", "llama tok/s"], rows=rows,
        notes=f"{same}/{len(rows)} prompts give identical greedy tokens ({args.max_new_tokens} new tokens, "
              f"{args.threads} threads, llama-server's own decode timings).")
    print(f"{same}/{len(rows)} identical")
    if args.bench:
        bench(target, {"qwen2 (original)": original, "llama (re-export)": llama}, args.threads)


if __name__ == "__main__":
    main()
