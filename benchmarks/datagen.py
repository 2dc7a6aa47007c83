"""Benchmark: drafter-datagen's vLLM (or llama.cpp) backend against its HF backend on the same prompts.

    python -m benchmarks.datagen throughput --vllm-python .venv-vllm/bin/python   # tokens/s and agreement
    python -m benchmarks.datagen throughput --engine llamacpp --datagen-overrides target=qwen2.5-coder-1.5b
    python -m benchmarks.datagen tau --vllm-python .venv-vllm/bin/python          # drafters trained on each

throughput: the same training prompts are continued greedily by both backends, `--in-flight` prompts at a time (HF:
datagen.batch_size; vLLM: datagen.vllm.max_num_seqs, the whole prompt set sent at once; llama.cpp:
datagen.llamacpp.parallel slots of llama-server on the target's GGUF, `--threads` threads), interleaved HF / vLLM
`--repeats` times after an untimed warm-up; tokens/s is generated tokens over generate time (engine start
excluded; it is printed apart).
tau: drafter-datagen writes one folder per backend (same prompts, same held-out eval prompts), then the same short
drafter-train run (`--train-overrides`, one per `--seeds`) trains a drafter on each; every final drafter then
decodes the shared held-out prompts speculatively (greedy, `--draft-len`; greedy output is the target's own, so the
AR pass drafter-eval adds for speedup is skipped): tau = tokens / target passes. Seeds measure the noise.

Both report agreement: the share of prompts whose greedy responses are token-identical, and at each first
divergence the HF target's top-1 minus top-2 logit (as drafter-eval reports for greedy mismatches): differences of
float kernels flip only near-ties. Results go to <output-root>/<mode>.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from drafter_train.recipes.cli import compose_config

from benchmarks.common import command_line, write_result
from drafter_train.data.generation import HFBackend
from drafter_train.data.llamacpp_backend import LlamaCppBackend
from drafter_train.data.sources import open_source, select_prompts
from drafter_train.data.vllm_backend import VllmBackend
from drafter_train.drafters.registry import make_drafter
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.stats import DecodeStats
from drafter_train.decoding.verify import verify_greedy
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.evaluation import divergence_margin
from drafter_train.data.store import load_distill_dataset
from drafter_train.recipes.datagen import Throughput, pad_id, generate_shard, run_datagen
from drafter_train.targets import eos_token_ids, load_target
from drafter_train.data.training_data import eval_prompt_ids
from drafter_train.recipes.train import train


def agreement(target, prompts: list[list[int]], reference: list[list[int]], other: list[list[int]]) -> dict:
    """Token-identical share, and the HF target's top-1 minus top-2 logit where each mismatching pair parts."""
    mismatches = [(p, a, b) for p, a, b in zip(prompts, reference, other) if a != b]
    margins = sorted(divergence_margin(target, p, a, b) for p, a, b in mismatches)
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for _, a, b in mismatches]
    return {"prompts": len(prompts), "identical": 1 - len(mismatches) / len(prompts), "margins": margins,
            "first_divergence_positions": first}


def timed_run(backend, prompts, dg) -> tuple[list[list[int]], float]:
    meter = Throughput(len(prompts), 0, enabled=False)
    records = generate_shard(backend, prompts, dg, meter)
    return [r["response_ids"] for r in records], meter.tokens_per_s


def throughput(args, common: list[str]) -> dict:
    cfg = compose_config("datagen", [*common, f"datagen.num_prompts={args.num_prompts}"])
    model, tokenizer = load_target(cfg.target)
    prompts = select_prompts(open_source(cfg.datagen), tokenizer, cfg.datagen, cfg.target.chat_template).train
    eos = eos_token_ids(model, tokenizer)
    rows, outputs = [], {}
    for in_flight in args.in_flight:
        dg = dataclasses.replace(cfg.datagen, batch_size=in_flight)
        hf = HFBackend(model, tokenizer, dg, eos, pad_id(tokenizer, eos))
        samples = {"hf": [], "vllm": []}
        with engine_backend(args, common, in_flight) as vllm:
            start = time.perf_counter()
            for backend in (hf, vllm):  # untimed warm-up (for vLLM: the engine start too)
                generate_shard(backend, prompts[:2], dg, Throughput(2, 0, enabled=False))
            engine_start = time.perf_counter() - start
            for repeat in range(args.repeats):
                for name, backend in (("hf", hf), ("vllm", vllm)):
                    if isinstance(backend, LlamaCppBackend):
                        backend.done.clear()  # its resume journal would answer repeats without the server
                    outputs[name, in_flight], tokens_per_s = timed_run(backend, prompts, dg)
                    samples[name].append(tokens_per_s)
                    print(json.dumps({"in_flight": in_flight, "backend": name, "repeat": repeat,
                                      "tokens_per_s": tokens_per_s, "load": os.getloadavg()[0]}), flush=True)
        ids = [p.prompt_ids for p in prompts]
        rows.append({
            "in_flight": in_flight, "hf_tokens_per_s": statistics.median(samples["hf"]),
            "vllm_tokens_per_s": statistics.median(samples["vllm"]), "samples": samples,
            "warmup_and_engine_start_s": engine_start,
            "agreement": agreement(model, ids, outputs["hf", in_flight], outputs["vllm", in_flight]),
            # Batching alone moves float results too: HF against itself at the first in-flight setting.
            "hf_vs_hf_first": agreement(model, ids, outputs["hf", args.in_flight[0]], outputs["hf", in_flight]),
        })
    print(f"\nmedians of {args.repeats}; {len(prompts)} prompts x up to {cfg.datagen.max_new_tokens} tokens")
    other = "llama.cpp" if args.engine == "llamacpp" else "vLLM"  # the rows' "vllm" keys hold either engine's figures
    print(f"| prompts in flight | HF tokens/s | {other} tokens/s | {other} / HF | identical responses "
          "| margins at divergence |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a = r["agreement"]
        print(f"| {r['in_flight']} | {r['hf_tokens_per_s']:.1f} | {r['vllm_tokens_per_s']:.1f} | "
              f"{r['vllm_tokens_per_s'] / r['hf_tokens_per_s']:.2f} | {a['identical']:.3f} | "
              f"{', '.join(f'{m:.3f}' for m in a['margins'])} |")
    return {"rows": rows}


def tau(args, common: list[str]) -> dict:
    root = Path(args.output_root)
    folders = {}
    for backend, extra in (("hf", [f"datagen.batch_size={min(16, args.num_prompts)}"]), ("vllm", vllm_overrides(args))):
        start = time.perf_counter()
        folders[backend] = run_datagen(compose_config("datagen", [
            *common, f"datagen.num_prompts={args.num_prompts}", f"datagen.output_dir={root / ('data-' + backend)}",
            f"datagen.backend={backend}", *extra]))
        print(f"datagen {backend}: {time.perf_counter() - start:.0f} s", flush=True)
    data = {name: load_distill_dataset(folder) for name, folder in folders.items()}
    assert data["hf"]["prompt_ids"] == data["vllm"]["prompt_ids"]
    target, tokenizer = load_target(compose_config("datagen", common).target)
    result = {"agreement": agreement(target, data["hf"]["prompt_ids"], data["hf"]["response_ids"],
                                     data["vllm"]["response_ids"]), "runs": []}
    runs = {}
    for seed in args.seeds:
        for backend, folder in folders.items():
            runs[backend, seed] = compose_config("train", [
                f"train.data_dir={folder}", f"train.output_root={root}", f"train.run_name={backend}-seed{seed}",
                f"train.seed={seed}", f"drafter.draft_len={args.draft_len}", *args.train_overrides])
            train(runs[backend, seed])  # a finished run returns at once
    cfg = runs["hf", args.seeds[0]]
    prompts = eval_prompt_ids(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_prompts=10**6)),
                              tokenizer)  # every held-out prompt: the same for both folders
    eos = eos_token_ids(target, tokenizer)
    measured = {}  # weights sha256 -> run: identical data and seed train byte-identical drafters (greedy decoding
    for (backend, seed), run in runs.items():  # of the same weights gives the same tau, so it is not redone)
        last = Path(run.train.output_root) / run.train.run_name / "latest" / "drafter"  # step 60
        digest = hashlib.sha256((last / "model.safetensors").read_bytes()).hexdigest()
        if digest in measured:
            row = dict(measured[digest], backend=backend, seed=seed, same_weights_as=measured[digest]["run"])
        else:
            drafter = make_drafter(load_drafter(dataclasses.replace(run.drafter, path=str(last)), target, tokenizer,
                                                "float32"))
            stats = DecodeStats(draft_len=args.draft_len)
            for prompt in prompts:
                stats.merge(generate_speculative(target, drafter, prompt, args.draft_len, verify_greedy,
                                                 args.eval_tokens, eos_token_ids=eos).stats)
            row = measured[digest] = {"backend": backend, "seed": seed, "run": run.train.run_name, "tau": stats.tau,
                                      "acceptance_rate": stats.acceptance_rate, "prompts": len(prompts)}
        result["runs"].append(dict(row, run=run.train.run_name, weights_sha256=digest))
        print(json.dumps(result["runs"][-1]), flush=True)
    a = result["agreement"]
    print(f"\nidentical responses {a['identical']:.3f} of {a['prompts']}; margins {a['margins']}")
    print("| data from | " + " | ".join(f"tau seed {s}" for s in args.seeds) + " |")
    print("|---|" + "---|" * len(args.seeds))
    for backend in folders:
        taus = [r["tau"] for r in result["runs"] if r["backend"] == backend]
        print(f"| {backend} | " + " | ".join(f"{t:.3f}" for t in taus) + " |")
    return result


def engine_backend(args, common: list[str], in_flight: int):
    """The backend compared with HF (named "vllm" in the figures whatever --engine says, for older result files)."""
    log_dir = f"datagen.output_dir={Path(args.output_root) / 'throughput'}"  # its log (and llama.cpp's journal)
    if args.engine == "llamacpp":
        return LlamaCppBackend(compose_config("datagen", [
            *common, "datagen.backend=llamacpp", f"datagen.llamacpp.parallel={in_flight}",
            f"datagen.llamacpp.threads={args.threads}", log_dir]))
    return VllmBackend(compose_config("datagen", [*common, *vllm_overrides(args),
                                                  f"datagen.vllm.max_num_seqs={in_flight}", log_dir]))


def write_llamacpp_result(args, rows: list[dict], prompts: int, max_new: int) -> None:
    """benchmarks/results/datagen_llamacpp.json: tokens/s of both backends and their agreement, on this CPU."""
    write_result(
        "datagen_llamacpp", title="drafter-datagen: llama.cpp backend (llama-server slots) vs HF backend",
        question="How fast does llama-server make training data on the target's GGUF, against transformers "
                 "generate on its dequantised float32 copy, and how often are their greedy answers identical?",
        command=command_line("datagen"), split=f"training prompts ({prompts}, up to {max_new} tokens)",
        baseline="datagen.backend=hf, same prompts, batch = slots",
        columns=["prompts in flight", "HF tok/s", "llama.cpp tok/s", "llama.cpp / HF", "identical answers"],
        rows=[[r["in_flight"], r["hf_tokens_per_s"], r["vllm_tokens_per_s"],
               r["vllm_tokens_per_s"] / r["hf_tokens_per_s"], r["agreement"]["identical"]] for r in rows],
        notes=f"{args.threads} threads for llama-server; HF in this process with torch's threads. Medians of "
              f"{args.repeats}. llama.cpp runs the Q4_K arithmetic of the GGUF itself, HF the dequantised weights "
              "in float32: answers part where the top two logits nearly tie (margins in the run's JSON).")


def vllm_overrides(args) -> list[str]:
    return ["datagen.backend=vllm", f"datagen.vllm_python={args.vllm_python}",
            f"datagen.vllm.enforce_eager={str(args.enforce_eager).lower()}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("throughput", "tau"))
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm", help="the backend compared with HF")
    parser.add_argument("--threads", type=int, default=2, help="llamacpp: llama-server's threads")
    parser.add_argument("--vllm-python", default=sys.executable, help="python of an environment with vLLM")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 64 (throughput), 128 (tau)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 96 (throughput), 64 (tau)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--eval-tokens", type=int, default=64, help="tau: tokens decoded per held-out prompt")
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                        help="let vLLM compile (slower start; on CPU eager is what was measured)")
    parser.add_argument("--output-root", default="checkpoints/datagen-bench")
    parser.add_argument("--datagen-overrides", nargs="*", default=[], help="drafter-datagen overrides for both")
    parser.add_argument("--train-overrides", nargs="*", default=[
        "drafter.path=truncated:2", "loss=ce", "train.max_steps=60", "train.save_every=60", "train.batch_size=8",
        "train.lr=2e-3", "train.eval_at_start=false", "eval.num_prompts=1", "eval.max_new_tokens=8",
        "eval.warmup=0"], help="tau: the trainer's own checkpoint evaluation is kept minimal (tau is measured after)")
    args = parser.parse_args()
    thru = args.mode == "throughput"
    args.num_prompts = args.num_prompts or (64 if thru else 128)
    max_new = args.max_new_tokens or (96 if thru else 64)
    common = [f"datagen.max_new_tokens={max_new}", "datagen.max_prompt_tokens=128", "datagen.num_eval_prompts=16",
              f"datagen.shard_size={args.num_prompts}", *args.datagen_overrides]
    result = (throughput if thru else tau)(args, common)
    if thru and args.engine == "llamacpp":
        write_llamacpp_result(args, result["rows"], args.num_prompts, max_new)
    out = Path(args.output_root)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.mode}.json").write_text(json.dumps(
        {"args": vars(args), "load_avg_end": os.getloadavg(), **result}, indent=2))
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
