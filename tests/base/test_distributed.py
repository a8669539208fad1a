"""Multi-process training: 2 CPU processes with 2 devices each against 1 process with 4 devices.

The two-process run talks over JAX's CPU collectives (gloo) through a coordinator on a free
localhost port; the mesh puts all 4 devices on the fsdp axis, so parameters, optimizer state and
batch rows are split across the processes and every step all-gathers and reduce-scatters
across them. The two-process run is also interrupted after its step-2 checkpoint and resumed in
the same processes, so each process restores its shards. Plus in-process checks of the
configuration errors, the cluster detection and the per-process batch rows.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import distributed, sharding
from mars_jax import workdir as wd
from mars_jax.batches import Example, batched_dataset
from mars_jax.common_types import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400  # per launch; both runs took ~1 min each on a shared 2-core CPU

# configs/tiny.py shrunk as in tests/programs/test_train.py; 3 steps of 8 rows (2 per device).
# The vocabulary is trimmed to the data's tokens: with Qwen2.5's 151,680 rows every step moved
# 20 MB of embedding, gradient and optimizer shards through gloo (about 1 s a step).
OVERRIDES = {
    "data.trim_vocab": True,
    "train.num_steps": 3,
    "train.batch_size": 8,
    "train.log_every": 1,
    "train.save_every": 2,
    "data.num_synthetic_train": 32,
    "model.num_layers": 1,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.head_dim": 8,
    "mesh.data": 1,
    "mesh.fsdp": 4,
}

# One training process: the tiny config with OVERRIDES and the distributed keys (argv[2], JSON),
# run in argv[1]; with argv[3] == "interrupt" it stops right after the step-2 checkpoint and
# calls train.train again in the same process (distributed.initialize is then a no-op).
DRIVER = r"""
import json, sys
from absl import logging
from mars_jax import checkpoints, train

from tests.helpers import tiny_config

workdir, settings, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]


def config():
    return tiny_config("ar", settings)


class Interrupted(Exception):
    pass


logging.set_verbosity(logging.INFO)
if mode == "interrupt":
    real_save = checkpoints.Checkpoints.save

    def save_then_stop(self, step, state):
        real_save(self, step, state)
        if step == 2:
            self.close()
            raise Interrupted

    checkpoints.Checkpoints.save = save_then_stop
    try:
        train.train(config(), workdir)
        raise SystemExit("the run was not interrupted")
    except Interrupted:
        checkpoints.Checkpoints.save = real_save
train.train(config(), workdir)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(workdir, logs, settings, mode, devices, process_id=None):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    name = "single" if process_id is None else f"process{process_id}"
    out = open(logs / f"{name}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(workdir), json.dumps(settings), mode],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: killed with everything it started
    )
    proc.log_path = logs / f"{name}.log"
    return proc


def wait_all(procs, timeout):
    """Waits for every process; on a failure or past ``timeout`` kills them all and fails
    with the tail of each log."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [p for p in procs if p.returncode != 0]
    assert not failed, "\n\n".join(
        f"{p.log_path.name}: exit {p.returncode}\n{p.log_path.read_text()[-3000:]}" for p in failed
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(two-process workdir, one-process workdir, {log name: text}, seconds of the 2-process
    launch)."""
    root = tmp_path_factory.mktemp("distributed")
    two, one = root / "two", root / "one"
    port = free_port()
    t0 = time.monotonic()
    procs = [
        launch(
            two,
            root,
            {
                **OVERRIDES,
                "distributed.coordinator_address": f"localhost:{port}",
                "distributed.num_processes": 2,
                "distributed.process_id": i,
            },
            "interrupt",
            devices=2,
            process_id=i,
        )
        for i in range(2)
    ]
    wait_all(procs, TIMEOUT_S)
    seconds = time.monotonic() - t0
    wait_all([launch(one, root, OVERRIDES, "straight", devices=4)], TIMEOUT_S)
    logs = {p.name: p.read_text() for p in root.glob("*.log")}
    return str(two), str(one), logs, seconds


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def flat_params(workdir, step=None):
    model, _, _ = wd.load_model(workdir, step=step)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_resume_and_write_once(runs):
    two, _, logs, seconds = runs
    print(f"two-process launch (3 steps, interrupted and resumed): {seconds:.1f} s")
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["2", "3"]
    # One record per step: the file was written by one process, and the resume dropped nothing.
    assert [m["step"] for m in read_metrics(two)] == [1, 2, 3]
    for name in ("config.json", "model.json", "tokenizer"):
        assert os.path.exists(os.path.join(two, name)), name
    # Both processes trained (the coordinator log names 2 processes); only process 0 logged.
    assert "distributed runtime: 2 processes, 4 devices (2 local)" in logs["process0.log"]
    assert "step 3/3" in logs["process0.log"] and "resuming " in logs["process0.log"]
    assert "step 1/3" not in logs["process1.log"] and "resuming " not in logs["process1.log"]
    assert "step 3/3" in logs["single.log"] and "distributed runtime" not in logs["single.log"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_equal_one_process(runs):
    two, one, _, _ = runs
    m2, m1 = read_metrics(two), read_metrics(one)
    assert [m["step"] for m in m1] == [1, 2, 3]
    for a, b in zip(m2, m1):
        # The same rows in every global batch: token counts are integers and must agree exactly.
        assert a["label_tokens"] == b["label_tokens"], (a["step"], a, b)
        # The same computation with the cross-device sums taken by another collective
        # implementation (gloo across processes, in-process otherwise), so the fp32 results
        # differ by roundoff only: ~1e-7 relative (1 ulp of the loss measured at step 2). A
        # batch with other rows changes the loss by ~1e-2 here (the logged losses of
        # consecutive steps differ by 4e-2 at a nearly constant model).
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])
        assert a["learning_rate"] == b["learning_rate"]
    # Step 1 runs at warmup learning rate 0; steps 2 and 3 update the parameters.
    lr_sum = sum(m["learning_rate"] for m in m1)
    assert lr_sum > 0
    p2, p1 = flat_params(two), flat_params(one)
    # As in tests/multidevice/test_sharding_8dev.py: AdamW moves each coordinate by about lr per step whatever
    # the gradient's size, so roundoff in a gradient coordinate near zero can change that
    # coordinate's step by a fraction of lr; other data or a missing reduction changes steps by
    # O(lr). The bound, 1% of the summed learning rate, lies between the two (measured: 1.2e-7,
    # i.e. 3e-5 of the summed learning rate).
    bound = 1e-2 * lr_sum
    assert max_diff(p2, p1) <= bound
    # The last step alone really moved the parameters, by far more than the bound.
    assert max_diff(flat_params(one, step=3), flat_params(one, step=2)) > 10 * bound


PREEMPT_STEPS = 24


def two_process_run(workdir, logs, mode="straight", steps=PREEMPT_STEPS):
    port = free_port()
    settings = {
        **OVERRIDES,
        "train.num_steps": steps,
        "train.save_every": 1000,
        "distributed.coordinator_address": f"localhost:{port}",
        "distributed.num_processes": 2,
    }
    return [
        launch(workdir, logs, {**settings, "distributed.process_id": i}, mode, 2, i)
        for i in range(2)
    ]


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes_bitwise(tmp_path):
    """SIGTERM to process 1 of 2 (a preemption notice reaching one host): JAX's preemption
    sync makes both stop after the same step, save it together and exit 0; the same launch
    then resumes and ends with the parameters of an uninterrupted 2-process run, bitwise."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    procs = two_process_run(run, tmp_path / "a")
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), procs[0].log_path.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGTERM)
    finally:
        wait_all(procs, TIMEOUT_S)  # both exit 0
    saved = [int(s) for s in os.listdir(run / "checkpoints")]
    assert len(saved) == 1 and 2 <= saved[0] < PREEMPT_STEPS, saved
    log0 = (tmp_path / "a" / "process0.log").read_text()
    assert f"saved step {saved[0]} of {PREEMPT_STEPS}" in log0, log0[-3000:]
    wait_all(two_process_run(run, tmp_path / "a"), TIMEOUT_S)
    wait_all(two_process_run(straight, tmp_path / "b"), TIMEOUT_S)
    assert [m["step"] for m in read_metrics(run)][-1] == PREEMPT_STEPS
    a, b = flat_params(str(run)), flat_params(str(straight))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------
# In-process checks (one process, one device).


def dist(address="", count=0, index=-1):
    return types.SimpleNamespace(coordinator_address=address, num_processes=count, process_id=index)


def test_initialize_without_keys_or_cluster_is_a_no_op(monkeypatch):
    for var in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.cluster_launch() is None
    distributed.initialize(dist())
    assert not jax.distributed.is_initialized() and jax.process_count() == 1
    assert distributed.is_primary()


def test_initialize_rejects_incomplete_keys():
    with pytest.raises(ValueError, match="coordinator_address is not"):
        distributed.initialize(dist(count=2, index=0))
    with pytest.raises(ValueError, match="process_id=1 are set"):
        distributed.initialize(dist(index=1))
    for count, index in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError, match="distributed.num_processes >= 1") as e:
            distributed.initialize(dist("localhost:1234", count, index))
        assert f"num_processes={count} and process_id={index}" in str(e.value)
    assert not jax.distributed.is_initialized()


def test_cluster_detection_is_jax_own(monkeypatch):
    """A Slurm job step with several tasks is a multi-process launch; one task is not."""
    for var in ("OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for var, value in slurm.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.cluster_launch() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.cluster_launch() == "SlurmCluster"


def fake_examples(n, length=4):
    return [
        Example(np.full(length, i, np.int32), np.full(length, i, np.int32), row=i) for i in range(n)
    ]


def test_batched_dataset_rows_are_the_process_share():
    examples = fake_examples(10)
    full = batched_dataset(examples, batch_size=4, max_length=4, seed=3)
    part = batched_dataset(examples, batch_size=4, max_length=4, seed=3, rows=[1, 3])
    for i in range(5):  # across the epoch boundary (2 batches per epoch)
        for key in ("input_ids", "labels"):
            np.testing.assert_array_equal(part[i][key], full[i][key][[1, 3]])
    # A partial last batch: rows past its end are padding rows.
    kw = dict(batch_size=4, max_length=4, seed=3, drop_remainder=False, num_epochs=1)
    last_full = batched_dataset(examples, **kw)[2]
    last_part = batched_dataset(examples, **kw, rows=[1, 2, 3])[2]
    np.testing.assert_array_equal(last_part["input_ids"], last_full["input_ids"][1:])
    assert (last_part["labels"][1:] == IGNORE_INDEX).all()
    assert (last_part["labels"][0] != IGNORE_INDEX).all()
    for bad in ([4], [2, 1], [0, 0]):
        with pytest.raises(ValueError, match="ascending"):
            batched_dataset(examples, batch_size=4, max_length=4, seed=3, rows=bad)


def test_one_process_holds_every_row():
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    bs = sharding.batch_sharding(mesh, sharding.logical_rules())
    rows = distributed.process_rows(bs, 6)
    np.testing.assert_array_equal(rows, np.arange(6))
    local = {"input_ids": np.arange(12, dtype=np.int32).reshape(6, 2)}
    batch = distributed.global_batch(local, bs, 6)
    np.testing.assert_array_equal(np.asarray(batch["input_ids"]), local["input_ids"])
    assert batch["input_ids"].sharding == bs
