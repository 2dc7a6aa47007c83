#!/usr/bin/env bash
# benchmarks/llamacpp_build_check.py on a lent device machine's CPU (no network there). Prepare here:
#   mkdir -p .llamacpp/tok && cp ../shared/models/stories260K/tokenizer* .llamacpp/tok/
#   tar -C <dir of setup_llamacpp.sh's llama.cpp> --exclude=llama.cpp/docs --exclude=llama.cpp/models \
#       --exclude=llama.cpp/media --exclude=llama.cpp/benches -czf .llamacpp/src.tar.gz llama.cpp    # ~11 MB
# then run `bash benchmarks/llamacpp_build_check_device.sh` there with carry [".llamacpp"]; the result file lands in $OUT.
set -u
mkdir -p /tmp/ll && tar -xzf .llamacpp/src.tar.gz -C /tmp/ll
timeout 300 python3 -m benchmarks.llamacpp_build_check --source /tmp/ll/llama.cpp --tokenizer .llamacpp/tok \
  --work /tmp/bc --threads 2 16 --jobs "$(nproc)" --results-dir "$OUT"
echo "build_check rc $?"
cp /tmp/bc/build_check.log "$OUT/" 2>/dev/null
