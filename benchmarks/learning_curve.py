"""Learning curve: a drafter's acceptance against the training data's size (issue 54), and recipe ablations.

    python -m benchmarks.learning_curve --data /work/data/smollm2-lc --points 25000 100000 400000 1600000
    python -m benchmarks.learning_curve --data /work/data/smollm2-lc --points 100000 --result-name ablations \
        --variant main-job= --variant ttt3="drafter.ttt_steps=3"
    python -m benchmarks.learning_curve --target qwen2.5-coder-1.5b --data DATA --response reference \
        --points 10000 30000 100000 --result-name learning_curve_qwen1.5b
    python -m benchmarks.learning_curve --recipe served_qwen:ar --data DATA --response reference \
        --points 10000 30000 --result-name learning_curve_qwen1.5b_ar

--target names the target (a conf/target config: the main job's SmolLM2-135M by default); DATA must hold its token
ids (drafter-datagen target=NAME ..., or datagen.generate=false for the source's answers).

For each variant (default: the main job's EAGLE-3 recipe, scripts/quickstart.sh's drafter-train options; --recipe
PIPELINE:STAGE: another pipeline stage's, such as served_qwen:ar, the AR drafter cut from the 0.5B) and each point (a
number of training response tokens), a drafter is trained on the first records of `--data` (train.max_records: the
fewest that hold that many response tokens, so every point shares one datagen folder and one feature cache, which
grows with the points) for `--epochs` passes over them, then decoded by our speculative decoder as a
chain of its top-1 tokens (`--draft-len`) on the dev split (for choosing) and on the test split (for reporting),
greedy. A variant with peer=TRAINER:SETTINGS (e.g. peer=speculators:defaults-bf16, benchmarks.peers'
SETTINGS, its venv from scripts/setup_peers.sh) trains its points with that peer trainer on the same records, epochs,
draft vocabulary and feature layers instead, decoded the same way: the best peer beside the recipe at equal data.
Points beyond the data are reported as not reached. Each finished point's figures are kept in
<out>/<run>/point.json, so a rerun skips it (grow the data with drafter-datagen and rerun for more points).

With two points or more, the first-position acceptance is fitted as a + b * log10(tokens) (least squares) and the
fit says how many response tokens 0.6 and 0.7 (--aims) would take: an extrapolation of a straight line in log tokens, which
flattens in truth as acceptance nears its ceiling, so a floor on what is needed, not a promise.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common import command_line, write_result
from drafter_train.config import RESPONSE_COLUMNS
from drafter_train.data.store import load_distill_dataset
from drafter_train.errors import ConfigError
from drafter_train.recipes.cli import compose_config
from drafter_train.recipes.evaluate import run_eval_job
from drafter_train.recipes.train import train
from drafter_train.targets import model_name


def main_job_recipe() -> list[str]:
    """The main job's EAGLE-3 recipe (conf/pipeline/quickstart.yaml: shared.recipe), the options every variant adds
    to."""
    from drafter_train.recipes.pipeline import compose_pipeline

    return list(compose_pipeline(["pipeline=quickstart"]).shared["recipe"])


# what a point's training sets itself (its data, run, steps and saves, a small checkpoint evaluation): left out of a
# --recipe stage's options
MANAGED = ("train.data_dir=", "train.output_root=", "train.run_name=", "train.max_steps=", "train.save_every=",
           "train.keep_last=", "train.log_every=", "train.eval_at_start=", "eval.")
KIND_NAMES = {"eagle3": "EAGLE-3", "ar": "the AR drafter", "dflash": "DFlash", "nar": "the Spec-Drafter"}


def stage_recipe(spec: str) -> list[str]:
    """--recipe PIPELINE:STAGE: the drafter-train options of that stage of that pipeline (conf/pipeline/), less those
    a point sets itself (MANAGED); e.g. served_qwen:ar, the AR drafter cut from the 0.5B."""
    from drafter_train.pipeline.runner import flat
    from drafter_train.recipes.pipeline import compose_pipeline

    name, _, stage = spec.partition(":")
    known = compose_pipeline([f"pipeline={name}"]).known
    if stage not in known:
        raise ConfigError(f"--recipe {spec}: pipeline {name} has no stage {stage!r} ({', '.join(known)})")
    run = [str(option) for option in flat(known[stage].run)]
    if run[:1] != ["drafter-train"]:
        raise ConfigError(f"--recipe {spec}: that stage runs {run[0] if run else 'nothing'}, not drafter-train")
    return [option for option in run[1:] if not option.startswith(MANAGED)]


AIMS = (0.6, 0.7)  # the main job's aims (issue 54); --aims for another target's
# in bfloat16 a verify pass over several tokens and a 1-token pass round differently: near-ties break otherwise
BF16_NOTE = (" (where a verify pass and a 1-token pass round a near-tie differently, the output parts from plain "
             "decoding's and acceptance is counted along the speculative output: greedy_match and the margins at the "
             "parting in each point's test-chain.json)")
# A point's training saves every this many steps (and at its end), so a stopped point resumes where it was (a 1.5B
# point runs ~5 s a step on 2 cores); the last checkpoint is the point's drafter.
SAVE_EVERY = 100
# how points are decoded unless asked otherwise (points kept without their "eval" settings were decoded so)
DECODE_DEFAULTS = {"num_prompts": 16, "max_new_tokens": 48, "draft_len": 3}
COLUMNS = ["variant", "response tokens", "records", "steps", "train s", "dev acceptance 1", "test acceptance 1",
           "test acceptance 2", "test acceptance 3", "test tau"]


def records_for(lengths: Sequence[int], tokens: int) -> Optional[int]:
    """The fewest records whose responses hold `tokens` tokens; None when the data is short."""
    total = 0
    for count, length in enumerate(lengths, 1):
        total += length
        if total >= tokens:
            return count
    return None


def fit_log_tokens(points: Sequence[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """Least-squares (a, b) of acceptance = a + b * log10(tokens) over (tokens, acceptance) points."""
    xs, ys = [math.log10(t) for t, _ in points], [a for _, a in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def tokens_for(fit: tuple[float, float], acceptance: float) -> Optional[float]:
    a, b = fit
    return 10 ** ((acceptance - a) / b) if b > 0 else None


def eval_settings(args) -> dict:
    """How a point is decoded; a point or an evaluation kept from a run that decoded otherwise is decoded again."""
    return {"dtype": args.eval_dtype, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
            "draft_len": args.draft_len}


def evaluate(drafter: Path, split: str, args, output: Path) -> dict:
    """Our decoder, the drafter's top-1 chain, greedy: the same call for every point, variant and split. Only
    acceptance is read, so plain decoding is timed once per prompt, without warm-up (eval.baseline_kernels=same):
    greedy acceptance does not depend on it, and the evaluation takes a third of the time. A kept evaluation is
    reused only when it was decoded as asked (eval_settings: --eval-dtype, --num-prompts, ...)."""
    if output.is_file():
        kept = json.loads(output.read_text())
        config = kept["config"]
        if dict(config["eval"], dtype=config["target"]["dtype"]).items() >= eval_settings(args).items():
            return kept
    return run_eval_job(compose_config("eval", [
        *args.target_options, f"target.dtype={args.eval_dtype}", "drafter=path", f"drafter.path={drafter}",
        f"eval.prompts={split}",
        f"eval.num_prompts={args.num_prompts}",
        f"eval.max_new_tokens={args.max_new_tokens}", f"eval.draft_len={args.draft_len}", f"eval.output={output}",
        "eval.baseline_kernels=same", "eval.warmup=0"]))


def run_point(variant: str, overrides: list[str], records: int, args) -> dict:
    """Train (resuming from its last save) and evaluate one point; its figures are kept in point.json. A variant's
    `epochs=N` sets its own number of passes (the others are drafter-train options)."""
    run = f"{variant}-r{records}"
    run_dir = Path(args.out) / run
    saved = run_dir / "point.json"
    recipe = args.recipe
    if saved.is_file():
        point = json.loads(saved.read_text())
        if settings(point.get("recipe") or []) != settings(recipe):
            raise ConfigError(f"{saved} was trained with another recipe than this run's ({point.get('recipe')} "
                              f"against {recipe}): pass another --out")
        decoded = point.get("eval", dict(DECODE_DEFAULTS, dtype=point.get("eval_dtype", "float32")))
        if decoded == eval_settings(args) and (point["dev"] or "dev" not in args.splits):
            for split in ("dev", "test"):  # figures added since the point was kept (per_position_tested)
                chain = run_dir / f"{split}-chain.json"
                if point[split] and chain.is_file():
                    point[split] = _figures(json.loads(chain.read_text()))
            return point  # else decoded otherwise than asked: decoded again, the training kept (trained.json)
    epochs = float(_last_value(overrides, "epochs", args.epochs))
    peer = _last_value(overrides, "peer")
    overrides = [o for o in overrides if not o.startswith(("epochs=", "peer="))]
    if args.response == "reference":
        overrides = ["train.response=reference", *overrides]
    steps = max(int(-(-epochs * records // _batch(recipe, overrides))), 1)
    if not args.pace.fits(steps):
        return None
    began = time.perf_counter()
    trained = run_dir / "trained.json"  # the training's wall seconds once it ended: a rerun decodes, never retrains
    kept = json.loads(trained.read_text()) if trained.is_file() else {}
    drafter = run_dir / f"step-{steps}" / "drafter"
    if peer:
        if not kept:
            kept = train_peer(peer, records, epochs, run_dir, args)
            trained.write_text(json.dumps(kept) + "\n")
        steps, seconds, drafter = kept["steps"], kept["train_s"], Path(kept["drafter"])
        began = time.perf_counter()
    elif kept.get("steps") == steps:
        seconds = kept["train_s"]
    else:
        train(compose_config("train", [
            *recipe, f"train.data_dir={args.data}", f"train.max_records={records}", f"train.output_root={args.out}",
            f"train.run_name={run}", f"train.max_steps={steps}", f"train.save_every={min(steps, SAVE_EVERY)}",
            "train.keep_last=1",
            "train.eval_at_start=false", "eval.prompts=dev", "eval.num_prompts=1", "eval.max_new_tokens=8",
            *overrides]))
        seconds = time.perf_counter() - began
        run_dir.mkdir(parents=True, exist_ok=True)
        trained.write_text(json.dumps({"steps": steps, "train_s": seconds}) + "\n")
        began = time.perf_counter()
    dev = evaluate(drafter, "dev", args, run_dir / "dev-chain.json") if "dev" in args.splits else None
    test = evaluate(drafter, "test", args, run_dir / "test-chain.json")
    args.pace.record(steps, seconds, time.perf_counter() - began)
    point = {"variant": variant, "recipe": recipe, "overrides": overrides, "records": records, "steps": steps,
             **({"peer": peer, "tokens_seen": kept["tokens_seen"]} if peer else {}),
             "train_s": seconds, "response_tokens": args.tokens_in(records), "dev": dev and _figures(dev),
             "test": _figures(test), "eval_dtype": args.eval_dtype, "eval": eval_settings(args),
             "machine": test["machine"]}
    run_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(point, indent=2) + "\n")
    return point


def train_peer(peer: str, records: int, epochs: float, run_dir: Path, args) -> dict:
    """A peer trainer's point (a variant's peer=TRAINER:SETTINGS, benchmarks.peers' SETTINGS), trained in
    its own venv (benchmarks/peers) on the point's records, the same first ones of --data ours trains on, as its rows
    cut at the recipe's train.max_seq_len (its tokens packed a step too), with the recipe's draft vocabulary and
    feature layers, for `epochs` passes. Returns what trained.json keeps: its drafter folder, optimizer steps,
    seconds (its feature extraction included) and response tokens seen."""
    from transformers import AutoConfig

    from benchmarks import peers
    from drafter_train.engines.vllm_cpu import local_target
    from drafter_train.features import default_layers

    trainer, name = check_peer(peer, epochs)
    peers.check_venv(trainer)
    cfg = compose_config("train", args.recipe)
    target_dir = local_target(cfg.target.path, cfg.target.cache_dir)
    layers = list(cfg.drafter.target_layers or default_layers(AutoConfig.from_pretrained(target_dir).num_hidden_layers))
    run_dir.mkdir(parents=True, exist_ok=True)
    data, rows = load_distill_dataset(args.data), run_dir / "rows.jsonl"
    seen = peers.write_rows((data[i] for i in range(records)), rows, cfg.train.max_seq_len, None,
                            RESPONSE_COLUMNS[args.response])
    info = peers.train_peer(trainer, Path(target_dir), rows, layers, run_dir,
                            dict(peers.SETTINGS[(trainer, name)], epochs=int(epochs)), cfg.drafter.draft_vocab_size,
                            cfg.train.max_seq_len)
    return {"peer": peer, "drafter": str(run_dir / trainer / "drafter"), "steps": info["optimizer_steps"],
            "train_s": info["train_wall_s"] + (info.get("features_wall_s") or 0.0), "tokens_seen": seen * int(epochs)}


def check_peer(peer: str, epochs: float) -> tuple[str, str]:
    """A variant's peer=TRAINER:SETTINGS, refused in one line unless benchmarks.peers has those settings for a peer
    trainer and the passes are whole."""
    from benchmarks.peers import PACKING, SETTINGS

    trainer, _, name = peer.partition(":")
    if trainer not in PACKING or (trainer, name) not in SETTINGS:
        known = ", ".join(f"{t}:{n}" for t, n in SETTINGS if t in PACKING)
        raise ConfigError(f"peer={peer}: not a peer trainer's settings ({known})")
    if epochs != int(epochs):
        raise ConfigError(f"peer={peer}: the peers train whole passes, not epochs={epochs:g}")
    return trainer, name


class Pace:
    """`--deadline`: a point runs only if the seconds per step and per evaluation measured on the points trained so
    far in this run say it ends before the deadline (the first point always runs: nothing is measured yet). The
    seconds per step include the first point's feature extraction, so the prediction errs long."""

    def __init__(self, deadline: Optional[float]):
        self.began, self.deadline = time.perf_counter(), deadline
        self.steps = self.train_s = self.eval_s = 0.0
        self.points = 0

    def fits(self, steps: int) -> bool:
        if self.deadline is None or not self.points:
            return True
        left = self.deadline - (time.perf_counter() - self.began)
        needs = steps * self.train_s / self.steps + self.eval_s / self.points
        if needs > left:
            print(f"learning_curve: skipping a point of {steps} steps: ~{needs:.0f} s predicted, {left:.0f} s left "
                  f"before --deadline", flush=True)
            return False
        return True

    def record(self, steps: int, train_s: float, eval_s: float) -> None:
        self.steps, self.train_s, self.eval_s, self.points = (self.steps + steps, self.train_s + train_s,
                                                              self.eval_s + eval_s, self.points + 1)


def _batch(recipe: Sequence[str], overrides: Sequence[str]) -> int:
    """Rows per step: the variant's train.batch_size, else the recipe's."""
    return compose_config("train", [*recipe, *overrides]).train.batch_size


def settings(recipe: Sequence[str]) -> dict:
    """What a recipe trains with, composed (the kind's conf/recipe defaults included): its drafter, loss and train
    settings less those a point sets itself. Two recipes are the same when these are, however they are spelled (a
    point kept before the recipe moved into conf/recipe/eagle3.yaml listed every option)."""
    cfg = compose_config("train", list(recipe))
    kept = {"drafter": asdict(cfg.drafter), "loss": asdict(cfg.loss), "target": asdict(cfg.target)}
    kept["train"] = {k: v for k, v in asdict(cfg.train).items() if f"train.{k}=" not in MANAGED}
    return kept


def _last_value(options: Sequence[str], key: str, default=None):
    """The value of the last `key=value` among options (as Hydra takes the last override), else default."""
    return next((o.split("=", 1)[1] for o in reversed(options) if o.startswith(f"{key}=")), default)


def _figures(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("tau", "acceptance_rate", "per_position_acceptance", "per_position_tested",
                                    "speedup") if k in metrics}


def choice_note(at: Sequence[dict]) -> str:
    """The dev split's choice among the variants at one point, and for each other variant whether the choice's margin
    over it exceeds two standard errors of the difference of two first-position acceptances (binomial over the first
    drafts each tested; a lower bound on the noise: drafts within one prompt are not independent)."""
    ranked = sorted(at, key=lambda p: -p["dev"]["per_position_acceptance"][0])
    best, first = ranked[0], ranked[0]["dev"]["per_position_acceptance"][0]
    note = f"the dev split's best first-position acceptance is {best['variant']}'s ({first:.3f})"
    tested = [p["dev"].get("per_position_tested", [0])[0] for p in ranked]
    if len(ranked) < 2 or not all(tested):
        return note
    parts = []
    for other, n in zip(ranked[1:], tested[1:]):
        second = other["dev"]["per_position_acceptance"][0]
        two_se = 2 * math.sqrt(first * (1 - first) / tested[0] + second * (1 - second) / n)
        margin = first - second
        parts.append(f"{margin:.3f} above {other['variant']}'s (two standard errors of the difference {two_se:.3f}: "
                     + ("beyond noise)" if margin > two_se else "within noise)"))
    return f"{note}: {', '.join(parts)}; binomial over the first drafts each tested, a lower bound on the noise"


def row(point: dict) -> list:
    test = point["test"]["per_position_acceptance"] + [None] * 3
    return [point["variant"], point["response_tokens"], point["records"], point["steps"], round(point["train_s"]),
            point["dev"] and point["dev"]["per_position_acceptance"][0], *test[:3], point["test"]["tau"]]


# an ablation's further columns (issue 71): the tokens each variant trained on (its passes included), and its dev
# first-position acceptance against the first variant's (the baseline) with two standard errors of that difference
ABLATION_COLUMNS = [*COLUMNS, "tokens seen", "dev diff vs baseline", "2 SE of diff"]


def ablation_row(point: dict, baseline: dict) -> list:
    seen = point.get("tokens_seen") or round(point["response_tokens"] * point["steps"]
                                             * _batch(point["recipe"], point["overrides"]) / point["records"])
    if not (point["dev"] and baseline["dev"]):
        return [*row(point), seen, None, None]
    (a, n), (b, m) = [(p["dev"]["per_position_acceptance"][0], p["dev"].get("per_position_tested", [0])[0])
                      for p in (point, baseline)]
    two_se = 2 * math.sqrt(a * (1 - a) / n + b * (1 - b) / m) if n and m else None
    return [*row(point), seen, a - b, two_se]


def fit_notes(points: list[dict], aims: Sequence[float] = AIMS) -> str:
    """Per variant with two points or more: the fit and the tokens each aim would take."""
    notes = []
    for variant in dict.fromkeys(p["variant"] for p in points):
        mine = [(p["response_tokens"], p["test"]["per_position_acceptance"][0]) for p in points
                if p["variant"] == variant]
        fit = fit_log_tokens(mine)
        if fit is None:
            continue
        needs = ", ".join(f"{aim} at ~{_tokens(tokens_for(fit, aim))} response tokens" for aim in aims)
        notes.append(f"{variant}: first-position acceptance (test) = {fit[0]:.3f} + {fit[1]:.3f} * log10(tokens) over "
                     f"{len(mine)} points ({_tokens(min(t for t, _ in mine))}-{_tokens(max(t for t, _ in mine))}): "
                     f"{needs}")
    return "; ".join(notes)


def _epochs(points: list[dict], args) -> str:
    """The passes the points made: --epochs, or the variants' own epochs=N."""
    counts = sorted({round(_passes(p), 1) for p in points} or {args.epochs})
    return " / ".join(f"{c:g}" for c in counts) + (" epochs" if counts != [1] else " epoch")


def _passes(point: dict) -> float:
    """The passes a point made over its records (a peer's: its tokens seen over the records')."""
    if point.get("peer"):
        return point["tokens_seen"] / point["response_tokens"]
    return point["steps"] * _batch(point["recipe"], point["overrides"]) / point["records"]


BEYOND_TOKENS = 1e12  # a fit that needs more than this (a trillion response tokens) says only "not in sight"


def _tokens(value: Optional[float]) -> str:
    if value is None:
        return "never (no gain with data)"
    if value > BEYOND_TOKENS:  # a near-flat fit: its figure would be a hundred digits of noise
        return "more than 1,000,000M (the fit is nearly flat: not in sight)"
    return f"{value / 1e6:.1f}M" if value >= 1e6 else f"{value / 1e3:.0f}k"


def parse_variants(specs: Sequence[str], default: str = "main-job") -> dict[str, list[str]]:
    """NAME=OVERRIDES specs; none: the recipe as it is, named `default` (a point's folder is NAME-r<records>)."""
    variants = {}
    for spec in specs or [f"{default}="]:
        name, _, overrides = spec.partition("=")
        variants[name] = shlex.split(overrides)
    return variants


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a drafter-datagen folder (the target's own answers)")
    parser.add_argument("--target", default=None, help="the target, a conf/target name such as qwen2.5-coder-1.5b "
                        "(default: the main job's, SmolLM2-135M-Instruct); points trained on another are refused")
    parser.add_argument("--points", type=int, nargs="+", default=[25_000, 100_000, 400_000, 1_600_000],
                        help="training response tokens per point")
    parser.add_argument("--recipe", default=None, help="PIPELINE:STAGE: train with that pipeline stage's drafter-train "
                        "options (e.g. served_qwen:ar, the AR drafter cut from the 0.5B; served_qwen:eagle3); default: "
                        "the main job's EAGLE-3 recipe")
    parser.add_argument("--variant", action="append", help="NAME=OVERRIDES (drafter-train options added to the "
                        "recipe, space-separated; epochs=N sets the variant's passes; peer=TRAINER:SETTINGS trains "
                        "the point with a peer trainer instead, e.g. peer=speculators:defaults-bf16, "
                        "benchmarks.peers.SETTINGS); repeatable; default: "
                        "main-job= (the recipe as it is; with --recipe P:S, P-S=, so its points are kept apart "
                        "from the main job's)")
    parser.add_argument("--epochs", type=float, default=6, help="passes over each point's records (the main job: "
                        "1200 steps of 8 over 1600 records = 6)")
    parser.add_argument("--response", choices=list(RESPONSE_COLUMNS), default="target",
                        help="train on the target's own answers, or on the source's (a datagen.generate=false folder: "
                             "train.response=reference; the target's features and distributions over given text)")
    parser.add_argument("--splits", nargs="+", choices=["dev", "test"], default=["dev", "test"],
                        help="the splits decoded (test always): dev chooses between variants, so a curve of one "
                             "variant may leave it out (--splits test) and take half the time")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the target's dtype in the evaluations (target.dtype): bfloat16 decodes a 1.5B target "
                             "faster on a CPU with bf16 matmuls, its greedy answers rounded otherwise than float32's")
    parser.add_argument("--aims", type=float, nargs="+", default=list(AIMS),
                        help="first-position acceptances the fit says the data for (the 1.5B's aim is 0.5)")
    parser.add_argument("--draft-len", type=int, default=DECODE_DEFAULTS["draft_len"])
    parser.add_argument("--num-prompts", type=int, default=DECODE_DEFAULTS["num_prompts"])
    parser.add_argument("--max-new-tokens", type=int, default=DECODE_DEFAULTS["max_new_tokens"])
    parser.add_argument("--out", default="checkpoints/learning-curve")
    parser.add_argument("--result-name", default="learning_curve")
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--command", default=None, help="the command line the result file records (a wrapper's, "
                        "such as benchmarks/learning_curve_device.sh's); default: this one")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds: skip a point that the pace measured so far says would end later (a lent "
                             "machine's time limit; benchmarks/learning_curve_device.sh); skipped points are reported "
                             "as not reached in time")
    args = parser.parse_args(argv)
    args.splits = sorted({*args.splits, "test"})
    # the target is part of the recipe: a point.json trained on another target is refused like another recipe's
    recipe = stage_recipe(args.recipe) if args.recipe else main_job_recipe()
    # --target names the target, whatever the stage's was; without it a stage's own target trains and decodes
    stage_target = [option for option in recipe if option.startswith("target=")][-1:]
    args.target_options = [f"target={args.target}"] if args.target else stage_target
    recipe = [option for option in recipe if not option.startswith("target=")]
    args.recipe_name = args.recipe.replace(":", "-") if args.recipe else "main-job"
    args.recipe_label = ("the {} pipeline's {} stage".format(*args.recipe.split(":", 1)) if args.recipe else
                         "the main job's recipe")
    args.recipe = [*recipe, *args.target_options]
    composed = compose_config("train", args.recipe)
    args.title_target = model_name(composed.target.path)
    args.kind_name = KIND_NAMES.get(composed.drafter.kind, composed.drafter.kind)
    args.pace = Pace(args.deadline)
    variants = parse_variants(args.variant, args.recipe_name)
    for peer, overrides in ((_last_value(o, "peer"), o) for o in variants.values()):  # before any data loads
        if peer:
            check_peer(peer, float(_last_value(overrides, "epochs", args.epochs)))
    column = RESPONSE_COLUMNS[args.response]
    lengths = [len(r) for r in load_distill_dataset(args.data)[column]]
    args.tokens_in = lambda records: sum(lengths[:records])
    points, missing, late = [], [], []
    for variant, overrides in variants.items():
        for tokens in args.points:
            records = records_for(lengths, tokens)
            if records is None:
                missing.append(tokens)
                continue
            point = run_point(variant, overrides, records, args)
            if point is None:
                late.append(tokens)
                continue
            points.append(point)
            print(json.dumps(row(points[-1])), flush=True)
    order = list(variants)
    points.sort(key=lambda p: (order.index(p["variant"]), p["response_tokens"]))  # --points may run big ones first
    write(points, sorted(set(missing)), lengths, args, args.command or command_line("learning_curve", argv),
          sorted(set(late)))


def how_generated(data: str) -> str:
    """How drafter-datagen made the target's answers in `data` (its datagen.json): greedy, or sampled at a
    temperature, and how many a prompt."""
    manifest = Path(data) / "datagen.json"
    generation = json.loads(manifest.read_text()).get("generation", {}) if manifest.is_file() else {}
    temperature = generation.get("temperature", 0.0)
    sampled = f"sampled at temperature {temperature:g}" if temperature else "greedy"
    per_prompt = generation.get("samples_per_prompt", 1)
    return sampled + (f", {per_prompt} a prompt" if per_prompt > 1 else "")


def write(points: list[dict], missing: list[int], lengths: list[int], args, command: str,
          late: Sequence[int] = ()) -> None:
    notes = [f"Our decoder, greedy, the drafter's top-1 tokens as a chain of {args.draft_len}, {args.max_new_tokens} new "
             f"tokens per prompt; acceptance i = P(draft i accepted | drafts before it accepted). Training: "
             f"{args.recipe_label} ({' '.join(args.recipe)}) plus each variant's options, {_epochs(points, args)} "
             f"of each point's records; data: "
             f"{args.data} ({sum(lengths)} response tokens in {len(lengths)} records); the target decodes in "
             f"{args.eval_dtype}{BF16_NOTE if args.eval_dtype == 'bfloat16' else ''}. "
             + ("Variants are compared on the dev split; the test split reports." if "dev" in args.splits else
                "The test split only (the dev split is not decoded: nothing is chosen here).")]
    variants = list(dict.fromkeys(p["variant"] for p in points))
    if len(variants) > 1 and all(p["dev"] for p in points):
        for tokens in sorted({p["response_tokens"] for p in points}):
            at = [p for p in points if p["response_tokens"] == tokens]
            notes.append(f"At {_tokens(tokens)} response tokens {choice_note(at)}.")
    if missing:
        notes.append(f"Not reached (the data is too small): {', '.join(_tokens(t) for t in missing)} response tokens.")
    if late:
        notes.append(f"Not reached in time (--deadline {args.deadline:g} s): "
                     f"{', '.join(_tokens(t) for t in late)} response tokens.")
    if fit_notes(points, args.aims):
        notes.append(f"Fit, a straight line in log tokens (it flattens near the ceiling: a floor on the data needed): "
                     f"{fit_notes(points, args.aims)}.")
    extra = {"results_dir": Path(args.results_dir)} if args.results_dir else {}
    curve = len(variants) <= 1
    reference = args.response == "reference"
    source = " (trained on the source's answers)" if reference else ""
    answers = ("the source's own answers (ShareGPT's, not the target's)" if reference else
               f"the target's own answers ({how_generated(args.data)})")
    on = args.title_target
    kind = args.kind_name
    write_result(args.result_name, title=(f"{kind[0].upper() + kind[1:]}'s acceptance against training data on {on}"
                                          if curve else f"{kind[0].upper() + kind[1:]} recipe ablations on {on} "
                                          + ("(chosen on dev, reported on test)" if "dev" in args.splits else
                                             "(test split only: a diagnosis, nothing chosen)"))
                 + source,
                 question=f"How does the first-position acceptance of {kind} ({args.recipe_label}) grow with "
                          f"{answers} as training data, and how much data would "
                          f"{' and '.join(f'{a:g}' for a in args.aims)} take?"
                 if curve else
                          f"Which change to {kind}'s recipe ({args.recipe_label}) raises its acceptance at equal data?",
                 command=command, split=f"test split, first {args.num_prompts} prompts"
                 + (" (dev split beside it)" if "dev" in args.splits else ""),
                 baseline="none (acceptance, not speed)", columns=COLUMNS if curve else ABLATION_COLUMNS,
                 rows=[row(p) for p in points] if curve else [ablation_row(p, next(
                     b for b in points if b["response_tokens"] == p["response_tokens"])) for p in points],
                 notes=" ".join(notes), machine=points[0]["machine"] if points else None, data={"points": points},
                 **extra)


if __name__ == "__main__":
    main()
