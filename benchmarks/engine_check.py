"""Serve an exported drafter in vLLM or llama.cpp and compare its acceptance with this project's evaluator on the same
prompts.

    python -m benchmarks.engine_check --run checkpoints/<run> [--which best] [--vllm-python VENV/bin/python]
    python -m benchmarks.engine_check --engine llamacpp --run checkpoints/<run> [--gguf-type f32]
    python -m benchmarks.engine_check --checkpoint checkpoints/<run>/step-100 --exported exports/my-drafter

One tool for every drafter kind with a vLLM export format (EAGLE-3, DFlash, stand-alone AR drafters); any other kind
is refused in one line before anything runs.

1. Export: `drafter-export export.format=vllm` of the checkpoint (or --exported: a folder exported before). The
   drafter kind decides the format and vLLM's method (DrafterKind.engine_methods["vllm"]): EAGLE-3 -> the
   speculators format, method eagle3; DFlash -> its DFlashDraftModel folder, method dflash; stand-alone AR
   drafters -> their HF folder, method draft_model.
2. A speculators-format folder is also loaded with the `speculators` package's own config and model classes:
   every exported tensor must land in the model unchanged (no key left at its random init, d2t/t2d present).
3. vLLM (greedy, num_speculative_tokens = draft_len, enforce_eager) decodes the prompts in a worker process under
   --vllm-python (vLLM pins its own transformers, so the worker imports nothing of drafter_train), once with the
   drafter and once without: acceptance from llm.get_metrics(), tokens/s batched (all prompts at once, as a server
   runs them) and one prompt at a time (as our evaluator does).
4. Our evaluator (drafter-eval's decoder, greedy, same token ids, same token budget) decodes the same prompts.
5. Compared: per-position acceptance (P(draft i accepted | drafts before it accepted)) and the acceptance length it
   implies (1 + sum over i of the product of the first i rates). They agree when each differs by at most
   --tolerance (absolute). Both decoders see the same target features and the same greedy output; what may differ
   is float rounding in the drafter (vLLM's kernels vs torch's: a near-tie flips a draft). The measured mean
   acceptance length (1 + accepted drafts per drafting step, vLLM's definition) is reported too, but differs at the
   token budget: in a request's last step we draft only what fits, vLLM drafts num_speculative_tokens and counts
   drafts accepted past max_tokens (short outputs at high acceptance show it most).

llama.cpp (--engine llamacpp; benchmarks/llamacpp_engine.py): the checkpoint is exported with
`drafter-export export.format=gguf` (target and drafter, --gguf-type), served by llama-server (greedy, the same
prompt token ids, --spec-type the kind's: draft-eagle3 / draft-simple) with and without the drafter. Compared:
per-position acceptance from the server's per-step log against ours (same tolerance), the engine's speculative
output against its own plain output token by token (mismatches are listed: rounding at near-ties in the engine,
reported rather than hidden), and llama.cpp's tokens/s with and without the drafter. --lookups puts llama.cpp's
n-gram modes ahead of the drafter in one --spec-type list (the product; --lookup-corpus adds the corpus as a static
n-gram cache) and our lookups ahead of ours; the two acceptances are then reported side by side, not compared. Results:
<output>/llamacpp_check.json (with --result also benchmarks/results/engine_llamacpp.json; --result-name NAME writes
benchmarks/results/NAME.json instead, e.g. a second drafter kind's check). The build: scripts/setup_llamacpp.sh.

Results (vLLM): <output>/vllm_check.json (and printed; with --result also benchmarks/results/engine_check.json); exit status
1 when they disagree or the speculators check fails.
The vLLM environment: scripts/setup_vllm.sh (default $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm in the repo).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# Only the standard library at the top: vLLM's interpreter runs this file as a script (--worker), without
# drafter_train or this package on its path.
REPO = Path(__file__).resolve().parent.parent
DEFAULT_TOLERANCE = 0.1


def default_vllm_python() -> Path:
    return Path(os.environ.get("DRAFTER_TRAIN_VLLM_VENV") or REPO / ".venv-vllm") / "bin" / "python"


# ----------------------------------------------------------------------------------------------------------------
# The vLLM side (runs under --vllm-python; standard library, vLLM and speculators only)


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
# Comparing


def acceptance_from_vllm(metrics: dict) -> dict:
    """vLLM's spec-decode counters -> mean acceptance length and conditional per-position acceptance."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    reached = [drafts] + per_pos[:-1]  # draft i is checked in the steps where drafts 1..i-1 were accepted
    per_position = [a / r if r else 0.0 for a, r in zip(per_pos, reached)]
    return {"mean_acceptance_length": 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / max(drafts, 1),
            "implied_acceptance_length": implied_acceptance_length(per_position),
            "per_position_acceptance": per_position, "drafting_steps": drafts, "accepted_per_position": per_pos}


def implied_acceptance_length(per_position: list[float]) -> float:
    """1 + expected accepted drafts per full drafting step, from the conditional per-position acceptance."""
    length, reach = 1.0, 1.0
    for rate in per_position:
        reach *= rate
        length += reach
    return length


def compare(ours: dict, vllm: dict, tolerance: float) -> dict:
    """Absolute differences of each position's acceptance and of the acceptance length they imply, and the verdict.

    The headline mean acceptance lengths differ at the token budget: in the last step of a request we draft only
    the tokens that fit, vLLM drafts num_speculative_tokens and counts accepted drafts past max_tokens. Conditional
    per-position acceptance is unbiased by that on both sides, so the verdict compares it and the length it implies.
    """
    length = abs(implied_acceptance_length(ours["per_position_acceptance"])
                 - implied_acceptance_length(vllm["per_position_acceptance"]))
    positions = [abs(a - b) for a, b in zip(ours["per_position_acceptance"], vllm["per_position_acceptance"])]
    return {"tolerance": tolerance, "implied_acceptance_length_diff": length, "per_position_diff": positions,
            "agree": length <= tolerance and all(d <= tolerance for d in positions)}


# ----------------------------------------------------------------------------------------------------------------
# This project's side


def vllm_env(**settings: str) -> dict:
    """The environment of a vLLM worker process: offline, vLLM's CPU settings (KV cache GiB, the cores its threads
    bind to: defaults unless set, `settings` override), nothing of ours on its path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.update(settings)
    env.pop("PYTHONPATH", None)  # the worker imports vLLM's own packages only
    env.pop("LD_PRELOAD", None)  # libiomp made spec decoding 2-3x slower here
    return env


def worker_command(vllm_python: str, script: str, *args: str) -> list[str]:
    """`script` under vLLM's interpreter. -P: benchmarks/ stays off the worker's path, or its kernels.py shadows the
    `kernels` package transformers probes."""
    return [vllm_python, "-P", str(Path(script).resolve()), *args]


def run_vllm(vllm_python: str, request: dict, folder: Path, name: str) -> dict:
    request = dict(request, result=str(folder / f"{name}_raw.json"))
    (folder / f"{name}_request.json").write_text(json.dumps(request))
    subprocess.run(worker_command(vllm_python, __file__, "--worker", str(folder / f"{name}_request.json")),
                   check=True, env=vllm_env())
    return json.loads((folder / f"{name}_raw.json").read_text())


def local_target(path: str, cache_dir: Optional[str] = None) -> str:
    """The target's local folder for vLLM (an embedded: target's cached folder)."""
    from drafter_train.targets import embedded_folder

    return str(embedded_folder(path, cache_dir) if path.startswith("embedded:") else Path(path).absolute())


def vllm_method(kind) -> str:
    """vLLM's speculative method for a drafter kind; exits with one line for a kind vLLM cannot serve from an export
    (no export.format=vllm: the kind neither writes one nor is a plain causal LM transformers can drive)."""
    from drafter_train.drafters.registry import all_kinds

    def servable(k) -> bool:
        return "vllm" in k.engine_methods and (k.hf_assistant or "vllm" in k.export_formats)

    if not servable(kind):
        sys.exit(f"engine_check: {kind.description} (drafter kind {kind.name}) has no vLLM export format; kinds "
                 f"with one: {', '.join(k.name for k in all_kinds() if servable(k))}")
    return kind.engine_methods["vllm"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a drafter-train run folder (with --which)")
    source.add_argument("--checkpoint", help="one step folder of a run")
    source.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm")
    parser.add_argument("--which", default="best", help="with --run: best, latest or step-N")
    parser.add_argument("--exported", help="an export of that checkpoint (export.format=vllm, or gguf with "
                                           "--engine llamacpp) to serve instead of exporting it again")
    parser.add_argument("--vllm-python", default=str(default_vllm_python()))
    parser.add_argument("--llamacpp", default=None, help="the llama.cpp folder scripts/setup_llamacpp.sh built "
                                                         "(default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp)")
    parser.add_argument("--gguf-type", default="f32", help="llama.cpp: precision of the exported target "
                                                           "(f32, f16, q8_0; the drafter is f32 with f32, else f16)")
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
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--no-baseline", action="store_true", help="skip the engine without the drafter (tokens/s)")
    parser.add_argument("--output", default=None, help="folder for the export and results (default: "
                                                       "<run>/<engine>)")
    parser.add_argument("--result", action="store_true", help="also write benchmarks/results/engine_check.json "
                                                              "(vLLM) or engine_llamacpp.json (llama.cpp)")
    parser.add_argument("--result-name", default=None,
                        help="write the result file under this name instead (implies --result; e.g. "
                             "engine_llamacpp_ar for a second drafter kind's check beside the first)")
    parser.add_argument("--artifacts", default=None,
                        help="the command that made --run and --exported (e.g. 'bash benchmarks/engine_artifacts.sh'): "
                             "the result file's command starts with it")
    args = parser.parse_args(argv)
    if args.result_name is not None:
        if not args.result_name.replace("_", "").replace("-", "").isalnum():
            parser.error(f"--result-name {args.result_name!r}: a plain file name (letters, digits, _ and -), "
                         "written as benchmarks/results/<name>.json")
        args.result = True
    if args.worker:
        worker(args.worker)
        return 0
    return check_llamacpp(args) if args.engine == "llamacpp" else check_vllm(args)


def _checkpoint(args, fmt: str, **export_fields):
    """(export config, step folder, run info) of the checkpoint to check."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from drafter_train.recipes.export import ExportConfig, resolve_checkpoint
    from drafter_train.model_card import read_run_info

    export_cfg = ExportConfig(run_dir=args.run, checkpoint=args.checkpoint, which=args.which, format=fmt,
                              **export_fields)
    step_dir = resolve_checkpoint(export_cfg)
    return export_cfg, step_dir, read_run_info(step_dir)


def _exported(args, export_cfg, out: Path) -> Path:
    """--exported, else a fresh export of the checkpoint into out/drafter."""
    from drafter_train.recipes.export import export

    if args.exported:
        return Path(args.exported).absolute()
    export_cfg.output_dir, export_cfg.overwrite = str(out / "drafter"), True
    export(export_cfg)
    return out / "drafter"


def _ours(args, step_dir: Path, info, draft_len: int):
    """The run's target and prompts, and our evaluator on them (greedy): (target config, target, prompts, eos,
    our acceptance record, our evaluation)."""
    from drafter_train.config import DrafterConfig, EvalConfig, TargetConfig
    from benchmarks.common import prompt_ids
    from drafter_train.drafters.common.loading import load_drafter
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.evaluation import evaluate_decoding
    from drafter_train.targets import eos_token_ids, load_target

    fields = {f.name for f in dataclasses.fields(TargetConfig)}
    target_cfg = TargetConfig(**{k: v for k, v in info.config.get("target", {}).items() if k in fields})
    target, tokenizer = load_target(target_cfg)
    eos = eos_token_ids(target, tokenizer)
    prompts, _ = prompt_ids(tokenizer, target_cfg, args.prompts, args.num_prompts)
    drafter = load_drafter(DrafterConfig(path=str(step_dir / "drafter")), target, tokenizer, "float32")
    eval_cfg = EvalConfig(draft_len=draft_len, max_new_tokens=args.max_new_tokens, warmup=1,
                          lookup=our_lookups(args.lookups, args.lookup_corpus))
    ours = evaluate_decoding(target, make_drafter(drafter), prompts, eval_cfg, eos, progress=True)
    acceptance = {"mean_acceptance_length": 1 + ours["accepted_draft_tokens"] / max(ours["proposals"], 1),
                  "implied_acceptance_length": implied_acceptance_length(ours["per_position_acceptance"]),
                  "per_position_acceptance": ours["per_position_acceptance"], "drafting_steps": ours["proposals"],
                  "tau": ours["tau"]}
    record = dict(acceptance, greedy_match=ours["greedy_match"], spec_tokens_per_s=ours["spec_tokens_per_s"],
                  ar_tokens_per_s=ours["ar_tokens_per_s"], speedup=ours["speedup"])
    return target_cfg, target, prompts, eos, acceptance, record


def our_lookups(lookups: Optional[str], corpus: Optional[str]):
    """Our lookups beside llama.cpp's --lookups: prompt lookup (min_ngram 2, the main job's), and corpus lookup on
    the same corpus; off without --lookups."""
    from drafter_train.config import CorpusLookupConfig, LookupConfig

    return LookupConfig(min_ngram=2, corpus=CorpusLookupConfig(path=corpus)) if lookups else LookupConfig()


def check_vllm(args) -> int:
    export_cfg, step_dir, info = _checkpoint(args, "vllm")
    method = vllm_method(info.kind)
    if not Path(args.vllm_python).is_file():
        sys.exit(f"engine_check: no vLLM interpreter at {args.vllm_python} (build one with scripts/setup_vllm.sh, "
                 "or pass --vllm-python)")
    out = Path(args.output or step_dir.parent / "vllm").absolute()
    out.mkdir(parents=True, exist_ok=True)
    drafter_dir = _exported(args, export_cfg, out)
    draft_len = args.draft_len or info.draft_len
    exported_config = json.loads((drafter_dir / "config.json").read_text())
    target_cfg, target, prompts, eos, ours_acceptance, ours_record = _ours(args, step_dir, info, draft_len)
    target_folder = local_target(target_cfg.path, target_cfg.cache_dir)
    request = {"target": target_folder, "drafter": str(drafter_dir), "prompts": prompts, "draft_len": draft_len,
               "max_new_tokens": args.max_new_tokens, "eos": sorted(eos), "method": method,
               "max_model_len": min(1024, getattr(target.config, "max_position_embeddings", None) or 1024),
               "speculators": "speculators_model_type" in exported_config}
    served = run_vllm(args.vllm_python, request, out, "vllm_spec")
    plain = None if args.no_baseline else run_vllm(args.vllm_python, dict(request, method=None, speculators=False),
                                                   out, "vllm_plain")
    vllm_acceptance = acceptance_from_vllm(served["metrics"])
    ours_tokens = sum(len(t) for t in served["tokens"])  # vLLM's output; equal to ours when greedy is lossless
    result = {
        "engine": "vllm", "checkpoint": str(step_dir), "kind": info.kind.name, "method": method,
        "exported": str(drafter_dir), "draft_len": draft_len, "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "ours": ours_record,
        "vllm": dict(vllm_acceptance, startup_s=served["startup_s"],
                     spec_tokens_per_s_batched=ours_tokens / served["batched_s"],
                     spec_tokens_per_s_sequential=ours_tokens / served["sequential_s"]),
        "speculators": served.get("speculators"),
        "comparison": compare(ours_acceptance, vllm_acceptance, args.tolerance),
        "load_avg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if plain is not None:
        plain_tokens = sum(len(t) for t in plain["tokens"])
        result["vllm"].update(plain_tokens_per_s_batched=plain_tokens / plain["batched_s"],
                              plain_tokens_per_s_sequential=plain_tokens / plain["sequential_s"],
                              output_equals_plain=plain["tokens"] == served["tokens"])
        result["vllm"]["speedup_batched"] = result["vllm"]["spec_tokens_per_s_batched"] / \
            result["vllm"]["plain_tokens_per_s_batched"]
        result["vllm"]["speedup_sequential"] = result["vllm"]["spec_tokens_per_s_sequential"] / \
            result["vllm"]["plain_tokens_per_s_sequential"]
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = result["comparison"]["agree"] and (result["speculators"] is None or result["speculators"]["ok"])
    if args.result:
        write_engine_result(result, args)
    print(f"engine_check: {'AGREE' if ok else 'DISAGREE'}: acceptance length implied by per-position acceptance: "
          f"ours {ours_acceptance['implied_acceptance_length']:.3f}, vLLM "
          f"{vllm_acceptance['implied_acceptance_length']:.3f} (tolerance {args.tolerance}); measured mean "
          f"acceptance length ours {ours_acceptance['mean_acceptance_length']:.3f}, vLLM "
          f"{vllm_acceptance['mean_acceptance_length']:.3f}")
    return 0 if ok else 1


def check_llamacpp(args) -> int:
    """The llama.cpp engine (benchmarks/llamacpp_engine.py): the gguf export served by llama-server with and
    without the drafter, against our evaluator on the same prompt ids."""
    from benchmarks import llamacpp_engine as engine
    from drafter_train.llamacpp import DRAFTER_FILE, TARGET_FILE, llamacpp_dir, write_lookup_cache
    from drafter_train.targets import load_target_tokenizer, model_name

    root = llamacpp_dir(args.llamacpp)
    if not (root / "build" / "bin" / "llama-server").is_file():
        sys.exit(f"engine_check: no llama-server in {root}/build/bin (build it with scripts/setup_llamacpp.sh, or "
                 "pass --llamacpp)")
    export_cfg, step_dir, info = _checkpoint(args, "gguf", gguf_type=args.gguf_type, llamacpp=str(root))
    if "gguf" not in info.kind.export_formats:
        sys.exit(f"engine_check: {info.kind.description} (drafter kind {info.kind.name}) has no GGUF export")
    spec_type = llamacpp_spec_type(args.spec_type or info.kind.engine_methods["gguf"], args.lookups,
                                   args.lookup_corpus)
    out = Path(args.output or step_dir.parent / "llamacpp").absolute()
    out.mkdir(parents=True, exist_ok=True)
    exported = _exported(args, export_cfg, out)
    draft_len = args.draft_len or info.draft_len
    target_cfg, _, prompts, _, ours_acceptance, ours_record = _ours(args, step_dir, info, draft_len)
    cache = None if not args.lookup_corpus else write_lookup_cache(
        root, exported / TARGET_FILE, Path(args.lookup_corpus), out / "corpus.lookup",
        load_target_tokenizer(target_cfg))

    def serve(drafter: Optional[Path], name: str) -> dict:
        port = engine.free_port()
        command = engine.server_command(root / "build" / "bin", exported / TARGET_FILE, drafter,
                                        spec_type if drafter else None, draft_len, args.threads, port,
                                        f32_cache=args.gguf_type == "f32", lookup_cache=cache if drafter else None)
        return engine.decode_prompts(command, out / f"{name}.log", prompts, args.max_new_tokens)

    served = serve(exported / DRAFTER_FILE, "llamacpp_spec")
    engine_acceptance = engine.acceptance_from_steps(served["steps"], draft_len)
    engine_acceptance["implied_acceptance_length"] = implied_acceptance_length(
        engine_acceptance["per_position_acceptance"])
    record = dict(engine_acceptance, spec_type=spec_type, gguf_type=args.gguf_type, threads=args.threads,
                  spec_tokens_per_s=served["tokens_per_s"], draft_n=served["draft_n"],
                  draft_n_accepted=served["draft_n_accepted"])
    if not args.no_baseline:
        plain = serve(None, "llamacpp_plain")
        mismatches = engine.output_mismatches(served["tokens"], plain["tokens"])
        record.update(plain_tokens_per_s=plain["tokens_per_s"], speedup=served["tokens_per_s"] / plain["tokens_per_s"],
                      output_equals_plain=not mismatches, output_mismatches=mismatches)
    result = {
        "engine": "llamacpp", "target": model_name(target_cfg.path), "checkpoint": str(step_dir),
        "kind": info.kind.name, "method": spec_type,
        "exported": str(exported), "draft_len": draft_len, "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "ours": ours_record, "llamacpp": record,
        "comparison": compare(ours_acceptance, engine_acceptance, args.tolerance),
        "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if args.lookups:  # two lookup rules: acceptance is reported side by side, not expected to agree
        result["comparison"]["agree"] = None
    (out / "llamacpp_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = result["comparison"]["agree"] is not False and engine_acceptance["drafting_steps"] > 0
    if args.result:
        write_llamacpp_result(result, args)
    mismatched = len(record.get("output_mismatches", []))
    verdict = "SIDE BY SIDE (lookups differ: not compared)" if result["comparison"]["agree"] is None else \
        "AGREE" if ok else "DISAGREE"
    print(f"engine_check: {verdict}: per-position acceptance ours "
          f"{_rates(ours_acceptance)}, llama.cpp {_rates(engine_acceptance)} (tolerance {args.tolerance}); "
          f"speculative output differs from plain in {mismatched} of {len(prompts)} prompts; "
          f"llama.cpp {record['spec_tokens_per_s']:.1f} tok/s with the drafter"
          + (f", {record['plain_tokens_per_s']:.1f} without" if "plain_tokens_per_s" in record else ""))
    return 0 if ok else 1


NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def llamacpp_spec_type(drafter_type: str, lookups: Optional[str], lookup_corpus: Optional[str] = None) -> str:
    """llama-server's --spec-type: the drafter's type, with the --lookups n-gram modes ahead of it in one comma
    list (the product: lookups first, the drafter where they find nothing). Unknown modes, and a corpus without the
    ngram-cache mode that reads it, are refused in one line."""
    if lookup_corpus and "ngram-cache" not in (lookups or "").split(","):
        sys.exit("engine_check: --lookup-corpus is read by llama.cpp's ngram-cache mode: add --lookups ngram-cache")
    if not lookups:
        return drafter_type
    modes = [m for m in lookups.split(",") if m]
    unknown = [m for m in modes if m not in NGRAM_TYPES]
    if unknown:
        sys.exit(f"engine_check: --lookups {','.join(unknown)}: not a llama.cpp n-gram mode ({', '.join(NGRAM_TYPES)})")
    return ",".join(modes + [drafter_type])


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
            [f"llama.cpp ({engine['gguf_type']}, --spec-type {engine['spec_type']})",
             engine["implied_acceptance_length"], engine["mean_acceptance_length"],
             " ".join(f"{a:.3f}" for a in engine["per_position_acceptance"]), engine["spec_tokens_per_s"],
             engine.get("plain_tokens_per_s"), engine.get("speedup"),
             len(engine["output_mismatches"]) if "output_mismatches" in engine else None]]
    return write_result(
        args.result_name or "engine_llamacpp",
        title=f"The exported {result['kind']} drafter of {result['target']} served by llama.cpp",
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
              f"{result['comparison']['agree']}. Output differences between llama.cpp's speculative and plain "
              "decoding are rounding in the engine (a batched verify pass and a one-token pass differ at near-ties), "
              "not drafts accepted wrongly.", results_dir=results_dir or RESULTS_DIR)


if __name__ == "__main__":
    sys.exit(main())
