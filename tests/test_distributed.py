"""Two processes on CPU train ONE drafter: DDP and DeepSpeed ZeRO-2 / ZeRO-3, launched with the README's
`accelerate launch` commands, each checked against a one-process run at the same global batch (2 ranks x batch 2
== 1 process x batch 4).

Every multi-process test asserts that 2 ranks really ran as one job (accelerate has launches that silently run one
process, or two unrelated ones). Agreement with the one-process run is within LOSS_TOL / WEIGHT_TOL: the ranks see
the same records in other groupings, so only the order of float sums differs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from drafter_train.config import CONF_DIR
from drafter_train.data.batches import BatchStream
from drafter_train.data.store import load_distill_dataset
from drafter_train.distributed import check_launch, check_launch_precision
from drafter_train.errors import ConfigError
from drafter_train.recipes.train import train
from tests.conftest import REPO
from tests.stubs import compose_cfg, run_cli
from tests.test_train import losses

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)  # per-step train/loss, 2 ranks vs 1 process
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)  # drafter weights after 4 AdamW steps at lr 3e-3
ACCELERATE_CONF = Path(CONF_DIR) / "accelerate"
RUN = "run"


def overrides(root: Path, out: Path, batch_size: int, *extra: str) -> list[str]:
    """A 4-step run on the tiny target with a constant LR (so a run stopped at step 2 and resumed to 4 is the same
    run as one of 4 steps), as Hydra CLI overrides."""
    return [
        f"target.path={root / 'target'}", "target.chat_template=false", "drafter.path=truncated:1",
        f"train.data_dir={root / 'data'}", f"train.output_root={out}", f"train.run_name={RUN}", "train.max_steps=4",
        f"train.batch_size={batch_size}", "train.save_every=2", "train.log_every=1", "train.lr=3e-3",
        "train.warmup_steps=0", "train.lr_schedule=constant", "eval.num_prompts=2", "eval.max_new_tokens=8",
        "eval.warmup=0", *extra,
    ]


def job_config(args: list[str]):
    return OmegaConf.to_object(compose_cfg("train", args))


@pytest.fixture(scope="module")
def one_process(tiny_data, tmp_path_factory) -> Path:
    """The reference: one process, batch 4 (the 2-rank runs' global batch)."""
    out = tmp_path_factory.mktemp("one_process")
    train(job_config(overrides(tiny_data, out, 4)))
    return out / RUN


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_matches_one_process(run_dir: Path, reference: Path) -> None:
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        torch.testing.assert_close(got[step], want[step], **LOSS_TOL, msg=f"train/loss at step {step}")
    saved = load_file(run_dir / "step-4" / "drafter" / "model.safetensors")
    for name, value in load_file(reference / "step-4" / "drafter" / "model.safetensors").items():
        torch.testing.assert_close(saved[name], value, **WEIGHT_TOL, msg=name)


def assert_one_job_of_two_ranks(run_dir: Path, distributed_type: str, launches: int = 1) -> None:
    """Two ranks ran as one job, and only the main process evaluated, logged and wrote checkpoints."""
    launch = [r for r in rows(run_dir) if "launch/num_processes" in r]
    launched = [(r["launch/num_processes"], r["launch/distributed_type"]) for r in launch]
    assert launched == [(2, distributed_type)] * launches
    train_steps = [r["step"] for r in rows(run_dir) if "train/loss" in r]
    assert train_steps == [1, 2, 3, 4]  # each step logged once, not once per rank
    assert not list(run_dir.glob(".step-*.tmp")), "a checkpoint was left half-written"
    assert (run_dir / "latest").resolve().name == "step-4"


# ---- 2 ranks through accelerate launch (the README's commands) ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config: str, args: list[str], cwd: Path, use_cpu: bool = False, module="drafter_train.recipes.train"):
    """`accelerate launch --config_file conf/accelerate/<config> -m <module> <args>`, on this checkout's code.

    (Not accelerate.debug_launcher: it forks this process, and a fork of a process that has already run torch ops
    on several threads can hang in its first parallel op.)"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("ACCELERATE_USE_CPU", None)
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONF / config),
           "--main_process_port", str(free_port()), "-m", module, *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


# the 2-rank DDP runs whose ranks report what they drew and hold (tests/ddp_rank_report.py), in the order they train:
# name -> train overrides. The run with a tracker goes first: ending its tracker must leave the launch's process group
# to the run after it, as a `-m` sweep's jobs share one launch (accelerate's end_training would destroy it).
RANK_REPORT_RUNS = {
    "ar": ("tracker=tensorboard",),
    "nar": ("drafter=nar", "drafter.path=truncated:1", "drafter.glancing_ratio=0.5"),  # a Spec-Drafter: its own module
}


@pytest.fixture(scope="module")
def rank_reports(tiny_data, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """ONE DDP launch of tests/ddp_rank_report.py training each of RANK_REPORT_RUNS in turn (as a sweep's jobs
    share a launch): name -> (the ranks' reports by "rank<r>-step<s>", the run folder). One launch, not one per run:
    starting the launcher and 2 ranks costs more than training these tiny runs."""
    root = tmp_path_factory.mktemp("rank_reports")
    args = []
    for name, extra in RANK_REPORT_RUNS.items():
        (root / name / "reports").mkdir(parents=True)
        args += ["::", str(root / name / "reports"), *overrides(tiny_data, root / name / "out", 2, *extra)]
    accelerate_launch("ddp_cpu.yaml", args[1:], cwd=root, use_cpu=True, module="tests.ddp_rank_report")
    return {name: ({p.stem: torch.load(p, weights_only=False) for p in (root / name / "reports").glob("*.pt")},
                   root / name / "out" / RUN) for name in RANK_REPORT_RUNS}


def test_two_ddp_ranks_train_one_model_on_disjoint_data(tiny_data, one_process, rank_reports):
    """Each rank reports what it drew and what it holds at every checkpoint (tests/ddp_rank_report.py)."""
    reports, run_dir = rank_reports["ar"]
    assert sorted(reports) == ["rank0-step2", "rank0-step4", "rank1-step2", "rank1-step4"]
    assert all(r["num_processes"] == 2 for r in reports.values())
    for step in (2, 4):  # gradients were all-reduced: both ranks hold the same parameters, bit for bit
        r0, r1 = reports[f"rank0-step{step}"], reports[f"rank1-step{step}"]
        assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    # Sharded, not duplicated: per step the ranks draw disjoint halves of the one-process run's batch.
    single = BatchStream(len(load_distill_dataset(tiny_data / "data")), 4, seed=0)
    for step, (mine, theirs) in enumerate(zip(reports["rank0-step4"]["drawn"], reports["rank1-step4"]["drawn"])):
        assert not set(mine) & set(theirs), f"step {step + 1}: both ranks trained on the same records"
        assert sorted(mine + theirs) == sorted(single.next_indices())

    assert_one_job_of_two_ranks(run_dir, DistributedType.MULTI_CPU.value)
    assert [r["step"] for r in rows(run_dir) if "eval/tau" in r] == [0, 2, 4]
    writers = {p.name.split(".")[-2] for p in run_dir.rglob("events.out.tfevents.*")}  # <time>.<host>.<pid>.<n>
    assert len(writers) == 1  # TensorBoard files from one process only: the main one
    assert_matches_one_process(run_dir, one_process)


def test_two_ddp_ranks_train_one_spec_drafter(rank_reports):
    """A Spec-Drafter is its own training module: DDP hooks run on its forward (glancing's no-grad pass included),
    so both ranks hold the same weights and the checkpoint is a Spec-Drafter folder."""
    reports, run_dir = rank_reports["nar"]
    assert sorted(reports) == ["rank0-step2", "rank0-step4", "rank1-step2", "rank1-step4"]
    first, last = reports["rank0-step2"]["weights"], reports["rank0-step4"]["weights"]
    assert not torch.equal(first["mask_embeds"], last["mask_embeds"])  # it trained
    for step in (2, 4):
        r0, r1 = reports[f"rank0-step{step}"], reports[f"rank1-step{step}"]
        assert r0["num_processes"] == 2 and all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    assert_one_job_of_two_ranks(run_dir, DistributedType.MULTI_CPU.value)
    assert json.loads((run_dir / "latest" / "drafter" / "config.json").read_text())["model_type"] == "spec_drafter"


def assert_main_process_reported(done: subprocess.CompletedProcess, jobs: int = 1) -> None:
    """Only the process that evaluated prints the final metrics: no `nan` line from a rank that holds none."""
    output = done.stdout + done.stderr
    assert re.search(r"\bnan\b", output, re.IGNORECASE) is None, output[-3000:]
    assert output.count("final checkpoint: tau=") == jobs, output[-3000:]


def test_ddp_launch_command_runs_two_ranks_in_one_run_dir(tiny_data, one_process, tmp_path):
    done = accelerate_launch("ddp_cpu.yaml", overrides(tiny_data, tmp_path / "out", 2), cwd=tmp_path, use_cpu=True)
    assert_main_process_reported(done)
    run_dir = tmp_path / "out" / RUN
    assert_one_job_of_two_ranks(run_dir, DistributedType.MULTI_CPU.value)
    # Hydra's output folder: the run folder, shared by both ranks (no per-rank timestamped folders).
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob(".hydra")] == [Path("out") / RUN / ".hydra"]
    assert_matches_one_process(run_dir, one_process)


def test_zero2_sweep_with_accumulation_resumes_and_matches_one_process(tiny_data, one_process, tmp_path):
    """A Hydra -m sweep inside one launch: job 1 trains 2 steps, job 2 resumes its checkpoint (optimizer partitions
    included) to step 4. 2 ranks x batch 1 x grad_accum 2: DeepSpeed's accumulation is the trainer's. Checkpoints
    every step with keep_last=1 exercise latest/best and pruning."""
    args = overrides(tiny_data, tmp_path / "out", 1, "train.grad_accum=2", "train.save_every=1", "train.keep_last=1")
    done = accelerate_launch("zero2_cpu.yaml", ["--multirun", *args, "train.max_steps=2,4"], cwd=tmp_path)
    assert_main_process_reported(done, jobs=2)
    run_dir = tmp_path / "out" / RUN
    assert_one_job_of_two_ranks(run_dir, DistributedType.DEEPSPEED.value, launches=2)
    assert [r["step"] for r in rows(run_dir) if "eval/tau" in r] == [0, 1, 2, 3, 4]
    assert {p.name for p in run_dir.glob("step-*")} == {"step-4", (run_dir / "best").resolve().name}
    assert_matches_one_process(run_dir, one_process)


def test_zero3_saves_a_full_hf_drafter_and_resumes_in_a_new_launch(tiny_data, one_process, tmp_path):
    args = overrides(tiny_data, tmp_path / "out", 2)
    accelerate_launch("zero3_cpu.yaml", [*args, "train.max_steps=2"], cwd=tmp_path)
    run_dir = tmp_path / "out" / RUN
    partitions = sorted(p.name for p in (run_dir / "step-2" / "sharded_state").rglob("*optim_states.pt"))
    assert len(partitions) == 2, partitions  # one optimizer partition per rank
    accelerate_launch("zero3_cpu.yaml", args, cwd=tmp_path)  # resume=auto: continues from step-2

    assert_one_job_of_two_ranks(run_dir, DistributedType.DEEPSPEED.value, launches=2)
    assert [r["step"] for r in rows(run_dir) if "eval/tau" in r] == [0, 2, 4]
    drafter = AutoModelForCausalLM.from_pretrained(run_dir / "step-4" / "drafter")
    reference = AutoModelForCausalLM.from_pretrained(one_process / "step-4" / "drafter")
    for (name, value), (_, expected) in zip(drafter.state_dict().items(), reference.state_dict().items()):
        assert value.numel() > 0 and value.shape == expected.shape, name  # gathered, not a ZeRO-3 placeholder
    assert_matches_one_process(run_dir, one_process)


def test_only_the_main_process_writes_hydra_files_into_the_shared_run_dir(tmp_path):
    """Every rank runs Hydra in the one run folder; .hydra/ and train.log get one writer, the main process (RANK 0).
    (A run that stops at its config check: Hydra has written its files by then.)"""
    for rank in ("1", "0"):
        out = tmp_path / f"rank{rank}"
        done = run_cli("drafter-train", f"train.output_root={out}", "train.run_name=run", "train.batch_size=0",
                       cwd=tmp_path, env={"RANK": rank})
        assert done.returncode == 2 and "train.batch_size" in done.stderr, done.stderr[-2000:]
        written = sorted(p.name for p in (out / "run").iterdir())
        assert written == ([".hydra", "train.log"] if rank == "0" else []), (rank, written)


# ---- launches that would silently train something else -------------------------------------------------------------


def test_ranks_that_did_not_join_one_job_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # e.g. --multi_gpu on CPU without ACCELERATE_USE_CPU: 2 separate runs
    with pytest.raises(ConfigError, match="ACCELERATE_USE_CPU=1"):
        check_launch(SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # DeepSpeed config + ACCELERATE_USE_CPU: plain DDP
    with pytest.raises(ConfigError, match="DeepSpeed was asked for"):
        check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an FSDP config on CPUs: accelerate silently runs DDP
    with pytest.raises(ConfigError, match="FSDP was asked for but accelerate runs MULTI_CPU"):
        check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))


def test_launch_precision_must_match_the_run(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ConfigError, match=r"train\.mixed_precision=bf16"):
        check_launch_precision("no")
    check_launch_precision("bf16")


# ---- the launch configs, as accelerate reads them ------------------------------------------------------------------


def launch_env(config: Path):
    """The processes `accelerate launch --config_file config` starts, and the environment it gives each one
    (accelerate's own parsing)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, precision_from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(config), "x.py"]))
    if not args.use_deepspeed:
        return args.num_processes, prepare_multi_gpu_env(args)
    # as accelerate's launch_command tells its DeepSpeed launcher which fields the config file set
    fields = [*defaults.deepspeed_config, *(["mixed_precision"] if precision_from_config else [])]
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args.num_processes, prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize("name", sorted(p.stem for p in ACCELERATE_CONF.glob("*.yaml")))
def test_every_launch_config_gives_the_launch_its_name_says(name, monkeypatch):
    """ddp / zero2 / zero3 / fsdp, on cpu (2 processes, fp32) or gpu (8 processes, bf16): what accelerate makes of
    each file, down to the plugin its Accelerator would build; and the run's own precision must match it."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    processes, env = launch_env(ACCELERATE_CONF / f"{name}.yaml")
    launch, device = name.split("_")[:2]
    assert processes == (8 if device == "gpu" else 2)
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if device == "gpu" else "no")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if launch.startswith("zero"):
        assert DeepSpeedPlugin().zero_stage == int(launch[-1])
    elif launch == "fsdp":
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.state_dict_type.name == "SHARDED_STATE_DICT"
        assert type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # FSDP2's base policy: no offloading
    else:
        assert "ACCELERATE_USE_FSDP" not in env and "ACCELERATE_USE_DEEPSPEED" not in env
    check_launch_precision("bf16" if device == "gpu" else "no")
    with pytest.raises(ConfigError, match="train.mixed_precision"):
        check_launch_precision("no" if device == "gpu" else "bf16")
