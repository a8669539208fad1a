#!/usr/bin/env bash
# Stage 1 (AR SFT), stage 2 (MARS from stage 1), then the evaluation table of both.
#   bash launch/two_stage.sh CONFIG RUN_DIR [--config.key=value ...]
# e.g. bash launch/two_stage.sh configs/tiny.py runs/tiny
# Extra flags go to every command (train and evaluate). Re-running resumes each stage.
set -euo pipefail
config=${1:?config file}; run=${2:?run directory}; shift 2
python -m mars_jax.train --config="$config:ar" --workdir="$run/ar" "$@"
python -m mars_jax.train --config="$config:mars" --workdir="$run/mars" \
  "$@" --config.init_from="$run/ar"
python -m mars_jax.evaluate --config="$config:ar" --workdir="$run/ar" "$@"
python -m mars_jax.evaluate --config="$config:mars" --workdir="$run/mars" "$@"
