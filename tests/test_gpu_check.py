"""benchmarks/gpu_check.py, the one GPU device check: its whole path runs here at tiny size on the CPU, and
make_results renders what it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check
from benchmarks.make_results import results_page

REPO = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_every_stage_at_tiny_size_on_the_cpu(tmp_path):
    """`python -m benchmarks.gpu_check --device cpu --tiny` is the device command at tiny size: every stage ends
    without an error, gpu.json is written to the results folder and copied to --out ($OUT on the device), the
    device tests it runs pass by name, the checkpoint decodes losslessly, and the plan sits beside the peak."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("ACCELERATE_USE_CPU", None)  # --device cpu must set it itself
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--tiny",
                           "--results-dir", str(tmp_path / "results"), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert (tmp_path / "out" / "gpu.json").read_text() == (tmp_path / "results" / "gpu.json").read_text()
    stages = record["data"]["gpu_check"]
    assert list(stages) == ["machine", "tests", "target", "verify_curve", "drafter", "predictions", "train", "plan",
                            "lossless_fp32"]
    assert not [name for name, stage in stages.items() if "error" in stage]
    tests = stages["tests"]["tests"]
    assert tests == {"test_devices::test_the_scan_finds_device_strings_in_every_form": {"outcome": "passed",
                                                                                       "message": ""}}
    curve = stages["verify_curve"]
    assert set(curve["ours_ms"]) == set(curve["bare_ms"]) == {str(n) for n in gpu_check.SIZES}
    assert curve["ours_relative"]["1"] == 1.0 and all(ms > 0 for ms in curve["bare_ms"].values())
    assert [row["draft_len"] for row in stages["predictions"]["rows"]] == gpu_check.DRAFT_LENS
    assert stages["predictions"]["drafter_cost_measured"]
    train = stages["train"]
    assert train["evaluation"]["greedy_match"] == 1.0 and train["s_per_step"] > 0 and train["tokens_per_s"] > 0
    assert stages["plan"]["ddp_gib"]["total"] > stages["plan"]["ddp_gib"]["target"] > 0
    assert stages["lossless_fp32"]["dtype"] == "float32" and stages["lossless_fp32"]["greedy_match"] == 1.0
    assert [row[0] for row in record["rows"]] == gpu_check.SHOWN


def fixture_record() -> dict:
    """A gpu.json as the device run writes it (figures invented, shapes real)."""
    curve = {"prefix": 512, "repeats": 20, "dtype": "bfloat16",
             "ours_ms": {"1": 24.0, "64": 30.0}, "bare_ms": {"1": 20.0, "64": 27.0},
             "ours_relative": {"1": 1.0, "64": 1.25}, "bare_relative": {"1": 1.0, "64": 1.35}}
    stages = {
        "machine": {"tiny": False},
        "tests": {"summary": "9 passed, 1 skipped", "tolerance": gpu_check.TOLERANCE_NOTE,
                  "tests": {"test_devices::test_x": {"outcome": "passed", "message": ""}}},
        "verify_curve": curve,
        "drafter": {"parameters": 8.3e8, "draft_vocab": 8192, "by_draft_len": {"3": {"ms_per_proposal": 9.0}}},
        "predictions": {"rows": [{"draft_len": 3, "verify_cost": 1.1, "draft_cost": 0.4, "break_even_tau": 1.5,
                                  "tau=2": 1.33, "tau=3": 2.0, "tau=4": 2.67}]},
        "train": {"steps": 30, "batch_size": 2, "seq_len": 2048, "tokens_per_s": 20000.0, "s_per_step": 0.2,
                  "peak_allocated_gib": 31.5, "evaluation": {"greedy_match": 1.0, "num_prompts": 4,
                                                             "greedy_mismatch_margins": [], "tokens_per_s": 30.0,
                                                             "speedup": 0.5, "tau": 1.0}},
        "plan": {"command": "python -m benchmarks.gpu_plan --gpus 1", "ddp_gib": {"total": 30.0}},
        "train_failed_example": {"error": "StageTimeout: over its budget of 200 s"},
    }
    return {"title": "The GPU check", "question": "What does a pass cost?", "command": "python -m benchmarks.gpu_check",
            "split": "none", "baseline": "a 1-token pass", "date": "2026-11-27",
            "machine": {"cpu": "x86", "torch_threads": 16, "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2,
                        "torch": "2.11.0", "cuda": "13.0", "transformers": "5.17.0"},
            "columns": ["n", "calibration ms", "bare torch ms", "relative (calibration)", "relative (bare)"],
            "rows": [[1, 24.0, 20.0, 1.0, 1.0], [64, 30.0, 27.0, 1.25, 1.35]], "data": {"gpu_check": stages}}


def test_make_results_renders_the_gpu_record_as_a_section():
    page = results_page({"gpu": fixture_record()})
    assert "On **NVIDIA H100 80GB HBM3** (79.2 GiB), torch 2.11.0, CUDA 13.0, transformers 5.17.0." in page
    assert "| 64 | 30.0 | 27.0 | 1.250 | 1.350 |" in page  # the verify curve
    assert "| `test_devices::test_x` | passed |" in page
    assert "| 3 | 1.100 | 0.400 | 1.500 | 1.330 | 2.000 | 2.670 |" in page  # the predictions
    assert "peak allocated **31.5 GiB** (steps 2-30) against the plan's 30.0 GiB" in page
    assert "greedy speculative == plain on 1.000 of 4 prompts" in page
    assert "- stage train_failed_example: StageTimeout: over its budget of 200 s" in page
    assert "- machine: NVIDIA H100 80GB HBM3 (79.2 GiB), x86 (usable extensions not probed), 16 torch threads" in page
    assert "- result file: `benchmarks/results/gpu.json`" in page
