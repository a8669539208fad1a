#!/usr/bin/env bash
# SmolLM2-135M-Instruct on GSM8K train: MARS and its AR control, both from the instruct model,
# then the evaluation of the untuned model, the control and MARS, and the report.
#   bash launch/smollm2_gsm8k.sh RUN_DIR [--config.key=value ...]
# Extra flags go to every train and evaluate command. Re-running resumes each step.
# SMOLLM2=DIR takes the model from DIR instead of models/smollm2 (built by tools/smollm2.py).
set -euo pipefail
run=${1:?run directory}; shift
config=configs/smollm2_gsm8k.py
model=${SMOLLM2:-models/smollm2}
if [ -z "${SMOLLM2:-}" ]; then python -m tools.smollm2 --link=models/smollm2; fi
python -m mars_jax.train --config="$config:mars" --workdir="$run/mars" --config.init_from="$model" "$@"
python -m mars_jax.train --config="$config:ar" --workdir="$run/ar" --config.init_from="$model" "$@"
# The untuned model, its report in the run folder (nothing is written into the model's own).
python -m mars_jax.evaluate --config="$config:ar" --workdir="$model" --output_dir="$run/untuned" "$@"
python -m mars_jax.evaluate --config="$config:ar" --workdir="$run/ar" "$@"
python -m mars_jax.evaluate --config="$config:mars" --workdir="$run/mars" "$@"
python -m experiments.smollm2_report --run="$run" --output_dir="$run/results"
