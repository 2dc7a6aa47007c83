"""`drafter-report`: tau and speedup against draft length or tree size over a sweep, as a markdown table and a PNG
plot. The x axis is the number of draft tokens one target pass verifies: a chain's draft_len, a tree's total_tokens
(a sweep over `eval.tree.total_tokens` draws one line per tree shape, next to the chains').

It reads what the runs wrote, nothing else:
- a drafter-train run folder: config.yaml (the resolved config) and its `best` checkpoint's metrics.json;
- a Hydra job folder of a `drafter-train -m` sweep: its .hydra/config.yaml names the run folder
  (train.output_root/train.run_name), which is read as above;
- a job folder of a `drafter-eval -m` sweep: metrics.json, whose `config` says what was evaluated.
Training runs make one line per loss and drafter kind; evaluator jobs one line per evaluated drafter and kind.
`SweepReport` writes the same report into the sweep folder when a `-m` sweep ends (hydra.callbacks in
conf/train.yaml and conf/eval.yaml).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from drafter_train.recipes.cli import on_main_process, one_line_errors, report_main
from drafter_train.config import ReportJobConfig, TrackerConfig
from drafter_train.io import read_json_or_empty
from drafter_train.errors import ConfigError
from drafter_train.model_card import run_config
from drafter_train.tracking import log_report

# drafter.kind (ar | nar | eagle3 ...) is recorded by newer runs; runs from before it existed trained autoregressive drafters.
DEFAULT_KIND = "ar"
COLUMNS = ("loss", "kind", "drafter", "draft_len", "tau", "acceptance_rate", "speedup", "tree", "draft_tokens", "run",
           "measured_at")


@dataclass
class RunResult:
    """One point of the report: the numbers one run (or evaluator job) measured at one draft length."""

    loss: str  # "-" for evaluator jobs (what trained the drafter is not recorded there)
    kind: str
    drafter: str
    draft_len: int
    tau: float
    acceptance_rate: float
    speedup: float
    tree: str  # the tree's shape ("top_k=4 depth=6"), "-" for a chain
    draft_tokens: int  # draft tokens per target pass: a chain's draft_len, a tree's total_tokens
    run: str  # the run (or job) folder's name
    measured_at: str  # which metrics.json: the best checkpoint's, or the evaluator job's

    @property
    def line(self) -> str:
        """The plot line this point belongs to."""
        first = f"loss={self.loss}" if self.loss != "-" else f"drafter={self.drafter}"
        return f"{first}, kind={self.kind}" + ("" if self.tree == "-" else f", tree {self.tree}")

    def row(self) -> list:
        return [getattr(self, name) for name in COLUMNS]


@dataclass
class Collected:
    results: list[RunResult] = field(default_factory=list)
    # Folders that look like runs but could not be reported, with the reason (listed in the report).
    skipped: list[str] = field(default_factory=list)


@dataclass
class Report:
    markdown: Path
    plot: Path
    results: list[RunResult]


# ----------------------------------------------------------------------------------------------------------------
# Reading runs




def _result(config: dict, metrics: dict, loss: str, run: str, measured_at: str) -> RunResult:
    drafter = config.get("drafter", {})
    # The draft length that was measured; the configured one when an old metrics file lacks it.
    draft_len = metrics.get("draft_len") or config.get("eval", {}).get("draft_len") or drafter.get("draft_len")
    # The kind the evaluator loaded (drafter=path configs say "auto"), else the configured one.
    kind = metrics.get("drafter_kind") or drafter.get("kind", DEFAULT_KIND)
    tree = metrics.get("tree")  # the measured tree (None or absent: a chain)
    shape = "-" if not tree else f"top_k={tree['top_k']} depth={tree['depth']}" + (
        "" if tree.get("branching", "topk") == "topk" else f" {tree['branching']}")
    size = int(tree["total_tokens"]) if tree else int(draft_len)
    return RunResult(loss, kind, str(drafter.get("path", "?")), int(draft_len), metrics["tau"],
                     metrics["acceptance_rate"], metrics["speedup"], shape, size, run, measured_at)


def train_result(run_dir: Path, found: Collected) -> None:
    """A drafter-train run folder, through its best checkpoint (the highest tau of all its evaluations)."""
    best = run_dir / "best"
    metrics = read_json_or_empty(best / "metrics.json")
    if "tau" not in metrics:
        found.skipped.append(f"{run_dir}: no best checkpoint with metrics.json yet")
        return
    config = run_config(run_dir / "config.yaml")
    loss = config.get("loss", {}).get("name", "?")
    found.results.append(_result(config, metrics, loss, run_dir.name, f"best ({best.resolve().name})"))


def eval_result(job_dir: Path, metrics: dict, found: Collected) -> None:
    found.results.append(_result(metrics["config"], metrics, "-", job_dir.name, "metrics.json"))


def hydra_job_run_dir(job_dir: Path) -> Optional[Path]:
    """The run folder a drafter-train Hydra job folder trained into (relative paths: from the current folder)."""
    train = run_config(job_dir / ".hydra" / "config.yaml").get("train")
    if not isinstance(train, dict) or "run_name" not in train:
        return None
    return Path(str(train.get("output_root", "checkpoints"))) / str(train["run_name"])


def read_folder(folder: Path, found: Collected, seen: set) -> None:
    """Add what `folder` holds if it is a run, an evaluator job or a training sweep's job folder; else nothing."""
    metrics = read_json_or_empty(folder / "metrics.json")
    if "config" in metrics and "tau" in metrics:  # drafter-eval wrote it (checkpoints' metrics have no config)
        eval_result(folder, metrics, found)
        return
    run_dir = folder if (folder / "config.yaml").is_file() else hydra_job_run_dir(folder)
    if run_dir is None or run_dir.resolve() in seen:
        return
    seen.add(run_dir.resolve())
    if not (run_dir / "config.yaml").is_file():
        found.skipped.append(f"{folder}: its run folder {run_dir} is missing (relative to the current folder)")
        return
    train_result(run_dir, found)


def collect(folder: Path) -> Collected:
    """Every run under `folder` (or `folder` itself when it is one run), in folder-name order."""
    if not folder.is_dir():
        raise ConfigError(f"report.input: {folder}: no such folder")
    found, seen = Collected(), set()
    is_one_run = (folder / "config.yaml").is_file() or (folder / "metrics.json").is_file()
    for path in [folder] if is_one_run else sorted(p for p in folder.iterdir() if p.is_dir()):
        read_folder(path, found, seen)
    if not found.results:
        why = f" ({found.skipped[0]})" if found.skipped else ""
        raise ConfigError(f"report.input: {folder} holds no runs to report: no drafter-train run folder with a best "
                          f"checkpoint, training sweep job or drafter-eval metrics.json{why}")
    return found


# ----------------------------------------------------------------------------------------------------------------
# Table and plot


def group_lines(results: list[RunResult]) -> dict[str, list[RunResult]]:
    """Results by plot line, each line in order of draft tokens per pass."""
    lines = defaultdict(list)
    for result in sorted(results, key=lambda r: (r.line, r.draft_tokens, r.run)):
        lines[result.line].append(result)
    return dict(lines)


def _cell(column: str, value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return f"`{value}`" if column in ("drafter", "run") else str(value)  # paths and folder names: shown as code


def markdown_table(title: str, results: list[RunResult], skipped: list[str], plot_name: str) -> str:
    lines = [
        f"# {title}", "",
        "Training runs are reported through their **best checkpoint** (highest tau over its evaluations: "
        "`best/metrics.json`); evaluator jobs through their `metrics.json`. tau = tokens per target forward pass, "
        "speedup = speculative over AR tokens/s, draft_tokens = draft tokens verified per target pass (a chain's "
        "draft_len, a tree's total_tokens; definitions: README).", "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---:" if c in ("draft_len", "tau", "acceptance_rate", "speedup", "draft_tokens") else "---"
                       for c in COLUMNS)
        + "|",
    ]
    for points in group_lines(results).values():
        lines += ["| " + " | ".join(_cell(c, v) for c, v in zip(COLUMNS, point.row())) + " |" for point in points]
    lines += ["", f"![tau and speedup against draft tokens per pass]({plot_name})", ""]
    if skipped:
        lines += ["Not reported:", "", *[f"- {reason}" for reason in skipped], ""]
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, title: str) -> None:
    """tau and speedup against draft tokens per pass, one line per group (matplotlib's Agg canvas: no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tau, ax_speedup = fig.subplots(1, 2)
    for line, points in group_lines(results).items():
        sizes = [p.draft_tokens for p in points]
        ax_tau.plot(sizes, [p.tau for p in points], marker="o", label=line)
        ax_speedup.plot(sizes, [p.speedup for p in points], marker="o", label=line)
    ax_speedup.axhline(1.0, color="grey", linestyle="--", linewidth=1)  # AR decoding
    for ax, ylabel in ((ax_tau, "tau (tokens per target pass)"), (ax_speedup, "speedup over AR decoding")):
        ax.set_xlabel("draft tokens per target pass (chain: draft_len, tree: total_tokens)")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    ax_tau.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def write_report(folder: Path, output_dir: Path, tracker: TrackerConfig) -> Report:
    """report.md and report.png for the runs under `folder`, written into `output_dir`, and logged to `tracker`."""
    found = collect(folder)
    title = f"Draft-length / tree-size sweep: {folder.resolve().name}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        report = Report(output_dir / "report.md", output_dir / "report.png", found.results)
        markdown = markdown_table(title, found.results, found.skipped, report.plot.name)
        report.markdown.write_text(markdown)
        plot(found.results, report.plot, title)
    except OSError as err:
        raise ConfigError(f"report.output_dir: cannot write {output_dir}: {err.strerror}") from None
    rows = [r.row() for points in group_lines(found.results).values() for r in points]
    log_report(tracker, output_dir, list(COLUMNS), rows, markdown, report.plot)
    for reason in found.skipped:
        print(f"drafter-report: skipped {reason}", file=sys.stderr)
    return report


# ----------------------------------------------------------------------------------------------------------------
# Entry points: the end of a -m sweep, and drafter-report


class SweepReport(Callback):
    """Writes report.md / report.png into the sweep folder when a `-m` sweep ends (configured in hydra.callbacks)."""

    def __init__(self, tracker: Optional[DictConfig] = None):
        # drafter-train passes its tracker group (the report becomes a run of its own there); drafter-eval none.
        self.tracker = TrackerConfig(**dict(tracker)) if tracker else TrackerConfig()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not on_main_process():  # every rank of a multi-process launch runs the sweep: write once
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        with one_line_errors("drafter-report"):
            report = write_report(sweep_dir, sweep_dir, self.tracker)
        print(f"sweep report: {report.markdown} and {report.plot}", file=sys.stderr)


def command(job: ReportJobConfig) -> None:
    """drafter-report once recipes/cli.py has built the job (its checks are the report's own)."""
    job.report.require_inputs()
    folder = Path(job.report.input)
    report = write_report(folder, Path(job.report.output_dir) if job.report.output_dir else folder, job.tracker)
    print(f"{len(report.results)} runs reported: {report.markdown} and {report.plot}", file=sys.stderr)


def main() -> None:
    """drafter-report as `python -m drafter_train.recipes.report`, and for installs whose console script still names
    this function; the console script is recipes/cli.py's report_main."""
    report_main()


if __name__ == "__main__":
    main()
