"""results.md's opening table: where things stand, one current figure per question, each linking its section.

docs/results.md has a section per result file (~40); a reader asking "is our trainer ahead of the peers?" or "what
does the main job get?" should not have to tell which of several sections is current. Each question names the result
files that answer it, newest figures first (the first one present wins), and how to say their figure in one line.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from benchmarks.common import cell


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _curve(result: dict) -> str:
    """A learning curve's points: test first-position acceptance at each data size, per variant."""
    columns = result["columns"]
    tokens, first = columns.index("response tokens"), columns.index("test acceptance 1")
    points = [f"{cell(row[first])} at {_tokens(row[tokens])}" for row in result["rows"] if row[first] is not None]
    return "first position (test) " + ", ".join(points)


def _ablation(result: dict) -> str:
    """Recipe candidates at equal data: the dev split's best, its test figure, and the baseline's (the first row), with
    whether the margin on dev exceeds two standard errors of the difference (where the file has that column)."""
    columns = result["columns"]
    dev, test = columns.index("dev acceptance 1"), columns.index("test acceptance 1")
    rows = [row for row in result["rows"] if row[dev] is not None]
    if not rows:
        return "no variant decoded on dev yet"
    best, base = max(rows, key=lambda row: row[dev]), rows[0]
    line = (f"best on dev: {best[0]} (dev {cell(best[dev])}, test {cell(best[test])}) against {base[0]} "
            f"(dev {cell(base[dev])}, test {cell(base[test])}), {_tokens(base[columns.index('response tokens')])} "
            f"tokens, {len(rows)} candidates")
    if "2 SE of diff" in columns and best is not base and best[columns.index("2 SE of diff")] is not None:
        two_se = best[columns.index("2 SE of diff")]
        line += f"; margin {cell(best[dev] - base[dev])}, " + ("beyond" if best[dev] - base[dev] > two_se else
                                                               "within") + f" two standard errors ({cell(two_se)})"
    return line


def _peers(result: dict) -> str:
    """Each trainer's first-position acceptance and acceptance length in our decoder."""
    rows = [row for row in result["rows"] if row.get("engine") == "ours"] or result["rows"]
    return ", ".join(f"{row['trainer']}: first position {cell(row['per_position_acceptance'][0])}, acceptance length "
                     f"{cell(row['acceptance_length'])}" for row in rows)


def _main_job(result: dict) -> str:
    """The product's tau and speedup, its ratio to the free lookups', and EAGLE-3's chain at the first position."""
    columns = {name: i for i, name in enumerate(result["columns"])}

    def value(keyword: str, column: str):
        row = next((row for row in result["rows"] if keyword in row[0]), None)
        return row[columns[column]] if row and column in columns else None
    speedup, lookups = value("product", "speedup"), value("no drafter", "speedup")
    line = f"the product: tau {cell(value('product', 'tau'))}, speedup {cell(speedup)}"
    if speedup and lookups:
        line += f" ({cell(speedup / lookups)}x the free lookups' {cell(lookups)})"
    chain = value("chain", "acceptance per position")
    return line + (f"; EAGLE-3's chain at first position {cell(chain[0])}" if chain else "")


def _served(result: dict) -> str:
    rows = result["data"]["engine_rows"]
    plain = max((r for r in rows if r["decoder"] == "plain" and r.get("tokens_per_s")), key=lambda r: r["tokens_per_s"])
    trained = [r for r in rows if r["decoder"] not in ("plain", "free n-gram", "product") and r.get("tokens_per_s")
               and r.get("label") != "0.5B"]
    best = max(trained, key=lambda r: r["tokens_per_s"], default=None)
    line = f"fastest plain {cell(plain['tokens_per_s'])} tok/s ({plain['precision']})"
    return line + (f"; best drafter trained here {cell(best['speedup_over_fastest'])}x ({best['decoder']})"
                   if best else "")


def _throughput(result: dict) -> str:
    return (f"feature pass at {cell(result.get('feature_pass_of_peak'))} of the measured matmul peak, a training step "
            f"{cell(result.get('step_over_feature_pass'))}x a feature pass")


# question -> (result files, newest first; a name ending in "*" matches by prefix), its one-line figure
STANDING: list[tuple[str, list[str], Callable[[dict], str]]] = [
    ("Our EAGLE-3 trainer against the best peer, equal data", ["peer_trainers_ref_100k"], _peers),
    ("Recipe candidates at equal data (SmolLM2-135M)", ["ablations_recipe_100k"], _ablation),
    ("Acceptance against data (SmolLM2-135M, 6 epochs on 2 CPU cores)", ["learning_curve_reference_auto"], _curve),
    ("Acceptance against data (SmolLM2-135M, 2 epochs on a GPU)", ["learning_curve_reference_gpu"], _curve),
    ("One run over all of ShareGPT: its snapshots (SmolLM2-135M)", ["long_run_smollm2"], _curve),
    ("The main job (README command 1)", ["main_job"], _main_job),
    ("The served 1.5B: acceptance at equal data", ["learning_curve_qwen1.5b_served_recipe"], _curve),
    ("The served 1.5B in llama.cpp", ["served_qwen1.5b-amd-epyc-avx512", "served_qwen1.5b*"], _served),
    ("Per-token cost against the machine's peak", ["throughput-*"], _throughput),
]


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _find(names: list[str], results: dict[str, dict]) -> Optional[str]:
    for name in names:
        matches = sorted(n for n in results if (n.startswith(name[:-1]) if name.endswith("*") else n == name))
        if matches:
            return matches[0]
    return None


def standing_table(results: dict[str, dict], titles: dict[str, str]) -> str:
    """The opening table: question, current figure, link to the section (`titles`: result name -> its heading)."""
    lines = ["| question | where it stands | section |", "|---|---|---|"]
    for question, names, figure in STANDING:
        name = _find(names, results)
        if name is None:
            continue
        lines.append(f"| {question} | {figure(results[name])} | [{name}](#{slug(titles[name])}) |")
    return "\n".join(lines)
