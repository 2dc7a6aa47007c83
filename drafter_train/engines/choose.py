"""Choosing served settings by measured speed in the engine, on the dev split (the served pipeline's `choose`
stage: drafter_train/pipeline/served.py).

    python -m drafter_train.engines.choose RUN/choose.json e3 ar [--corpus RUN/choose-corpus.json]

RUN/choose.json is what `python -m benchmarks.engines --prompts dev ...` wrote: one row per decoder. Each PREFIX's
drafter ran at several draft lengths, as the labels PREFIX-1, PREFIX-2 ...; the fastest length is kept. The free
n-gram mode kept is the fastest one that had a draft accepted (one that had none decoded plainly, and beat plain
only by noise); the product runs it ahead of its drafter, and then llama.cpp's ngram-cache
(the context's n-grams plus the corpus as the static cache: prompt and corpus lookup), unless that is the one kept.
With --corpus, a second dev record that timed the kept mode alone and as the product without a drafter
(`--ngram-modes MODE --product lookups --product-ngram MODE,ngram-cache --lookup-cache ...`), the corpus cache joins
only if it made that mode faster (`corpus`: both figures and the verdict); else the product runs the mode alone.
The product keeps a drafter only if that drafter, alone at its chosen length, decoded faster than the fastest plain
row: llama.cpp tries the n-gram modes first and asks the drafter wherever they find nothing, so a drafter that loses
alone only adds its losing steps to the lookups' (`product`: the fastest such prefix, else "lookups": no drafter).
Prints JSON: {"draft_len": {PREFIX: N}, "ngram_mode": ..., "product_ngram": ..., "product": PREFIX or "lookups",
"tokens_per_s": {row: tok/s}, "machine": the record's (journal.machine_identity), "corpus": {...} with --corpus}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from drafter_train.engines.base import implied_acceptance_length
from drafter_train.engines.table import LOOKUPS_ONLY
from drafter_train.errors import ConfigError

CORPUS_MODE = "ngram-cache"  # the n-gram mode that reads llama.cpp's static (corpus) cache


def _name(row: dict) -> str:
    return row.get("label") or f"{row['precision']} {row['decoder']} {row['setting']}"


def _dev_only(record: dict, what: str) -> None:
    if record.get("prompts") == "test":
        raise ConfigError(f"{what}: the test split is for reporting only; choose on the dev split")


def _accepted(row: dict) -> bool:
    """Whether any of the row's drafts was accepted (tau above 1; a row without a tau counts as accepted)."""
    return row.get("tau") is None or row["tau"] > 1.0


def corpus_joins(record: dict, mode: str) -> dict:
    """From a dev record holding `mode` alone (a free n-gram row) and the product without a drafter
    (LOOKUPS_ONLY: `mode` then ngram-cache with the static corpus cache): both tokens/s and whether the corpus cache
    made the mode faster."""
    _dev_only(record, "choose --corpus")
    alone = [r for r in record["rows"] if r["decoder"] == "free n-gram" and r["setting"] == f"--spec-type {mode}"]
    cached = [r for r in record["rows"] if r["decoder"] == "product" and r.get("label") == LOOKUPS_ONLY
              and r["setting"].startswith(f"--spec-type {mode},{CORPUS_MODE} ")]
    if not alone or not cached:
        raise ConfigError(f"choose --corpus: the record needs the free n-gram row of {mode} and the product row "
                          f"{LOOKUPS_ONLY} with --product-ngram {mode},{CORPUS_MODE} and a --lookup-cache")
    out = {"mode_alone": alone[0]["tokens_per_s"], "with_corpus_cache": cached[0]["tokens_per_s"]}
    return dict(out, joins=out["with_corpus_cache"] > out["mode_alone"])


def choose(record: dict, prefixes: Sequence[str], corpus_record: dict | None = None) -> dict:
    """The fastest draft length per prefix and the fastest free n-gram mode among `record`'s rows (tokens/s);
    corpus_record: whether the corpus cache joins the product (corpus_joins)."""
    rows = record["rows"]
    _dev_only(record, "choose")
    if corpus_record is not None and corpus_record.get("machine") != record.get("machine"):
        raise ConfigError("choose --corpus: the two dev records were measured on different machines")
    # the machine the choice was measured on: a choice made on another CPU is made again (the served pipeline)
    out = {"draft_len": {}, "tokens_per_s": {_name(r): r["tokens_per_s"] for r in rows},
           "machine": record.get("machine")}
    plain = max((r["tokens_per_s"] for r in rows if r["decoder"] == "plain"), default=None)
    if plain is None:
        raise ConfigError("choose: no plain row to weigh the drafters against")
    winners = []
    for prefix in prefixes:
        mine = [r for r in rows if r["decoder"] != "product" and r.get("label", "").rpartition("-")[0] == prefix
                and r["label"].rpartition("-")[2].isdigit()]
        if not mine:
            raise ConfigError(f"choose: no row labelled {prefix}-<draft length> (labels: "
                              f"{', '.join(sorted({r.get('label', '') for r in rows} - {''}))})")
        best = max(mine, key=lambda r: r["tokens_per_s"])
        out["draft_len"][prefix] = int(best["label"].rpartition("-")[2])
        if best["tokens_per_s"] > plain and _accepted(best):
            winners.append((best["tokens_per_s"], prefix))
    ngram = [r for r in rows if r["decoder"] == "free n-gram"]
    if not ngram:
        raise ConfigError("choose: no free n-gram rows (run the benchmark with --ngram-modes)")
    # a mode none of whose drafts was accepted decoded plainly: what it measured beyond plain is the machine's noise
    # (one dev round), so it is kept only if no mode had a draft accepted
    mode = max([r for r in ngram if _accepted(r)] or ngram, key=lambda r: r["tokens_per_s"])["setting"].split()[1]
    out["ngram_mode"] = mode
    out["product_ngram"] = mode if mode == CORPUS_MODE else f"{mode},{CORPUS_MODE}"
    if corpus_record is not None and mode != CORPUS_MODE:
        out["corpus"] = corpus_joins(corpus_record, mode)
        if not out["corpus"]["joins"]:
            out["product_ngram"] = mode
    out["product"] = max(winners)[1] if winners else LOOKUPS_ONLY
    return out


def verify_file_choice(split: dict, acceptance: Sequence[float], draft_len: int) -> dict:
    """The target file EAGLE-3 is served on, from a verify-split record measured on this machine
    (benchmarks/verify_split.py, dev prompts) and EAGLE-3's per-position acceptance on dev: per file with EAGLE-3
    costs, the predicted speedup over the fastest plain file of a chain of draft_len, tau / (its verify step over
    draft_len + 1 tokens + its drafting), both in plain steps of the fastest file (tau from the conditional
    per-position acceptance, engines.base). Returns {"file", "predicted": {file: speedup}}."""
    from drafter_train.calibrate import cost_at

    figures = split["data"]["figures"]
    fastest = min(f["plain_ms"] for f in figures.values())
    tau = implied_acceptance_length(list(acceptance)[:draft_len])
    predicted = {}
    for label, f in figures.items():
        eagle3 = f["kinds"].get("eagle3")
        if not eagle3:
            continue
        step = {int(n): ms for n, ms in eagle3["ms"].items()}
        drafting = {int(n): ms for n, ms in eagle3["draft_ms"].items() if ms is not None}
        if not drafting:
            continue
        cost = (cost_at(step, draft_len + 1) + cost_at(drafting, draft_len + 1)) / fastest
        predicted[label] = round(tau / cost, 4)
    if not predicted:
        raise ConfigError("choose --verify-split: the record has no file with EAGLE-3 costs (run it with --eagle3)")
    return {"file": max(predicted, key=predicted.get), "predicted": predicted}


def chose_all(choice: dict, prefixes: Sequence[str]) -> bool:
    """Whether `choice` (choice.json) chose a draft length for every one of `prefixes` (a drafter added since was
    never timed beside the others: the choice is made again)."""
    return set(prefixes) <= set(choice.get("draft_len", {}))


def chosen(choice: dict, dotted: str):
    """A field of choice.json by its dotted path ("draft_len.e3")."""
    value = choice
    for key in dotted.split("."):
        value = value[key]
    return value


def add_verify_file(picked: dict, record: dict, prefix: str, split: dict) -> dict:
    """`picked` (choose's output for `record`) with verify_file: verify_file_choice at the draft length chosen for
    `prefix` (EAGLE-3's) and that row's dev acceptance."""
    length = picked["draft_len"][prefix]
    row = next(r for r in record["rows"] if r.get("label") == f"{prefix}-{length}")
    return dict(picked, verify_file=verify_file_choice(split, row.get("acceptance_per_position") or [], length))


def _read(path: Path) -> dict:
    if not path.is_file():
        sys.exit(f"choose: no such file {path}")
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafter_train.engines.choose", description=__doc__.split("\n")[0])
    parser.add_argument("record", type=Path, help="the dev record benchmarks.engines wrote")
    parser.add_argument("prefixes", nargs="+", help="each drafter's label prefix (PREFIX-<draft length> rows)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="a dev record of the kept mode alone and with the corpus cache (the lookups product)")
    parser.add_argument("--verify-split", type=Path, default=None,
                        help="benchmarks/verify_split.py's record for this machine: also choose the target file "
                             "EAGLE-3 (the first prefix) is served on, at its chosen length and dev acceptance")
    args = parser.parse_args(argv)
    record = _read(args.record)
    corpus = _read(args.corpus) if args.corpus else None
    try:
        out = choose(record, args.prefixes, corpus)
        if args.verify_split:
            out = add_verify_file(out, record, args.prefixes[0], _read(args.verify_split))
        print(json.dumps(out, indent=2))
    except ConfigError as err:
        sys.exit(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
