"""`drafter-train`: distil a drafter from the target's outputs, evaluating real speculative decoding at every
checkpoint. `train(cfg)` is the whole recipe, top to bottom; the console script (recipes/cli.py) only checks the
command line's config and calls it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from typing import Sequence

import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import get_scheduler

from drafter_train.checkpoint import (
    TrainState, check_same_run, latest_checkpoint, load_training_state, mark_best, prepare_run_dir, prune,
    rng_state, partial_checkpoint, resume_checkpoint, save_checkpoint, save_run_config, set_rng_state,
    start_checkpoint,
)
from drafter_train.config import TrainJobConfig
from drafter_train.machine import machine_info
from drafter_train.preflight import check_inputs
from drafter_train.recipes.cli import on_main_process, train_main
from drafter_train.data.batches import BatchStream, collate, token_counts
from drafter_train.data.overlap import check_eval_overlap
from drafter_train.data.prompts import refuse_test_split, split_name
from drafter_train.data.store import data_fingerprint
from drafter_train.data.training_data import (eval_prompt_ids, eval_prompt_texts, eval_prompts_path, full_lengths,
                                              load_training_data)
from drafter_train.distributed import (
    full_drafter, load_sharded_state, make_accelerator, optimizer_state, resolve_mixed_precision, save_sharded_state,
    uses_deepspeed, uses_fsdp,
)
from drafter_train.devices import default_device
from drafter_train.optimizers import logged_lrs, make_optimizer
from drafter_train.drafters.common.conditioned import compile_feature_pass
from drafter_train.drafters.common.loading import load_drafter
from drafter_train.decoding.lookup import check_corpus
from drafter_train.drafters.registry import DrafterKind, kind_config, make_drafter, resolve_kind
from drafter_train.errors import DrafterTrainError
from drafter_train.engines.evaluate import CheckpointEngine
from drafter_train.evaluation import check_decoder, evaluate_decoding
from drafter_train.targets import eos_token_ids, load_target, model_vocab_size
from drafter_train.tracking import RunLogger, log_with
from drafter_train.run_progress import (
    check_same_tokenizer, crossed, due_by_time, expected_tokens, machine_kind, progress_record, same_data,
    say_what_changed, this_machine, TrainingRate,
)


class TrainingDivergedError(DrafterTrainError):
    """The loss became NaN or infinite."""


def every_n_steps(step: int, n: int, last: int) -> bool:
    return step % n == 0 or step == last


def next_micro_batches(data, stream: BatchStream, response_key: str, cfg: TrainJobConfig, pad_id: int, device,
                       kind: DrafterKind):
    """The grad_accum micro-batches of one optimizer step, as the drafter kind reads them, on `device`."""
    topk = cfg.loss.uses_stored_logits
    micro = []
    for _ in range(cfg.train.grad_accum):
        records = list(data.select(stream.next_indices()))
        batch = collate(records, response_key, cfg.train.max_seq_len, pad_id, topk)
        micro.append(kind.prepare_batch(batch, records, cfg).to(device))
    return micro


def master_dtype(cfg: TrainJobConfig) -> str:
    """The dtype the drafter's weights train in: fp32 master weights under bf16 autocast, whatever the target's dtype
    (the optimizer updates fp32, autocast computes in bf16); without autocast, the target's dtype."""
    return "float32" if cfg.train.mixed_precision == "bf16" else cfg.target.dtype


def evaluate_checkpoint(cfg, target, model, prompts, eos, overlap=None) -> dict:
    """Real speculative decoding with the current drafter (full weights, see full_drafter) on the held-out prompts
    ((ids, categories); main process only), naming their split and what the overlap check found."""
    model.eval()
    drafter = make_drafter(model, cfg.target.cpu_kernels)
    metrics = evaluate_decoding(target, drafter, prompts[0], cfg.eval, eos, progress=False, categories=prompts[1],
                                kernels=cfg.target.cpu_kernels)
    model.train()
    return {**metrics, "split": split_name(eval_prompts_path(cfg)), "overlap": overlap,
            "machine": machine_info(target.device, cfg.target.dtype)}  # every figure names its machine


def restore(saved: dict, optimizer, scheduler, stream: BatchStream, state: TrainState) -> None:
    """Put back everything a checkpoint holds besides the weights: the run continues exactly. (Under DeepSpeed the
    optimizer state is partitioned and comes back after prepare: load_sharded_state.)"""
    if saved["optimizer"] is not None:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    stream.load_state_dict(saved["data"])
    state.load_state_dict(saved["train_state"])
    set_rng_state(saved["rng"])


def accumulate_gradients(accelerator, drafter, target, micro: list, cfg: TrainJobConfig, kind: DrafterKind,
                         step: int) -> tuple[float, int]:
    """Forward/backward over the step's micro-batches, then clip. Returns (mean loss per token, tokens).

    Each micro-batch's loss sum is divided by the step's total response tokens over all micro-batches and ranks,
    so accumulation is exact. accelerator.backward divides by grad_accum and DDP / DeepSpeed average gradients over
    ranks, hence both factors. `accumulate` skips the gradient all-reduce (and DeepSpeed's optimizer step) until
    the step's last micro-batch.
    """
    local = torch.tensor(float(sum(b.num_tokens for b in micro)), device=accelerator.device)
    total_tokens = int(accelerator.reduce(local, "sum"))
    scale = len(micro) * accelerator.num_processes / max(total_tokens, 1)
    loss_sum = torch.zeros((), device=accelerator.device)
    for batch in micro:
        with accelerator.accumulate(drafter):
            out = kind.loss(drafter, target, batch, cfg)
            if not torch.isfinite(out.loss_sum):
                raise TrainingDivergedError(
                    f"loss is {out.loss_sum.item()} at step {step}; lower train.lr, keep train.max_grad_norm > 0 "
                    "or use train.mixed_precision=no (the last checkpoint is intact: rerun to resume from it)"
                )
            accelerator.backward(out.loss_sum * scale)
            loss_sum += out.loss_sum.detach()
    if cfg.train.max_grad_norm > 0:
        accelerator.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
    return float(accelerator.reduce(loss_sum, "sum")) / max(total_tokens, 1), total_tokens


def train(cfg: TrainJobConfig) -> dict:
    """Train a drafter as configured; returns the last checkpoint's metrics (evaluated on the main process: other ranks
    may get {})."""
    # `best` (and layer-skip's search) is chosen on the evaluated prompts: never the test split
    refuse_test_split(cfg.eval.prompts, "eval.prompts", "drafter-train (picking best)")
    fit = resolve_kind(cfg.drafter).fit
    if fit is not None:  # a kind trained otherwise than by gradient descent (layerskip: a search)
        return fit(cfg, check_inputs)
    check_inputs(cfg)
    tcfg = cfg.train
    if tcfg.eval_engine != "ours":  # one line, before anything loads: not built, no export, a layout it cannot run
        refuse_engine_before_training(cfg)
    run_dir = prepare_run_dir(tcfg.output_root, tcfg.run_name, tcfg.resume)
    config = OmegaConf.to_container(OmegaConf.structured(cfg))  # plain dict: saved, compared, tracked
    identity = {"tokenizer_sha256": check_same_tokenizer(cfg, run_dir),  # the tokenizer alone: before the target
                "data_sha256": data_fingerprint(tcfg.data_dir)}
    if tcfg.resume == "auto":  # the same data in another folder (another machine's paths) is the same run; fields added
        # to the drafter's, loss's or train's schema since the run began are taken at their defaults
        defaults = {"drafter": dataclasses.asdict(type(cfg.drafter)()), "loss": dataclasses.asdict(type(cfg.loss)()),
                    "train": dataclasses.asdict(type(tcfg)())}
        check_same_run(run_dir, config, ignore=["train.data_dir"] if same_data(run_dir, identity) else [],
                       defaults=defaults)
    precision, why = resolve_mixed_precision(tcfg.mixed_precision, default_device)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(tcfg, mixed_precision=precision))  # no or bf16 from here
    tcfg = cfg.train
    accelerator = make_accelerator(tcfg, log_with(cfg.tracker), run_dir)
    if accelerator.is_main_process:
        print(f"train.mixed_precision: {precision} ({why})", file=sys.stderr)
    set_seed(tcfg.seed)
    target, tokenizer = load_target(cfg.target)  # never prepared: no-grad, full weights on every rank
    target.to(accelerator.device)
    if tcfg.compile_target:
        compile_feature_pass(target)
    check_decoder(target, cfg.eval)
    data, response_key = load_training_data(cfg, tokenizer)
    check_corpus(cfg.eval.lookup.corpus, tokenizer, "eval.lookup.corpus.path")
    prompts, eos = eval_prompt_ids(cfg, tokenizer), eos_token_ids(target, tokenizer)
    overlap = check_eval_overlap(eval_prompt_texts(cfg), cfg, tokenizer, [tcfg.data_dir])
    kind = resolve_kind(cfg.drafter)
    cfg = dataclasses.replace(cfg, drafter=kind_config(cfg.drafter, kind))  # drafter=path: the kind's own fields
    data = kind.prepare_data(cfg, data, response_key, target, tokenizer, accelerator)

    # ---- model, optimizer, schedule; resume restores all of it plus RNG and data position ----
    state = TrainState()
    resume_from = resume_checkpoint(run_dir, accelerator.is_main_process) if tcfg.resume == "auto" else None
    drafter_cfg = cfg.drafter
    if resume_from is not None:
        drafter_cfg = dataclasses.replace(cfg.drafter, path=str(resume_from / "drafter"))
    counts = lambda: token_counts(data, response_key, model_vocab_size(target))  # noqa: E731  (a new EAGLE-3 head)
    drafter = kind.training_module(load_drafter(drafter_cfg, target, tokenizer, master_dtype(cfg), for_training=True,
                                                token_counts=counts))
    if tcfg.mixed_precision == "bf16":
        drafter.float()  # a new drafter is built in the target's dtype
    optimizer = make_optimizer(drafter, tcfg, partitioned=uses_deepspeed(accelerator) or uses_fsdp(accelerator))
    scheduler = get_scheduler(tcfg.lr_schedule, optimizer, tcfg.warmup_steps, tcfg.max_steps)
    lengths = [min(n, tcfg.max_seq_len) for n in full_lengths(data, response_key)] if tcfg.group_by_length else None
    stream = BatchStream(len(data), tcfg.batch_size, tcfg.seed, accelerator.process_index, accelerator.num_processes,
                         lengths, tcfg.group_by_length)
    saved = load_training_state(resume_from) if resume_from is not None else None
    if saved is not None:
        restore(saved, optimizer, scheduler, stream, state)
        if accelerator.is_main_process:
            say_what_changed(resume_from, saved.get("machine"), this_machine(accelerator, tcfg))
    if state.machine_kinds[-1:] != [machine_kind(accelerator.device)]:
        state.machine_kinds.append(machine_kind(accelerator.device))
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    if saved is not None:
        load_sharded_state(accelerator, resume_from, saved)

    run_name = tcfg.run_name
    if accelerator.is_main_process:  # the resolved config, whatever launched the run (CLI, -m sweep, a test)
        save_run_config(run_dir, config)
    tags = [f"draft_len={cfg.drafter.draft_len}", f"loss={cfg.loss.name}", f"drafter={cfg.drafter.kind}:{cfg.drafter.path}"]
    logger = RunLogger(accelerator, run_dir, cfg.tracker, run_name, tags, config)
    eval_history: list[dict] = []

    logger.log({"launch/num_processes": accelerator.num_processes,
                "launch/distributed_type": accelerator.distributed_type.value,
                "launch/mixed_precision": tcfg.mixed_precision}, state.step)  # as run: auto resolved (the card's)

    engine = None if tcfg.eval_engine == "ours" else CheckpointEngine(
        cfg.eval, {"path": cfg.target.path, "cache_dir": cfg.target.cache_dir}, run_dir / "engine-eval", prompts[0])

    def checkpoint_eval(step: int, model) -> dict:
        metrics = evaluate_checkpoint(cfg, target, model, prompts, eos, overlap)
        if engine is not None:  # the checkpoint's drafter as it will be saved, in the engine
            folder = run_dir / ".engine-eval" / "drafter"  # beside the run's config.yaml; engine files go elsewhere
            shutil.rmtree(folder, ignore_errors=True)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            metrics["engine"] = engine.evaluate(folder, metrics)
        row = {"step": step, **{k: metrics[k] for k in ("tau", "acceptance_rate", "speedup")},
               **engine_scalars(metrics)}
        eval_history.append(row)
        logger.log({f"eval/{k}": v for k, v in metrics.items()
                    if k not in ("per_position_acceptance", "per_category", "machine", "engine")} | {
                    f"eval/{k}": v for k, v in engine_scalars(metrics).items()}, step)
        logger.log_eval_table(eval_history, step)
        return metrics

    if state.step == 0 and tcfg.eval_at_start:  # the untrained drafter: the baseline the run must beat
        model = full_drafter(accelerator, drafter, kind.hf_model)  # all ranks: a collective under ZeRO-3
        if accelerator.is_main_process:
            checkpoint_eval(0, model)
        accelerator.wait_for_everyone()

    # ---- the loop ----
    # the bar counts tokens: its rate is tokens/s, its total (tokens per step so far times max_steps) gives the ETA
    bar = tqdm(total=expected_tokens(state, tcfg.max_steps), initial=state.tokens_seen, unit="tok", unit_scale=True,
               desc=f"train {run_name}", disable=not accelerator.is_main_process)
    last = None
    rate = TrainingRate()
    clock = last_save = time.monotonic()  # train_seconds leaves out checkpoints and their evaluations
    while state.step < tcfg.max_steps:
        micro = next_micro_batches(data, stream, response_key, cfg, tokenizer.pad_token_id, accelerator.device, kind)
        loss_value, step_tokens = accumulate_gradients(accelerator, drafter, target, micro, cfg, kind, state.step + 1)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += step_tokens
        state.train_seconds += time.monotonic() - clock
        rate.add(step_tokens)
        bar.total = expected_tokens(state, tcfg.max_steps)
        bar.update(step_tokens)
        if every_n_steps(state.step, tcfg.log_every, tcfg.max_steps):
            logger.log({"train/loss": loss_value, **logged_lrs(optimizer, scheduler.get_last_lr()),
                        "train/tokens_per_s": rate.take(), "train/tokens_seen": state.tokens_seen}, state.step)
            bar.set_postfix(step=f"{state.step}/{tcfg.max_steps}", loss=f"{loss_value:.4f}")
        evaluated = every_n_steps(state.step, tcfg.save_every, tcfg.max_steps)
        snapshots = crossed(tcfg.snapshot_tokens, state.tokens_seen - step_tokens, state.tokens_seen)
        timed = due_by_time(accelerator, tcfg.save_every_minutes, last_save)
        if evaluated or snapshots or timed:
            progress = progress_record(state, cfg, accelerator, identity, this_machine(accelerator, tcfg))
            with rate.paused():  # saving, evaluating: not training
                metrics = save_and_evaluate(accelerator, cfg, run_dir, drafter, kind, tokenizer, optimizer, scheduler,
                                            stream, state, checkpoint_eval if evaluated else None, progress, snapshots)
            last = metrics if evaluated else last
            last_save = time.monotonic()
        clock = time.monotonic()
    bar.close()
    logger.finish()
    if last is None and latest_checkpoint(run_dir) is not None:  # resumed a finished run: report its last eval
        last = json.loads((latest_checkpoint(run_dir) / "metrics.json").read_text())
    return last or {}


def engine_scalars(metrics: dict) -> dict:
    """The engine's figures for the tracker and the eval table, beside our decoder's (none without an engine)."""
    engine = metrics.get("engine")
    if not engine:
        return {}
    return {"engine_tau": engine["tau"], "engine_tau_diff": engine["tau_diff"],
            "engine_acceptance_1": (engine["per_position_acceptance"] or [0.0])[0],
            "engine_predicted_speedup": engine["predicted_speedup"],
            "engine_measured_speedup": engine["measured_speedup"], "engine_seconds": engine["seconds"]}


def refuse_engine_before_training(cfg: TrainJobConfig) -> None:
    """train.eval_engine=llamacpp: the build, the kind's export and the drafter's layout (EAGLE-3's per-layer
    fc_norm), checked from the config before any model loads."""
    from drafter_train.engines.evaluate import refuse_build
    from drafter_train.engines.export import check_layout, engine_method

    field = f"train.eval_engine={cfg.train.eval_engine}"
    refuse_build(cfg.train.eval_engine, cfg.eval, field)
    kind = resolve_kind(cfg.drafter)
    engine_method(kind, cfg.train.eval_engine, field)
    check_layout(kind, cfg.train.eval_engine, dataclasses.asdict(cfg.drafter), field)


def save_and_evaluate(accelerator, cfg, run_dir, drafter, kind, tokenizer, optimizer, scheduler, stream, state,
                      evaluate, progress: dict, snapshots: Sequence[int] = ()):
    """Evaluate the current drafter, write step-<N> (atomically), move `latest`/`best`, prune old steps.
    evaluate=None: a checkpoint only (train.save_every_minutes, a snapshot), metrics.json empty, `best` unmoved.
    snapshots: the train.snapshot_tokens this step reached, kept as snapshot-<tokens>.

    Every rank calls this: gathering ZeRO-3 weights and writing DeepSpeed's optimizer partitions are collective;
    evaluation, the HF drafter folder, links and pruning happen on the main process only.
    """
    model = full_drafter(accelerator, drafter, kind.hf_model)
    if accelerator.is_main_process:
        start_checkpoint(run_dir, state.step)
    accelerator.wait_for_everyone()
    save_sharded_state(accelerator, partial_checkpoint(run_dir, state.step))
    accelerator.wait_for_everyone()
    metrics = {}
    if accelerator.is_main_process and evaluate is not None:
        metrics = evaluate(state.step, model)
        if cfg.train.best_by == "engine":
            score = metrics["engine"]["predicted_speedup"]
            if score is not None and score > state.best_engine_speedup:
                state.best_engine_speedup, state.best_step = score, state.step
        elif metrics["tau"] > state.best_tau:
            state.best_tau, state.best_step = metrics["tau"], state.step
    if accelerator.is_main_process:
        training_state = {
            "optimizer": optimizer_state(accelerator, optimizer), "scheduler": scheduler.state_dict(),
            "data": stream.state_dict(), "train_state": state.state_dict(), "rng": rng_state(),
            "machine": progress["machine"],
        }
        step_dir = save_checkpoint(run_dir, model, tokenizer, training_state, metrics, state.step, started=True,
                                   progress=progress, keep_as=[f"snapshot-{tokens}" for tokens in snapshots])
        if state.best_step == state.step:
            mark_best(run_dir, step_dir)
        prune(run_dir, cfg.train.keep_last)
    accelerator.wait_for_everyone()
    return metrics


def command(job: TrainJobConfig) -> float:
    """drafter-train once recipes/cli.py has checked the job: train; the main process prints the final checkpoint's
    figures. Returns tau, what a Hydra sweeper would optimise."""
    metrics = train(job)
    tau = metrics.get("tau", math.nan)
    if on_main_process():  # the only process that evaluates: other ranks hold no metrics
        print(f"final checkpoint: tau={tau:.3f} acceptance={metrics.get('acceptance_rate', math.nan):.3f} "
              f"speedup={metrics.get('speedup', math.nan):.3f}", file=sys.stderr)
    return tau


def main() -> None:
    """drafter-train as `python -m drafter_train.recipes.train` (what accelerate launch runs), and for installs whose
    console script still names this function; the console script is recipes/cli.py's train_main."""
    train_main()


if __name__ == "__main__":
    main()
