"""Serve an exported drafter in vLLM or llama.cpp and compare its acceptance with this project's evaluator on the same
prompts: the driver of drafter_train/engines/check.py (what is checked, and how, is said there), with its result files.

    python -m benchmarks.engine_check --run checkpoints/<run> [--which best] [--vllm-python VENV/bin/python]
    python -m benchmarks.engine_check --engine llamacpp --run checkpoints/<run> [--gguf-type f32]
    python -m benchmarks.engine_check --checkpoint checkpoints/<run>/step-100 --exported exports/my-drafter

llama.cpp results: <output>/llamacpp_check.json (with --result also benchmarks/results/engine_llamacpp.json;
--result-name NAME writes benchmarks/results/NAME.json instead, e.g. a second drafter kind's check). The build:
scripts/setup_llamacpp.sh. --target-gguf serves a given target GGUF (e.g. the original Q4_K_M file) instead of
exporting the run's target at --gguf-type.

Results (vLLM): <output>/vllm_check.json (and printed; with --result also benchmarks/results/engine_check.json); exit status
1 when they disagree or the speculators check fails.
The vLLM environment: scripts/setup_vllm.sh (default $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm in the repo).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from drafter_train.engines.check import DEFAULT_TOLERANCE, CheckSpec, check_llamacpp, check_vllm
from drafter_train.errors import DrafterTrainError


def main(argv=None) -> int:
    from benchmarks.common import add_results_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a drafter-train run folder (with --which)")
    source.add_argument("--checkpoint", help="one step folder of a run")
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm")
    parser.add_argument("--which", default="best", help="with --run: best, latest or step-N")
    parser.add_argument("--exported", help="an export of that checkpoint (export.format=vllm, or gguf with "
                                           "--engine llamacpp) to serve instead of exporting it again")
    parser.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: $DRAFTER_TRAIN_VLLM_VENV, "
                                                           "else .venv-vllm)")
    parser.add_argument("--llamacpp", default=None, help="the llama.cpp folder scripts/setup_llamacpp.sh built "
                                                         "(default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp)")
    parser.add_argument("--gguf-type", default="f32", help="llama.cpp: precision of the exported target "
                                                           "(f32, f16, q8_0; the drafter is f32 with f32, else f16)")
    parser.add_argument("--target-gguf", default=None, help="llama.cpp: a given target GGUF instead of the run's "
                                                            "target exported at --gguf-type")
    parser.add_argument("--spec-type", default=None, help="llama.cpp --spec-type (default: the kind's, e.g. "
                                                          "draft-eagle3); a comma list combines drafters")
    parser.add_argument("--lookups", default=None,
                        help="llama.cpp: the product, n-gram modes ahead of the drafter (e.g. ngram-cache or "
                             "ngram-simple; llama.cpp tries n-gram types first); ours then runs prompt lookup "
                             "(min_ngram 2) and, with --lookup-corpus, corpus lookup ahead of the drafter")
    parser.add_argument("--lookup-corpus", default=None,
                        help="with --lookups ngram-cache: a drafter-datagen folder whose responses become llama.cpp's "
                             "static n-gram cache (llama-lookup-create) and our corpus lookup")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--draft-len", type=int, default=None, help="default: the run's drafter.draft_len")
    parser.add_argument("--prompts", default=None, help="prompt file (default: the evaluator's built-in prompts)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--categories", default=None, help="only prompts of these task categories (comma list)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--ours-from", default=None,
                        help="llama.cpp: our evaluator's figures from an earlier check's llamacpp_check.json (same "
                             "checkpoint, prompts, budget, draft length, lookups), not decoded again")
    parser.add_argument("--no-baseline", action="store_true", help="skip the engine without the drafter (tokens/s)")
    parser.add_argument("--output", default=None, help="folder for the export and results (default: "
                                                       "<run>/<engine>)")
    parser.add_argument("--result", action="store_true", help="also write benchmarks/results/engine_check.json "
                                                              "(vLLM) or engine_llamacpp.json (llama.cpp)")
    parser.add_argument("--result-name", default=None,
                        help="write the result file under this name instead (implies --result; e.g. "
                             "engine_llamacpp_ar for a second drafter kind's check beside the first)")
    add_results_dir(parser)
    parser.add_argument("--artifacts", default=None,
                        help="the command that made --run and --exported (e.g. 'drafter-pipeline pipeline=engine_artifacts'): "
                             "the result file's command starts with it")
    args = parser.parse_args(argv)
    if args.ours_from and args.engine != "llamacpp":
        parser.error("--ours-from: llama.cpp checks only")
    if args.result_name is not None:
        if not args.result_name.replace("_", "").replace("-", "").isalnum():
            parser.error(f"--result-name {args.result_name!r}: a plain file name (letters, digits, _ and -), "
                         "written as benchmarks/results/<name>.json")
        args.result = True
    try:
        return run_check(args)
    except DrafterTrainError as err:
        sys.exit(f"engine_check: {err}")


def run_check(args) -> int:
    """The checkpoint's check in its engine; the verdict printed, the result file written with --result."""
    from drafter_train.config import ExportConfig
    from drafter_train.recipes.export import resolve_checkpoint

    step_dir = resolve_checkpoint(ExportConfig(run_dir=args.run, checkpoint=args.checkpoint, which=args.which))
    spec = CheckSpec(prompts=args.prompts, num_prompts=args.num_prompts,
                     categories=args.categories.split(",") if args.categories else None, max_new_tokens=args.max_new_tokens,
                     draft_len=args.draft_len, tolerance=args.tolerance, baseline=not args.no_baseline,
                     threads=args.threads, output=args.output, exported=args.exported, llamacpp=args.llamacpp,
                     gguf_type=args.gguf_type, target_gguf=args.target_gguf, spec_type=args.spec_type,
                     lookups=args.lookups, lookup_corpus=args.lookup_corpus, vllm_python=args.vllm_python,
                     ours_from=args.ours_from)
    if args.engine == "llamacpp":
        result = check_llamacpp(step_dir, spec)
        print(json.dumps(result, indent=2))
        if args.result:
            write_llamacpp_result(result, args, args.results_dir)
        print_llamacpp_verdict(result, args.tolerance)
    else:
        result = check_vllm(step_dir, spec)
        print(json.dumps(result, indent=2))
        if args.result:
            write_engine_result(result, args, args.results_dir)
        print_vllm_verdict(result, args.tolerance)
    return 0 if result["ok"] else 1


def print_vllm_verdict(result: dict, tolerance: float) -> None:
    ours, vllm = result["ours"], result["vllm"]
    print(f"engine_check: {'AGREE' if result['ok'] else 'DISAGREE'}: acceptance length implied by per-position "
          f"acceptance: ours {ours['implied_acceptance_length']:.3f}, vLLM {vllm['implied_acceptance_length']:.3f} "
          f"(tolerance {tolerance}); measured mean acceptance length ours {ours['mean_acceptance_length']:.3f}, vLLM "
          f"{vllm['mean_acceptance_length']:.3f}")


def differing(record: dict) -> Optional[str]:
    """How many prompts' speculative output differs from plain, and in how many of them the plain server's replay
    showed a near tie (None: not compared)."""
    if "output_mismatches" not in record:
        return None
    same = record.get("same_output_as_plain") or {}
    shown = f" (near tie shown in {same['near_ties_shown']})" if "near_ties_shown" in same else ""
    return f"{len(record['output_mismatches'])}{shown}"


def print_llamacpp_verdict(result: dict, tolerance: float) -> None:
    record = result["llamacpp"]
    mismatched = differing(record)
    verdict = "SIDE BY SIDE (lookups differ: not compared)" if result["comparison"]["agree"] is None else \
        "AGREE" if result["ok"] else "DISAGREE"
    print(f"engine_check: {verdict}: per-position acceptance ours "
          f"{_rates(result['ours'])}, llama.cpp {_rates(record)} (tolerance {tolerance}); "
          + (f"speculative output differs from plain in {mismatched} of {result['num_prompts']} prompts; "
             if mismatched is not None else "speculative output not compared with plain (--no-baseline); ")
          + f"llama.cpp {record['spec_tokens_per_s']:.1f} tok/s with the drafter"
          + (f", {record['plain_tokens_per_s']:.1f} without" if "plain_tokens_per_s" in record else ""))


def result_command(artifacts: Optional[str], argv=None) -> str:
    """The result file's command: this one (without --artifacts), after the command that made its artifacts."""
    from benchmarks.common import command_line

    given, kept = list(sys.argv[1:] if argv is None else argv), []
    for i, arg in enumerate(given):
        if not (arg == "--artifacts" or arg.startswith("--artifacts=") or (i and given[i - 1] == "--artifacts")):
            kept.append(arg)
    command = command_line("engine_check", kept)
    return f"{artifacts} && {command}" if artifacts else command


def _rates(acceptance: dict) -> str:
    return "[" + " ".join(f"{a:.3f}" for a in acceptance["per_position_acceptance"]) + "]"


def write_engine_result(result: dict, args, results_dir: Optional[Path] = None) -> Path:
    """benchmarks/results/engine_check.json (or --result-name): our evaluator's acceptance beside vLLM's, and vLLM's
    own speedup."""
    from benchmarks.common import RESULTS_DIR, split_name, write_result

    ours, vllm = result["ours"], result["vllm"]
    rows = [["this project's decoder", ours["implied_acceptance_length"], ours["mean_acceptance_length"],
             " ".join(f"{a:.2f}" for a in ours["per_position_acceptance"]), ours["speedup"], None],
            ["vLLM", vllm["implied_acceptance_length"], vllm["mean_acceptance_length"],
             " ".join(f"{a:.2f}" for a in vllm["per_position_acceptance"]), vllm.get("speedup_sequential"),
             vllm.get("speedup_batched")]]
    return write_result(
        args.result_name or "engine_check", title=f"The exported {result['kind']} drafter served by vLLM",
        question="Does a real serving engine accept the exported drafter's drafts as often as our evaluator does?",
        command=result_command(args.artifacts), split=split_name(args.prompts, result["num_prompts"]),
        baseline="each decoder's own plain decoding (ours: this project's decoder; vLLM: the engine without the "
                 "drafter, one prompt at a time and batched)",
        columns=["decoder", "acceptance length (implied)", "mean acceptance length", "per-position acceptance",
                 "speedup (one prompt at a time)", "speedup (batched)"], rows=rows,
        notes=f"vLLM method {result['method']}, draft_len {result['draft_len']}, greedy, {result['max_new_tokens']} "
              f"new tokens per prompt; agree within {args.tolerance}: {result['comparison']['agree']}.",
        results_dir=results_dir or RESULTS_DIR)


def write_llamacpp_result(result: dict, args, results_dir: Optional[Path] = None) -> Path:
    """benchmarks/results/engine_llamacpp.json (or --result-name): our evaluator's acceptance beside llama.cpp's, and
    llama.cpp's tokens/s with and without the drafter (its own plain decoding is the baseline)."""
    from benchmarks.common import RESULTS_DIR, split_name, write_result

    ours, engine = result["ours"], result["llamacpp"]
    rows = [["this project's decoder", ours["implied_acceptance_length"], ours["mean_acceptance_length"],
             " ".join(f"{a:.3f}" for a in ours["per_position_acceptance"]), ours["spec_tokens_per_s"],
             ours["ar_tokens_per_s"], ours["speedup"], None],
            [f"llama.cpp ({engine['gguf_type']}" + (f", {engine['kv_cache']} KV cache" if "kv_cache" in engine else "")
             + f", --spec-type {engine['spec_type']})",
             engine["implied_acceptance_length"], engine["mean_acceptance_length"],
             " ".join(f"{a:.3f}" for a in engine["per_position_acceptance"]), engine["spec_tokens_per_s"],
             engine.get("plain_tokens_per_s"), engine.get("speedup"),
             differing(engine)]]
    return write_result(
        args.result_name or "engine_llamacpp",
        title=f"The exported {result['kind']} drafter of {result['target']} served by llama.cpp"
              + (f" ({engine['gguf_type']} target file)" if result.get("target_gguf") else ""),
        question="Does llama.cpp accept the GGUF-exported drafter's drafts as often as our evaluator does, and does "
                 "speculation pay inside llama.cpp?",
        command=result_command(args.artifacts), split=split_name(args.prompts, result["num_prompts"]),
        baseline="each decoder's own plain decoding (ours: this project's decoder; llama.cpp: llama-server "
                 "without the drafter), one prompt at a time",
        columns=["decoder", "acceptance length (implied)", "mean acceptance length", "per-position acceptance",
                 "tokens/s with drafter", "tokens/s plain", "speedup", "prompts whose output differs from plain"],
        rows=rows,
        notes=f"draft_len {result['draft_len']}, greedy, {result['max_new_tokens']} new tokens per prompt, "
              f"{engine['threads']} threads; per-position acceptance agrees within {args.tolerance}: "
              f"{result['comparison']['agree']}. Each prompt whose speculative output differs from plain is replayed "
              "on the plain server at its first difference: a near tie is shown where the margin between the two "
              "tokens is no larger than the shift one of the engine's own batch shapes (a multi-token pass, a "
              "verify step's batch) gives it, so arithmetic alone can pick either token.",
        results_dir=results_dir or RESULTS_DIR)


if __name__ == "__main__":
    sys.exit(main())
