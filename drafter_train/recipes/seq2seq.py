"""`drafter-seq2seq`: one AR or NAR drafter for an encoder-decoder target, from pairs to test metrics (issue 33).

    datagen   the target rewrites the train split's outputs (greedy), cached row by row in <run>/datagen/: a rerun
              resumes after the last written row (seq2seq/data.py)
    train     DrafterTraining's steps; every train.save_every steps and at the end a checkpoint (checkpoint.py:
              written atomically, `latest`), evaluated on the dev split, `best` = the highest dev tau; resume=auto
              continues from the newest intact checkpoint exactly (weights, optimizer, samplers, RNG)
    eval      `best` on the test split: tau, acceptance, speedup over the fastest plain decoding
              (seq2seq/decoding.py, evaluation.py's timing), written atomically as metrics.json

Paths and settings are checked before anything loads (seq2seq/config.py). The pieces are the seq2seq package's
functions; this module only orders them and keeps the run folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, PreTrainedModel

from drafter_train.checkpoint import (TrainState, check_same_run, latest_checkpoint, load_training_state, mark_best,
                                      prepare_run_dir, prune, resume_checkpoint, rng_state, save_checkpoint,
                                      save_run_config, set_rng_state)
from drafter_train.cpu_kernels import use_grouped_attention, use_onednn_linears
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.errors import ConfigError
from drafter_train.io import write_atomic
from drafter_train.recipes.cli import seq2seq_main
from drafter_train.preflight import check_writable
from drafter_train.seq2seq.config import Seq2SeqJobConfig, check_paths, split_path
from drafter_train.seq2seq.data import read_pairs, regenerate
from drafter_train.seq2seq.decoding import evaluate_seq2seq
from drafter_train.seq2seq.drafters import Seq2SeqDrafter, SpecDrafter, cut_from_target, parameter_counts
from drafter_train.seq2seq.target import Source, load_seq2seq
from drafter_train.seq2seq.training import DrafterTraining

# What may change when a run is resumed: how long it goes on, how often it saves, and what it is evaluated on.
RESUMABLE_CHANGES = ("train.max_steps", "train.save_every", "train.keep_last", "train.resume", "data.num_dev",
                     "data.num_test", "eval")


def build_drafter(cfg: Seq2SeqJobConfig, target: PreTrainedModel) -> PreTrainedModel:
    if cfg.drafter.kind == "nar":
        return SpecDrafter.from_target(target, cfg.drafter.draft_len, cfg.drafter.decoder_layers)
    return cut_from_target(target, cfg.drafter.decoder_layers)


def load_weights(drafter: PreTrainedModel, folder: Path) -> None:
    """A checkpoint's drafter/ weights into `drafter` (same class and shape)."""
    drafter.load_state_dict(type(drafter).from_pretrained(folder).state_dict())


def split_sources(cfg: Seq2SeqJobConfig, split: str, count: int) -> list[str]:
    rows = read_pairs(str(split_path(cfg.data.path, split)), cfg.data.source_key, None)
    return [row["source"] for row in rows[: count or None]]


def evaluate(cfg: Seq2SeqJobConfig, target, drafter, sources: Sequence[Source], quick: bool) -> dict:
    """evaluate_seq2seq with the job's settings; quick (dev, choosing `best`): one plain-decoding setting, no warm-up
    (tau does not depend on the timing)."""
    params = SamplingParams(temperature=cfg.eval.temperature) if cfg.eval.verify == "sample" else SamplingParams()
    return evaluate_seq2seq(target, Seq2SeqDrafter(drafter, target), sources, cfg.drafter.draft_len,
                            cfg.data.max_new_tokens, cfg.eval.verify, params, cfg.train.seed,
                            "same" if quick else cfg.eval.baseline_kernels, cfg.target.cpu_kernels,
                            warmup=0 if quick else cfg.eval.warmup, tree=cfg.tree_spec())


def train(cfg: Seq2SeqJobConfig, target, tokenizer, drafter, examples, dev: Sequence[Source], run_dir: Path) -> None:
    """Train to train.max_steps from the newest intact checkpoint (if any), checkpointing and choosing `best`."""
    resumed = resume_checkpoint(run_dir, main_process=True) if cfg.train.resume == "auto" else None
    if resumed is not None:
        load_weights(drafter, resumed / "drafter")
    training = DrafterTraining(drafter, target, examples, cfg.loss, cfg.drafter.draft_len, tokenizer.pad_token_id,
                               cfg.train.batch_size, cfg.train.lr, cfg.train.blocks_per_example, cfg.train.seed)
    state = TrainState()
    if resumed is not None:
        saved = load_training_state(resumed)
        training.load_state_dict(saved["training"])
        state.load_state_dict(saved["state"])
        set_rng_state(saved["rng"])
        print(f"drafter-seq2seq: resuming from {resumed.name}", file=sys.stderr)
    else:
        torch.manual_seed(cfg.train.seed)
    losses = []
    while state.step < cfg.train.max_steps:
        losses.append(training.step())
        state.step += 1
        if state.step % cfg.train.save_every and state.step < cfg.train.max_steps:
            continue
        drafter.eval()
        metrics = {"step": state.step, "loss": sum(losses) / len(losses), "split": "dev",
                   **evaluate(cfg, target, drafter, dev, quick=True)}
        losses = []
        better = metrics["tau"] > state.best_tau
        if better:
            state.best_tau, state.best_step = metrics["tau"], state.step
        step_dir = save_checkpoint(run_dir, drafter, tokenizer, {"training": training.state_dict(),
                                   "state": state.state_dict(), "rng": rng_state()}, metrics, state.step)
        if better:
            mark_best(run_dir, step_dir)
        prune(run_dir, cfg.train.keep_last)
        print(f"drafter-seq2seq: step {state.step}: loss {metrics['loss']:.3f}, dev tau {metrics['tau']:.3f}"
              f"{' (best)' if better else ''}", file=sys.stderr)
    drafter.eval()


def run(cfg: Seq2SeqJobConfig) -> dict:
    """The whole job (module doc); returns the test metrics it wrote."""
    check_paths(cfg)
    run_dir = prepare_run_dir(cfg.train.output_root, cfg.train.run_name, cfg.train.resume)
    output = Path(cfg.eval.output) if cfg.eval.output else run_dir / "metrics.json"
    check_writable(output)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    check_same_run(run_dir, config, ignore=RESUMABLE_CHANGES)
    save_run_config(run_dir, config)

    tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    target = load_seq2seq(cfg.target.path, cfg.target.dtype)
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"target.path: the tokenizer in {cfg.target.path} has no pad token")
    examples = regenerate(target, tokenizer, split_sources(cfg, "train", cfg.data.num_train),
                          str(run_dir / "datagen" / "train.jsonl"), cfg.data.max_new_tokens)
    use_onednn_linears(target, cfg.target.cpu_kernels)
    use_grouped_attention(target, cfg.target.cpu_kernels)

    def encoded(split: str, count: int) -> list[Source]:
        return [Source.text(tokenizer(text)["input_ids"]) for text in split_sources(cfg, split, count)]

    drafter = build_drafter(cfg, target)
    train(cfg, target, tokenizer, drafter, examples, encoded("dev", cfg.data.num_dev), run_dir)
    best = (run_dir / "best").resolve() if (run_dir / "best").is_symlink() else latest_checkpoint(run_dir)
    load_weights(drafter, best / "drafter")
    metrics = {**evaluate(cfg, target, drafter, encoded("test", cfg.data.num_test), quick=False), "split": "test",
               "target": str(Path(cfg.target.path).resolve()), "drafter": str(best / "drafter"),
               "drafter_kind": cfg.drafter.kind, "best_step": int(best.name.split("-")[1]),
               "dev_tau": json.loads((best / "metrics.json").read_text())["tau"],
               "train_examples": len(examples), **parameter_counts(drafter, Seq2SeqDrafter(drafter, target).shares_encoder),
               "torch_threads": torch.get_num_threads(), "config": config}
    write_atomic(output, json.dumps(metrics, indent=2))  # a kill mid-write leaves the old file or none
    return metrics


def command(job: Seq2SeqJobConfig) -> None:
    """drafter-seq2seq once recipes/cli.py has checked the job (check_paths): the whole job, then its test figures."""
    metrics = run(job)
    print(f"drafter-seq2seq: test split: tau {metrics['tau']:.3f}, speedup {metrics['speedup']:.3f} over plain "
          f"decoding on {metrics['baseline']['kernels']} kernels (best: step {metrics['best_step']}); metrics in "
          f"{Path(job.eval.output or job.run_dir / 'metrics.json').resolve()}", file=sys.stderr)


def main() -> None:
    """drafter-seq2seq as `python -m drafter_train.recipes.seq2seq`, and for installs whose console script still
    names this function; the console script is recipes/cli.py's seq2seq_main."""
    seq2seq_main()


if __name__ == "__main__":
    main()
