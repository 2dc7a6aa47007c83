"""The engine table's arithmetic: which llama.cpp decoders to run, each run's record (tokens/s, tau, the verify steps
it made), medians over interleaved rounds, and the speedup each engine's cost curve predicts from a run's own steps
(calibrate.predicted_steps_speedup) beside the speedup measured over the same engine's plain decoding. The driver is
benchmarks/engines.py; drafter-eval and checkpoint evaluation use the same predictions for one engine.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Optional

from drafter_train.engines.llamacpp_cost import PRECISIONS, verify_kind
from drafter_train.engines.llamacpp_server import decode_prompts, free_port, server_command

NGRAM_MODES = "ngram-simple,ngram-mod,ngram-cache"
PRODUCT_NGRAM = "ngram-cache"  # the context's n-grams plus the static corpus cache: prompt lookup + corpus lookup


def llamacpp_decoders(exports: Path, ngram_modes: list[str], draft_len: int,
                      ar_exports: Optional[Path] = None, precisions: tuple = PRECISIONS) -> list[dict]:
    """Every llama.cpp decoder to run: (precision, row, spec types, files). ar_exports: the AR drafter's gguf
    folders per precision (its drafter.gguf served with the target of `exports` at that precision)."""
    from drafter_train.drafters.registry import get_kind

    out = []
    lookup = exports / "corpus.lookup"
    for precision in precisions:
        folder = exports / precision
        if not (folder / "target.gguf").is_file():
            continue
        base = {"engine": "llama.cpp", "precision": precision, "target": folder / "target.gguf"}
        out.append(dict(base, decoder="plain", spec_type=None))
        out += [dict(base, decoder="free n-gram", spec_type=mode) for mode in ngram_modes]
        if (folder / "drafter.gguf").is_file():
            drafter = folder / "drafter.gguf"
            out.append(dict(base, decoder="EAGLE-3", spec_type="draft-eagle3", drafter=drafter))
            out.append(dict(base, decoder="product", spec_type=f"{PRODUCT_NGRAM},draft-eagle3", drafter=drafter,
                            lookup_cache=lookup if lookup.is_file() else None))
        if ar_exports is not None and (ar_exports / precision / "drafter.gguf").is_file():
            out.append(dict(base, decoder="AR drafter", spec_type=get_kind("ar").engine_methods["gguf"],
                            drafter=ar_exports / precision / "drafter.gguf"))
    for d in out:
        d["draft_len"] = draft_len if d["spec_type"] else 0
    return out


def run_llamacpp(decoder: dict, bin_dir: Path, prompts: list[list[int]], max_new_tokens: int, threads: int,
                 log: Path) -> dict:
    command = server_command(bin_dir, decoder["target"], decoder.get("drafter"), decoder["spec_type"],
                                    decoder["draft_len"], threads, free_port(),
                                    f32_cache=decoder["precision"] == "f32", lookup_cache=decoder.get("lookup_cache"))
    served = decode_prompts(command, log, prompts, max_new_tokens)
    return {"tokens_per_s": served["tokens_per_s"], "tokens": served["generated"], "steps": served["steps"],
            "draft_ms": served["draft_ms"], "outputs": served["tokens"], "requests": served["requests"]}


def ours_steps(stats) -> tuple[int, list[int], float]:
    """(plain passes, draft tokens verified per drafting step, drafter seconds) of our run: each proposal counts as
    its mean size (DecodeStats keeps totals, not every step's size)."""
    steps = max(stats.proposals, 1)
    size = round(stats.proposed / steps)
    return stats.target_forward_passes - stats.proposals, [size] * stats.proposals, stats.drafter_call_seconds


def predict(row: dict, relative: dict[int, float], ms_1: float) -> Optional[float]:
    """The predicted speedup of one speculative row over its engine's plain decoding (None for plain rows). Tokens a
    prompt pass made (free_tokens: llama-server's first token of each request) cost no step in either run."""
    from drafter_train.calibrate import predicted_steps_speedup

    if "plain_passes" not in row:
        return None
    free = row.get("free_tokens", 0)
    return predicted_steps_speedup(row["tokens"] - free, row["plain_passes"] - free, row["drafted"], relative,
                                   row["draft_ms"] / ms_1)


def _relative_for(row: dict, curve: dict) -> tuple[dict[int, float], float]:
    """The cost curve a row's verify passes follow and its 1-token cost in ms: our sibling trees' passes are tree
    passes (tree_relative); llama.cpp's steps cost what llama-server's step of their verify kind costs (server)."""
    server = curve.get("server")
    if server and row.get("verify_kind") in server["kinds"]:
        return server["kinds"][row["verify_kind"]]["relative"], server["ms_1"]
    return {**curve["relative"], **(curve.get("tree_relative", {}) if row.get("tree") else {})}, curve["ms_1"]


def summarize(rounds: list[dict], curves: list[dict]) -> list[dict]:
    """Per decoder: median tokens/s over rounds, tau, speedup over its engine's plain decoding (same precision), the
    prediction from the engine's curve, and the speedup over the fastest plain decoder of all."""
    keys = list(rounds[0])
    rows = []
    for key in keys:
        runs = [r[key] for r in rounds if key in r]
        row = dict(runs[0]["row"], tokens_per_s=median(run["tokens_per_s"] for run in runs),
                   tokens_per_s_rounds=[run["tokens_per_s"] for run in runs])
        for field in ("tau", "acceptance_per_position", "tokens", "plain_passes", "drafted", "draft_ms",
                      "free_tokens", "verify_kind"):
            if field in runs[-1]:
                row[field] = runs[-1][field]
        rows.append(row)
    fastest = max((r for r in rows if r["decoder"] == "plain"), key=lambda r: r["tokens_per_s"])
    curve_of = {(c["engine"], c["precision"]): c for c in curves}
    for row in rows:
        own = next((r for r in rows if r["decoder"] == "plain" and r["engine"] == row["engine"]
                    and r["precision"] == row["precision"]), None)
        row["speedup_over_own_plain"] = row["tokens_per_s"] / own["tokens_per_s"] if own else None
        row["speedup_over_fastest"] = row["tokens_per_s"] / fastest["tokens_per_s"]
        row["fastest_plain"] = f"{fastest['engine']} {fastest['precision']}".strip()
        curve = curve_of.get((row["engine"], row["precision"]))
        relative, ms_1 = _relative_for(row, curve) if curve else (None, None)
        row["predicted_speedup"] = predict(row, relative, ms_1) if curve else None
        if curve and curve.get("server") and "plain_passes" in row:  # beside it: from llama-bench's pass curve
            row["predicted_from_llama_bench"] = predict(row, curve["relative"], curve["ms_1"])
        if curve and "plain_passes" in row:  # drafting per target pass, in 1-token passes of that engine
            passes = max(row["plain_passes"] + len(row["drafted"]), 1)
            row["draft_cost_per_step"] = row["draft_ms"] / ms_1 / passes
        for field in ("drafted",):  # per-step lists stay out of the result file
            row.pop(field, None)
    return rows


def llamacpp_record(decoder: dict, served: dict) -> dict:
    """llama-server's first token of each request comes from the prompt pass, outside its generation time
    (free_tokens); each row's verify kind picks its server step-cost curve."""
    record = steps_record(_row(decoder), served, bool(decoder["spec_type"]))
    if decoder["spec_type"]:
        record.update(free_tokens=served["requests"], verify_kind=verify_kind(decoder["spec_type"]))
    return record


def steps_record(row: dict, served: dict, speculative: bool) -> dict:
    """An engine's round from its verify steps (accepted, drafted) (llama.cpp's log, vLLM's per-request metrics)."""
    steps = served["steps"]
    tau_steps = sum(a + 1 for a, _ in steps)
    record = {"tokens_per_s": served["tokens_per_s"], "row": row}
    if speculative:
        plain_passes = max(served["tokens"] - tau_steps, 0)
        record.update(tokens=served["tokens"], plain_passes=plain_passes, drafted=[d for _, d in steps],
                      draft_ms=served["draft_ms"], tau=served["tokens"] / max(plain_passes + len(steps), 1))
    return record


def ours_record(name: str, setting: str, ran: dict) -> dict:
    record = {"tokens_per_s": ran["tokens_per_s"],
              "row": {"engine": "ours", "precision": "f32", "decoder": name, "setting": setting}}
    if "stats" in ran:
        stats = ran["stats"]
        plain_passes, drafted, seconds = ours_steps(stats)
        record.update(tokens=stats.tokens_generated, plain_passes=plain_passes, drafted=drafted,
                      draft_ms=1000 * seconds, tau=stats.tau, tree=ran["tree"])
    return record


def _row(decoder: dict) -> dict:
    setting = "plain" if not decoder["spec_type"] else f"--spec-type {decoder['spec_type']}" + (
        f" --spec-draft-n-max {decoder['draft_len']}" if "draft" in decoder["spec_type"] else "") + (
        " --lookup-cache-static corpus.lookup" if decoder.get("lookup_cache") else "")
    return {"engine": decoder["engine"], "precision": decoder["precision"], "decoder": decoder["decoder"],
            "setting": setting}


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["engine"], r["precision"], r["decoder"], r["setting"], r["tokens_per_s"], r.get("tau"),
             r["speedup_over_own_plain"], r["predicted_speedup"], r["speedup_over_fastest"]] for r in rows]


def median_curves(curve_rounds: list[dict]) -> list[dict]:
    """Per engine and precision: the median over rounds of each size's ms, and the curve relative to n = 1. Our
    sibling tree's pass (tree<n>) is kept apart: `tree_relative`."""
    out = []
    for key in curve_rounds[0]:
        sizes = curve_rounds[0][key]
        ms = {n: median(c[key][n] for c in curve_rounds) for n in sizes}
        chain = {n: v for n, v in ms.items() if isinstance(n, int)}
        curve = {"engine": key[0], "precision": key[1], "ms_1": chain[1],
                 "ms": chain, "relative": {n: v / chain[1] for n, v in chain.items()}}
        trees = {int(str(n)[4:]): v / chain[1] for n, v in ms.items() if not isinstance(n, int)}
        if trees:
            curve["tree_relative"] = trees
        out.append(curve)
    return out
