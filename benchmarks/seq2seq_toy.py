"""Benchmark: speculative decoding of an encoder-decoder target, end to end on a toy translation (issue 33).

No pretrained seq2seq weights are reachable offline, so the whole pipeline runs here, in one command:

    1. data       rule-based toy translation pairs (dictionary + reordering; drafter_train/seq2seq/toy.py), splits
    2. target     a tiny Marian model trained on the references, saved, and loaded back through load_seq2seq
    3-4. drafter-seq2seq's run() (recipes/seq2seq.py), once per drafter: the target regenerates the outputs of the
                  training sources (jsonl cache, shared by the two runs), then AR (the target's encoder + its first
                  decoder layer) or NAR Spec-Drafter (the same deep encoder, one decoder layer, draft_len mask
                  queries) trains on them with the existing losses, checkpointing 4 times; `best` = highest dev tau
    5. eval       untrained and `best` drafters on the test split: tau, acceptance, per-position acceptance and
                  speedup over the fastest plain decoding of the same target (every CPU kernel setting) in the same
                  run (seq2seq/decoding.py), --repeats times, medians; greedy (lossless: greedy_match 1.0) and
                  sampling at temperature 1
    6. export     the trained AR drafter as an HF folder, run as transformers' `assistant_model`

    python -m benchmarks.seq2seq_toy            # writes benchmarks/results/seq2seq_toy.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM

from benchmarks.common import RESULTS_DIR, command_line, write_result
from drafter_train.config import LossConfig
from drafter_train.decoding.sampling import SamplingParams
from drafter_train.recipes.seq2seq import build_drafter, load_weights, run as run_job
from drafter_train.seq2seq.config import (Seq2SeqDataConfig, Seq2SeqDrafterConfig, Seq2SeqEvalConfig,
                                          Seq2SeqJobConfig, Seq2SeqTargetConfig, Seq2SeqTrainConfig)
from drafter_train.seq2seq.data import read_pairs
from drafter_train.seq2seq.decoding import evaluate_seq2seq, generate_seq2seq_autoregressive
from drafter_train.seq2seq.drafters import Seq2SeqDrafter, parameter_counts
from drafter_train.seq2seq.export import export_assistant
from drafter_train.seq2seq.target import Source, load_seq2seq
from drafter_train.seq2seq.toy import make_pairs, toy_target, toy_tokenizer, train_toy_target

COLUMNS = ["drafter", "trained", "verify", "tau", "acceptance", "per-position acceptance", "drafter ms/step",
           "speedup", "greedy match"]


def sources_of(path: Path, count: int) -> tuple[list[str], list[str]]:
    rows = read_pairs(str(path))[:count]
    return [r["source"] for r in rows], [r["reference"] for r in rows]


def exact_match(target, tokenizer, sources, references, max_new_tokens: int) -> float:
    """Share of sources the target translates exactly as the rules do (how well the toy target learned them)."""
    hits = 0
    for text, reference in zip(sources, references):
        out = generate_seq2seq_autoregressive(target, Source.text(tokenizer(text)["input_ids"]), max_new_tokens)
        hits += tokenizer.decode(out.tokens, skip_special_tokens=True) == reference
    return hits / len(sources)


def median_metrics(runs: list[dict]) -> dict:
    """Medians of the headline numbers over repeats (per-position acceptance: position by position)."""
    keys = ("tau", "acceptance_rate", "drafter_ms_per_step", "speedup")
    merged = {key: statistics.median(run[key] for run in runs) for key in keys}
    positions = zip(*(run["per_position_acceptance"] for run in runs))
    merged["per_position_acceptance"] = [statistics.median(p) for p in positions]
    merged["greedy_match"] = runs[0]["greedy_match"]
    return merged


def assisted_row(target, assistant_dir: Path, sources: list[Source], max_new_tokens: int, repeats: int) -> list:
    """transformers' own assisted generation with the exported drafter against its plain greedy `generate`."""
    assistant = AutoModelForSeq2SeqLM.from_pretrained(assistant_dir).eval()
    times, same = {"plain": [], "assisted": []}, 0
    for _ in range(repeats):
        spent = {"plain": 0.0, "assisted": 0.0}
        for source in sources:
            outs = {}
            for name, extra in (("plain", {}), ("assisted", {"assistant_model": assistant})):
                began = time.perf_counter()
                outs[name] = target.generate(**source.inputs, max_new_tokens=max_new_tokens, do_sample=False, **extra)
                spent[name] += time.perf_counter() - began
            same += outs["plain"].tolist() == outs["assisted"].tolist()
        for name in spent:
            times[name].append(spent[name])
    speedup = statistics.median(times["plain"]) / statistics.median(times["assisted"])
    return ["AR, exported, in transformers' generate(assistant_model=)", "yes", "greedy", None, None, None, None,
            speedup, same / (len(sources) * repeats)]


def job_config(args, work: Path, kind: str) -> Seq2SeqJobConfig:
    """drafter-seq2seq's config for one drafter on the toy data (as `drafter-seq2seq target.path=... ` would build)."""
    return Seq2SeqJobConfig(
        target=Seq2SeqTargetConfig(path=str(work / "target")),
        data=Seq2SeqDataConfig(path=str(work / "data"), num_train=args.train_sources, num_dev=args.dev_sources,
                               num_test=args.test_sources, max_new_tokens=args.max_new_tokens),
        drafter=Seq2SeqDrafterConfig(kind=kind, decoder_layers=1, draft_len=args.draft_len),
        loss=LossConfig(name=args.loss),
        train=Seq2SeqTrainConfig(output_root=str(work / "runs"), run_name=kind, max_steps=args.drafter_steps,
                                 lr=args.drafter_lr, save_every=max(1, args.drafter_steps // 4)),
        eval=Seq2SeqEvalConfig(baseline_kernels="all"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default=None, help="where data, target and drafters go (default: a temp dir)")
    parser.add_argument("--target-steps", type=int, default=450)
    parser.add_argument("--train-sources", type=int, default=600, help="sources the target regenerates")
    parser.add_argument("--drafter-steps", type=int, default=400)
    parser.add_argument("--drafter-lr", type=float, default=3e-3)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--loss", default="fkl", help="losses.py name for both drafters")
    parser.add_argument("--dev-sources", type=int, default=32, help="dev sources `best` is chosen on")
    parser.add_argument("--test-sources", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    torch.manual_seed(0)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="seq2seq_toy_"))
    tokenizer, splits = toy_tokenizer(), make_pairs(work / "data")

    target = toy_target(len(tokenizer))
    target_losses = train_toy_target(target, tokenizer, splits["train"], args.target_steps)
    target.save_pretrained(work / "target")
    target = load_seq2seq(str(work / "target"))  # the real loading path
    test_texts, test_refs = sources_of(splits["test"], args.test_sources)
    accuracy = exact_match(target, tokenizer, test_texts, test_refs, args.max_new_tokens)

    tokenizer.save_pretrained(work / "target")
    test = [Source.text(tokenizer(t)["input_ids"]) for t in test_texts]
    rows, notes, runs = [], [], {}
    for name, kind in (("AR", "ar"), ("NAR", "nar")):
        cfg = job_config(args, work, kind)
        if runs:  # the target's outputs are the same for both drafters: the second run resumes the first's cache
            (cfg.run_dir / "datagen").mkdir(parents=True, exist_ok=True)
            shutil.copy(next(iter(runs.values()))["datagen"], cfg.run_dir / "datagen" / "train.jsonl")
        metrics = run_job(cfg)  # drafter-seq2seq's run(): datagen, training, best on dev, test metrics
        runs[name] = {"datagen": cfg.run_dir / "datagen" / "train.jsonl", "metrics": metrics}
        untrained, trained = build_drafter(cfg, target), build_drafter(cfg, target)
        load_weights(trained, Path(metrics["drafter"]))
        counts = parameter_counts(trained, Seq2SeqDrafter(trained, target).shares_encoder)
        notes.append(f"{name}: {counts['parameters']:,} parameters ({counts['encoder_parameters']:,} in the encoder, "
                     f"shared with the target: {counts['encoder_shared']}); best of the dev-split checkpoints: step "
                     f"{metrics['best_step']} of {args.drafter_steps} (dev tau {metrics['dev_tau']:.2f}); the run's "
                     f"own test evaluation: tau {metrics['tau']:.2f}, speedup {metrics['speedup']:.2f}")
        for label, model in (("no", untrained), ("yes", trained)):
            for verify, params in (("greedy", SamplingParams()), ("sample", SamplingParams(temperature=1.0))):
                if verify == "sample" and label == "no":
                    continue
                repeats = [evaluate_seq2seq(target, Seq2SeqDrafter(model, target), test, args.draft_len,
                                            args.max_new_tokens, verify, params, seed=r) for r in range(args.repeats)]
                m = median_metrics(repeats)
                rows.append([name, label, verify, m["tau"], m["acceptance_rate"],
                             " ".join(f"{a:.2f}" for a in m["per_position_acceptance"]), m["drafter_ms_per_step"],
                             m["speedup"], m["greedy_match"]])
        if name == "AR":
            export_assistant(trained, str(work / "assistant"), args.draft_len, tokenizer)
    examples = runs["AR"]["metrics"]["train_examples"]
    rows.append(assisted_row(target, work / "assistant", test, args.max_new_tokens, args.repeats))
    target_params = sum(p.numel() for p in target.parameters())
    notes = [f"Target: Marian, {target_params:,} parameters, {args.target_steps} steps on the references (loss "
             f"{statistics.mean(target_losses[:10]):.3f} -> {statistics.mean(target_losses[-10:]):.3f}); it "
             f"translates {accuracy:.0%} of the test sources exactly as the rules do. Drafters trained "
             f"{args.drafter_steps} steps on the target's outputs for {examples} training sources with "
             f"{args.loss} through drafter-seq2seq's run() (checkpoints every {args.drafter_steps // 4} steps, "
             f"`best` by tau on {args.dev_sources} dev sources); draft_len {args.draft_len}."] + notes + [
             f"Medians of {args.repeats} runs; the whole command took {time.perf_counter() - began:.0f} s. The "
             "encoder pass is inside every timed request (plain and speculative); a drafter that shares the "
             "target's encoder costs no encoder pass of its own (docs/seq2seq.md). The last row times "
             "transformers' generate with and without the exported AR drafter as assistant_model."]
    path = write_result(
        "seq2seq_toy", title="Seq2seq: AR and NAR drafters for a toy-translation Marian target",
        question="On an encoder-decoder target, do drafters trained on the target's outputs raise tau above the "
                 "untrained ones, with greedy decoding still lossless, and what speedup follows?",
        command=command_line("seq2seq_toy", argv),
        split=f"toy translation test split, first {args.test_sources} sources (drafter_train/seq2seq/toy.py, seed 0)",
        baseline="the fastest plain decoding of the same target over the CPU kernel settings (auto, onednn, "
                 "default), this project's decoder, same process, interleaved (the last row: transformers' plain "
                 "greedy generate)",
        columns=COLUMNS, rows=rows, notes="\n\n".join(notes), results_dir=args.results_dir)
    print(Path(path).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
