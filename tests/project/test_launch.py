"""The launchers' dry runs: launch/xm_launch.py's job spec and launch/tpu_vm.sh's gcloud commands.

Neither needs xmanager, gcloud or an accelerator: the dry runs only print what would run.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import python_env, run_python
from tests.train_runs import cli_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMBED = "--config.mesh.rules.embed=('fsdp','tensor')"
DATA = "--config.data.train_path=/data/my sft.jsonl"


def xm_dry_run(*flags: str) -> dict:
    return json.loads(run_python("launch/xm_launch.py", "--dry_run", *flags, timeout=60).stdout)


@pytest.mark.subprocess
def test_xm_dry_run_tpu_both_stages():
    spec = xm_dry_run(
        "--config=configs/qwen7b.py",
        "--workdir=/shared/runs/q7",
        "--tpu=v5e",
        "--topology=4x4",
        "--num_hosts=4",
        "--",
        "--config.init_from=/models/Qwen2.5-7B",
        EMBED,
    )
    assert spec["name"] == "mars-qwen7b"
    assert spec["accelerator"] == {"tpu": "v5e", "topology": "4x4"}
    assert spec["num_hosts"] == 4
    assert spec["image"]["pip_install"] == ["-r", "requirements.txt", "jax[tpu]==0.10.2"]
    train = ["python", "-m", "mars_jax.train"]
    assert spec["jobs"] == [
        {
            "stage": "ar",
            "workdir": "/shared/runs/q7/ar",
            "argv": train
            + [
                "--config=configs/qwen7b.py:ar",
                "--workdir=/shared/runs/q7/ar",
                "--config.init_from=/models/Qwen2.5-7B",
                EMBED,
            ],
        },
        # Stage 2 starts from stage 1: its init_from comes last, so it wins.
        {
            "stage": "mars",
            "workdir": "/shared/runs/q7/mars",
            "argv": train
            + [
                "--config=configs/qwen7b.py:mars",
                "--workdir=/shared/runs/q7/mars",
                "--config.init_from=/models/Qwen2.5-7B",
                EMBED,
                "--config.init_from=/shared/runs/q7/ar",
            ],
        },
    ]


@pytest.mark.subprocess
def test_xm_dry_run_gpu_one_stage():
    spec = xm_dry_run(
        "--config=configs/qwen0_5b.py",
        "--workdir=/shared/runs/q05",
        "--gpu=a100",
        "--gpus_per_host=4",
        "--stage=ar",
        "--",
        DATA,
    )
    assert spec["accelerator"] == {"gpu": "a100", "count": 4}
    assert spec["num_hosts"] == 1
    assert spec["image"]["pip_install"][-1] == "jax[cuda12]==0.10.2"
    assert spec["env"] == {"PYTHONUNBUFFERED": "1"}
    [job] = spec["jobs"]
    assert job["argv"][3:] == [
        "--config=configs/qwen0_5b.py:ar",
        "--workdir=/shared/runs/q05",
        DATA,
    ]


@pytest.mark.subprocess
def test_xm_rejects_flags_that_are_not_config_overrides():
    run = run_python(
        "launch/xm_launch.py",
        "--dry_run",
        "--config=configs/tiny.py",
        "--workdir=w",
        "--gpu=a100",
        "--",
        "--workdir=other",
        timeout=60,
        check=False,
    )
    assert run.returncode != 0
    assert "only --config.KEY=VALUE overrides" in run.stderr


@pytest.mark.subprocess
def test_tpu_vm_dry_run_commands():
    env = dict(
        os.environ,
        NAME="mars-pod",
        ZONE="us-west4-a",
        ACCELERATOR_TYPE="v5litepod-16",
        RUNTIME_VERSION="v2-alpha-tpuv5-lite",
        PROJECT="proj",
    )
    command = [
        "python",
        "-m",
        "mars_jax.train",
        "--config=configs/qwen0_5b.py:ar",
        "--workdir=/mnt/shared/runs/a b",
        EMBED,
        DATA,
    ]
    out = subprocess.run(
        ["bash", "launch/tpu_vm.sh", "--dry_run", "--queued", "--spot", "--", *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    gcloud = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ gcloud")]
    scope = ["--zone=us-west4-a", "--project=proj"]
    assert [
        "gcloud",
        "compute",
        "tpus",
        "queued-resources",
        "create",
        "mars-pod",
        "--node-id=mars-pod",
        "--accelerator-type=v5litepod-16",
        "--runtime-version=v2-alpha-tpuv5-lite",
        "--spot",
        *scope,
    ] in gcloud
    ssh = [c for c in gcloud if c[3:5] == ["tpu-vm", "ssh"]]
    assert len(ssh) == 2  # install, then the command
    for c in ssh:
        assert c[5:9] == ["mars-pod", "--worker=all", *scope]
    install = ssh[0][9].removeprefix("--command=")
    assert "-r requirements.txt 'jax[tpu]==0.10.2' -e ." in install
    remote = shlex.split(ssh[1][9].removeprefix("--command="))
    # The remote shell sees the command's arguments exactly as given, spaces and quotes included.
    start = remote.index("{") + 1
    assert remote[start : remote.index(";", start)] == command
    assert "logs/$(hostname).log" in ssh[1][9]
    scp = [c for c in gcloud if c[3:5] == ["tpu-vm", "scp"]]
    assert [c[-3:] for c in scp] == [["--worker=all", *scope]] * 2
    assert scp[1][5:9] == [
        "--recurse",
        "mars-pod:mars-jax/logs",
        "logs/tpu/mars-pod",
        "--worker=all",
    ]


@pytest.mark.subprocess
def test_tpu_vm_names_the_variable_it_lacks():
    """Without its environment, --dry_run says which variable is missing and what it is, not
    bash's bare ``NAME: set NAME``; creating also needs the chips and the runtime."""
    base = {k: v for k, v in os.environ.items() if k not in ("NAME", "ZONE")}
    base.pop("ACCELERATOR_TYPE", None)
    base.pop("RUNTIME_VERSION", None)
    cases = [
        ({}, "NAME is not set: the TPU VM's name, e.g. NAME=mars (see --help)"),
        ({"NAME": "pod"}, "ZONE is not set: its zone, e.g. ZONE=us-west4-a (see --help)"),
        (
            {"NAME": "pod", "ZONE": "z"},
            "ACCELERATOR_TYPE is not set: the chips to create pod with, e.g. v5litepod-16",
        ),
    ]
    for extra, message in cases:
        run = subprocess.run(
            ["bash", "launch/tpu_vm.sh", "--dry_run", "--", "echo", "hi"],
            cwd=ROOT,
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith(f"launch/tpu_vm.sh: {message}")


def test_launchers_pin_the_same_jax():
    with open(os.path.join(ROOT, "launch/tpu_vm.sh")) as f:
        pinned = re.search(r"JAX_VERSION=\$\{JAX_VERSION:-([^}]+)\}", f.read()).group(1)
    with open(os.path.join(ROOT, "launch/xm_launch.py")) as f:
        assert f'JAX_VERSION = "{pinned}"' in f.read()


@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_c_in_stage_1_ends_the_two_stage_pipeline(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) during stage 1 of launch/two_stage.sh:
    stage 1 saves its step and exits 130, and the script stops there (status 130) instead of
    starting stage 2 from a half-trained stage 1."""
    run = tmp_path / "run"
    env = python_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    proc = subprocess.Popen(
        ["bash", "launch/two_stage.sh", "configs/tiny.py", str(run), *cli_flags()]
        + ["--config.train.num_steps=200", "--config.train.save_every=1000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    marker, deadline = run / "ar" / "metrics.jsonl", time.time() + 300
    try:
        while not (marker.exists() and marker.stat().st_size > 0):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopped by SIGINT: saved step" in stderr
    assert os.listdir(run / "ar" / "checkpoints") and not (run / "mars").exists()
