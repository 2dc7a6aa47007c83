"""The engine check: serve a checkpoint's exported drafter in vLLM or llama.cpp and compare its acceptance with this
project's evaluator on the same prompts (the driver, with its result files, is benchmarks/engine_check.py).

One check for every drafter kind with an export for the engine; any other kind is refused in one line before
anything runs.

vLLM:
1. The kind's vLLM folder (engines/export.py: EAGLE-3 -> the speculators format, method eagle3; DFlash -> its
   DFlashDraftModel folder, method dflash; stand-alone AR drafters -> their HF folder, method draft_model), or a
   folder exported before (`exported`).
2. A speculators-format folder is also loaded with the `speculators` package's own config and model classes:
   every exported tensor must land in the model unchanged (no key left at its random init, d2t/t2d present).
3. vLLM (greedy, num_speculative_tokens = draft_len, enforce_eager) decodes the prompts in a worker process under
   vLLM's interpreter (engines/vllm_cpu_worker.py), once with the drafter and once without: acceptance from
   llm.get_metrics(), tokens/s batched (all prompts at once, as a server runs them) and one prompt at a time.
4. Our evaluator (drafter-eval's decoder, greedy, same token ids, same token budget) decodes the same prompts.
5. Compared: per-position acceptance (P(draft i accepted | drafts before it accepted)) and the acceptance length it
   implies (1 + sum over i of the product of the first i rates). They agree when each differs by at most
   `tolerance` (absolute). What may differ is float rounding in the drafter (a near-tie flips a draft). The measured
   mean acceptance length is reported too, but differs at the token budget: in a request's last step we draft only
   what fits, vLLM drafts num_speculative_tokens and counts drafts accepted past max_tokens.

llama.cpp: drafter.gguf from the kind's gguf writer, the target a given GGUF or the run's target exported at
`gguf_type` (cached by its fingerprint), served by llama-server (greedy, the same prompt token ids, --spec-type the
kind's: draft-eagle3 / draft-simple / draft-dflash) with and without the drafter. Compared: per-position acceptance
from the server's per-step log against ours (same tolerance), the engine's speculative output against its own plain
output token by token (mismatches listed, each replayed on the plain server for a near tie: near_ties.py), and
llama.cpp's tokens/s with and without the drafter. `lookups` puts llama.cpp's n-gram modes ahead of the drafter in
one --spec-type list (the product; `lookup_corpus` adds the corpus as a static n-gram cache) and our lookups ahead of
ours; the two acceptances are then reported side by side, not compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from drafter_train.engines.base import acceptance_from_steps, compare, implied_acceptance_length
from drafter_train.engines.near_ties import same_output_as_plain
from drafter_train.errors import ConfigError

DEFAULT_TOLERANCE = 0.1
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


@dataclass
class CheckSpec:
    """What one engine check runs: the prompts (a prompt file or split; None: the evaluator's built-in prompts) and
    budget, the draft length (None: the run's drafter.draft_len), the engine's inputs, where the results go."""

    prompts: Optional[str] = None
    num_prompts: int = 4
    categories: Optional[list[str]] = None  # only prompts of these task categories (the file's `category` column)
    max_new_tokens: int = 64
    draft_len: Optional[int] = None
    tolerance: float = DEFAULT_TOLERANCE
    baseline: bool = True  # also decode without the drafter (tokens/s, speedup, output equal to plain)
    threads: int = 2
    output: Optional[str] = None  # default: <run>/<engine>
    exported: Optional[str] = None  # an export of the checkpoint to serve instead of exporting it again
    # llama.cpp
    llamacpp: Optional[str] = None  # the llama.cpp folder (default: $DRAFTER_TRAIN_LLAMACPP, else .llamacpp)
    gguf_type: str = "f32"  # the exported target's precision (the drafter is f32 with f32, else f16)
    target_gguf: Optional[str] = None  # a given target GGUF instead of the exported one
    spec_type: Optional[str] = None  # default: the kind's (e.g. draft-eagle3)
    lookups: Optional[str] = None  # llama.cpp n-gram modes ahead of the drafter (the product)
    lookup_corpus: Optional[str] = None  # a drafter-datagen folder: llama.cpp's static n-gram cache, our corpus lookup
    # our evaluator's figures from an earlier llama.cpp check of the same checkpoint, prompts, budget, draft length
    # and lookups (its llamacpp_check.json): the same torch decoding, not run again for another target GGUF
    ours_from: Optional[str] = None
    # vLLM
    vllm_python: Optional[str] = None  # vLLM's interpreter (default: $DRAFTER_TRAIN_VLLM_VENV, else .venv-vllm)


def llamacpp_spec_type(drafter_type: str, lookups: Optional[str], lookup_corpus: Optional[str] = None) -> str:
    """llama-server's --spec-type: the drafter's type, with the `lookups` n-gram modes ahead of it in one comma
    list (the product: lookups first, the drafter where they find nothing). Unknown modes, and a corpus without the
    ngram-cache mode that reads it, are refused in one line."""
    if lookup_corpus and "ngram-cache" not in (lookups or "").split(","):
        raise ConfigError("--lookup-corpus is read by llama.cpp's ngram-cache mode: add --lookups ngram-cache")
    if not lookups:
        return drafter_type
    modes = [m for m in lookups.split(",") if m]
    unknown = [m for m in modes if m not in NGRAM_TYPES]
    if unknown:
        raise ConfigError(f"--lookups {','.join(unknown)}: not a llama.cpp n-gram mode ({', '.join(NGRAM_TYPES)})")
    return ",".join(modes + [drafter_type])


def our_lookups(lookups: Optional[str], corpus: Optional[str]):
    """Our lookups beside llama.cpp's lookups: prompt lookup (min_ngram 2, the main job's), and corpus lookup on
    the same corpus; off without lookups."""
    from drafter_train.config import CorpusLookupConfig, LookupConfig

    return LookupConfig(min_ngram=2, corpus=CorpusLookupConfig(path=corpus)) if lookups else LookupConfig()


def evaluate_ours(step_dir: Path, config: dict, spec: CheckSpec, draft_len: int):
    """The run's target and prompts, and our evaluator on them (greedy): (target config, target, tokenizer,
    prompts, eos, our acceptance record, our evaluation)."""
    from drafter_train.config import DrafterConfig, EvalConfig
    from drafter_train.data.prompts import prompt_ids
    from drafter_train.drafters.common.loading import load_drafter
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.evaluation import evaluate_decoding
    from drafter_train.targets import eos_token_ids, load_target

    target_cfg = run_target_config(config)
    target, tokenizer = load_target(target_cfg)
    eos = eos_token_ids(target, tokenizer)
    prompts, _ = prompt_ids(tokenizer, target_cfg, spec.prompts, spec.num_prompts, spec.categories)
    drafter = load_drafter(DrafterConfig(path=str(step_dir / "drafter")), target, tokenizer, "float32")
    eval_cfg = EvalConfig(draft_len=draft_len, max_new_tokens=spec.max_new_tokens, warmup=1,
                          lookup=our_lookups(spec.lookups, spec.lookup_corpus))
    ours = evaluate_decoding(target, make_drafter(drafter), prompts, eval_cfg, eos, progress=True)
    acceptance = ours_acceptance(ours)
    record = dict(acceptance, greedy_match=ours["greedy_match"], spec_tokens_per_s=ours["spec_tokens_per_s"],
                  ar_tokens_per_s=ours["ar_tokens_per_s"], speedup=ours["speedup"])
    return target_cfg, target, tokenizer, prompts, eos, acceptance, record


def run_target_config(config: dict):
    """The run's target config (its config.yaml's `target`, fields this version knows)."""
    from drafter_train.config import TargetConfig

    fields = {f.name for f in dataclasses.fields(TargetConfig)}
    return TargetConfig(**{k: v for k, v in config.get("target", {}).items() if k in fields})


def reused_ours(path: Path, same: dict, config: dict, spec: CheckSpec):
    """(target config, tokenizer, prompt ids, our record) from an earlier check's llamacpp_check.json, refused in one
    line unless it checked the same checkpoint on the same prompts, budget, draft length and lookups (our decoding
    does not depend on the engine's target GGUF). Only the tokenizer loads: the prompts are made again."""
    from drafter_train.data.prompts import prompt_ids
    from drafter_train.targets import load_target_tokenizer

    if not path.is_file():
        raise ConfigError(f"--ours-from: no such file {path}")
    earlier = json.loads(path.read_text())
    differ = [k for k, v in same.items() if earlier.get(k, "(not recorded)") != v]
    if differ:
        raise ConfigError(f"--ours-from {path}: another check (" + ", ".join(
            f"{k} {earlier.get(k, '(not recorded)')!r}, here {same[k]!r}" for k in differ) + ")")
    target_cfg = run_target_config(config)
    tokenizer = load_target_tokenizer(target_cfg)
    prompts, _ = prompt_ids(tokenizer, target_cfg, spec.prompts, spec.num_prompts, spec.categories)
    return target_cfg, tokenizer, prompts, earlier["ours"]


def ours_acceptance(metrics: dict) -> dict:
    """Our evaluation's metrics -> the acceptance record engines are compared with."""
    return {"mean_acceptance_length": 1 + metrics["accepted_draft_tokens"] / max(metrics["proposals"], 1),
            "implied_acceptance_length": implied_acceptance_length(metrics["per_position_acceptance"]),
            "per_position_acceptance": metrics["per_position_acceptance"], "drafting_steps": metrics["proposals"],
            "tau": metrics["tau"]}


def per_drafter(steps: list[tuple[int, int]], impls: list[str], draft_len: int) -> dict:
    """The acceptance of each drafter of a --spec-type list over the steps it drafted (impls: the drafter of each
    step, "" for none)."""
    return {name: acceptance_from_steps([s for s, i in zip(steps, impls) if i == name], draft_len)
            for name in sorted(set(impls) - {""})}


def _run_info(step_dir: Path):
    from drafter_train.model_card import read_run_info

    return read_run_info(step_dir)


def check_vllm(step_dir: Path, spec: CheckSpec) -> dict:
    """The vLLM check of one checkpoint; the result's "ok": they agree and the speculators check passed."""
    from drafter_train.engines.export import export_vllm
    from drafter_train.engines.vllm_cpu import (acceptance_from_vllm, local_target, run_vllm, vllm_method,
                                                vllm_python_or_refuse)

    info = _run_info(step_dir)
    method = vllm_method(info.kind, "engine_check --engine vllm")
    vllm_python = vllm_python_or_refuse(spec.vllm_python, "engine_check --vllm-python")
    out = Path(spec.output or step_dir.parent / "vllm").absolute()
    out.mkdir(parents=True, exist_ok=True)
    drafter_dir = Path(spec.exported).absolute() if spec.exported else \
        export_vllm(step_dir / "drafter", out / "drafter", "engine_check --engine vllm",
                    draft_len=spec.draft_len or info.draft_len).drafter
    draft_len = spec.draft_len or info.draft_len
    exported_config = json.loads((drafter_dir / "config.json").read_text())
    target_cfg, target, _, prompts, eos, ours, ours_record = evaluate_ours(step_dir, info.config, spec, draft_len)
    request = {"target": local_target(target_cfg.path, target_cfg.cache_dir), "drafter": str(drafter_dir),
               "prompts": prompts, "draft_len": draft_len, "max_new_tokens": spec.max_new_tokens, "eos": sorted(eos),
               "method": method,
               "max_model_len": min(1024, getattr(target.config, "max_position_embeddings", None) or 1024),
               "speculators": "speculators_model_type" in exported_config}
    served = run_vllm(vllm_python, request, out, "vllm_spec")
    plain = run_vllm(vllm_python, dict(request, method=None, speculators=False), out, "vllm_plain") \
        if spec.baseline else None
    vllm_acceptance = acceptance_from_vllm(served["metrics"])
    tokens = sum(len(t) for t in served["tokens"])  # vLLM's output; equal to ours when greedy is lossless
    result = {
        "engine": "vllm", "checkpoint": str(step_dir), "kind": info.kind.name, "method": method,
        "exported": str(drafter_dir), "draft_len": draft_len, "num_prompts": len(prompts),
        "max_new_tokens": spec.max_new_tokens, "ours": ours_record,
        "vllm": dict(vllm_acceptance, startup_s=served["startup_s"],
                     spec_tokens_per_s_batched=tokens / served["batched_s"],
                     spec_tokens_per_s_sequential=tokens / served["sequential_s"]),
        "speculators": served.get("speculators"),
        "comparison": compare(ours, vllm_acceptance, spec.tolerance),
        "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if plain is not None:
        plain_tokens = sum(len(t) for t in plain["tokens"])
        vllm = result["vllm"]
        vllm.update(plain_tokens_per_s_batched=plain_tokens / plain["batched_s"],
                    plain_tokens_per_s_sequential=plain_tokens / plain["sequential_s"],
                    output_equals_plain=plain["tokens"] == served["tokens"])
        vllm["speedup_batched"] = vllm["spec_tokens_per_s_batched"] / vllm["plain_tokens_per_s_batched"]
        vllm["speedup_sequential"] = vllm["spec_tokens_per_s_sequential"] / vllm["plain_tokens_per_s_sequential"]
    result["ok"] = result["comparison"]["agree"] and (result["speculators"] is None or result["speculators"]["ok"])
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2))
    return result


def check_llamacpp(step_dir: Path, spec: CheckSpec) -> dict:
    """The llama.cpp check of one checkpoint: its GGUF export served by llama-server with and without the drafter,
    against our evaluator on the same prompt ids; the result's "ok": they agree (or are side by side) and the
    engine drafted."""
    from drafter_train.engines.export import export_llamacpp, engine_method
    from drafter_train.engines.llamacpp_server import LlamaServer, server_bin
    from drafter_train.gguf_file import file_type
    from drafter_train.engines.lookup_cache import write_lookup_cache
    from drafter_train.llamacpp import DRAFTER_FILE, TARGET_FILE, llamacpp_dir
    from drafter_train.targets import model_name

    field = "engine_check --engine llamacpp"
    root = llamacpp_dir(spec.llamacpp)
    bin_dir = server_bin(root, field)
    info = _run_info(step_dir)
    spec_type = llamacpp_spec_type(spec.spec_type or engine_method(info.kind, "llamacpp", field), spec.lookups,
                                   spec.lookup_corpus)
    out = Path(spec.output or step_dir.parent / "llamacpp").absolute()
    out.mkdir(parents=True, exist_ok=True)
    if spec.exported:
        exported = Path(spec.exported).absolute()
        target, drafter = Path(spec.target_gguf or exported / TARGET_FILE), exported / DRAFTER_FILE
    else:
        files = export_llamacpp(step_dir / "drafter", out / "drafter", root, spec.gguf_type, field,
                                info.config.get("target", {}), spec.draft_len or info.draft_len,
                                Path(spec.target_gguf) if spec.target_gguf else None)
        target, drafter = files.target, files.drafter
        (out / "drafter" / TARGET_FILE).symlink_to(target)  # the folder serves as `exported` later
    draft_len = spec.draft_len or info.draft_len
    same = {"checkpoint": str(step_dir), "prompts": spec.prompts, "categories": spec.categories,
            "num_prompts": spec.num_prompts, "max_new_tokens": spec.max_new_tokens, "draft_len": draft_len,
            "lookups": spec.lookups, "lookup_corpus": spec.lookup_corpus}
    if spec.ours_from:
        target_cfg, tokenizer, prompts, ours_record = reused_ours(Path(spec.ours_from), same, info.config, spec)
        ours = {k: ours_record[k] for k in ("mean_acceptance_length", "implied_acceptance_length",
                                              "per_position_acceptance", "drafting_steps", "tau")}
    else:
        target_cfg, _, tokenizer, prompts, _, ours, ours_record = evaluate_ours(step_dir, info.config, spec, draft_len)
    cache = None if not spec.lookup_corpus else write_lookup_cache(root, target, Path(spec.lookup_corpus),
                                                                   out / "corpus.lookup", tokenizer)
    engine = LlamaServer(bin_dir, target, drafter, spec_type, draft_len, spec.threads, out,
                         f32_cache=spec.gguf_type == "f32", lookup_cache=cache)
    served = engine.decode(prompts, spec.max_new_tokens, speculative=True)
    raw = engine.last
    engine_acceptance = acceptance_from_steps(served.steps, draft_len)
    engine_acceptance["implied_acceptance_length"] = implied_acceptance_length(
        engine_acceptance["per_position_acceptance"])
    record = dict(engine_acceptance, spec_type=spec_type, threads=spec.threads,
                  gguf_type=file_type(target, "--target-gguf") if spec.target_gguf else spec.gguf_type,
                  kv_cache="f32" if spec.gguf_type == "f32" else "f16",
                  spec_tokens_per_s=served.tokens_per_s, draft_n=raw["draft_n"], draft_n_accepted=raw["draft_n_accepted"])
    if spec.lookups:  # the product: each drafter's own steps (the lookups' and the drafter's)
        record["per_drafter"] = per_drafter(served.steps, raw["step_impls"], draft_len)
    if spec.baseline:
        plain = engine.decode(prompts, spec.max_new_tokens, speculative=False)
        identical = same_output_as_plain(plain.tokens, served.tokens, prompts, draft_len, engine.plain_command(),
                                         out / "near_ties.log")
        record.update(plain_tokens_per_s=plain.tokens_per_s, speedup=served.tokens_per_s / plain.tokens_per_s,
                      output_equals_plain=not identical["differences"], output_mismatches=identical["differences"],
                      same_output_as_plain=identical)
    result = {
        **same, "engine": "llamacpp", "target": model_name(target_cfg.path), "target_gguf": str(target),
        "kind": info.kind.name, "method": spec_type, "exported": str(drafter.parent), "num_prompts": len(prompts),
        "ours": dict(ours_record, reused_from=spec.ours_from) if spec.ours_from else ours_record, "llamacpp": record,
        "comparison": compare(ours, engine_acceptance, spec.tolerance),
        "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if spec.lookups:  # two lookup rules: acceptance is reported side by side, not expected to agree
        result["comparison"]["agree"] = None
    result["ok"] = result["comparison"]["agree"] is not False and engine_acceptance["drafting_steps"] > 0
    (out / "llamacpp_check.json").write_text(json.dumps(result, indent=2))
    return result
