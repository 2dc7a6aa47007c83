"""`drafter-eval`: the AR baseline and the speculative decoder on the same prompts, in the same process; and
`drafter-compare`: several drafter-eval jobs' decoders against one plain decoding, side by side.

The evaluation itself is drafter_train/evaluation.py (`evaluate_decoding`, shared with training); this entry point
checks the paths, loads what the config names, optionally calibrates, and writes metrics.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from drafter_train.calibrate import calibrate, calibration_record, engine_costs, engine_predictions
from drafter_train.checkpoint import verify_drafter_folder
from drafter_train.evaluation import (calibration_decoder, check_decoder, evaluate_decoding, evaluate_side_by_side,
                                      print_calibration, print_table)
from drafter_train.config import EvalConfig, EvalJobConfig
from drafter_train.recipes.cli import eval_main
from drafter_train.cpu_kernels import row_policy
from drafter_train.preflight import check_inputs, check_writable
from drafter_train.data.overlap import check_eval_overlap, recorded_data_dir
from drafter_train.data.prompts import load_prompt_records, refuse_test_split, split_name
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.decoding.lookup import check_corpus
from drafter_train.drafters.registry import make_drafter, model_kind
from drafter_train.engines.evaluate import evaluate_in_engine, print_engine, refuse_early, start_engine
from drafter_train.errors import CheckpointDamagedError, ConfigError
from drafter_train.io import write_atomic
from drafter_train.machine import machine_info
from drafter_train.targets import encode_prompt, eos_token_ids, load_target, model_identity


def _check_intact(drafter_path: str) -> None:
    """A drafter/ folder of a drafter-train checkpoint must match the checksums recorded when it was written."""
    try:
        verify_drafter_folder(drafter_path)
    except CheckpointDamagedError as err:
        raise CheckpointDamagedError(f"drafter.path: checkpoint {err}; evaluate another checkpoint") from None


def metrics_path(cfg: EvalConfig) -> Path:
    """eval.output, else metrics.json in the Hydra job's output folder (one per -m sweep job; cwd outside Hydra)."""
    if cfg.output:
        return Path(cfg.output)
    return Path(HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else ".") / "metrics.json"


def run_eval_job(cfg: EvalJobConfig) -> dict:
    """Load everything named by the config, evaluate, write metrics.json and return the metrics."""
    output = metrics_path(cfg.eval)
    cal = cfg.eval.calibration
    engine_field = f"eval.engine={cfg.eval.engine}"
    if cfg.eval.engine != "ours":  # one line each, before anything heavy: not built, no export, a layout it cannot run
        refuse_early(cfg.eval.engine, cfg.eval, Path(cfg.drafter.path), engine_field)
    if cal.enabled:
        refuse_test_split(cfg.eval.prompts, "eval.prompts", "eval.calibration")
        curves = engine_curves(cal.engine_costs)
    check_writable(output)
    _check_intact(cfg.drafter.path)
    check_inputs(cfg)
    engine = None if cfg.eval.engine == "ours" else start_engine(
        cfg.eval.engine, cfg.eval, Path(cfg.drafter.path), output.parent / "engine", engine_field,
        {"path": cfg.target.path, "cache_dir": cfg.target.cache_dir}, ())
    target, tokenizer = load_target(cfg.target)
    check_decoder(target, cfg.eval)
    check_corpus(cfg.eval.lookup.corpus, tokenizer, "eval.lookup.corpus.path")
    model = load_drafter(cfg.drafter, target, tokenizer, cfg.target.dtype)
    drafter = make_drafter(model, cfg.target.cpu_kernels)
    extra = cal.num_prompts if cal.enabled else 0
    records = load_prompt_records(cfg.eval.prompts, cfg.eval.num_prompts + extra, cfg.eval.prompt_field)
    eval_cfg, num = cfg.eval, cfg.eval.num_prompts
    overlap = check_eval_overlap([text for text, _ in records[:num]], cfg, tokenizer, recorded_data_dir(cfg.drafter.path))
    prompt_ids = [encode_prompt(tokenizer, text, cfg.target.chat_template) for text, _ in records]
    eos = eos_token_ids(target, tokenizer)
    if cal.enabled:  # on the prompts after the evaluated ones when the prompt set has them
        calibration_prompts = prompt_ids[num:] or prompt_ids[: cal.num_prompts]
        candidates, costs = calibrate(target, calibration_prompts, cfg.eval,
                                      calibration_decoder(target, drafter, calibration_prompts, eos, cfg.eval))
        eval_cfg = candidates[0].apply(cfg.eval)
    metrics = evaluate_decoding(target, drafter, prompt_ids[:num], eval_cfg, eos,
                                categories=[c for _, c in records[:num]], kernels=cfg.target.cpu_kernels)
    if engine is not None:
        if cfg.eval.engine == "vllm":
            engine.eos = sorted(eos)
        metrics["engine"] = evaluate_in_engine(engine, prompt_ids[:num], eval_cfg, metrics)
    describe(metrics, cfg, target, model, overlap)
    if cal.enabled:
        info = {"machine": machine_info(target.device, cfg.target.dtype), "target": model_identity(cfg.target),
                "drafter": str(Path(cfg.drafter.path).resolve()) if Path(cfg.drafter.path).exists() else
                cfg.drafter.path, "drafter_kind": model_kind(model).name, "verify": cfg.eval.verify,
                "calibration_prompts": "disjoint" if len(prompt_ids) > num else "the evaluated ones",
                "split": metrics["split"]}
        record = calibration_record(candidates, costs, {**metrics, "max_new_tokens": eval_cfg.max_new_tokens}, info)
        record["engines"] = engine_predictions(candidates, costs["ar_ms_per_token"], curves)
        path = Path(cal.output) if cal.output else output.parent / "calibration.json"
        path.write_text(json.dumps(record, indent=2))
        metrics["calibration"] = {**record["pick"], "file": str(path.resolve())}
        print_calibration(record)
    write_atomic(output, json.dumps(metrics, indent=2))  # a kill mid-write leaves the old file or none
    return metrics


def describe(metrics: dict, cfg: EvalJobConfig, target, model, overlap) -> None:
    """What metrics.json records beside the figures: the split and its overlap with the training data, the target,
    the drafter, the machine and the job's config."""
    policy = row_policy(target)
    metrics.update(split=split_name(cfg.eval.prompts), overlap=overlap)
    metrics.update(target=model_identity(cfg.target), drafter=cfg.drafter.path, drafter_kind=model_kind(model).name,
                   torch_threads=torch.get_num_threads(),
                   machine={**machine_info(target.device, cfg.target.dtype), "cpu_kernels": cfg.target.cpu_kernels,
                            "target_kernels_by_rows": policy.describe() if policy else None})
    metrics["config"] = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def run_compare(jobs: dict[str, EvalJobConfig]) -> dict[str, dict]:
    """`drafter-compare`: the decoders of several drafter-eval jobs on the same prompts against one plain decoding
    (evaluation.evaluate_side_by_side): the target loaded once, plain decoding timed once per prompt and kernel
    setting, every decoder interleaved with it. recipes/cli.py has checked that the jobs share the target, the prompts
    and what plain decoding depends on. Each job's metrics go to its own eval.output, as drafter-eval writes them,
    with `side_by_side` naming the decoders timed together; returns {name: metrics}."""
    first = next(iter(jobs.values()))
    for cfg in jobs.values():
        check_writable(metrics_path(cfg.eval))
        _check_intact(cfg.drafter.path)
    target, tokenizer = load_target(first.target)
    models, decoders = {}, {}
    for name, cfg in jobs.items():
        check_decoder(target, cfg.eval)
        check_corpus(cfg.eval.lookup.corpus, tokenizer, "eval.lookup.corpus.path")
        models[name] = load_drafter(cfg.drafter, target, tokenizer, cfg.target.dtype)
        decoders[name] = (make_drafter(models[name], cfg.target.cpu_kernels), cfg.eval)
    records = load_prompt_records(first.eval.prompts, first.eval.num_prompts, first.eval.prompt_field)
    texts = [text for text, _ in records]
    prompt_ids = [encode_prompt(tokenizer, text, first.target.chat_template) for text in texts]
    results = evaluate_side_by_side(target, decoders, prompt_ids, eos_token_ids(target, tokenizer),
                                    categories=[c for _, c in records], kernels=first.target.cpu_kernels)
    for name, cfg in jobs.items():
        overlap = check_eval_overlap(texts, cfg, tokenizer, recorded_data_dir(cfg.drafter.path))
        describe(results[name], cfg, target, models[name], overlap)
        results[name]["side_by_side"] = list(jobs)
        write_atomic(metrics_path(cfg.eval), json.dumps(results[name], indent=2))
    return results


def compare(jobs: dict[str, EvalJobConfig]) -> None:
    """drafter-compare once recipes/cli.py has checked the jobs: evaluate, print each table and where it went."""
    for name, metrics in run_compare(jobs).items():
        print_table(metrics, title=f"drafter-compare: {name}")
        print(f"{name}: metrics written to {metrics_path(jobs[name].eval).resolve()}", file=sys.stderr)


def engine_curves(path: Optional[str]) -> list[dict]:
    """eval.calibration.engine_costs' cost curves; refused in one line, before anything loads, when the file is
    missing or holds none."""
    if not path:
        return []
    if not Path(path).is_file():
        raise ConfigError(f"eval.calibration.engine_costs: no such file {path} (python -m benchmarks.engines writes "
                          "benchmarks/results/engines.json)")
    curves = engine_costs(json.loads(Path(path).read_text()))
    if not curves:
        raise ConfigError(f"eval.calibration.engine_costs: {path} holds no cost curves (data.cost_curves)")
    return curves


def command(job: EvalJobConfig) -> None:
    """drafter-eval once recipes/cli.py has checked the job: evaluate, print the table and where the metrics went."""
    metrics = run_eval_job(job)
    print_table(metrics)
    if "engine" in metrics:
        print_engine(metrics["engine"])
    print(f"metrics written to {metrics_path(job.eval).resolve()}", file=sys.stderr)


def main() -> None:
    """drafter-eval as `python -m drafter_train.recipes.evaluate`, and for installs whose console script still names
    this function; the console script is recipes/cli.py's eval_main."""
    eval_main()


if __name__ == "__main__":
    main()
