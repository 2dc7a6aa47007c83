#!/usr/bin/env bash
# The CMake flags that pick ggml-cpu's instruction groups for this machine, printed on one line:
#   bash scripts/llamacpp_flags.sh        -> e.g. -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON ... -DGGML_AMX_INT8=OFF
# On x86-64 each group ggml-cpu has an option for is ON only when a probe (scripts/cpu_probe.c, compiled with the
# group's -m flags) runs here: what this process can EXECUTE, not what /proc/cpuinfo lists. GGML_NATIVE
# (-march=native) enables whatever CPUID reports; on an Intel Xeon VM that lists AMX, tools built so died with
# SIGILL on every pass over 2+ tokens (ggml's AMX kernels use tile instructions only when a matmul has 2+ rows).
# stderr gets one line naming the groups found usable and the ones left out.
# Overrides: LLAMACPP_CMAKE_FLAGS="..." is printed as given (no probing); LLAMACPP_NATIVE=1 gives -DGGML_NATIVE=ON
# (the build this script replaced). Other architectures get -DGGML_NATIVE=ON: ggml's ARM detection test-compiles.
set -euo pipefail
cd "$(dirname "$0")"
if [ -n "${LLAMACPP_CMAKE_FLAGS:-}" ]; then echo "$LLAMACPP_CMAKE_FLAGS"; exit 0; fi
if [ "${LLAMACPP_NATIVE:-0}" = 1 ] || [ "$(uname -m)" != x86_64 ]; then echo "-DGGML_NATIVE=ON"; exit 0; fi

# group -> the -m flags ggml-cpu's CMakeLists.txt adds for GGML_<group> (the probe is compiled with the same), and the
# groups it needs: ggml only uses an AVX-512 extension inside AVX-512 code, and AMX only with AVX512-VNNI.
declare -A MFLAGS=(
  [SSE42]="-msse4.2" [AVX]="-mavx" [F16C]="-mf16c" [FMA]="-mfma" [AVX2]="-mavx2" [BMI2]="-mbmi2"
  [AVX_VNNI]="-mavxvnni" [AVX512]="-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw"
  [AVX512_VBMI]="-mavx512f -mavx512vbmi" [AVX512_VNNI]="-mavx512f -mavx512vnni"
  [AVX512_BF16]="-mavx512f -mavx512bf16" [AMX_TILE]="-mamx-tile" [AMX_INT8]="-mamx-tile -mamx-int8"
  [AMX_BF16]="-mamx-tile -mamx-bf16")
declare -A NEEDS=(
  [F16C]="AVX" [FMA]="AVX" [AVX2]="AVX" [AVX_VNNI]="AVX2" [AVX512]="AVX2" [AVX512_VBMI]="AVX512"
  [AVX512_VNNI]="AVX512" [AVX512_BF16]="AVX512" [AMX_TILE]="AVX512_VNNI" [AMX_INT8]="AMX_TILE"
  [AMX_BF16]="AMX_TILE")
ORDER=(SSE42 AVX F16C FMA AVX2 BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 AMX_BF16)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
declare -A USABLE=()
flags=(-DGGML_NATIVE=OFF)
usable=() unusable=()
for group in "${ORDER[@]}"; do
  ok=1
  for need in ${NEEDS[$group]:-}; do [ -n "${USABLE[$need]:-}" ] || ok=0; done
  # ${CC:-cc}: a compiler that cannot emit the group also leaves it out. The probe runs in a subshell inside a
  # group whose stderr is dropped, so that a SIGILL is its exit status (132) and not a "Illegal instruction" line.
  # shellcheck disable=SC2086
  if [ "$ok" = 1 ] && "${CC:-cc}" -O1 ${MFLAGS[$group]} "-DPROBE_$group" cpu_probe.c -o "$work/$group" 2>/dev/null \
      && { ( "$work/$group" ) >/dev/null 2>&1; } 2>/dev/null; then
    USABLE[$group]=1; usable+=("$group"); flags+=("-DGGML_$group=ON")
  else
    unusable+=("$group"); flags+=("-DGGML_$group=OFF")
  fi
done
echo "llamacpp_flags: usable here: ${usable[*]:-none}; left out: ${unusable[*]:-none}" >&2
echo "${flags[*]}"
