#!/usr/bin/env bash
# Copies into .accelerator_data/ (ignored by git; or the directory given) what the lent GPU
# machine reads and lacks (it has neither ../shared nor models/): GSM8K's train and test rows,
# for benchmarks/accelerator.sh's real-data train-step parts and launch/smollm2_gpu.sh, and
# SmolLM2-135M-Instruct's shape (config.json and tokenizer files, no weights: the benchmark
# draws random ones). Run it here after `python -m tools.smollm2 --link=models/smollm2`, then
# give the device run `carry: [".whl", ".accelerator_data"]` (8 MB).
#
#   bash benchmarks/accelerator_data.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.accelerator_data}
mkdir -p "$out/smollm2_shape"
cp ../shared/data/gsm8k/train.jsonl "$out/gsm8k_train.jsonl"
cp ../shared/data/gsm8k/test.jsonl "$out/gsm8k_test.jsonl"
for name in config.json generation_config.json tokenizer.json tokenizer_config.json \
    chat_template.jinja special_tokens_map.json; do
  if [ -e "models/smollm2/$name" ]; then cp "models/smollm2/$name" "$out/smollm2_shape/"; fi
done
du -sh "$out"
