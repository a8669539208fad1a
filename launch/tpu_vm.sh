#!/usr/bin/env bash
# Runs one command on every worker of a Cloud TPU VM (a single host or a pod slice).
#
#   NAME=mars ZONE=us-west4-a ACCELERATOR_TYPE=v5litepod-16 RUNTIME_VERSION=v2-alpha-tpuv5-lite \
#     bash launch/tpu_vm.sh [options] -- COMMAND [ARG ...]
#
# Steps: create the TPU VM (or a queued resource) unless it exists; copy `git archive HEAD` of
# this repository to ~/mars-jax on every worker and install it there into ~/mars-jax/.venv
# (requirements.txt, "jax[tpu]==$JAX_VERSION", the package); run COMMAND from ~/mars-jax on all
# workers at once, each worker teeing its output to ~/mars-jax/logs/<hostname>.log; copy those
# logs back to $LOG_DIR/logs/. The exit status is COMMAND's (non-zero if it failed on any worker).
# Every host runs the same command; mars_jax.train detects the pod and starts jax.distributed.
#
# Environment:
#   NAME              TPU VM (and queued resource) name                       (required)
#   ZONE              e.g. us-west4-a                                         (required)
#   ACCELERATOR_TYPE  e.g. v5litepod-16, v4-32, v6e-16                        (for creating)
#   RUNTIME_VERSION   TPU software version, e.g. v2-alpha-tpuv5-lite          (for creating)
#   PROJECT           GCP project (default: gcloud's configured project)
#   PYTHON            interpreter on the workers, >= 3.11 (default python3.11; installed with
#                     apt-get if missing)
#   JAX_VERSION       jax[tpu] release to install (default 0.10.2, as launch/xm_launch.py)
#   LOG_DIR           where worker logs are collected (default logs/tpu/$NAME)
#
# Options:
#   --queued       create through a queued resource (waits until it is ACTIVE)
#   --spot         Spot capacity (preemptible)
#   --best_effort  best-effort queued resource (with --queued)
#   --skip_install reuse the code and venv already on the workers
#   --dry_run      print every gcloud command instead of running it (nothing exists then: the
#                  creation path is shown)
#   -h, --help     this text
#
# Example (stage 1 of configs/qwen0_5b.py; workdir, weights and data in a bucket that the VM's
# service account can write, or on a filesystem every worker mounts at the same path):
#   bash launch/tpu_vm.sh -- python -m mars_jax.train --config=configs/qwen0_5b.py:ar \
#     --workdir=gs://my-bucket/runs/q05/ar --config.init_from=gs://my-bucket/Qwen2.5-0.5B-Instruct \
#     --config.data.train_path=gs://my-bucket/sft.jsonl --config.mesh.rules.embed="('data','fsdp')"
#
# gcloud flags as documented for `gcloud compute tpus tpu-vm` and `gcloud compute tpus
# queued-resources` (GA track); not run against a real project from this repository's CI.
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

queued=0 spot=0 best_effort=0 skip_install=0 dry_run=0
while (($#)); do
  case $1 in
    --queued) queued=1 ;;
    --spot) spot=1 ;;
    --best_effort) best_effort=1 ;;
    --skip_install) skip_install=1 ;;
    --dry_run) dry_run=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (the command goes after --)" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
(($#)) || { echo "no command given after --" >&2; usage >&2; exit 2; }
need() {  # need VAR WHAT: VAR set, or a message saying what it is, and status 2
  [ -n "${!1:-}" ] || { echo "launch/tpu_vm.sh: $1 is not set: $2 (see --help)" >&2; exit 2; }
}
need NAME "the TPU VM's name, e.g. NAME=mars"
need ZONE "its zone, e.g. ZONE=us-west4-a"
PYTHON=${PYTHON:-python3.11}
JAX_VERSION=${JAX_VERSION:-0.10.2}
LOG_DIR=${LOG_DIR:-logs/tpu/$NAME}
if ((best_effort && !queued)); then echo "--best_effort needs --queued" >&2; exit 2; fi
if ((spot && best_effort)); then echo "--spot and --best_effort exclude each other" >&2; exit 2; fi

scope=(--zone="$ZONE")
[[ -n ${PROJECT:-} ]] && scope+=(--project="$PROJECT")

# gcloud ARG...: runs gcloud, or prints it (shell-quoted) with --dry_run.
gcloud_() {
  if ((dry_run)); then
    printf '+ gcloud'; printf ' %q' "$@"; printf '\n'
  else
    gcloud "$@"
  fi
}

# exists KIND: whether the TPU VM ("tpu-vm") or queued resource ("queued-resources") $NAME
# exists (never, in a dry run).
exists() {
  ((dry_run)) && { gcloud_ compute tpus "$1" describe "$NAME" "${scope[@]}"; return 1; }
  gcloud compute tpus "$1" describe "$NAME" "${scope[@]}" --format='value(name)' >/dev/null 2>&1
}

create() {
  need ACCELERATOR_TYPE "the chips to create $NAME with, e.g. v5litepod-16"
  need RUNTIME_VERSION "the TPU software to create $NAME with, e.g. v2-alpha-tpuv5-lite"
  local tier=()
  ((spot)) && tier=(--spot)
  ((best_effort)) && tier=(--best-effort)
  if ((queued)); then
    exists queued-resources || gcloud_ compute tpus queued-resources create "$NAME" \
      --node-id="$NAME" --accelerator-type="$ACCELERATOR_TYPE" \
      --runtime-version="$RUNTIME_VERSION" "${tier[@]}" "${scope[@]}"
    local state=""
    until [[ $state == ACTIVE ]]; do
      if ((dry_run)); then
        gcloud_ compute tpus queued-resources describe "$NAME" "${scope[@]}" \
          --format='value(state.state)'
        state=ACTIVE
      else
        state=$(gcloud compute tpus queued-resources describe "$NAME" "${scope[@]}" \
          --format='value(state.state)')
        case $state in
          FAILED|SUSPENDED) echo "queued resource $NAME is $state" >&2; exit 1 ;;
          ACTIVE) ;;
          *) echo "queued resource $NAME: ${state:-unknown}; waiting" >&2; sleep 60 ;;
        esac
      fi
    done
  else
    gcloud_ compute tpus tpu-vm create "$NAME" --accelerator-type="$ACCELERATOR_TYPE" \
      --version="$RUNTIME_VERSION" "${tier[@]}" "${scope[@]}"
  fi
}

# on_all COMMAND_STRING: runs a shell command string on every worker at once.
on_all() { gcloud_ compute tpus tpu-vm ssh "$NAME" --worker=all "${scope[@]}" --command="$1"; }

exists tpu-vm || create

if ((!skip_install)); then
  tarball=$(mktemp -d)/mars-jax.tar.gz
  repo=$(cd "$(dirname "$0")/.." && pwd)
  if ((dry_run)); then
    printf '+ git -C %q archive --format=tar.gz -o %q HEAD\n' "$repo" "$tarball"
  else
    git -C "$repo" archive --format=tar.gz -o "$tarball" HEAD
  fi
  gcloud_ compute tpus tpu-vm scp "$tarball" "$NAME:mars-jax.tar.gz" --worker=all "${scope[@]}"
  # Ubuntu 22.04 TPU images ship Python 3.10; python3.X-venv pulls python3.X from the archive.
  on_all "set -euo pipefail; \
(command -v $PYTHON >/dev/null || (sudo apt-get update -q && sudo apt-get install -y -q $PYTHON-venv)) \
&& rm -rf ~/mars-jax && mkdir -p ~/mars-jax && tar -xzf ~/mars-jax.tar.gz -C ~/mars-jax \
&& cd ~/mars-jax && $PYTHON -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip \
&& .venv/bin/python -m pip install -q -r requirements.txt 'jax[tpu]==$JAX_VERSION' -e ."
fi

command_line=$(printf '%q ' "$@")
status=0
on_all "cd ~/mars-jax && source .venv/bin/activate && mkdir -p logs && set -o pipefail && \
{ ${command_line}; } 2>&1 | tee logs/\$(hostname).log" || status=$?

((dry_run)) || mkdir -p "$LOG_DIR"
gcloud_ compute tpus tpu-vm scp --recurse "$NAME:mars-jax/logs" "$LOG_DIR" --worker=all \
  "${scope[@]}" || echo "could not collect all logs into $LOG_DIR" >&2
exit "$status"
