"""The model card (README.md) of an exported drafter, written from what its run recorded: the run's Hydra config,
the checkpoint's metrics.json and the run's metrics.jsonl eval history.

Only public names reach the card: a path local to the training machine is reduced to its last component.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafter_train.drafters.registry import DrafterKind, folder_kind, get_kind, module_name
from drafter_train.io import read_json_or_empty
from drafter_train.errors import ConfigError

_STEP = re.compile(r"^step-(\d+)$")
# Written into every card; `export.overwrite=true` only ever deletes a folder that carries it.
MARKER = "Exported with `drafter-export`"
# Targets known by an alias in this project, and the Hub model they are (for the transformers snippet).
HUB_IDS = {"embedded:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclass
class RunInfo:
    """What the card is written from: the run's config (empty when unknown) and its measured numbers."""

    step_dir: Path
    step: Optional[int]  # None: a step folder renamed away from step-N
    config: dict
    metrics: dict
    history: list[dict]
    draft_len: int
    kind: Optional[DrafterKind] = None  # what the checkpoint's drafter/ holds (None: read from the folder)
    calibration: Optional[dict] = None  # export.calibration: drafter-eval's calibration.json for this drafter
    ran_in: Optional[str] = None  # the mixed precision the run resolved (train.mixed_precision=auto: no or bf16)

    def __post_init__(self) -> None:
        self.kind = self.kind or folder_kind(str(self.step_dir / "drafter")) or get_kind("ar")


# ----------------------------------------------------------------------------------------------------------------
# What the run recorded


def read_run_info(step_dir: Path) -> RunInfo:
    """The step's metrics.json, the run's eval history (metrics.jsonl) and its Hydra config (.hydra/config.yaml)."""
    run_dir = step_dir.parent
    metrics = read_json_or_empty(step_dir / "metrics.json")
    # train() writes the resolved config.yaml itself (sweeps and in-process runs leave no .hydra/ in the run folder).
    config = run_config(run_dir / "config.yaml") or run_config(run_dir / ".hydra" / "config.yaml")
    # The trained draft length; a run started without Hydra left only its evaluation's draft length.
    draft_len = config.get("drafter", {}).get("draft_len") or metrics.get("draft_len")
    if not draft_len:
        raise ConfigError(f"export.checkpoint: {step_dir} records no draft length (no metrics.json, no run config)")
    step = int(m.group(1)) if (m := _STEP.match(step_dir.name)) else None
    history = read_metrics(run_dir / "metrics.jsonl")  # read once: it holds every step a long run logged
    return RunInfo(step_dir, step, config, metrics, eval_history(history), int(draft_len),
                   ran_in=last_logged(history, "launch/mixed_precision"))




def run_config(path: Path) -> dict:
    """Hydra saves the composed config unresolved; resolve it group by group, so that one interpolation only the
    training machine could resolve (an env var, a Hydra resolver) leaves just its own group as written."""
    if not path.is_file():
        return {}
    loaded = OmegaConf.load(path)
    return {str(key): _resolved(loaded, key) for key in loaded}


def _resolved(cfg: DictConfig, key):
    try:
        node = cfg[key]
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except OmegaConfBaseException:
        return OmegaConf.to_container(cfg, resolve=False)[key]


def eval_history(records: list[dict]) -> list[dict]:
    """One row per evaluated step of metrics.jsonl's `records`, in step order; a resumed run may log a step twice,
    the last entry wins."""
    rows = {}
    for record in records:
        if "eval/tau" in record:
            rows[record["step"]] = {k.removeprefix("eval/"): v for k, v in record.items()}
    return [rows[step] for step in sorted(rows)]


def last_logged(records: list[dict], key: str):
    """The last value metrics.jsonl's `records` logged under `key` (a resumed run logs its launch again), else None."""
    return next((r[key] for r in reversed(records) if key in r), None)


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records, in order ([] without the file)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
    return records


# ----------------------------------------------------------------------------------------------------------------
# Public names


def looks_local(value: str) -> bool:
    """An absolute or home-relative path, or anything naming the home folder."""
    home = str(Path.home())
    return value.startswith(("/", "~")) or (len(home) > 1 and home in value)


def public_name(path: Optional[str]) -> Optional[str]:
    """A path as the user gave it, unless it is local to this machine: then only its last component."""
    if path is None or not looks_local(path):
        return path
    return Path(path).expanduser().name


def target_names(info: RunInfo, target_id: Optional[str]) -> tuple[str, str, str]:
    """The target for the card: (as shown, as drafter-eval's target.path, as transformers loads it).

    The run's target.path is shown as given unless it is local to the training machine: then only its folder name,
    and the snippets name `export.target_id` if given, else a placeholder path.
    """
    path = info.config.get("target", {}).get("path")
    if not path:
        fallback = target_id or "path/to/target"
        return f"`{target_id}`" if target_id else "unknown (the run folder records no config)", fallback, fallback
    if looks_local(str(path)):
        name = public_name(str(path))
        return f"`{name}` (a local folder)", target_id or f"path/to/{name}", target_id or f"path/to/{name}"
    return f"`{path}`", path, target_id or HUB_IDS.get(path, path)


# ----------------------------------------------------------------------------------------------------------------
# The card


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    return str(value)


def step_text(info: RunInfo) -> str:
    return str(info.step) if info.step is not None else info.step_dir.name


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows])


def _training_rows(info: RunInfo, target: str) -> list[tuple[str, str]]:
    cfg = info.config
    drafter, loss, train = cfg.get("drafter", {}), cfg.get("loss", {}), cfg.get("train", {})
    rows = [("target", target), ("draft length (`draft_len`)", str(info.draft_len))]
    if not cfg:
        return rows + [("training config", "not recorded (the run was not started through `drafter-train`)")]
    if info.kind.fit is not None:  # not trained by gradient descent: what its own recipe recorded (layerskip)
        return rows + _search_rows(info, train)
    loss_text = f"`{loss.get('name')}` (teacher {loss.get('teacher')}, temperature {loss.get('temperature')}"
    loss_text += f", beta {loss.get('beta')})" if loss.get("name") == "jsd" else ")"
    return rows + [
        ("drafter init", f"`{public_name(str(drafter.get('path')))}`"),
        ("data", _data_text(train)),
        ("loss", loss_text),
        ("exported step", f"{step_text(info)} of {train.get('max_steps')} (batch {train.get('batch_size')} x "
                          f"{train.get('grad_accum')} accumulation, lr {train.get('lr')} {train.get('lr_schedule')})"),
        ("precision", f"target {cfg.get('target', {}).get('dtype')}, mixed precision {_precision(train, info)}"),
    ]


def _precision(train: dict, info: RunInfo) -> str:
    """As configured, and what auto resolved to on the training machine (the saved config keeps auto, so that a
    resume compares equal)."""
    configured = train.get("mixed_precision")
    return f"{configured} ({info.ran_in} as trained)" if info.ran_in and info.ran_in != configured else str(configured)


def _search_rows(info: RunInfo, train: dict) -> list[tuple[str, str]]:
    found = info.metrics.get("search") or {}
    return [("data", _data_text(train)),
            ("search", f"{found.get('trials')} trials (optuna TPE on SWIFT's one-pass proxy), the best "
                       f"{len(found.get('confirmed', []))} decoded for real; chosen: trial {found.get('trial')}, "
                       f"proxy {_fmt(found.get('proxy'))}, cost {_fmt(found.get('cost'))}"),
            ("skipped sub-layers", f"attention {info.metrics.get('skip_attn')}, MLP {info.metrics.get('skip_mlp')}")]


def _data_text(train: dict) -> str:
    """The distillation data as named in the run, plus what drafter-datagen recorded when it is still readable."""
    data_dir = str(train.get("data_dir"))
    answers = "the target's own continuations" if train.get("response", "target") == "target" else "reference answers"
    text = f"`{public_name(data_dir)}`, trained on {answers}"
    record = read_json_or_empty(Path(data_dir).expanduser() / "datagen.json")  # relative paths: only from the run's cwd
    if record:
        source = public_name(record.get("prompts", {}).get("source")) or "ShareGPT first user turns"
        gen = record.get("generation", {})
        mode = "greedy" if not gen.get("temperature") else f"sampled at temperature {gen.get('temperature')}"
        text += (f" of {record.get('counts', {}).get('train_prompts')} prompts from `{source}` "
                 f"({mode}, up to {gen.get('max_new_tokens')} new tokens)")
    return text


def _metrics_section(info: RunInfo) -> str:
    m = info.metrics
    if not m:
        return "No evaluation was recorded for this checkpoint."
    keys = ("tau", "acceptance_rate", "per_position_acceptance", "speedup", "greedy_match", "spec_tokens_per_s",
            "ar_tokens_per_s", "draft_len", "verify", "num_prompts", "tokens_generated", "target_forward_passes")
    evals = info.config.get("eval", {})
    prompts = f"`{public_name(evals['prompts'])}`" if evals.get("prompts") else "held-out prompts"
    cap = f", up to {evals['max_new_tokens']} new tokens each" if "max_new_tokens" in evals else ""
    tree = m.get("tree")
    shape = (f"a draft tree of top_k {tree['top_k']}, depth {tree['depth']}, {tree['total_tokens']} draft tokens per "
             f"pass ({tree['branching']})" if tree else f"draft_len {m.get('draft_len')}")
    where = f"{m.get('num_prompts')} {prompts}{cap}, `{m.get('verify')}` verification, {shape}"
    return f"Measured by drafter_train's speculative decoder at step {step_text(info)} ({where}):\n\n" + _table(
        [(f"`{k}`", _fmt(m[k])) for k in keys if k in m], ("metric", "value"))


_DEFINITIONS = (
    "`tau`: tokens generated per target forward pass, the prefill pass included (plain decoding has 1). "
    "`acceptance_rate`: accepted / proposed draft tokens. "
    "`per_position_acceptance[i]`: P(draft i accepted | drafts before it accepted), i = 1..`draft_len`. "
    "`speedup`: speculative tokens per second over those of the fastest plain decoding timed on every CPU kernel "
    "setting (`baseline` names it), same prompts, same process, on the machine that trained the drafter (it "
    "depends on that hardware). "
    "`greedy_match`: share of prompts whose speculative output equals plain greedy decoding (1.0 = lossless)."
)


def _calibration_section(record: dict) -> str:
    """The draft length / tree size drafter-eval's calibration picked, and the machine it measured."""
    from drafter_train.machine import describe_usable  # torch: not with the module, which drafter-report imports

    pick, machine = record["pick"], record["machine"]
    where = (f"{machine['cpu']} ({machine['device']}, {describe_usable(machine)}, {machine['logical_cores']} logical "
             f"cores, {machine['torch_threads']} torch threads, {machine['dtype']}, torch {machine['torch']}; load "
             f"average {' / '.join(str(x) for x in machine['load_average'])})")
    rows = [(c["name"], f"{c['predicted_tau']:.2f}", f"{c['draft_ms']:.1f}", f"{c['verify_ms']:.1f}",
             f"{c['predicted_speedup']:.3f}") for c in record["candidates"][:5]]
    table = "\n".join(["| setting | predicted tau | drafter ms | verify ms | predicted speedup |",
                       "|---|---|---|---|---|"] + ["| " + " | ".join(row) + " |" for row in rows])
    return (f"`drafter-eval eval.calibration.enabled=true` measured this machine's verify cost curve and this "
            f"drafter's cost and acceptance ({record['verify']} verification, {record['measured_at']}) on {where}, "
            f"and picked **{pick['name']}**: predicted speedup {pick['predicted_speedup']:.3f}, measured "
            f"{pick['measured_speedup']:.3f} ({pick['measured_on']}; tau {pick['measured_tau']:.2f}). The best "
            f"setting depends on the hardware: calibrate again on yours.\n\n{table}")


def _history_section(info: RunInfo) -> str:
    if not info.history:
        return "No evaluation history (metrics.jsonl) was found next to the checkpoint."
    lines = ["| step | tau | acceptance | speedup | greedy_match |", "|---|---|---|---|---|"]
    for row in info.history:
        step = {0: "0 (untrained)", info.step: f"**{info.step}** (exported)"}.get(row["step"], str(row["step"]))
        cells = [_fmt(row.get(k)) for k in ("tau", "acceptance_rate", "speedup", "greedy_match")]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _usage_section(info: RunInfo, target_path: str, target_hub: str, drafter_ref: str) -> str:
    if not info.kind.hf_assistant:
        return _project_decoder_usage(info, target_path, target_hub, drafter_ref)
    return f"""With transformers (assisted generation; this folder's generation config drafts {info.draft_len} tokens
per target pass, the draft length it was trained for):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{target_hub}")
target = AutoModelForCausalLM.from_pretrained("{target_hub}")
drafter = AutoModelForCausalLM.from_pretrained("{drafter_ref}")
inputs = tokenizer("Tell me a story.", return_tensors="pt")
out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=64)
print(tokenizer.decode(out[0], skip_special_tokens=True))
```

With drafter_train's own lossless speculative decoder (tau, acceptance and speedup against plain decoding):

""" + _eval_snippet(info, target_path, drafter_ref)


def _project_decoder_usage(info: RunInfo, target_path: str, target_hub: str, drafter_ref: str) -> str:
    kind, module = info.kind, module_name(info.kind)
    return f"""{kind.summary} transformers' assisted generation only drives stand-alone autoregressive drafters, so
decode with drafter_train's lossless speculative decoder (with drafter_train installed; importing `{module}`
registers the model with transformers' Auto classes):

```python
import {module}  # noqa: F401  registers model_type "{kind.model_type}"
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
from drafter_train.drafters.registry import make_drafter
from drafter_train.decoding.speculative import generate_speculative
from drafter_train.decoding.verify import make_verifier
from drafter_train.decoding.sampling import SamplingParams

tokenizer = AutoTokenizer.from_pretrained("{target_hub}")
target = AutoModelForCausalLM.from_pretrained("{target_hub}")
drafter = make_drafter(AutoModel.from_pretrained("{drafter_ref}"))
prompt = tokenizer("Tell me a story.")["input_ids"]
out = generate_speculative(target, drafter, prompt, {info.draft_len}, make_verifier("greedy", SamplingParams()), 64)
print(tokenizer.decode(out.tokens))
```

Measured against plain decoding:

""" + _eval_snippet(info, target_path, drafter_ref)


def _eval_snippet(info: RunInfo, target_path: str, drafter_ref: str) -> str:
    chat = " target.chat_template=false" if info.config.get("target", {}).get("chat_template") is False else ""
    return f"""```bash
drafter-eval target.path={target_path}{chat} drafter=path drafter.path={drafter_ref} eval.draft_len={info.draft_len}
```"""


def _serving_usage(info: RunInfo, fmt: str, target_hub: str, drafter_ref: str) -> str:
    """How the engine this folder was exported for serves it."""
    k, method = info.draft_len, info.kind.engine_methods[fmt]
    if fmt == "gguf":
        return f"""This folder is for llama.cpp (`drafter-export export.format=gguf`): `drafter.gguf`, and `target.gguf`
when it was exported with the target (a drafter only runs with the target file it was converted against):

```bash
llama-speculative-simple -m target.gguf -md drafter.gguf --spec-type {method} --spec-draft-n-max {k} \\
  -p "Tell me a story." -n 64 --temp 0 --top-k 1
llama-server -m target.gguf -md drafter.gguf --spec-type {method} --spec-draft-n-max {k}
```"""
    if fmt == "vllm":
        layout = {"eagle3": ", speculators layout", "dflash": ", DFlashDraftModel layout"}.get(method, "")
        return f"""This folder is in vLLM's format (`drafter-export export.format=vllm`{layout}):

```python
from vllm import LLM, SamplingParams

llm = LLM(model="{target_hub}", speculative_config={{"method": "{method}", "model": "{drafter_ref}",
                                                     "num_speculative_tokens": {k}}})
print(llm.generate(["Tell me a story."], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text)
```"""
    return f"""This folder is in SGLang's format (`drafter-export export.format=sglang`):

```bash
python -m sglang.launch_server --model-path {target_hub} --speculative-algorithm {method} \\
  --speculative-draft-model-path {drafter_ref} --speculative-num-steps {k} --speculative-eagle-topk 1 \\
  --speculative-num-draft-tokens {k + 1}
```"""


def model_card(info: RunInfo, drafter_ref: str, target_id: Optional[str] = None, fmt: str = "hf") -> str:
    """README.md: what the drafter was trained for and on, what it measured, and how to use it (in the engine
    `fmt` names, for a folder exported in an engine's format)."""
    target, target_path, hub = target_names(info, target_id)
    kind_tag = "".join(f"- {tag}\n" for tag in info.kind.card_tags)
    front = "---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- speculative-decoding\n" \
            f"{kind_tag}- drafter\n- drafter-train\n---\n"
    sections = [
        f"# Drafter for {target}\n\nA draft model for speculative decoding of {target}, trained with "
        f"drafter_train. {MARKER} from checkpoint step {step_text(info)}.",
        "## Training\n\n" + _table(_training_rows(info, target), ("setting", "value")),
        "## Measured speculative decoding\n\n" + _metrics_section(info) + "\n\n" + _DEFINITIONS,
        *(["## Draft length / tree size for this machine\n\n" + _calibration_section(info.calibration)]
          if info.calibration else []),
        "## Evaluation history\n\n" + _history_section(info),
        "## Usage\n\n" + (_usage_section(info, target_path, hub, drafter_ref) if fmt == "hf" else
                            _serving_usage(info, fmt, hub, drafter_ref)),
    ]
    return front + "\n\n".join(sections) + "\n"
