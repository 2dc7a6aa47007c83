"""Check a DFlash drafter in vLLM: export a run's checkpoint (export.format=vllm), decode the same prompts greedily in
vLLM (speculative method "dflash") and with this project's evaluator, and compare acceptance.

    python scripts/vllm_dflash.py --run checkpoints/<run> --vllm-python /work/venvs/vllm/bin/python --draft-len 7

This interpreter exports the checkpoint, encodes the prompts (chat template) and runs drafter-eval's decoder; the
vLLM side re-runs this file with --worker under --vllm-python (an environment with vLLM, which pins its own
transformers, so the worker imports nothing of drafter_train). Both sides decode the same token ids. Reported:
mean acceptance length (1 + accepted drafts per drafting step, vLLM's definition, prefill excluded), per-position
acceptance (P(draft i accepted | drafts before it accepted)), and whether vLLM's output equals the target's own
greedy output. Results go to <output>/vllm_dflash.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def worker(request_file: str) -> None:
    """Runs under vLLM's interpreter: one engine with the DFlash drafter, greedy, all prompts at once."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter, Vector

    request = json.loads(Path(request_file).read_text())
    llm = LLM(model=request["target"], dtype="float32", max_model_len=1024, enforce_eager=True,
              disable_log_stats=False, speculative_config={"method": "dflash", "model": request["drafter"],
                                                           "num_speculative_tokens": request["draft_len"]})
    params = SamplingParams(temperature=0, max_tokens=request["max_new_tokens"], stop_token_ids=request["eos"])
    began = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params)
    seconds = time.perf_counter() - began
    metrics = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = metric.value
        elif isinstance(metric, Vector) and metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = metric.values
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "metrics": metrics, "seconds": seconds}
    Path(request["result"]).write_text(json.dumps(result))


def acceptance_from_vllm(metrics: dict) -> dict:
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    reached = [drafts] + per_pos[:-1]  # position i is reached in the steps where drafts 1..i-1 were accepted
    return {"mean_acceptance_length": 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts,
            "per_position_acceptance": [a / r if r else 0.0 for a, r in zip(per_pos, reached)], "drafting_steps": drafts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="drafter-train run folder of a DFlash drafter (its best checkpoint)")
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--draft-len", type=int, default=7)
    parser.add_argument("--prompts", default="prompts/heldout-mix.jsonl")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default=None, help="folder for the export and results (default: <run>/vllm)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from omegaconf import OmegaConf

    from drafter_train.config import DrafterConfig, EvalConfig, TargetConfig
    from drafter_train.data.prompts import load_prompt_records
    from drafter_train.decoding.autoregressive import generate_autoregressive
    from drafter_train.drafters.loading import load_drafter
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.evaluate import evaluate_decoding
    from drafter_train.export import ExportConfig, export
    from drafter_train.targets import embedded_folder, encode_prompt, eos_token_ids, load_target

    run = Path(args.run)
    out = Path(args.output or run / "vllm")
    export(ExportConfig(run_dir=str(run), which="best", output_dir=str(out / "drafter"), overwrite=True,
                        format="vllm"))
    target_cfg = TargetConfig(**OmegaConf.to_container(OmegaConf.load(run / "config.yaml").target))
    target, tokenizer = load_target(target_cfg)
    eos = eos_token_ids(target, tokenizer)
    records = load_prompt_records(args.prompts, args.num_prompts, None)
    prompts = [encode_prompt(tokenizer, text, target_cfg.chat_template) for text, _ in records]

    drafter = load_drafter(DrafterConfig(path=str(run / "best" / "drafter")), target, tokenizer, "float32")
    eval_cfg = EvalConfig(draft_len=args.draft_len, max_new_tokens=args.max_new_tokens, warmup=0)
    ours = evaluate_decoding(target, make_drafter(drafter), prompts, eval_cfg, eos, progress=True)
    ar = [generate_autoregressive(target, p, args.max_new_tokens, eos_token_ids=eos).tokens for p in prompts]

    folder = embedded_folder(target_cfg.path, target_cfg.cache_dir) if target_cfg.path.startswith("embedded:") \
        else target_cfg.path  # vLLM loads an HF folder
    request = {"target": str(folder), "drafter": str(out / "drafter"), "prompts": prompts,
               "draft_len": args.draft_len, "max_new_tokens": args.max_new_tokens, "eos": sorted(eos),
               "result": str(out / "vllm_raw.json")}
    (out / "request.json").write_text(json.dumps(request))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    env.pop("PYTHONPATH", None)  # the worker imports vLLM's own packages only
    subprocess.run([args.vllm_python, __file__, "--worker", str(out / "request.json")], check=True, env=env)
    raw = json.loads((out / "vllm_raw.json").read_text())
    result = {
        "draft_len": args.draft_len, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "ours": {"mean_acceptance_length": 1 + ours["accepted_draft_tokens"] / max(ours["proposals"], 1),
                 "per_position_acceptance": ours["per_position_acceptance"], "tau": ours["tau"],
                 "drafting_steps": ours["proposals"], "greedy_match": ours["greedy_match"]},
        "vllm": dict(acceptance_from_vllm(raw["metrics"]), seconds=raw["seconds"],
                     greedy_match=sum(a == v for a, v in zip(ar, raw["tokens"])) / len(ar)),
        "load_avg": os.getloadavg(),
    }
    (out / "vllm_dflash.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
