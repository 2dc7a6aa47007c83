"""The typed config of a pipeline (drafter-pipeline pipeline=NAME): its stages, and each pipeline's own settings.

A stage names what it runs (a command line, or a function), what it reads (inputs), what it writes (outputs) and when
it is done, so the runner (pipeline/runner.py) can skip what is done, write outputs whole and time what it ran. The
pipelines' settings (sizes, step counts, folders) are fields of their own dataclass below, each default stated once;
the YAML files (conf/pipeline/*.yaml) interpolate them into the stages' options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from drafter_train.errors import ConfigError

# When a stage counts as done (Stage.done), besides "module:function" (called with the stage, returns a bool):
DONE_KINDS = ("outputs", "trained", "always")
PART = "{part}"  # in a stage's command or args: where it writes outputs[0], renamed to outputs[0] when it succeeds


@dataclass
class Stage:
    """One stage. Exactly one of `run` (a command line) or `call` ("package.module:function", called with `args`)."""

    # argv (a list inside it is spliced in: pipeline.shared's argument lists); drafter-<job> and python3 run in the
    # runner's interpreter
    run: list[Any] = field(default_factory=list)
    call: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)  # must exist before it runs; an output older than one is stale
    outputs: list[str] = field(default_factory=list)
    # outputs: every output exists and none is older than an input; trained: outputs[0] is a drafter-train run
    # folder whose latest checkpoint is step `steps` with a `best`; always: runs every time (it resumes itself, or
    # is a cheap check); "module:function": that function of the stage
    done: str = "outputs"
    steps: int = 0  # done=trained: the step count the run ends at
    log: str = ""  # the command's stdout and stderr go to this file (overwritten), else to the console
    ok_returncodes: list[int] = field(default_factory=lambda: [0])
    # timings: a file (JSON naming its "machine") or journal folder measured on another CPU sets aside `set_aside`
    # into <out>/other-machines/<when>/ (kept, not used) before the stage runs, so it is measured again here
    measured: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if bool(self.run) == bool(self.call):
            raise ConfigError("pipeline stage: give exactly one of run (a command line) or call (module:function)")
        if self.done not in DONE_KINDS and ":" not in self.done:
            raise ConfigError(f"pipeline stage done: {self.done!r} is not one of {', '.join(DONE_KINDS)} or "
                              "module:function")
        if self.done == "trained" and (self.steps <= 0 or not self.outputs):
            raise ConfigError("pipeline stage done=trained: needs steps > 0 and the run folder as outputs[0]")


@dataclass
class PipelineConfig:
    """What every pipeline has: where it writes its bookkeeping, the stages to run, and the stages it knows."""

    name: str = "???"
    out: str = "???"  # stages.jsonl (each stage's wall time and machine) and other-machines/ go here
    stages: list[str] = field(default_factory=list)  # run in this order; a group's name stands for its stages
    groups: dict[str, list[str]] = field(default_factory=dict)
    known: dict[str, Stage] = field(default_factory=dict)  # every stage by name
    shared: dict[str, Any] = field(default_factory=dict)  # what several stages use: argument lists, paths
    # set unless already set (the wrappers in scripts/ set DS_ACCELERATOR for deepspeed's accelerator warning)
    env: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False  # print each stage's command line, and whether it is done, instead of running it
    command: str = ""  # what reproduces this run (a result file's "command"): the wrapper and the overrides given


@dataclass
class QuickstartConfig(PipelineConfig):
    """The main job (scripts/quickstart.sh): why these sizes, benchmarks/README.md ("The main job's settings")."""

    num_prompts: int = 1600  # ShareGPT prompts the target answers
    data: str = "data/quickstart-smollm2"  # the answers: training data and the corpus of corpus lookup
    checkpoints: str = "checkpoints"  # drafter-train's train.output_root
    run: str = "quickstart-smollm2"  # the run folder: <checkpoints>/<run>
    steps: int = 1200  # training steps (6 passes over the answers' records at batch 8)
    save_every: int = 600
    eval_prompts: int = 16  # prompts per evaluation (dev picks `best`, test reports)
    draft_len: int = 2
    results_dir: str = "benchmarks/results"  # where the summary's result file (main_job.json) goes
    train_extra: list[str] = field(default_factory=list)  # more drafter-train overrides: [train.lr=1e-3, ...]


@dataclass
class ServedQwenConfig(PipelineConfig):
    """The served pipeline on Qwen2.5-Coder-1.5B (scripts/served_qwen.sh); its budget: docs/lab-notes/served-qwen.md."""

    target: str = "qwen2.5-coder-1.5b"
    draft_model: str = "qwen2.5-coder-0.5b"  # the stock draft model, and what the AR drafter is cut from
    data: str = "data/qwen2.5-coder-1.5b"
    num_prompts: int = 160
    threads: int = 2
    request_s: float = 600.0  # datagen.llamacpp.request_s: a machine busy with other work may need more
    vocab: int = 8192  # EAGLE-3's and DFlash's draft vocabulary
    e3_steps: int = 100
    e3_lr: float = 5e-4
    ar_layers: int = 4  # the AR drafter: the 0.5B's first layers
    ar_steps: int = 60
    ar_batch: int = 4
    df_steps: int = 60
    df_block: int = 4  # DFlash drafts up to df_block - 1 tokens
    save_every: int = 50
    per_category: int = 2  # the served table: prompts of each of the test split's 14 categories
    new_tokens: int = 64
    rounds: int = 3
    verify_rounds: int = 2  # verify-split: timing rounds of each target file (a reduced run's longest stage)
    e3_type: str = "q4_k_m"  # the EAGLE-3 export the table serves: f16, q8_0 or q4_k_m
    dev_tokens: int = 64  # new tokens per dev prompt in the choose stage
    agreement_prompts: int = 14  # test prompts of the agreement check, and new tokens of each (our decoder decodes
    agreement_tokens: int = 48  # them with the float32 target in torch: ~35 min on 2 cores at these sizes)
    # where the timed stages' result files go, and the pages the results stage regenerates from them: a reduced or
    # trial run points all three elsewhere, so the committed figures stay the ones their commands made
    results_dir: str = "benchmarks/results"
    results_page: str = "docs/results.md"
    readme: str = "README.md"
    ours_per_category: int = 1  # the opt-in ours / vllm stages
    ours_tokens: int = 32
    vllm_venv: str = "${oc.env:DRAFTER_TRAIN_VLLM_VENV,.venv-vllm}"  # scripts/setup_vllm.sh's venv


@dataclass
class EngineArtifactsConfig(PipelineConfig):
    """What the engine table (python -m benchmarks.engines) and the llama.cpp engine checks read, made from the main
    job's data folder (conf/pipeline/engine_artifacts.yaml)."""

    data: str = "data/quickstart-smollm2"  # a drafter-datagen folder (the main job's), with its feature cache
    steps: int = 600  # nbf: the main job's EAGLE-3 recipe in llama.cpp's layout
    save_every: int = 300
    ar_steps: int = 100  # ar2: the target's first 2 layers, a draft model llama.cpp serves (not a good one)
    eval_prompts: int = 16
    draft_len: int = 2


@dataclass
class LongRunConfig(PipelineConfig):
    """One EAGLE-3 drafter over all of ShareGPT's assistant turns, in a run that survives stops and moves between
    machines, with learning-curve snapshots read from the same run (conf/pipeline/long_run.yaml, docs/train.md)."""

    target: str = "smollm2"  # a conf/target name: the data is tokenized for it, the drafter trained on it
    data: str = "data/long-run-smollm2"  # datagen.generate=false datagen.multi_turn=true: every assistant turn
    num_prompts: int = 100000  # conversations (more than ShareGPT holds: all of them)
    max_seq_len: int = 2048  # a conversation ends before the first turn whose prompt exceeds it; training cuts here
    checkpoints: str = "checkpoints"
    run: str = "long-run-smollm2"
    steps: int = 7600  # of 2 conversations, ~2.1k tokens a step: about one pass, 10M near step 4,800 (docs/train.md)
    save_every: int = 2000  # evaluated checkpoints (dev split), which pick `best`
    save_every_minutes: float = 10.0  # plus unevaluated ones every this many minutes of wall time
    snapshot_tokens: list[int] = field(default_factory=lambda: [1_000_000, 2_000_000, 4_000_000, 8_000_000,
                                                                10_000_000])
    results_dir: str = "benchmarks/results"
    result_name: str = "long_run_smollm2"
    train_extra: list[str] = field(default_factory=list)  # more drafter-train overrides, after the recipe's
