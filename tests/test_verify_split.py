"""benchmarks/verify_split.py's arithmetic on made-up measurements (no llama.cpp), its server calibration's drafting
time, and the target files made for verification (drafter_train.llamacpp.verify_file) with a fake llama-quantize."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from benchmarks import verify_split
from drafter_train.calibrate import chain_tau
from drafter_train import llamacpp
from drafter_train.engines import llamacpp_cost
from drafter_train.errors import ConfigError
from drafter_train.llamacpp import VERIFY_FILES, verify_file


def figures(plain_ms: float, scale: float = 1.0) -> dict:
    """One file's medians: in-process parts at n = 1 and 4, a target-only server step at 4, EAGLE-3 at 2 and 4."""
    parts = {1: {"last_ms": 80.0 * scale, "all_ms": 80.0 * scale, "sample_ms": 1.0},
             4: {"last_ms": 100.0 * scale, "all_ms": 130.0 * scale, "sample_ms": 1.0}}
    kinds = {"ngram": {"ms": {1: plain_ms, 4: 150.0 * scale}, "draft_ms": {4: 0.0}},
             "eagle3": {"ms": {1: plain_ms, 4: 170.0 * scale}, "draft_ms": {4: 30.0}}}
    return {"parts": parts, "plain_ms": plain_ms, "kinds": kinds}


def test_split_rows_divide_each_measured_part_by_the_fastest_plain_step():
    rows = verify_split.split_rows({"a": figures(100.0), "b": figures(50.0, scale=0.5)}, fastest=50.0)
    a4 = next(r for r in rows if r[:2] == ["a", 4])
    # its plain step, pass, other rows of the output matrix, sampling (4 x 1 ms), the server's rest
    # (150 - 130 - 4), the target-only step, EAGLE-3's process() (170 - 150), drafting, and its whole step
    assert a4[2:11] == [2.0, 2.0, 0.6, 0.08, 0.32, 3.0, 0.4, 0.6, 4.0]
    b4 = next(r for r in rows if r[:2] == ["b", 4])
    assert b4[2:8] == [1.0, 1.0, 0.3, 0.08, 0.12, 1.5]  # rest: 75 - 65 - 4
    # a chain of 3 at acceptance x reaches tau(x) = 1 + x + x^2 + x^3; the speedup is tau over the step's cost
    # (EAGLE-3's 85 + 30 ms on file b = 2.3 plain steps): 1x needs tau 2.3
    needed = [float(v) for v in b4[11].split(" / ")[:2]]
    assert chain_tau(needed[0], 3) == pytest.approx(2.3, abs=0.03)  # to the cell's 2 decimals
    assert chain_tau(needed[1], 3) == pytest.approx(1.5 * 2.3, abs=0.03)
    assert b4[11].endswith(" / -")  # 2x needs tau 4.6 > 4: out of reach at 3 drafts
    a1 = next(r for r in rows if r[:2] == ["a", 1])
    assert a1[6:9] == [round((100 - 80 - 1) / 50, 3), 2.0, None]  # n = 1: the plain step itself


def test_medians_over_rounds_per_figure():
    rounds = [{"a": {"parts": figures(100.0)["parts"], "server": {"ms_1": ms, "kinds": figures(ms)["kinds"]}}}
              for ms in (90.0, 100.0, 130.0)]
    rounds[2]["a"]["server"]["kinds"]["eagle3"]["draft_ms"][4] = 60.0
    got = verify_split.medians(rounds)["a"]
    assert got["plain_ms"] == 100.0 and got["kinds"]["eagle3"]["draft_ms"][4] == 30.0


def test_server_curves_keep_the_drafters_own_time_per_step(monkeypatch):
    def decode(command, log, prompts, n_new, ignore_eos):  # 4 drafting steps, 40 ms of drafting logged
        return {"steps": [(0, 2)] * 4, "generated": 10, "requests": 1, "gen_ms": 400.0, "draft_ms": 40.0}

    monkeypatch.setattr(llamacpp_cost.engine, "decode_prompts", decode)
    got = llamacpp_cost.server_curves(Path("/b"), Path("/t.gguf"), {"eagle3": Path("/e.gguf")}, [[1, 2]], 8, 2,
                                      False, Path("/log"), {"eagle3": (2,)})
    assert got["kinds"]["eagle3"]["draft_ms"] == {3: 10.0}


def test_verify_file_requantises_once_with_its_output_type(tmp_path, monkeypatch):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    quantize = bin_dir / "llama-quantize"
    quantize.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nfor a; do out=$prev; prev=$a; done\n'
                        f'case "$*" in *--tensor-type-file*) cp "$5" {tmp_path}/types.txt;; esac\n'
                        'cp "$(eval echo \\${$(($#-2))})" "$out"\n')
    monkeypatch.setattr(llamacpp, "_tensor_types", lambda path: {"blk.1.ffn_down.weight": "q6_k",
                                                                 "blk.10.ffn_down.weight": "q4_k",
                                                                 "output.weight": "q6_k"})
    quantize.chmod(quantize.stat().st_mode | stat.S_IXUSR)
    src = tmp_path / "t.llama.gguf"
    src.write_bytes(b"GGUF")
    out = verify_file(tmp_path, src, "q4_k_m-out_q4_k")
    assert out == tmp_path / "t.llama.q4_k_m-out_q4_k.gguf" and out.read_bytes() == b"GGUF"
    call = (tmp_path / "calls").read_text().split()
    assert call[:4] == ["--allow-requantize", "--output-tensor-type", "q4_k", "--tensor-type-file"]
    assert call[-1] == "Q4_K_M"
    # every other tensor pinned to its own type, by an anchored pattern (blk.1 must not match blk.10)
    assert (tmp_path / "types.txt").read_text().split() == ["^blk\\.1\\.ffn_down\\.weight$=q6_k",
                                                            "^blk\\.10\\.ffn_down\\.weight$=q4_k"]
    assert verify_file(tmp_path, src, "q4_k_m-out_q4_k") == out  # made once
    verify_file(tmp_path, src, "q4_0")  # Q4_0's own choice of output type: no --output-tensor-type
    assert (tmp_path / "calls").read_text().splitlines()[1].split()[:2] == ["--allow-requantize", str(src)]
    assert not list(tmp_path.glob(".*"))  # no partial file left
    with pytest.raises(ConfigError, match="verify file 'q9': not one of " + ", ".join(VERIFY_FILES)):
        verify_file(tmp_path, src, "q9")


def test_export_verify_file_writes_the_target_requantised_from_gguf_type(tmp_path, monkeypatch):
    """export.verify_file: target.gguf converted at gguf_type, then requantised as that verify file; nothing else is
    left in the export folder. An unknown label is refused by the config, naming the field."""
    from drafter_train.config import ExportConfig
    from drafter_train.llamacpp import GgufJob
    from tests.test_gguf import fake_converter

    log = tmp_path / "quantize.log"
    root = fake_converter(tmp_path / "llcpp", log)
    quantize = root / "build" / "bin" / "llama-quantize"
    quantize.write_text(f'#!/bin/sh\necho "$@" >> {log}\nshift $(($# - 3))\ncp "$1" "$2"\n')
    monkeypatch.setattr(llamacpp, "_tensor_types", lambda path: {})
    out = tmp_path / "out"
    out.mkdir()
    GgufJob(root, tmp_path, "f16", with_target=True, verify_file="q4_0-out_q4_0").write_target(out)
    assert (out / "target.gguf").read_text() == "f16"  # converted in f16, then requantised
    call = log.read_text().split()
    assert call[:3] == ["--allow-requantize", "--output-tensor-type", "q4_0"] and call[-1] == "Q4_0"
    assert sorted(p.name for p in out.iterdir()) == ["target.gguf"]
    GgufJob(root, tmp_path, "q8_0", with_target=True).write_target(out)  # without it: gguf_type as it is
    assert log.read_text().splitlines()[-1].endswith("Q8_0")
    with pytest.raises(ConfigError, match="export.verify_file: must be one of q4_k_m-out_q4_k, "):
        GgufJob(root, tmp_path, "f16", verify_file="q9")
    assert ExportConfig(verify_file="q4_0").verify_file == "q4_0"  # the field the recipe hands to GgufJob
