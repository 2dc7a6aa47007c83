"""The served pipeline's stages that decide something between their commands (conf/pipeline/served_qwen.yaml): the
choice on the dev split, the agreement check, and the served table, which serves what was chosen.

Each times decoders through `python -m benchmarks.engines` (or benchmarks.engine_check), run in this interpreter as a
command (the package never imports the benchmarks); their options stay in the YAML, these functions only add what a
measurement before them decided.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from drafter_train.engines.choose import CORPUS_MODE, add_verify_file, chose_all, chosen, choose as choose_settings
from drafter_train.engines.journal import measured_here
from drafter_train.errors import ConfigError
from drafter_train.io import write_atomic
from drafter_train.pipeline.config import Stage
from drafter_train.pipeline.runner import StageFailed, command_line, set_aside

SUPERSEDED = "superseded"


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def benchmark(module: str, args: Sequence[str], ok: Sequence[int] = (0,)) -> int:
    """python -m benchmarks.<module> ARGS in this interpreter; an exit status outside `ok` is StageFailed."""
    code = subprocess.run(command_line(["python3", "-m", f"benchmarks.{module}", *map(str, args)])).returncode
    if code not in ok:
        raise StageFailed(f"benchmarks.{module} failed (exit {code}); rerunning resumes at it", code)
    return code


def draft_args(lengths: Sequence[int], files: dict) -> list[str]:
    """--draft-gguf / --draft-len-of for each drafter (label prefix -> GGUF@precision) at each draft length: rows
    labelled PREFIX-LENGTH, which choose reads."""
    args = []
    for prefix, file in files.items():
        for n in lengths:
            args += ["--draft-gguf", f"{prefix}-{n}={file}", "--draft-len-of", f"{prefix}-{n}={n}"]
    return args


def chose(stage: Stage) -> bool:
    """The choose stage's done rule: choice.json exists, chose every drafter, and holds the corpus verdict (made only
    when the kept mode is not the corpus mode itself, so that choice is remade each run: cheap, from the records)."""
    path = Path(stage.outputs[0])
    if not path.is_file():
        return False
    choice = json.loads(path.read_text())
    return chose_all(choice, list(stage.args["drafts"])) and "corpus" in choice


def choose(out: str, served: list, dev: list, drafts_at: list, drafts: dict, corpus_dev: list,
           quantised: dict, verify_split: str = "") -> None:
    """Time every drafter at each length of `drafts_at` and each free n-gram mode on dev (OUT/choose); then whether
    the corpus cache helps the kept mode, and EAGLE-3 exported quantised (`quantised`, at length 1), in a second dev
    pass (OUT/choose-corpus); write OUT/choice.json (engines/choose.py says what it keeps). With a `verify_split`
    record of this machine, also the target file EAGLE-3 (the first of `drafts`) is served on (its verify_file)."""
    root = Path(out)
    choice_file, first, second = root / "choice.json", root / "choose" / "choose.json", root / "choose-corpus"
    if choice_file.is_file() and not chose_all(json.loads(choice_file.read_text()), list(drafts)):
        # a choice made before a drafter joined is made again, all drafters side by side in one dev pass
        set_aside(root / SUPERSEDED, [str(choice_file), str(root / "choose"), str(second)],
                  f"served_qwen: chosen without one of {' '.join(drafts)}", _say)
    if not first.is_file():
        benchmark("engines", [*served, *dev, "--ngram-modes", "all", *draft_args(drafts_at, drafts),
                              "--output", root / "choose", "--result-name", "choose"])
    record = json.loads(first.read_text())
    mode = choose_settings(record, list(drafts))["ngram_mode"]
    corpus = None
    if mode != CORPUS_MODE:
        if not (second / "choose-corpus.json").is_file():
            benchmark("engines", [*served, *corpus_dev, "--ngram-modes", mode, "--product", "lookups",
                                  "--product-ngram", f"{mode},{CORPUS_MODE}", *draft_args([1], quantised),
                                  "--output", second, "--result-name", "choose-corpus"])
        corpus = json.loads((second / "choose-corpus.json").read_text())
    picked = choose_settings(record, list(drafts), corpus)
    if verify_split and Path(verify_split).is_file():
        picked = add_verify_file(picked, record, list(drafts)[0], json.loads(Path(verify_split).read_text()))
    write_atomic(choice_file, json.dumps(picked, indent=2) + "\n")


def agreement(out: str, target: str, made: list, served: dict, check: list, results: str) -> None:
    """EAGLE-3's per-position acceptance in llama.cpp against ours on the same test prompts, on each target file:
    first `target` (a target.path) converted here at each type of `made` (f16: llama.cpp and our decoder do the same
    arithmetic; engines/export.py llama_target_gguf), then `served` (name -> GGUF, the served Q4_K_M). Each is
    benchmarks.engine_check writing <results>/engine_llamacpp_qwen1_5b_<name>.json. Our decoding (fp32 torch,
    ~35 min here) is the same for every target file: made once, kept as OUT/agreement-ours.json."""
    from drafter_train.engines.export import llama_target_gguf

    root, ours = Path(out), Path(out) / "agreement-ours.json"
    files = {**{t: None for t in made}, **served}
    for name, file in files.items():
        result = f"engine_llamacpp_qwen1_5b_{name}"
        if (Path(results) / f"{result}.json").is_file():
            continue
        gguf = file or llama_target_gguf(target, name)
        again = ["--ours-from", ours] if ours.is_file() else []
        # 1: outside the tolerance, the verdict is in the result file; anything else failed
        benchmark("engine_check", [*check, "--target-gguf", gguf, "--output", root / f"agreement-{name}",
                                   "--result-name", result, "--results-dir", results, *again], ok=(0, 1))
        if not ours.is_file():
            shutil.copy(root / f"agreement-{name}" / "llamacpp_check.json", ours)


def table(out: str, served: list, test: list, choice: str, drafts: dict, near_ties: list, result_name: str,
          results_dir: str, verify_files: dict | None = None) -> None:
    """The served table on the test split: each drafter of `drafts` (label -> [GGUF@precision, draft length: a
    number, or the choice.json prefix whose length was chosen on dev]), the free mode chosen, the product with
    EAGLE-3 and, unless the corpus cache stayed out, without a drafter (lookups). `verify_files` (label -> GGUF, the
    files the verify-split stage made): each one's plain row, and where choose picked one for EAGLE-3
    (choice.json's verify_file), EAGLE-3 on it too (row eagle3-LABEL). The result file: <results_dir>/<result_name>.json."""
    why = measured_here(Path(choice))
    if why:
        raise ConfigError("served_qwen: the table serves what the choose stage chose on this machine: run "
                          f"pipeline.stages=[choose] first ({why})")
    picked = json.loads(Path(choice).read_text())
    args = [*served, *test, "--ngram-modes", chosen(picked, "ngram_mode")]
    for label, (file, length) in drafts.items():
        length = length if isinstance(length, int) else chosen(picked, f"draft_len.{length}")
        args += ["--draft-gguf", f"{label}={file}", "--draft-len-of", f"{label}={length}"]
    for label, file in (verify_files or {}).items():
        if Path(file).is_file():
            args += ["--target-gguf", f"{label}={file}"]
    on = (picked.get("verify_file") or {}).get("file")
    if on in (verify_files or {}) and Path(verify_files[on]).is_file():
        file, length = drafts["eagle3"]
        length = length if isinstance(length, int) else chosen(picked, f"draft_len.{length}")
        args += ["--draft-gguf", f"eagle3-{on}={file.rpartition('@')[0]}@{on}", "--draft-len-of",
                 f"eagle3-{on}={length}"]
    lookups = [] if chosen(picked, "product_ngram") == chosen(picked, "ngram_mode") else ["--product", "lookups"]
    ours = Path(out) / "agreement-ours.json"
    beside = ["--ours-acceptance", f"eagle3={ours}"] if ours.is_file() else []
    benchmark("engines", [*args, "--product", "eagle3", *lookups, "--product-ngram", chosen(picked, "product_ngram"),
                          *near_ties, *beside, "--output", Path(out) / "table", "--result", "--result-name",
                          result_name, "--results-dir", results_dir])
