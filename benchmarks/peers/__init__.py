"""The peer EAGLE-3 trainers (speculators, ModelOpt) run from outside: each adapter is a standalone script run by its
own venv's python (scripts/setup_peers.sh), fed the same rows as ours and writing a folder our evaluator and vLLM
load. Nothing here imports the peers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENVS = {"speculators": ("DRAFTER_TRAIN_SPECULATORS_VENV", ".venv-speculators"),
         "modelopt": ("DRAFTER_TRAIN_MODELOPT_VENV", ".venv-modelopt")}


def peer_python(name: str) -> Path:
    """The peer's venv interpreter: $DRAFTER_TRAIN_<NAME>_VENV, else .venv-<name> in the repo."""
    variable, default = VENVS[name]
    return Path(os.environ.get(variable) or REPO / default) / "bin" / "python"


def check_venv(name: str) -> None:
    """Refuse in one line (SystemExit) a peer whose venv is not built: the default is .venv-<name> in THIS checkout,
    which another clone does not have, and a missing interpreter would otherwise surface as a traceback mid-run."""
    python = peer_python(name)
    if not python.exists():
        variable = VENVS[name][0]
        raise SystemExit(f"peer_trainers: {name} runs in its own venv and {python} is not there: build it with "
                         f"bash scripts/setup_peers.sh, or set ${variable} to one built elsewhere (or leave {name} "
                         "out of --trainers)")


def trains(record: dict, column: str, max_seq_len: int) -> bool:
    """Whether a datagen record gives a row with response tokens: a non-empty `column` after a prompt shorter than
    max_seq_len."""
    return bool(record[column]) and len(record["prompt_ids"]) < max_seq_len


def write_rows(records: Iterable[dict], out: Path, max_seq_len: int, response_tokens: Optional[int] = None,
               column: str = "response_ids") -> int:
    """Our datagen records (prompt_ids and the response in `column`: response_ids, the target's answers, or
    reference_ids, the source's own, as datagen.generate=false stores them) -> the rows every trainer reads: JSONL
    {"input_ids", "loss_mask"} (1 on response tokens), cut at max_seq_len, until `response_tokens` response tokens are
    in. Records without response tokens are skipped. Returns the response tokens written."""
    seen = 0
    with out.open("w") as f:
        for record in records:
            if response_tokens is not None and seen >= response_tokens:
                break
            if not trains(record, column, max_seq_len):
                continue
            prompt, response = list(record["prompt_ids"]), list(record[column])
            ids = (prompt + response)[:max_seq_len]
            mask = ([0] * len(prompt) + [1] * len(response))[:max_seq_len]
            seen += sum(mask)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return seen


def engine_layer_ids(ours: list[int]) -> list[int]:
    """Our 'output of layer i' ids -> speculators' / vLLM's 'input of layer i + 1' ids."""
    return [i + 1 for i in ours]


def train_speculators(target: Path, rows: Path, layers: list[int], out: Path, settings: dict,
                      timeout: Optional[float] = None) -> dict:
    """speculators' trainer (benchmarks/peers/speculators_train.py) on `rows`: OUT/drafter, and its train_info."""
    return _run("speculators", target, rows, engine_layer_ids(layers), out, settings, timeout)


def train_modelopt(target: Path, rows: Path, layers: list[int], out: Path, settings: dict,
                   timeout: Optional[float] = None) -> dict:
    """ModelOpt's EAGLE-3 training (benchmarks/peers/modelopt_train.py) on `rows`, its layer ids ours (it hooks
    outputs): OUT/drafter (its export, for our evaluator), OUT/drafter-vllm (ids + 1, for vLLM), its train_info."""
    return _run("modelopt", target, rows, layers, out, settings, timeout)


def _run(peer: str, target: Path, rows: Path, layer_ids: list[int], out: Path, settings: dict,
         timeout: Optional[float]) -> dict:
    args = [str(peer_python(peer)), "-P", str(HERE / f"{peer}_train.py"), "--target", str(target),
            "--data", str(rows), "--layer-ids", ",".join(map(str, layer_ids)), "--out", str(out)]
    for key, value in settings.items():
        args += [f"--{key.replace('_', '-')}", str(int(value) if isinstance(value, bool) else value)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(args, check=True, env=env, timeout=timeout)
    return json.loads((out / "train_info.json").read_text())
