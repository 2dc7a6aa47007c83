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


# each peer's option that caps a row's tokens (and packs a step's): peer_trainers' --max-seq-len, a learning curve's
# train.max_seq_len
PACKING = {"speculators": "total_seq_len", "modelopt": "seq_len"}


def train_peer(trainer: str, target: Path, rows: Path, layers: list[int], out: Path, settings: dict,
               draft_vocab_size: int, seq_len: int) -> dict:
    """One peer trainer (a PACKING name) on `rows` with its `settings` plus the draft vocabulary and row length every
    comparison shares: OUT/<trainer>/drafter, and its train_info."""
    run = {"speculators": train_speculators, "modelopt": train_modelopt}[trainer]
    return run(target, rows, layers, out / trainer,
               dict(settings, draft_vocab_size=draft_vocab_size, **{PACKING[trainer]: seq_len}))


def _run(peer: str, target: Path, rows: Path, layer_ids: list[int], out: Path, settings: dict,
         timeout: Optional[float]) -> dict:
    args = [str(peer_python(peer)), "-P", str(HERE / f"{peer}_train.py"), "--target", str(target),
            "--data", str(rows), "--layer-ids", ",".join(map(str, layer_ids)), "--out", str(out)]
    for key, value in settings.items():
        args += [f"--{key.replace('_', '-')}", str(int(value) if isinstance(value, bool) else value)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(args, check=True, env=env, timeout=timeout)
    return json.loads((out / "train_info.json").read_text())


# The settings the peer comparisons run (benchmarks/peer_trainers.py's --settings, benchmarks/learning_curve.py's
# peer=TRAINER:SETTINGS variants): one table, so both read the same.
# Each trainer's own recommended settings, and the matched ones (ours' recipe, expressed in each trainer's terms).
# Ours' rows name ttt_decay 0.8 where they were measured with it: drafter-train's default until the ablations below
# made it 1.0 (chosen on the dev split: --prompts dev, peer_trainers_dev.json).
_OURS_MATCHED = {"loss": "fkl", "lr": 1e-3, "ttt_steps": 3, "norm_before_fc": True, "norm_output": True,
                 "ttt_decay": 0.8}
# ablations of ours toward speculators' defaults, one difference added at a time (--trainers ours --settings ...):
# its packing of 512 tokens a step makes ~4.5x our optimizer steps at batch 8; its warmup is 1 % of the steps
_STEPS = dict(_OURS_MATCHED, batch_size=2, warmup_steps=1)
_MUON = dict(_STEPS, optimizer="muon")
# and speculators' ttt_decay 1.0 (every unrolled step's loss weighted alike), drafter-train's default since it won
_DECAY1 = dict(_MUON, ttt_decay=1.0)
# and train.mixed_precision=auto: bf16 autocast for the drafter and the target's online forward where a bf16 matmul
# measures >= 1.5x float32 (this Xeon's AMX: ~6x), the same recipe in less wall
_AUTO = dict(_DECAY1, mixed_precision="auto")
_SPECULATORS = {"optimizer": "muon", "lr": 1e-3, "ttt_steps": 3, "norm_before_fc": True, "norm_output": True,
                "loss_fn": "kl_div", "ttt_decay": 1.0}

SETTINGS = {
    ("ours", "defaults"): dict(_OURS_MATCHED, lr=5e-4, norm_output=False),
    ("ours", "matched"): _OURS_MATCHED,
    ("ours", "steps"): _STEPS,
    ("ours", "steps-lr2e-3"): dict(_STEPS, lr=2e-3),
    ("ours", "steps-muon"): _MUON,
    ("ours", "steps-muon-decay1"): _DECAY1,
    # and speculators' linear decay of the lr (ours: cosine), the next difference at 50k tokens
    ("ours", "steps-muon-decay1-linear"): dict(_DECAY1, lr_schedule="linear"),
    ("ours", "steps-muon-decay1-auto"): _AUTO,
    ("ours", "steps-muon-decay1-auto-linear"): dict(_AUTO, lr_schedule="linear"),
    # and the target's features extracted once before training (drafter.features=offline), as speculators does
    ("ours", "steps-muon-decay1-auto-linear-offline"): dict(_AUTO, lr_schedule="linear", features="offline"),
    ("speculators", "defaults"): _SPECULATORS,
    # its defaults with its own training precision, bf16 autocast (hidden_states_dtype; float32 above), the hidden
    # states extracted under bf16 autocast too: the peer of ours' mixed_precision=auto on a CPU with fast bf16
    ("speculators", "defaults-bf16"): dict(_SPECULATORS, hidden_states_dtype="bfloat16"),
    ("speculators", "matched"): dict(_SPECULATORS, optimizer="adamw", ttt_decay=0.8, scheduler="cosine"),
    # ModelOpt: EAGLE3_DEFAULT_CFG (an 8B-sized draft layer, YaRN injected at export) and its example's lr 1e-4;
    # matched: the draft layer shaped like the target's, lr 1e-3, batch 8, the rope it trained with
    ("modelopt", "defaults"): {"lr": 1e-4, "batch_size": 1, "ttt_steps": 3, "ttt_decay": 0.8, "match_target": False,
                               "inject_yarn": True},
    ("modelopt", "matched"): {"lr": 1e-3, "batch_size": 8, "ttt_steps": 3, "ttt_decay": 0.8, "match_target": True,
                              "inject_yarn": False},
}
