"""Per-token cost against what this machine can do (issue 72, item 3): the feature pass and the training step of the
main job's EAGLE-3 recipe, in tokens/s and as a fraction of the machine's measured matmul peak.

    flock /tmp/cpu.lock nice -n 5 python -m benchmarks.throughput [--records 32] [--repeats 3]

- peak: torch's matmul on this process's threads, float32 and bf16 (drafter_train/throughput.py: matmul_tflops);
  the headline fraction divides by the peak of the precision the recipe's train.mixed_precision=auto resolves to
  here (bf16 where a bf16 matmul measures >= 1.5x float32);
- feature pass: target_signals (drafters/common/conditioned.py), the target's no-grad decoder forward that makes the
  EAGLE-3 features and final hidden states, over the training batches, under the recipe's precision;
- training step: the trainer's own step (recipes/train.py: accumulate_gradients, then the optimizer) on the same
  batches, online (the step computes the features itself) and offline (features given, as drafter.features=offline
  reads them from its cache).
The records are ShareGPT's first turns with their reference answers (prompt <= 128 tokens, answer cut at 192: the
learning curves' data), in the recipe's batches of 8. Writes benchmarks/results/throughput-<cpu kind>.json with
`feature_pass_of_peak` (useful FLOPs/s of the feature pass over the peak) and `step_over_feature_pass` (an online
training step's time over the feature pass's, same tokens), medians of --repeats passes over all batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import add_results_dir, command_line, describe_machine, write_result
from drafter_train import throughput
from drafter_train.data.batches import Batch, collate, token_counts
from drafter_train.drafters.common import conditioned
from drafter_train.machine import kind_slug

RESPONSE_KEY = "response_ids"


def sharegpt_records(tokenizer, count: int, max_prompt_tokens: int, max_response_tokens: int) -> list[dict]:
    """The first `count` ShareGPT first turns whose prompt fits, with their reference answers cut (the curves' data)."""
    from drafter_train.data.sharegpt import load_sharegpt_pairs
    from drafter_train.targets import encode_prompt

    records = []
    for text, reference in load_sharegpt_pairs():
        prompt = encode_prompt(tokenizer, text.strip(), True) if text.strip() else []
        answer = tokenizer(reference, add_special_tokens=False).input_ids[:max_response_tokens] if reference else []
        if prompt and answer and len(prompt) <= max_prompt_tokens:
            records.append({"prompt_ids": prompt, RESPONSE_KEY: answer})
        if len(records) == count:
            return records
    return records


def datagen_records(data_dir: str, count: int, max_seq_len: int) -> list[dict]:
    """The first `count` records of a drafter-datagen folder with their reference answers (and learned-token masks,
    multi-turn data), in order of length as train.group_by_length batches them: the long run's work."""
    from drafter_train.data.batches import mask_key
    from drafter_train.data.store import load_distill_dataset

    data = load_distill_dataset(data_dir).select(range(count))
    masked = mask_key("reference_ids") in data.column_names
    records = []
    for r in data:
        records.append({"prompt_ids": r["prompt_ids"], RESPONSE_KEY: r["reference_ids"]})
        if masked:
            records[-1][mask_key(RESPONSE_KEY)] = r[mask_key("reference_ids")]
    return sorted(records, key=lambda r: -min(max_seq_len, len(r["prompt_ids"]) + len(r[RESPONSE_KEY])))


def job(precision_override: list[str], data_dir: str):
    """The main job's EAGLE-3 recipe (conf/pipeline/quickstart.yaml: shared.recipe) as a typed train job, its
    train.mixed_precision=auto resolved on this machine; (job, why)."""
    from drafter_train.devices import default_device
    from drafter_train.distributed import resolve_mixed_precision
    from drafter_train.recipes.cli import compose_config
    from drafter_train.recipes.pipeline import compose_pipeline

    recipe = list(compose_pipeline(["pipeline=quickstart"]).shared["recipe"])
    cfg = compose_config("train", [*recipe, f"train.data_dir={data_dir}", *precision_override])
    precision, why = resolve_mixed_precision(cfg.train.mixed_precision, default_device)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mixed_precision=precision)), why


class Trainer:
    """The trainer's step on given batches: the recipe's drafter (new, its draft vocabulary from the records),
    optimizer and Accelerator, as recipes/train.py builds them."""

    def __init__(self, cfg, target, tokenizer, records: list[dict], run_dir: Path):
        import datasets

        from drafter_train.distributed import make_accelerator
        from drafter_train.drafters.common.loading import load_drafter
        from drafter_train.drafters.registry import resolve_kind
        from drafter_train.optimizers import make_optimizer
        from drafter_train.recipes.train import master_dtype
        from drafter_train.targets import model_vocab_size

        self.cfg, self.target, self.kind = cfg, target, resolve_kind(cfg.drafter)
        self.accelerator = make_accelerator(cfg.train, None, run_dir)
        data = datasets.Dataset.from_list(records)
        counts = lambda: token_counts(data, RESPONSE_KEY, model_vocab_size(target))  # noqa: E731
        drafter = self.kind.training_module(load_drafter(cfg.drafter, target, tokenizer, master_dtype(cfg),
                                                         for_training=True, token_counts=counts))
        if cfg.train.mixed_precision == "bf16":
            drafter.float()
        optimizer = make_optimizer(drafter, cfg.train, partitioned=False)
        self.drafter, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        self.steps = 0

    def step(self, batch: Batch) -> None:
        from drafter_train.recipes.train import accumulate_gradients

        self.steps += 1
        accumulate_gradients(self.accelerator, self.drafter, self.target, [batch], self.cfg, self.kind, self.steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def feature_pass(target, batch: Batch, layers, cfg, causal_only: bool = True) -> tuple:
    with conditioned.target_precision(batch.input_ids.device, cfg):
        return conditioned.target_signals(target, batch, layers, causal_only)


def with_cached_features(batch: Batch, signals: tuple, dtype: torch.dtype) -> Batch:
    """The batch as drafter.features=offline gives it to the step: the features in the cache's 16-bit dtype."""
    features, hidden = signals
    return dataclasses.replace(batch, features=features.to(dtype), target_hidden=hidden.to(dtype))


def measure(args) -> dict:
    from drafter_train.config import TargetConfig
    from drafter_train.targets import load_target

    torch.set_num_threads(args.threads)
    cfg, why = job(args.overrides, str(args.results_dir))
    peaks = {"float32": throughput.matmul_tflops(torch.float32), "bfloat16": throughput.matmul_tflops(torch.bfloat16)}
    dtype = "bfloat16" if cfg.train.mixed_precision == "bf16" else "float32"
    target, tokenizer = load_target(TargetConfig())
    if cfg.train.compile_target:
        conditioned.compile_feature_pass(target)  # compiled by the untimed pass that makes the offline batches
    if args.data:
        records = datagen_records(args.data, args.records, cfg.train.max_seq_len)
    else:
        records = sharegpt_records(tokenizer, args.records, args.max_prompt_tokens, args.max_response_tokens)
    batches = [collate(records[i:i + cfg.train.batch_size], RESPONSE_KEY, cfg.train.max_seq_len,
                       tokenizer.pad_token_id) for i in range(0, len(records) - cfg.train.batch_size + 1,
                                                             cfg.train.batch_size)]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, target, tokenizer, records, Path(run_dir))
        layers = trainer.drafter.config.target_layers
        cache_dtype = conditioned.feature_cache._DTYPES[cfg.drafter.feature_dtype]
        offline = [with_cached_features(b, feature_pass(target, b, layers, cfg), cache_dtype) for b in batches]
        seconds = {
            "feature_pass": throughput.median_seconds(lambda: [feature_pass(target, b, layers, cfg) for b in batches],
                                                      args.repeats),
            "feature_pass_padded": throughput.median_seconds(
                lambda: [feature_pass(target, b, layers, cfg, causal_only=False) for b in batches], args.repeats),
            "step_online": throughput.median_seconds(lambda: [trainer.step(b) for b in batches], args.repeats),
            "step_offline": throughput.median_seconds(lambda: [trainer.step(b) for b in offline], args.repeats),
        }
    lengths = [n for b in batches for n in b.attention_mask.sum(1).tolist()]
    flops = throughput.decoder_flops(target.get_decoder(), target.config, lengths)
    return {"precision": cfg.train.mixed_precision, "precision_why": why, "peak_dtype": dtype, "peaks_tflops": peaks,
            "seconds": seconds, "flops": flops, "tokens": sum(lengths),
            "padded_tokens": sum(b.input_ids.numel() for b in batches), "batches": len(batches),
            "batch_size": cfg.train.batch_size, "records": len(records)}


def summarize(m: dict) -> dict:
    """The headline figures from one measurement: tokens/s, fractions of the peak and the step's ratios."""
    s, peak = m["seconds"], m["peaks_tflops"][m["peak_dtype"]]
    return {"feature_pass_of_peak": round(throughput.of_peak(m["flops"]["total"], s["feature_pass"], peak), 4),
            "step_over_feature_pass": round(s["step_online"] / s["feature_pass"], 4),
            "drafter_step_over_feature_pass": round(s["step_offline"] / s["feature_pass"], 4),
            "feature_pass_tokens_per_s": round(m["tokens"] / s["feature_pass"], 1),
            "step_online_tokens_per_s": round(m["tokens"] / s["step_online"], 1),
            "step_offline_tokens_per_s": round(m["tokens"] / s["step_offline"], 1),
            "peak_tflops": round(peak, 4), "padding": round(1 - m["tokens"] / m["padded_tokens"], 4)}


def rows(m: dict, top: dict) -> list[list]:
    peak, tokens = top["peak_tflops"], m["tokens"]
    tflops = lambda key: m["flops"]["total"] / m["seconds"][key] / 1e12  # noqa: E731
    return [[f"matmul peak ({m['peak_dtype']})", None, round(peak, 3), 1.0, None],
            ["feature pass (target decoder, no grad)", top["feature_pass_tokens_per_s"],
             round(tflops("feature_pass"), 3), top["feature_pass_of_peak"], 1.0],
            ["feature pass with the attention mask (before)",
             round(tokens / m["seconds"]["feature_pass_padded"], 1), round(tflops("feature_pass_padded"), 3),
             round(tflops("feature_pass_padded") / peak, 4),
             round(m["seconds"]["feature_pass_padded"] / m["seconds"]["feature_pass"], 4)],
            ["training step, online features", top["step_online_tokens_per_s"], round(tflops("step_online"), 3),
             round(tflops("step_online") / peak, 4), top["step_over_feature_pass"]],
            ["drafter step alone (offline features)", round(tokens / m["seconds"]["step_offline"], 1), None, None,
             top["drafter_step_over_feature_pass"]]]


def workload(args, m: dict) -> str:
    if args.data:
        return (f"the first {m['records']} records of {args.data} with their reference answers, cut at "
                f"train.max_seq_len, batched by length, batches of {m['batch_size']}")
    return (f"ShareGPT first turns with their reference answers, first {m['records']} records (prompt <= "
            f"{args.max_prompt_tokens} tokens, answer <= {args.max_response_tokens}), batches of {m['batch_size']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=32, help="ShareGPT records timed (whole batches of 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all batches (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the machines here have 2 cores)")
    parser.add_argument("--data", default=None, help="time the first --records records of this drafter-datagen "
                        "folder instead (reference answers, batched by length), e.g. the long run's")
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--max-response-tokens", type=int, default=192)
    parser.add_argument("--result-name", default=None, help="default throughput-<cpu kind>")
    parser.add_argument("overrides", nargs="*", help="drafter-train overrides after the recipe's, e.g. "
                        "train.mixed_precision=no")
    add_results_dir(parser)
    args = parser.parse_args(argv)
    m = measure(args)
    top = summarize(m)
    machine = describe_machine()
    write_result(args.result_name or f"throughput-{kind_slug(machine)}",
                 title=f"Per-token cost against the matmul peak on {machine['cpu']}",
                 question="How close do the EAGLE-3 feature pass (the target's no-grad forward) and the main job's "
                          "training step come to this machine's measured matmul peak?",
                 command=command_line("throughput", argv), split=workload(args, m),
                 baseline=f"torch's matmul peak in {m['peak_dtype']} on {args.threads} threads (the fastest of "
                          f"drafter_train/throughput.py's PEAK_SHAPES); train.mixed_precision: {m['precision']} "
                          f"({m['precision_why']})",
                 columns=["pass", "tokens/s", "TFLOPS (useful)", "of peak", "time / feature pass"],
                 rows=rows(m, top), data={"throughput": m}, top=top, results_dir=args.results_dir,
                 notes=f"Useful FLOPs: 2 x decoder linear weights x real tokens + causal attention "
                       f"(drafter_train/throughput.py); padding {top['padding']:.1%} of the batches' positions. "
                       f"Medians of {args.repeats} passes over {m['batches']} batches. Peaks: float32 "
                       f"{m['peaks_tflops']['float32']:.3f}, bf16 {m['peaks_tflops']['bfloat16']:.3f} TFLOPS.")
    print(json.dumps(top), file=sys.stderr)


if __name__ == "__main__":
    main()
