"""The llama.cpp build's guards, without building it: drafter_train.llamacpp_flags turns on only the instruction groups
/proc/cpuinfo lists AND a probe executes here (fake CPUs: a cpuinfo file and a compiler whose probes run or die as a
test says), and smoke_check (the end of scripts/setup_llamacpp.sh, and the opt-in llama.cpp tests' first
step) turns a tool that dies on this CPU into one line naming the fix. The tools are fake scripts that kill
themselves with the signal a build for the wrong CPU dies with."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from drafter_train import targets
from drafter_train.llamacpp import SMOKE_FILE, LlamaCppError, smoke_check
from drafter_train.llamacpp_flags import cmake_flags, left_out
from tests.conftest import REPO

GROUPS = ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
          "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
# /proc/cpuinfo's name for a group's first instruction set (GGML_AVX512 needs avx512f and more)
CPUINFO = {"SSE42": "sse4_2", "AVX": "avx", "F16C": "f16c", "FMA": "fma", "AVX2": "avx2", "BMI2": "bmi2",
           "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
           "AVX512_BF16": "avx512_bf16", "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16"}


# every flag a group needs: a CPU listing them all (the probe alone decides)
EVERY_FLAG = ("sse4_2 avx f16c fma avx2 bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
              "avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")


def cpuinfo(path: Path, flags: str) -> str:
    """A fake /proc/cpuinfo listing `flags` (two processors, as the real file has one block each): its path."""
    path.write_text("".join(f"processor\t: {n}\nmodel name\t: Test CPU\nflags\t\t: fpu {flags}\n\n"
                            for n in range(2)))
    return str(path)


def flags(**env: str) -> tuple[list[str], str]:
    """cmake_flags() in this environment with `env` on top, without LLAMACPP_* overrides the caller did not give."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMACPP_")}
    return cmake_flags(dict(base, **env))


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None, reason="x86-64 with a C compiler")
def test_flags_turn_on_only_groups_whose_probe_ran_here():
    got, report = flags()
    assert got[0] == "-DGGML_NATIVE=OFF" and sorted(got[1:]) == sorted(
        f"-DGGML_{g}={'ON' if f'-DGGML_{g}=ON' in got else 'OFF'}" for g in GROUPS)  # every group, set explicitly
    listed = set(Path("/proc/cpuinfo").read_text().split())
    on = [g for g in GROUPS if f"-DGGML_{g}=ON" in got]
    # a group runs only where the CPU lists it (the converse is what the probe is for); the pre-AVX-512 groups it
    # lists do run (no probe is broken)
    assert all(CPUINFO[g] in listed for g in on)
    assert {g for g in ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2") if CPUINFO[g] in listed} <= set(on)
    assert ("AVX512" in on) <= ("AVX2" in on) and ("AMX_INT8" in on) <= ("AVX512_VNNI" in on)  # what ggml needs
    assert f"usable here: {' '.join(on)};" in report
    off = [g for g in GROUPS if g not in on]  # each named in the report with why (e.g. "runs but not listed")
    assert all(f" {g} " in report.split("left out:")[1].replace("(", " ") for g in off)
    if "avx512f" not in listed:  # this machine: the AVX-512 probe died with SIGILL, so no group above AVX2 is on
        assert not any(g.startswith(("AVX512", "AMX")) for g in on)


def test_flags_overrides():
    assert flags(LLAMACPP_NATIVE="1") == (["-DGGML_NATIVE=ON"], "")
    assert flags(LLAMACPP_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON") == (["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"],
                                                                            "")


# A compiler whose "probe" binaries exit 0 for the groups in $RUNS, die with SIGILL for the rest: what this CPU
# executes, decided by the test
PICKY_CC = ('out=; group=; while [ $# -gt 0 ]; do case $1 in -o) out=$2;; -DPROBE_*) group=${1#-DPROBE_};; esac; '
            'shift; done\necho "$group" >> "$LOG"\n'
            'case " $RUNS " in *" $group "*) body="exit 0";; *) body=\'kill -ILL $$\';; esac\n'
            'printf "#!/bin/sh\\n%s\\n" "$body" > "$out"; chmod +x "$out"')


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 instruction groups")
def test_flags_follow_what_runs_and_what_ggml_needs_under_it(tmp_path):
    fake_tool(tmp_path, "cc", PICKY_CC)
    log = tmp_path / "probed"
    # AVX512_VNNI runs but AVX512 does not: ggml uses VNNI only inside AVX-512 code, and AMX only with VNNI
    got, report = flags(CC=str(tmp_path / "cc"), LOG=str(log), RUNS="SSE42 AVX FMA AVX2 AVX512_VNNI AMX_TILE AMX_INT8",
                        LLAMACPP_CPUINFO=cpuinfo(tmp_path / "cpuinfo", EVERY_FLAG))
    on = ["SSE42", "AVX", "FMA", "AVX2"]
    assert got == ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if g in on else 'OFF'}" for g in GROUPS)]
    assert report == ("llamacpp_flags: usable here: SSE42 AVX FMA AVX2; left out: F16C BMI2 AVX_VNNI AVX512 "
                      "(listed, probe died), AVX512_VBMI AVX512_VNNI AVX512_BF16 (needs AVX512), AMX_TILE (needs "
                      "AVX512_VNNI), AMX_INT8 AMX_BF16 (needs AMX_TILE)")
    # a group whose needed group is out is not even compiled
    assert log.read_text().split() == ["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI", "AVX512"]
    # no compiler at all: every group off, no crash
    assert flags(CC=str(tmp_path / "no-such-cc"))[0] == ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}=OFF" for g in GROUPS)]


# The Xeon VM of issue 70 (family 6, model 207): it lists AVX-512 with VBMI and VNNI but neither avx_vnni,
# avx512_bf16 nor AMX, and executes AVX_VNNI and AVX512_BF16 all the same
XEON_207 = "sse4_2 avx f16c fma avx2 bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 instruction groups")
def test_a_group_goes_on_only_where_it_is_listed_and_its_probe_runs(tmp_path):
    fake_tool(tmp_path, "cc", PICKY_CC)
    runs = "SSE42 AVX F16C FMA AVX2 BMI2 AVX_VNNI AVX512 AVX512_VNNI AVX512_BF16"  # AVX512_VBMI dies, AMX too
    got, report = flags(CC=str(tmp_path / "cc"), LOG=str(tmp_path / "probed"), RUNS=runs,
                        LLAMACPP_CPUINFO=cpuinfo(tmp_path / "cpuinfo", XEON_207))
    on = ["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"]  # listed and runs
    assert got == ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if g in on else 'OFF'}" for g in GROUPS)]
    assert report == (f"llamacpp_flags: usable here: {' '.join(on)}; left out: AVX_VNNI AVX512_BF16 (runs but not "
                      "listed), AVX512_VBMI (listed, probe died), AMX_TILE (not listed), AMX_INT8 AMX_BF16 (needs "
                      "AMX_TILE)")
    # no cpuinfo to read: nothing is listed, so nothing goes on, whatever runs
    got, report = flags(CC=str(tmp_path / "cc"), LOG=str(tmp_path / "probed"), RUNS=runs,
                        LLAMACPP_CPUINFO=str(tmp_path / "no-such-file"))
    assert got == ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}=OFF" for g in GROUPS)]
    assert report.startswith("llamacpp_flags: usable here: none; left out: SSE42 AVX BMI2 (runs but not listed), "
                             "F16C FMA AVX2 (needs AVX), AVX_VNNI AVX512 (needs AVX2)")


AVX2_ONLY = "sse4_2 avx f16c fma avx2 bmi2"
AVX512_EPYC = f"{AVX2_ONLY} avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 instruction groups")
@pytest.mark.parametrize("listed, runs, on", [
    (AVX2_ONLY, "SSE42 AVX F16C FMA AVX2 BMI2", GROUPS[:6]),  # an AVX2-only AMD EPYC
    (AVX512_EPYC, " ".join(GROUPS[:11]), GROUPS[:11]),  # an AMD EPYC with AVX-512 and avx512_bf16
    (EVERY_FLAG, " ".join(GROUPS), GROUPS),  # an Intel Xeon listing AMX whose probes run (setup's fallback is next)
    (XEON_207, " ".join(GROUPS[:11]), ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI",
                                       "AVX512_VNNI")),  # runs AVX_VNNI and AVX512_BF16, lists neither
])
def test_each_cpu_kind_seen_gets_the_groups_it_lists_and_runs(tmp_path, listed, runs, on):
    fake_tool(tmp_path, "cc", PICKY_CC)
    got, report = flags(CC=str(tmp_path / "cc"), LOG=str(tmp_path / "probed"), RUNS=runs,
                        LLAMACPP_CPUINFO=cpuinfo(tmp_path / "cpuinfo", listed))
    assert got == ["-DGGML_NATIVE=OFF", *(f"-DGGML_{g}={'ON' if g in on else 'OFF'}" for g in GROUPS)]
    assert report.startswith(f"llamacpp_flags: usable here: {' '.join(on)}; left out: ")


@pytest.mark.parametrize("listed, ran, why", [
    ("avx512f avx512cd avx512vl avx512dq avx512bw", "runs", ""),  # listed and runs: on
    ("avx512f avx512cd avx512vl avx512dq avx512bw", "died", "listed, probe died"),
    ("avx512f avx512cd avx512vl avx512dq", "runs", "runs but not listed"),  # one of its flags missing
    ("", "died", "not listed"),
    ("avx512f avx512cd avx512vl avx512dq avx512bw", "not built", "listed, probe not built")])
def test_the_rule_for_one_group(listed, ran, why):
    outcomes = left_out({"sse4_2", "avx", "avx2", *listed.split()}, lambda g: ran if g == "AVX512" else "runs")
    assert outcomes["AVX512"] == why
    assert outcomes["AVX512_VNNI"] == ("runs but not listed" if not why else "needs AVX512")  # avx512_vnni isn't


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A llama.cpp folder whose llama-quantize copies its input (counting its runs) and whose llama-bench succeeds."""
    shipped = tmp_path / "shipped.gguf"
    shipped.write_bytes(b"GGUF")
    monkeypatch.setattr(targets, "embedded_gguf", lambda path: shipped)
    bin_dir = tmp_path / "llcpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    fake_tool(bin_dir, "llama-quantize", f'echo run >> {tmp_path}/quantized; cp "$2" "$3"')
    fake_tool(bin_dir, "llama-bench", "exit 0")
    return tmp_path / "llcpp"


def test_smoke_check_quantises_once_and_passes(fake_build):
    model = smoke_check(fake_build)
    assert model == fake_build / SMOKE_FILE and model.read_bytes() == b"GGUF"
    smoke_check(fake_build)  # the cached Q4_K_M file: no second quantisation
    assert (fake_build.parent / "quantized").read_text() == "run\n"


@pytest.mark.parametrize("native", [True, False])
def test_a_tool_killed_by_sigill_gives_one_line_naming_the_fix(fake_build, native):
    build = fake_build / "build"
    (build / "CMakeCache.txt").write_text(f"GGML_NATIVE:BOOL={'ON' if native else 'OFF'}\n")
    fake_tool(build / "bin", "llama-bench", f"kill -{signal.SIGILL.value} $$")
    with pytest.raises(LlamaCppError) as error:
        smoke_check(fake_build)
    line = str(error.value)
    assert "\n" not in line and line.startswith("llama.cpp tools crash on this CPU (SIGILL in a 4-token pass")
    assert f"bash scripts/setup_llamacpp.sh {fake_build}" in line
    assert ("without LLAMACPP_NATIVE=1" in line) == native


def test_a_crash_while_quantising_and_a_failing_tool_are_one_line_too(fake_build):
    build = fake_build / "build"
    fake_tool(build / "bin", "llama-quantize", f"kill -{signal.SIGILL.value} $$")
    with pytest.raises(LlamaCppError, match=r"^llama.cpp tools crash on this CPU \(SIGILL in llama-quantize"):
        smoke_check(fake_build)
    assert not (fake_build / SMOKE_FILE).exists()  # nothing half-written is cached
    fake_tool(build / "bin", "llama-quantize", 'cp "$2" "$3"; exit 1')  # a failure after writing its output
    with pytest.raises(LlamaCppError, match="llama-quantize to Q4_K_M failed"):
        smoke_check(fake_build)
    assert sorted(p.name for p in fake_build.iterdir()) == ["build"]  # no partial file left behind either
    fake_tool(build / "bin", "llama-quantize", 'cp "$2" "$3"')
    fake_tool(build / "bin", "llama-bench", "echo 'error: failed to load model' >&2; exit 3")
    with pytest.raises(LlamaCppError, match=r"^llama.cpp smoke run: a 4-token pass of llama-bench failed \(exit 3\): "
                                            "error: failed to load model$"):
        smoke_check(fake_build)


# scripts/setup_llamacpp.sh end to end with a fake toolchain: a CPU that lists every group and a `cc` whose probes
# all run (the Xeon VM's case: the CPU lists AMX and a probe of the instructions passes), `cmake` that records its
# -D flags in CMakeCache.txt and a log, `ninja` that "builds" tools reading that cache: llama-bench dies with SIGILL
# while the groups in $CRASH_ON are on.
FAKE_CC = 'out=; while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done; echo probe >> "$LOG/probes"\n' \
          'printf "#!/bin/sh\\nexit 0\\n" > "$out"; chmod +x "$out"'
FAKE_CMAKE = 'build=; for a; do case $prev in -B) build=$a;; esac; prev=$a; done; mkdir -p "$build"\n' \
             'echo "CMAKE_MAKE_PROGRAM:FILEPATH=$(dirname "$0")/ninja" > "$build/CMakeCache.txt"\n' \
             'for a; do case $a in -D*=*) k=${a#-D}; echo "${k%%=*}:BOOL=${a#*=}" >> "$build/CMakeCache.txt";; esac; done\n' \
             'echo "$*" >> "$LOG/cmake"'
FAKE_BENCH = ('for g in $CRASH_ON; do grep -q "^GGML_$g:BOOL=ON" "$(dirname "$0")/../CMakeCache.txt" '
              '&& kill -ILL $$; done; exit 0')
FAKE_NINJA = ('build=$2; [ "$3" = -t ] && { printf "llama-bench: phony\\nllama-quantize: phony\\n'
              'llama-speculative-simple: phony\\n"; exit 0; }\nmkdir -p "$build/bin"; echo "$*" >> "$LOG/ninja"\n'
              f"cat > \"$build/bin/llama-bench\" <<'X'\n#!/bin/sh\n{FAKE_BENCH}\nX\n"
              "printf '#!/bin/sh\\nln -sf \"$2\" \"$3\"\\n' > \"$build/bin/llama-quantize\"\n"
              "printf '#!/bin/sh\\necho --spec-type\\n' > \"$build/bin/llama-speculative-simple\"\n"
              'chmod +x "$build"/bin/*')


@pytest.fixture
def fake_toolchain(tmp_path):
    """A llama.cpp folder with its source and venv in place (nothing to download), and the fake tools on PATH."""
    root, tools, log = tmp_path / "llcpp", tmp_path / "tools", tmp_path / "log"
    (root / "llama.cpp").mkdir(parents=True)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    (root / "SOURCE").write_text("llama-cpp-python==test\n")
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "bin" / "python").symlink_to(shutil.which("python3"))
    for name, body in (("cc", FAKE_CC), ("cmake", FAKE_CMAKE), ("ninja", FAKE_NINJA)):
        tools.mkdir(exist_ok=True)
        fake_tool(tools, name, body)
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMACPP_CMAKE_FLAGS", "LLAMACPP_NATIVE", "CC")}
    env.update(PATH=f"{tools}:{env['PATH']}", LOG=str(log), CC=str(tools / "cc"), PYTHONPATH=str(REPO), JOBS="1",
               LLAMACPP_CPUINFO=cpuinfo(tmp_path / "cpuinfo", EVERY_FLAG))
    return root, log, env


def setup(root: Path, env: dict, crash_on: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "setup_llamacpp.sh"), str(root)], capture_output=True,
                          text=True, env=dict(env, CRASH_ON=crash_on), timeout=120)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 instruction groups")
def test_setup_falls_back_from_a_crashing_build_records_what_passed_and_reuses_it(fake_toolchain):
    root, log, env = fake_toolchain
    done = setup(root, env, crash_on="AMX_TILE AMX_INT8 AMX_BF16")
    assert done.returncode == 0, done.stderr
    configured = (log / "cmake").read_text().splitlines()
    assert len(configured) == 2 and "-DGGML_AMX_TILE=ON" in configured[0] and "-DGGML_AMX_TILE=OFF" in configured[1]
    assert "-DGGML_AVX512_BF16=ON" in configured[1]  # only the AMX groups were left out
    said = [line for line in done.stdout.splitlines() if line.startswith("setup_llamacpp: left out")]
    assert said == [f"setup_llamacpp: left out AMX_TILE AMX_INT8 AMX_BF16 (SIGILL in a 4-token pass of llama-bench "
                    f"with them on); the smoke run passes without them, recorded in {root}/build/setup-flags.json"]
    record = json.loads((root / "build" / "setup-flags.json").read_text())
    assert record["left_out"] == ["AMX_TILE", "AMX_INT8", "AMX_BF16"] and "-DGGML_AMX_INT8=OFF" in record["flags"]

    probes = (log / "probes").read_text().count("probe")
    again = setup(root, env, crash_on="AMX_TILE AMX_INT8 AMX_BF16")  # a rerun: the recorded flags, no probe
    assert again.returncode == 0, again.stderr
    assert (log / "probes").read_text().count("probe") == probes
    assert (log / "cmake").read_text().splitlines()[2] == configured[1]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 instruction groups")
def test_setup_steps_down_group_by_group_and_ends_in_one_line_when_nothing_passes(fake_toolchain):
    root, log, env = fake_toolchain
    done = setup(root, env, crash_on="AVX512_VNNI")  # survives leaving AMX out; the second step fixes it
    assert done.returncode == 0, done.stderr
    assert "left out AMX_TILE AMX_INT8 AMX_BF16 AVX512_BF16 AVX512_VNNI AVX512_VBMI (SIGILL" in done.stdout
    (root / "build" / "setup-flags.json").unlink()
    for f in ("cmake", "probes"):
        (log / f).unlink()
    failed = setup(root, env, crash_on="AVX2")  # nothing the fallbacks leave out helps
    assert failed.returncode == 2 and len(configured := (log / "cmake").read_text().splitlines()) == 4
    assert "-DGGML_AVX512=OFF" in configured[-1]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("setup_llamacpp: error: llama.cpp tools crash on this CPU (SIGILL in a 4-token pass")
    assert last.endswith("(already left out: AMX_TILE AMX_INT8 AMX_BF16 AVX512_BF16 AVX512_VNNI AVX512_VBMI AVX512 "
                         "AVX_VNNI)")
    assert not (root / "build" / "setup-flags.json").exists()
