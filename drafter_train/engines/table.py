"""The engine table's arithmetic: which llama.cpp decoders to run, each run's record (tokens/s, tau, the verify steps
it made), medians over interleaved rounds, and the speedup each engine's cost curve predicts from a run's own steps
(calibrate.predicted_steps_speedup) beside the speedup measured over the same engine's plain decoding. The driver is
benchmarks/engines.py; drafter-eval and checkpoint evaluation use the same predictions for one engine.

Two ways to name llama.cpp's decoders: an export folder per precision (`llamacpp_decoders`: DIR/<precision>/
target.gguf and drafter.gguf, the main job's layout), or the served table's targets and drafter files by label
(`served_decoders`: a given GGUF such as a Q4_K_M original, exports at stated types, a stock draft model, each
trained drafter's export, the product ahead of a chosen drafter). Both give the same decoder dicts. A round keeps
each prompt's own figures, so rows are also summed per prompt category (`group_figures`: each category, and the
code categories against the rest).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Optional, Sequence

from drafter_train.engines.base import acceptance_from_steps
from drafter_train.engines.llamacpp_cost import PRECISIONS, cost_key, verify_kind
from drafter_train.errors import ConfigError
from drafter_train.engines.llamacpp_server import decode_prompts, free_port, near_tie_logprobs, server_command
from drafter_train.engines.near_ties import NEAR_TIE_PROBS, near_tie

NGRAM_MODES = "ngram-simple,ngram-mod,ngram-cache"
# every free n-gram mode llama-server's --spec-type takes (common/speculative.cpp of the vendored source): the served
# table's default
ALL_NGRAM_MODES = "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache"
PRODUCT_NGRAM = "ngram-cache"  # the context's n-grams plus the static corpus cache: prompt lookup + corpus lookup
LOOKUPS_ONLY = "lookups"  # --product's label for the product without a drafter: its n-gram modes and corpus cache
# a drafter GGUF's general.architecture -> llama-server's --spec-type and the table's decoder name; any other
# architecture is a draft model (the target's own family, e.g. qwen2 or llama): draft-simple
DRAFTER_SPEC_TYPES = {"eagle3": ("draft-eagle3", "EAGLE-3"), "dflash": ("draft-dflash", "DFlash")}
DRAFT_MODEL = ("draft-simple", "AR drafter")
CODE_CATEGORIES = ("coding", "code-completion")  # the shipped splits' code categories: "code" against "rest"
NEEDED_SPEEDUPS = (1.0, 1.5, 2.0)  # the speedups a drafter row's needed acceptance is given for (the 1.5B aims)
ACCEPTANCE_POSITIONS = 8  # per-position acceptance kept for at most this many positions (n-gram drafts run longer)


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


def parse_labelled(value: str, option: str) -> tuple[str, Path, Optional[str]]:
    """LABEL=PATH[@PRECISION] -> (label, path, precision or None); a malformed one is refused in one line."""
    label, sep, rest = value.partition("=")
    path, _, precision = rest.partition("@")
    if not sep or not label or not path or "," in label or ":" in label:
        raise ConfigError(f"{option}: expected LABEL=PATH[@PRECISION] (a label without ',' or ':'), got {value!r}")
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"{option}: {label}: no such file {path}")
    return label, Path(path).expanduser().absolute(), precision or None


def drafter_spec_type(gguf: Path, option: str) -> tuple[str, str]:
    """(llama-server's --spec-type, the table's decoder name) of a drafter GGUF, from its header's architecture."""
    from drafter_train.gguf_file import check_gguf

    return DRAFTER_SPEC_TYPES.get(check_gguf(gguf, option).architecture, DRAFT_MODEL)


def served_decoders(targets: dict[str, Path], drafters: Sequence[dict], ngram_modes: Sequence[str], draft_len: int,
                    spec_precisions: Sequence[str] = (), products: Sequence[str] = (),
                    product_ngram: str = PRODUCT_NGRAM, lookup_cache: Optional[Path] = None,
                    no_repack: Sequence[str] = ()) -> list[dict]:
    """The served table's llama.cpp decoders. targets: precision label -> target GGUF (plain at every one);
    ngram_modes run at each of spec_precisions (default: the first target); drafters: {label, file, precision
    (default the first target), spec_type, decoder, draft_len (optional)}, each served with its precision's target;
    products: drafter labels to run with `product_ngram` ahead of them (the static corpus cache where given), or
    LOOKUPS_ONLY: `product_ngram` and the corpus cache alone (at the first of spec_precisions). no_repack: target
    labels served with --no-repack (every row at that precision, its llama-bench curve and step calibration)."""
    first = next(iter(targets))
    unknown = [d["label"] for d in drafters if (d.get("precision") or first) not in targets]
    if unknown:
        raise ConfigError(f"--draft-gguf: {', '.join(unknown)}: no target at its precision (targets: "
                          f"{', '.join(targets)})")
    labels = {d["label"] for d in drafters} | {LOOKUPS_ONLY}
    if set(products) - labels:
        raise ConfigError(f"--product: {', '.join(sorted(set(products) - labels))}: no --draft-gguf of that label")
    if set(no_repack) - set(targets):
        raise ConfigError(f"--no-repack: {', '.join(sorted(set(no_repack) - set(targets)))}: no target of that label "
                          f"(targets: {', '.join(targets)})")
    out = [dict(engine="llama.cpp", precision=p, target=t, decoder="plain", spec_type=None, draft_len=0)
           for p, t in targets.items()]
    if PRODUCT_NGRAM not in product_ngram.split(","):
        lookup_cache = None  # only ngram-cache reads llama.cpp's static cache: the flag would be noise in the setting
    for precision in spec_precisions or [first]:
        out += [dict(engine="llama.cpp", precision=precision, target=targets[precision], decoder="free n-gram",
                     spec_type=mode, draft_len=draft_len) for mode in ngram_modes]
    if LOOKUPS_ONLY in products:
        precision = (spec_precisions or [first])[0]
        out.append(dict(engine="llama.cpp", precision=precision, target=targets[precision], decoder="product",
                        label=LOOKUPS_ONLY, spec_type=product_ngram, draft_len=draft_len, lookup_cache=lookup_cache))
    for d in drafters:
        precision = d.get("precision") or first
        base = dict(engine="llama.cpp", precision=precision, target=targets[precision], drafter=d["file"],
                    label=d["label"], draft_len=d.get("draft_len") or draft_len)
        out.append(dict(base, decoder=d["decoder"], spec_type=d["spec_type"]))
        if d["label"] in products:
            out.append(dict(base, decoder="product", spec_type=f"{product_ngram},{d['spec_type']}",
                            lookup_cache=lookup_cache))
    for d in out:
        if d["precision"] in no_repack:
            d["repack"] = False
    return out


def run_llamacpp(decoder: dict, bin_dir: Path, prompts: list[list[int]], max_new_tokens: int, threads: int,
                 log: Path) -> dict:
    command = server_command(bin_dir, decoder["target"], decoder.get("drafter"), decoder["spec_type"],
                             decoder["draft_len"], threads, free_port(), f32_cache=decoder["precision"] == "f32",
                             lookup_cache=decoder.get("lookup_cache"), repack=decoder.get("repack", True))
    served = decode_prompts(command, log, prompts, max_new_tokens)
    return {"tokens_per_s": served["tokens_per_s"], "tokens": served["generated"], "steps": served["steps"],
            "draft_ms": served["draft_ms"], "outputs": served["tokens"], "requests": served["requests"],
            "per_prompt": served["per_prompt"]}


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
    key = row.get("cost_key") or row.get("verify_kind")
    if server and key in server["kinds"]:
        return server["kinds"][key]["relative"], server["ms_1"]
    return {**curve["relative"], **(curve.get("tree_relative", {}) if row.get("tree") else {})}, curve["ms_1"]


def summarize(rounds: list[dict], curves: list[dict], categories: Optional[Sequence[str]] = None,
              code: Sequence[str] = CODE_CATEGORIES) -> list[dict]:
    """Per decoder: median tokens/s over rounds, tau, speedup over its engine's plain decoding (same precision), the
    prediction from the engine's curve, and the speedup over the fastest plain decoder of all. categories: each
    prompt's category (rounds that kept per-prompt figures): the same per prompt group (`by_group`)."""
    keys = list(rounds[0])
    rows, runs_of = [], {}
    for key in keys:
        runs = runs_of[key] = [r[key] for r in rounds if key in r]
        row = dict(runs[0]["row"], tokens_per_s=median(run["tokens_per_s"] for run in runs),
                   tokens_per_s_rounds=[run["tokens_per_s"] for run in runs])
        for field in ("tau", "acceptance_per_position", "tokens", "plain_passes", "drafted", "draft_ms",
                      "free_tokens", "verify_kind", "cost_key"):
            if field in runs[-1]:
                row[field] = runs[-1][field]
        if categories and all("per_prompt" in run for run in runs):
            row["by_group"] = group_figures([run["per_prompt"] for run in runs], categories, code)
        rows.append(row)
    fastest = max((r for r in rows if r["decoder"] == "plain"), key=lambda r: r["tokens_per_s"])
    curve_of = {(c["engine"], c["precision"]): c for c in curves}
    for key, row in zip(keys, rows):
        own_key, own = next(((k, r) for k, r in zip(keys, rows) if r["decoder"] == "plain"
                             and r["engine"] == row["engine"] and r["precision"] == row["precision"]), (None, None))
        row["speedup_over_own_plain"] = row["tokens_per_s"] / own["tokens_per_s"] if own else None
        if own is not None and own is not row:
            agreement = output_agreement(runs_of[key], runs_of[own_key])
            if agreement:
                row["same_output_as_plain"] = agreement
        elif own is row:  # another file's plain decoding (a re-export, another precision) against the engine's first
            first_key, first = next((k, r) for k, r in zip(keys, rows)
                                    if r["decoder"] == "plain" and r["engine"] == row["engine"])
            agreement = output_agreement(runs_of[key], runs_of[first_key]) if first is not row else None
            if agreement:
                row["same_output_as_plain"] = dict(agreement, reference=first["precision"])
        row["speedup_over_fastest"] = row["tokens_per_s"] / fastest["tokens_per_s"]
        row["fastest_plain"] = f"{fastest['engine']} {fastest['precision']}".strip()
        group_speedups(row, fastest, own)
        curve = curve_of.get((row["engine"], row["precision"]))
        relative, ms_1 = _relative_for(row, curve) if curve else (None, None)
        row["predicted_speedup"] = predict(row, relative, ms_1) if curve else None
        if curve and curve.get("server") and "plain_passes" in row:  # beside it: from llama-bench's pass curve
            row["predicted_from_llama_bench"] = predict(row, curve["relative"], curve["ms_1"])
        if curve and "plain_passes" in row:  # drafting per target pass, in 1-token passes of that engine
            passes = max(row["plain_passes"] + len(row["drafted"]), 1)
            row["draft_cost_per_step"] = row["draft_ms"] / ms_1 / passes
            if row.get("draft_len") and row["drafted"]:
                # against the baseline: a file whose plain decoding is slower than the fastest file's pays for it
                slower = fastest["tokens_per_s"] / own["tokens_per_s"] if own else 1.0
                row["acceptance_needed"] = acceptance_needed_for(
                    relative, row["draft_len"], row["draft_ms"] / ms_1 / len(row["drafted"]), slower=slower)
        for field in ("drafted",):  # per-step lists stay out of the result file
            row.pop(field, None)
    return rows


def acceptance_needed_for(relative: dict[int, float], draft_len: int, draft_cost: float,
                          speedups: Sequence[float] = NEEDED_SPEEDUPS, slower: float = 1.0) -> dict[str, Optional[float]]:
    """The per-position acceptance (the same at every position of a chain of draft_len) at which a drafter whose
    every step drafts draft_len tokens, at `draft_cost` 1-token passes per step, with the engine's step `relative`,
    would reach each speedup over the baseline (None: not reachable at that draft length). slower: the file's plain
    step in plain steps of the baseline (the fastest plain file; 1: the file is the baseline)."""
    from drafter_train.calibrate import acceptance_needed, break_even_tau, cost_at

    step = break_even_tau(cost_at(relative, draft_len + 1), draft_cost) * slower
    return {f"{s:g}": acceptance_needed(s * step, draft_len) for s in speedups}


def output_agreement(runs: list[dict], plain_runs: list[dict]) -> Optional[dict]:
    """Whether a speculative row wrote what its precision's plain row wrote, prompt by prompt, round by round (the
    outputs each round kept): the prompts identical in every round, and each difference's first differing token.
    Lossless decoding gives none; an engine whose multi-token verify pass rounds differently from its 1-token pass
    can part from plain decoding where the top two logits nearly tie. None where outputs were not kept."""
    pairs = [(run["outputs"], plain["outputs"]) for run, plain in zip(runs, plain_runs)
             if "outputs" in run and "outputs" in plain]
    if not pairs:
        return None
    differences = []
    for r, (mine, theirs) in enumerate(pairs):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                differences.append({"round": r, "prompt": i, "position": at})
    prompts = len(pairs[0][0])
    return {"prompts": prompts, "identical": prompts - len({d["prompt"] for d in differences}),
            "differences": differences}


def near_tie_cases(rows: list[dict], keys: list[str], rounds: list[dict], prompts: list[list[int]]) -> dict:
    """The differences to check, per plain decoder that must answer for them (a speculative row's own precision's
    plain row; a further plain row's reference): each differing prompt once, at its first difference in the first
    round it appeared, with both outputs. rows and keys in summarize's order (rows[i] is rounds' keys[i])."""
    cases: dict[str, list[dict]] = {}
    for index, (key, row) in enumerate(zip(keys, rows)):
        same = row.get("same_output_as_plain") or {}
        if not same.get("differences"):
            continue
        precision = same.get("reference", row["precision"])
        reference = next(k for k, r in zip(keys, rows) if r["decoder"] == "plain" and r["engine"] == row["engine"]
                         and r["precision"] == precision)
        seen = set()
        for d in same["differences"]:
            if d["prompt"] in seen:
                continue
            seen.add(d["prompt"])
            cases.setdefault(reference, []).append({
                "row": index, "round": d["round"], "prompt_index": d["prompt"], "position": d["position"],
                "prompt": prompts[d["prompt"]], "reference": rounds[d["round"]][reference]["outputs"][d["prompt"]],
                "other": rounds[d["round"]][key]["outputs"][d["prompt"]]})
    return cases


def check_near_ties(rows: list[dict], keys: list[str], rounds: list[dict], prompts: list[list[int]],
                    decoders: dict[str, dict], bin_dir: Path, threads: int, log: Path,
                    n_probs: int = NEAR_TIE_PROBS) -> None:
    """Every row's output differences checked on its plain decoder's server (one start per plain decoder): each
    row's same_output_as_plain gains `near_ties` (near_tie, per differing prompt) and `near_ties_shown`."""
    for reference, cases in near_tie_cases(rows, keys, rounds, prompts).items():
        decoder = decoders[reference]
        command = server_command(bin_dir, decoder["target"], None, None, 0, threads, free_port(),
                                 f32_cache=decoder["precision"] == "f32", repack=decoder.get("repack", True))
        for case in cases:  # a speculative row's verify steps: its last accepted token and up to draft_len drafts
            row = decoders.get(keys[case["row"]], {})
            case["verify_sizes"] = list(range(2, row.get("draft_len", 0) + 2)) if row.get("spec_type") else []
        for case in near_tie_logprobs(command, log, cases, n_probs):
            same = rows[case["row"]]["same_output_as_plain"]
            same.setdefault("near_ties", []).append(near_tie(case))
            same["near_ties_shown"] = sum(t["near_tie"] for t in same["near_ties"])


def group_figures(rounds: list[list[dict]], categories: Sequence[str], code: Sequence[str]) -> dict[str, dict]:
    """Per prompt group (each category; "code": the code categories; "rest": the others) from each round's
    per-prompt records {tokens, gen_ms, steps}: tokens/s (median over rounds of the group's tokens over its
    generation time), the rounds' figures, and tau and the tokens from the last round's steps (the first token of
    each request came from the prompt pass)."""
    groups: dict[str, list[int]] = {}
    for index, category in enumerate(categories):
        groups.setdefault(str(category), []).append(index)
        groups.setdefault("code" if category in code else "rest", []).append(index)
    out = {}
    for name, members in groups.items():
        speeds = [sum(r[i]["tokens"] for i in members) / max(sum(r[i]["gen_ms"] for i in members) / 1000, 1e-9)
                  for r in rounds]
        last = [rounds[-1][i] for i in members]
        made = sum(p["tokens"] - 1 for p in last)
        drafting = [(a, d) for p in last for a, d in p["steps"] if d > 0]
        passes = max(made - sum(a + 1 for a, _ in drafting), 0) + len(drafting)
        out[name] = {"prompts": len(members), "tokens_per_s": median(speeds), "tokens_per_s_rounds": speeds,
                     "tau": made / max(passes, 1), "tokens": sum(p["tokens"] for p in last)}
    return out


def group_speedups(row: dict, fastest: dict, own: Optional[dict]) -> None:
    """Each prompt group's speedup over the fastest plain row's and over the row's own plain decoding, same group."""
    for name, group in row.get("by_group", {}).items():
        for field, base in (("speedup_over_fastest", fastest), ("speedup_over_own_plain", own)):
            theirs = (base or {}).get("by_group", {}).get(name)
            group[field] = group["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None


def llamacpp_record(decoder: dict, served: dict) -> dict:
    """llama-server's first token of each request comes from the prompt pass, outside its generation time
    (free_tokens); each row's verify kind picks its server step-cost curve."""
    record = steps_record(_row(decoder), served, bool(decoder["spec_type"]))
    if "per_prompt" in served:
        record["per_prompt"] = served["per_prompt"]
    if "outputs" in served:
        record["outputs"] = served["outputs"]
    if decoder["spec_type"]:
        record.update(free_tokens=served["requests"], verify_kind=verify_kind(decoder["spec_type"]),
                      cost_key=cost_key(decoder), acceptance_per_position=per_position(served["steps"], decoder))
    return record


def per_position(steps: list[tuple[int, int]], decoder: dict) -> list[float]:
    """llama.cpp's per-position acceptance of a row: at the draft length for a drafter, at the longest draft (at
    most ACCEPTANCE_POSITIONS) for n-gram modes, whose drafts run longer than the draft length."""
    longest = max((d for _, d in steps), default=0)
    positions = decoder["draft_len"] if decoder.get("drafter") else min(longest, ACCEPTANCE_POSITIONS)
    return acceptance_from_steps(steps, positions)["per_position_acceptance"]


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
    record.update({field: ran[field] for field in ("per_prompt", "outputs") if field in ran})
    if "stats" in ran:
        stats = ran["stats"]
        plain_passes, drafted, seconds = ours_steps(stats)
        record.update(tokens=stats.tokens_generated, plain_passes=plain_passes, drafted=drafted,
                      draft_ms=1000 * seconds, tau=stats.tau, tree=ran["tree"])
    return record


def _row(decoder: dict) -> dict:
    setting = "plain" if not decoder["spec_type"] else f"--spec-type {decoder['spec_type']}" + (
        f" --spec-draft-n-max {decoder['draft_len']}" if "draft" in decoder["spec_type"] else "") + (
        f" --lookup-cache-static {Path(decoder['lookup_cache']).name}" if decoder.get("lookup_cache") else "") + (
        " --no-repack" if decoder.get("repack") is False else "")
    row = {"engine": decoder["engine"], "precision": decoder["precision"], "decoder": decoder["decoder"],
           "setting": setting}
    if decoder.get("label"):
        row["label"] = decoder["label"]
    if decoder.get("drafter"):
        row["draft_len"] = decoder["draft_len"]
    return row


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["engine"], r["precision"], r["decoder"], r["setting"], r["tokens_per_s"], r.get("tau"),
             r["speedup_over_own_plain"], r["predicted_speedup"], r["speedup_over_fastest"]] for r in rows]


def median_curves(curve_rounds: list[dict]) -> list[dict]:
    """Per engine and precision: the median over the rounds that measured it of each size's ms, and the curve
    relative to n = 1. Our sibling tree's pass (tree<n>) is kept apart: `tree_relative`."""
    out = []
    for key in dict.fromkeys(k for c in curve_rounds for k in c):  # a key measured in some rounds only: those
        measured = [c[key] for c in curve_rounds if key in c]
        ms = {n: median(m[n] for m in measured) for n in measured[0]}
        chain = {n: v for n, v in ms.items() if isinstance(n, int)}
        curve = {"engine": key[0], "precision": key[1], "ms_1": chain[1],
                 "ms": chain, "relative": {n: v / chain[1] for n, v in chain.items()}}
        trees = {int(str(n)[4:]): v / chain[1] for n, v in ms.items() if not isinstance(n, int)}
        if trees:
            curve["tree_relative"] = trees
        out.append(curve)
    return out
