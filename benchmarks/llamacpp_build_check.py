"""Does a llama.cpp build run on the machine it was built on? scripts/setup_llamacpp.sh's probed flags against
ggml's native build (-march=native), on this CPU, over the passes that crashed on an Intel Xeon VM listing AMX.

Both builds compile llama-bench and llama-quantize from the same source. The model is a random 2-layer Llama whose
matrices are wide enough for ggml's AMX and AVX-512 kernels (hidden 1536, the 1.5B target's width; stories260K's
512-token vocabulary), converted by llama.cpp's own converter and quantised to Q4_K_M. Each build then runs
`llama-bench -p 4 -n 4` (a 4-token pass, the crash seen on the Xeon, and 1-token steps) at each thread count. A
signal is recorded as such (132 = SIGILL), never raised.

    python -m benchmarks.llamacpp_build_check --source /work/llcpp/llama.cpp --tokenizer ../shared/models/stories260K

`--source` is the vendored llama.cpp of llama-cpp-python's sdist (what scripts/setup_llamacpp.sh unpacks). The
result file is benchmarks/results/llamacpp_build_<cpu kind>.json (one per machine kind, since the point is the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import command_line, describe_machine, write_result
from drafter_train.llamacpp_flags import cmake_flags

TOOLS = ("llama-bench", "llama-quantize")
COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF"]


def run(cmd: list[str], log: Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n-> {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n")
    return done


def probed_flags(log: Path) -> tuple[list[str], str]:
    flags, line = cmake_flags()
    with open(log, "a") as out:
        out.write(f"$ drafter_train.llamacpp_flags.cmake_flags()\n{' '.join(flags)}\n{line}\n")
    return flags, line


def build(source: Path, build_dir: Path, flags: list[str], jobs: int, log: Path) -> None:
    for cmd in (["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *COMMON_FLAGS, *flags],
                ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS]):
        if run(cmd, log).returncode:
            sys.exit(f"llamacpp_build_check: {cmd[0]} {cmd[1]} failed for {build_dir.name}; see {log}")


def wide_model(out: Path, tokenizer: Path, source: Path, quantize: Path, log: Path, python: str = sys.executable) -> Path:
    """A random 2-layer Llama at the 1.5B's width with stories260K's tokenizer, as Q4_K_M GGUF."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    gguf = out / "wide-q4_k_m.gguf"
    if gguf.is_file():
        return gguf
    hf = out / "wide-hf"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=1536, intermediate_size=4608, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(hf)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, hf / name)
    f16 = out / "wide-f16.gguf"
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    if run([python, str(source / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16", "--outfile",
            str(f16)], log, env=env).returncode:
        sys.exit(f"llamacpp_build_check: convert_hf_to_gguf.py failed; see {log}")
    done = run([str(quantize), str(f16), str(gguf), "Q4_K_M"], log)
    if done.returncode:
        sys.exit(f"llamacpp_build_check: llama-quantize failed ({done.returncode}); see {log}")
    return gguf


def bench(tool: Path, model: Path, threads: int, log: Path) -> dict:
    """One llama-bench run: its exit status (negative: the signal), and pp4/tg4 tokens/s when it finished."""
    done = run([str(tool), "-m", str(model), "-p", "4", "-n", "4", "-r", "3", "-t", str(threads), "-o", "json"], log)
    row = {"threads": threads, "returncode": done.returncode, "signal": -done.returncode if done.returncode < 0 else None}
    if done.returncode == 0:
        for test in json.loads(done.stdout):
            row["pp4" if test["n_prompt"] else "tg4"] = round(test["avg_ts"], 1)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="llama.cpp source (llama-cpp-python's vendored copy)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with stories260K's tokenizer files")
    parser.add_argument("--work", type=Path, default=Path("build/llamacpp_build_check"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--variants", nargs="+", default=["probed", "native"], choices=["probed", "native"])
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--convert-python", default=sys.executable,
                        help="the python that runs llama.cpp's converter (needs sentencepiece; setup_llamacpp's venv has it)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "build_check.log"
    flags, probe_line = probed_flags(log)
    variants = {"probed": flags, "native": ["-DGGML_NATIVE=ON"]}
    rows, data = [], {"probe": probe_line, "flags": {}, "runs": {}}
    model = None
    for name in args.variants:
        build(args.source.resolve(), args.work / name, variants[name], args.jobs, log)
        data["flags"][name] = variants[name]
        bin_dir = args.work / name / "bin"
        if model is None:
            model = wide_model(args.work, args.tokenizer, args.source.resolve(), bin_dir / "llama-quantize", log,
                               args.convert_python)
        data["runs"][name] = [bench(bin_dir / "llama-bench", model, t, log) for t in args.threads]
        for run_row in data["runs"][name]:
            verdict = "ran" if run_row["returncode"] == 0 else (
                f"killed by signal {run_row['signal']}" if run_row["signal"] else f"exit {run_row['returncode']}")
            rows.append([name, run_row["threads"], verdict, run_row.get("pp4"), run_row.get("tg4")])
            print(f"{name:7s} t={run_row['threads']:<3d} {verdict:24s} pp4={run_row.get('pp4')} tg4={run_row.get('tg4')}")
    machine = describe_machine()
    kind = re.sub(r"[^a-z0-9]+", "_", machine["cpu"].lower()).strip("_")[:40]
    path = write_result(
        f"llamacpp_build_{kind}", title=f"llama.cpp builds on {machine['cpu']}: probed flags against -march=native",
        question="Does each build run a 4-token pass of a Q4_K_M model on the CPU it was built on?",
        command=command_line("llamacpp_build_check", argv), split="no prompts: llama-bench -p 4 -n 4, random weights",
        baseline="none (a pass/fail check; tokens/s for scale)",
        columns=["build", "threads", "llama-bench", "pp4 tok/s", "tg4 tok/s"], rows=rows, machine=machine,
        notes=f"Probe: {probe_line}. Model: random 2-layer Llama, hidden 1536, Q4_K_M.", data=data,
        **({"results_dir": args.results_dir} if args.results_dir else {}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
