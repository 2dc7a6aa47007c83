"""llama.cpp as scripts/setup_llamacpp.sh builds it: where it is, and the two tools the GGUF export runs.

The folder (export.llamacpp, else $DRAFTER_TRAIN_LLAMACPP, else .llamacpp next to the package) holds the unpatched
source vendored by the pinned llama-cpp-python sdist (llama.cpp/: convert_hf_to_gguf.py, gguf-py), the built tools
(build/bin/) and the converter's interpreter (venv/: this Python's packages plus sentencepiece). Conversion is the
vendored converter's own, run as a subprocess: GGUF tensor layouts (q/k permutation, d2t as int64, EAGLE-3's
renames) stay llama.cpp's business, and a newer llama.cpp is a new pin, not new code here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from drafter_train.errors import ConfigError, DrafterTrainError

SETUP = "scripts/setup_llamacpp.sh"
DRAFTER_FILE, TARGET_FILE = "drafter.gguf", "target.gguf"


@dataclass
class GgufJob:
    """What a kind's gguf writer needs besides its drafter folder: the llama.cpp folder, the target's HF folder (EAGLE-3
    conversion reads its vocabulary and shapes), the precision, and whether the target is written too."""

    root: Path
    target_dir: Path
    gguf_type: str = "f16"
    with_target: bool = True
    drafter_gguf_type: str = "auto"  # export.drafter_gguf_type
    verify_file: Optional[str] = None  # export.verify_file: a VERIFY_FILES label, the target requantised that way

    def __post_init__(self) -> None:
        if self.verify_file is not None and self.verify_file not in VERIFY_FILES:
            raise ConfigError(f"export.verify_file: must be one of {', '.join(VERIFY_FILES)}, got {self.verify_file!r}")

    @property
    def drafter_type(self) -> str:
        """The drafter's precision: as asked, or by default float (f32 with an f32 target, else f16)."""
        if self.drafter_gguf_type != "auto":
            return self.drafter_gguf_type
        return "f32" if self.gguf_type == "f32" else "f16"

    def write_target(self, out: Path) -> None:
        if not self.with_target:
            return
        if not self.verify_file:
            convert_typed(self.root, self.target_dir, out / TARGET_FILE, self.gguf_type, name="target")
            return
        # made from gguf_type as verify_file() makes it from an installed file, then moved to target.gguf
        source = convert_typed(self.root, self.target_dir, out / f".{TARGET_FILE}", self.gguf_type, name="target")
        try:
            os.replace(verify_file(self.root, source, self.verify_file), out / TARGET_FILE)
        finally:
            source.unlink(missing_ok=True)


def target_folder(target: dict, field: str) -> Path:
    """The run's target (its `target` config: path, gguf_file, cache_dir) as a local HF folder: llama.cpp's converter
    reads its vocabulary and shapes, and converts it. A GGUF target (named, embedded or the user's own file) is read
    through its dequantised copy, made once. A hub id is refused in one line."""
    from drafter_train.targets import target_folder as local_folder

    path = str(target.get("path", ""))
    folder = local_folder(path, target.get("gguf_file"), target.get("cache_dir"))
    if folder is None:
        raise ConfigError(f"{field}: the run's target.path {path!r} is not a local folder or GGUF file; llama.cpp's "
                          "converter needs the target's files")
    return folder


class LlamaCppError(DrafterTrainError):
    """A llama.cpp tool failed on a file this project wrote (its last line of output says why)."""


class LlamaCppCrash(LlamaCppError):
    """A tool of the smoke run died of a signal: built for instructions this CPU does not execute (setup falls back)."""

    def __init__(self, line: str, signal_name: str, what: str):
        super().__init__(line)
        self.signal_name, self.what = signal_name, what


def llamacpp_dir(given: Optional[str] = None) -> Path:
    if given:
        return Path(given).expanduser().absolute()
    env = os.environ.get("DRAFTER_TRAIN_LLAMACPP")
    return Path(env).expanduser().absolute() if env else Path(__file__).resolve().parent.parent / ".llamacpp"


def converter(root: Path, field: str = "export.format=gguf") -> Path:
    """The vendored convert_hf_to_gguf.py; refused in one line when the folder has none."""
    script = root / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConfigError(f"{field}: no llama.cpp converter in {root} (build it with {SETUP}, or set "
                          "export.llamacpp / $DRAFTER_TRAIN_LLAMACPP)")
    return script


def tool(root: Path, name: str, field: str = "export.gguf_type=q8_0", build: Optional[Path] = None) -> Path:
    """A built llama.cpp tool (build/bin/NAME, or BUILD/bin/NAME); refused in one line when it was not built."""
    path = (build or root / "build") / "bin" / name
    if not path.is_file():
        raise ConfigError(f"{field}: {name} is not built in {root} (run {SETUP})")
    return path


def _python(root: Path) -> str:
    venv = root / "venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def run_tool(command: list[str], what: str, env: Optional[dict] = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
        raise LlamaCppError(f"{what} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")


def convert(root: Path, model_dir: Path, out_file: Path, outtype: str, target_dir: Optional[Path] = None,
            name: str = "drafter") -> Path:
    """model_dir (an HF or speculators folder) -> out_file in `outtype` (f32, f16) with the vendored converter;
    target_dir: the target's folder, which EAGLE-3 conversion reads for the vocabulary and shapes. `name` becomes
    general.name (the converter would otherwise take the folder's name, a local one)."""
    script = converter(root)
    env = dict(os.environ, PYTHONPATH=str(root / "llama.cpp" / "gguf-py"), HF_HUB_OFFLINE="1")
    command = [_python(root), str(script), str(model_dir), "--outfile", str(out_file), "--outtype", outtype,
               "--model-name", name]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    run_tool(command, f"convert_hf_to_gguf.py on {model_dir.name}", env)
    return out_file


def convert_staged(job: GgufJob, out: Path, stage: str, write_folder: Callable[[Path], None],
                   finish: Optional[Callable[[Path], None]] = None) -> None:
    """drafter.gguf from the engine folder write_folder(staging) writes (staged in out/<stage>: the converter names
    general.finetune after it; removed after), converted with the target's folder at job.drafter_type (a quantised
    type: f16, then llama-quantize, whose absence is refused before anything is written); finish(file): a last
    change to the converter's float file, before any quantisation; then the target, if asked."""
    from drafter_train.config import FLOAT_GGUF_TYPES

    outtype = job.drafter_type
    if outtype not in FLOAT_GGUF_TYPES:
        tool(job.root, "llama-quantize", f"export.drafter_gguf_type={outtype}")  # refused before the folder is written
    staging = out / stage
    write_folder(staging)
    try:
        convert_typed(job.root, staging, out / DRAFTER_FILE, outtype, target_dir=job.target_dir, finish=finish)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    job.write_target(out)


def quantize(root: Path, src: Path, out_file: Path, gguf_type: str) -> Path:
    run_tool([str(tool(root, "llama-quantize")), str(src), str(out_file), gguf_type.upper()], f"llama-quantize {src.name}")
    return out_file


# Target files made for verification (issue 55), label -> (llama-quantize's file type, its output matrix's type,
# whether every other tensor keeps the type it has). On x86 ggml repacks Q4_0 and Q4_K weights into interleaved rows
# (ggml-cpu/repack.cpp), not the Q6_K that Q4_K_M gives the 151k-row output matrix, which a verify step computes at
# every position; and Q4_0's repacked gemm runs 4 rows for about the cost of 3. Each is requantised from the
# installed file (--allow-requantize): a tensor that keeps its type is copied unchanged, the rest come from the
# installed file's dequantised values, as an f16 file made from the same GGUF would give them.
VERIFY_FILES = {"q4_k_m-out_q4_k": ("Q4_K_M", "q4_k", True), "q4_0": ("Q4_0", None, False),
                "q4_0-out_q4_0": ("Q4_0", "q4_0", False)}


def verify_file(root: Path, src: Path, label: str) -> Path:
    """`src` (a target GGUF) requantised as VERIFY_FILES[label], once, next to it: NAME.LABEL.gguf (NAME.llama.LABEL.gguf
    for a llama re-export, which EAGLE-3 and DFlash are served on); written under a temporary name."""
    if label not in VERIFY_FILES:
        raise ConfigError(f"verify file {label!r}: not one of {', '.join(VERIFY_FILES)}")
    out = src.with_name(f"{src.stem}.{label}.gguf")
    if out.is_file():
        return out
    file_type, output_type, keep = VERIFY_FILES[label]
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    types = out.with_name(f".{out.name}.{os.getpid()}.types")
    command = [str(tool(root, "llama-quantize", f"verify file {label}")), "--allow-requantize"]
    if output_type:
        command += ["--output-tensor-type", output_type]
    if keep:  # llama-quantize's own mixture would move Q6_K between layers: pin each tensor to the type it has
        types.write_text("".join(f"^{re.escape(name)}$={kind}\n" for name, kind in _tensor_types(src).items()
                                 if name != "output.weight"))
        command += ["--tensor-type-file", str(types)]
    try:
        run_tool([*command, str(src), str(partial), file_type], f"llama-quantize {src.name} to {label}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
        types.unlink(missing_ok=True)
    return out


def _tensor_types(gguf_path: Path) -> dict[str, str]:
    """The quantised tensors of a GGUF file and their types (q4_k, q6_k ...), by name."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name.lower() for t in GGUFReader(gguf_path).tensors
            if t.tensor_type.name not in ("F32", "F16", "BF16")}


def convert_typed(root: Path, model_dir: Path, out_file: Path, gguf_type: str, target_dir: Optional[Path] = None,
                  name: str = "drafter", finish: Optional[Callable[[Path], None]] = None) -> Path:
    """convert() in f32 or f16, or a quantised type (q8_0, q4_k_m ...: config.GGUF_TYPES) made from an f16 file by
    llama-quantize (llama.cpp's per-tensor rules, e.g. a fallback type for rows a k-quant cannot split, which the
    converter's own q8_0 skips); the f16 file is removed. finish(file) runs on the converted float file first."""
    from drafter_train.config import FLOAT_GGUF_TYPES

    if gguf_type in FLOAT_GGUF_TYPES:
        convert(root, model_dir, out_file, gguf_type, target_dir, name)
        if finish is not None:
            finish(out_file)
        return out_file
    tool(root, "llama-quantize", f"gguf type {gguf_type}")  # refused before a conversion that would be thrown away
    f16 = out_file.with_name(out_file.stem + ".f16-tmp.gguf")
    try:
        convert(root, model_dir, f16, "f16", target_dir, name)
        if finish is not None:
            finish(f16)
        return quantize(root, f16, out_file, gguf_type)
    finally:
        f16.unlink(missing_ok=True)


# The smoke run: a multi-token pass on a quantised GGUF, which scripts/setup_llamacpp.sh ends with and the tests that
# run the built tools check first. Tools built for instructions the CPU lists but does not execute (AMX on an Intel
# Xeon VM) passed `--help` and single-token passes, and died with SIGILL on the first pass over 2+ tokens.
SMOKE_TYPE = "Q4_K_M"
SMOKE_FILE = "smoke-smollm2-135m.q4_k_m.gguf"  # cached in the llama.cpp folder, quantised once


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _crash_line(root: Path, build: Path, what: str, signum: int) -> str:
    """The one line a crashed tool gives: the signal, where, and the fix for how this build was configured."""
    name = _signal_name(signum)
    cache = build / "CMakeCache.txt"
    native = cache.is_file() and "GGML_NATIVE:BOOL=ON" in cache.read_text(errors="replace")
    fix = (f"rebuild with `bash {SETUP} {root}` without LLAMACPP_NATIVE=1 (it probes which instruction groups run here, "
           "and leaves out the likeliest culprits when a build still crashes)"
           if native else f"rebuild with `bash {SETUP} {root}` (it probes which instruction groups run here, and leaves "
           "out the likeliest culprits when a build still crashes), without a LLAMACPP_CMAKE_FLAGS that turns on more")
    return f"llama.cpp tools crash on this CPU ({name} in {what}, {build}): {fix}"


def _smoke_run(root: Path, build: Path, command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"llama.cpp smoke run: {what} took over 300 s ({build})") from None
    if done.returncode < 0:
        raise LlamaCppCrash(_crash_line(root, build, what, -done.returncode), _signal_name(-done.returncode), what)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()]
        raise LlamaCppError(f"llama.cpp smoke run: {what} failed (exit {done.returncode}): "
                            f"{lines[-1] if lines else 'no output'}")


def smoke_check(root: Path, build: Optional[Path] = None, threads: int = 2) -> Path:
    """llama-bench over a 4-token prompt and 4 generated tokens on the embedded SmolLM2 GGUF, as shipped (Q4_1) and
    quantised to Q4_K_M (by this build's llama-quantize, cached in `root`). Raises LlamaCppError with one line that
    names the fix when a tool dies (a signal) or fails; returns the Q4_K_M file."""
    from drafter_train.targets import embedded_gguf  # imports torch: only once a smoke run is asked for

    build = build or root / "build"
    shipped = embedded_gguf("embedded:smollm2")
    model = root / SMOKE_FILE
    if not model.is_file():
        # A name of this process's own: two processes checking at once (the suite's workers) must not write into
        # one file; whichever renames last leaves a whole file.
        partial = model.with_name(f".{model.name}.tmp-{os.getpid()}")
        quantize_cmd = [str(tool(root, "llama-quantize", "llama.cpp smoke run", build)), "--allow-requantize",
                        str(shipped), str(partial), SMOKE_TYPE]
        try:
            _smoke_run(root, build, quantize_cmd, "llama-quantize to " + SMOKE_TYPE)
            partial.replace(model)
        finally:
            partial.unlink(missing_ok=True)
    bench = [str(tool(root, "llama-bench", "llama.cpp smoke run", build)), "-m", str(model), "-m", str(shipped),
             "-p", "4", "-n", "4", "-r", "1", "-t", str(threads)]
    _smoke_run(root, build, bench, "a 4-token pass of llama-bench")
    return model
