"""Checkpoint robustness: retention, uncommitted step directories, checksums of
corrupted files and the fallback, and `kill -9` of real training processes."""

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax import config, errors, train
from mars_jax import workdir as wd
from mars_jax.checkpoints import CHECKSUMS, CheckpointError, Checkpoints, TrainState
from tests.helpers import python_env
from tests.train_runs import ROOT, cli_flags, flat_params, get_config


def tiny_state(seed: int) -> TrainState:
    """A small TrainState whose arrays and data position depend on ``seed``."""
    params = nnx.state(nnx.Linear(8, 512, rngs=nnx.Rngs(seed)))
    opt_state = {"mu": jnp.full((16,), float(seed)), "count": jnp.int32(seed)}
    return TrainState(params, opt_state, data_position=10 * seed)


def abstract(state: TrainState) -> TrainState:
    """``state`` as shapes, dtypes and shardings (what `Checkpoints.restore` takes)."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    return TrainState(jax.tree.map(spec, state.params), jax.tree.map(spec, state.opt_state), 0)


def assert_same_state(a: TrainState, b: TrainState) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a[:2]), jax.tree.leaves(b[:2])
    assert len(leaves_a) == len(leaves_b) == 4
    for x, y in zip(leaves_a, leaves_b):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert a.data_position == b.data_position


def save_steps(workdir, steps, **options) -> None:
    with Checkpoints(str(workdir), writer=True, **options) as checkpoints:
        for step in steps:
            checkpoints.save(step, tiny_state(step))


def committed(workdir) -> list[int]:
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    return sorted(int(n) for n in names if n.isdigit())


def test_retention_keeps_the_last_n_and_every_mth(tmp_path):
    save_steps(tmp_path, range(1, 11), max_to_keep=2, keep_every=4)
    assert committed(tmp_path) == [4, 8, 9, 10]
    save_steps(tmp_path / "all", range(1, 6))  # max_to_keep None: all
    assert committed(tmp_path / "all") == [1, 2, 3, 4, 5]


def test_checksums_cover_every_item_file(tmp_path):
    save_steps(tmp_path, [3])
    step_dir = tmp_path / "checkpoints" / "3"
    with open(step_dir / CHECKSUMS) as f:
        sums = json.load(f)
    expected = {}
    for item in ("params", "opt_state", "data"):
        for path in (step_dir / item).rglob("*"):
            if path.is_file() and path.name != "commit_success.txt":
                expected[str(path.relative_to(step_dir))] = [
                    hashlib.sha256(path.read_bytes()).hexdigest(),
                    path.stat().st_size,
                ]
    assert sums == expected
    assert any(name.startswith("params/") for name in sums)
    assert any(name.startswith("opt_state/") for name in sums)


def test_uncommitted_step_is_ignored_and_can_be_saved_again(tmp_path):
    save_steps(tmp_path, [1, 2])
    base = tmp_path / "checkpoints"
    # What a save killed in flight leaves: its temporary directory, partly written.
    partial = base / "5.orbax-checkpoint-tmp"  # Orbax 0.12's name for it
    partial.mkdir()
    (partial / "params").mkdir()
    (partial / "params" / "manifest.ocdbt").write_bytes(b"\0" * 10)
    with Checkpoints(str(tmp_path)) as reader:  # not the writer: leaves it alone
        assert reader.latest_step() == 2
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 2
    assert_same_state(state, tiny_state(2))
    assert partial.exists()

    save_steps(tmp_path, [5])  # the writer removes the leftover, then saves step 5
    assert not partial.exists()
    with Checkpoints(str(tmp_path)) as reader:
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 5
    assert_same_state(state, tiny_state(5))


def largest_file(step_dir, item="params"):
    files = [p for p in glob.glob(f"{step_dir}/{item}/**", recursive=True) if os.path.isfile(p)]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_file_names_step_and_file(tmp_path, damage):
    save_steps(tmp_path, [1, 2])
    path = largest_file(tmp_path / "checkpoints" / "2")  # the array data
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        open(path, "wb").write(bytes(data[: len(data) - 7]))
    else:
        os.remove(path)
    with Checkpoints(str(tmp_path)) as reader:
        with pytest.raises(CheckpointError) as info:
            reader.restore_latest(abstract(tiny_state(0)))
        assert str(info.value).startswith(f"checkpoint step 2: {path}: ")
        reason = {
            "flip": "corrupted",
            "truncate": f"{len(data) - 7} bytes, {len(data)} when",
            "delete": "missing",
        }[damage]
        assert reason in str(info.value)
        with pytest.raises(CheckpointError, match="checkpoint step 2: "):
            reader.restore_params(abstract(tiny_state(0)).params)
        # Step 1 is intact.
        assert_same_state(reader.restore(1, abstract(tiny_state(0))), tiny_state(1))


@pytest.mark.parametrize("damage", ["no manifest", "empty manifest", "empty step", "extra file"])
def test_unverifiable_step_is_refused_and_falls_back(tmp_path, damage):
    """A step whose checksums are missing or do not cover its files is never restored: a
    `CheckpointError`, and with the fallback the previous step."""
    save_steps(tmp_path, [1, 2])
    step_dir = tmp_path / "checkpoints" / "2"
    manifest = step_dir / CHECKSUMS
    if damage == "no manifest":
        os.remove(manifest)
    elif damage == "empty manifest":
        manifest.write_text("{}")
    elif damage == "empty step":
        shutil.rmtree(step_dir)
        os.makedirs(step_dir / "params")
    else:
        (step_dir / "params" / "stray").write_bytes(b"x")
    with Checkpoints(str(tmp_path)) as reader:
        with pytest.raises(CheckpointError, match="checkpoint step 2: "):
            reader.restore_latest(abstract(tiny_state(0)))
        with pytest.raises(CheckpointError, match="checkpoint step 2: "):
            reader.restore_params(abstract(tiny_state(0)).params)
    with Checkpoints(str(tmp_path), writer=True) as checkpoints:
        state, step = checkpoints.restore_latest(abstract(tiny_state(0)), fallback=True)
    assert step == 1
    assert_same_state(state, tiny_state(1))


def test_fallback_restores_the_previous_step_and_resaves(tmp_path, caplog):
    save_steps(tmp_path, [1, 2, 3])
    path = largest_file(tmp_path / "checkpoints" / "3")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with Checkpoints(str(tmp_path), writer=True) as checkpoints:
        state, step = checkpoints.restore_latest(abstract(tiny_state(0)), fallback=True)
        assert step == 2
        assert_same_state(state, tiny_state(2))
        assert f"checkpoint step 3: {path}:" in caplog.text and "restoring step 2" in caplog.text
        assert committed(tmp_path) == [1, 2]
        assert os.path.isdir(tmp_path / "corrupt_checkpoints" / "3" / "params")
        checkpoints.save(3, tiny_state(7))  # the step number is free again
    with Checkpoints(str(tmp_path)) as reader:
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 3
    assert_same_state(state, tiny_state(7))


def test_fallback_without_an_earlier_step_raises(tmp_path):
    save_steps(tmp_path, [4])
    os.remove(largest_file(tmp_path / "checkpoints" / "4", "opt_state"))
    with Checkpoints(str(tmp_path)) as reader:
        with pytest.raises(CheckpointError, match="checkpoint step 4: .*opt_state.*: missing"):
            reader.restore_latest(abstract(tiny_state(0)), fallback=True)


def test_a_second_training_process_on_a_workdir_stops(tmp_path):
    """The run lock: while a process trains in a workdir, another `train` there stops at once
    with WorkdirInUse naming the holder; the lock is free again once released."""
    workdir = str(tmp_path / "run")
    with wd.RunLock(workdir):
        with pytest.raises(wd.WorkdirInUse, match=rf"{workdir} is in use .*pid {os.getpid()}"):
            train.train(kill_config(), workdir)
        assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    with wd.RunLock(workdir):  # released: taken again
        pass


@pytest.mark.parametrize("key, value", [("train.max_to_keep", 0), ("train.keep_every", -1)])
def test_bad_retention_settings(key, value):
    with pytest.raises(errors.SettingError, match=f"^{key}={value}: must be >= "):
        config.validate(get_config("ar", **{key.replace(".", "__"): value}), training=True)


# ----------------------------------------------------------------------------------------------
# kill -9 of `python -m mars_jax.train`, then the same command again.

KILL_STEPS = 8
KILL_FLAGS = [f"--config.train.num_steps={KILL_STEPS}", "--config.train.save_every=2"]
TIMEOUT_S = 300


def train_command(workdir):
    return [
        sys.executable,
        "-m",
        "mars_jax.train",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        *cli_flags(),
        *KILL_FLAGS,
    ]


def run_until(workdir, log, event=None, env=None) -> int:
    """Runs the train command in ``workdir`` (stderr to ``log``; environment ``env``, default
    `python_env()`) to its end, or sends it SIGKILL as soon as ``event()`` holds (polled every
    2 ms; it must still be running then). Returns the exit status."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            train_command(workdir),
            cwd=ROOT,
            env=env or python_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.time() + TIMEOUT_S
    try:
        while event is not None and not event():
            assert proc.poll() is None, open(log).read()[-3000:]
            assert time.time() < deadline, "the kill event never came"
            time.sleep(0.002)
        if event is not None:
            proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def kill_config(**extra):
    return get_config("ar", train__num_steps=KILL_STEPS, train__save_every=2, **extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The workdir of the KILL_STEPS-step run straight through (in-process)."""
    workdir = str(tmp_path_factory.mktemp("runs") / "straight")
    train.train(kill_config(), workdir)
    return workdir


def assert_same_run(workdir, straight):
    """``workdir`` ends with the parameters (bitwise), data position and losses of
    ``straight``."""
    a, _, step_a = wd.load_model(workdir)
    b, _, step_b = wd.load_model(straight)
    assert step_a == step_b == KILL_STEPS
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert np.array_equal(pa[key], pb[key]), key
    for run in (workdir, straight):
        with open(os.path.join(run, "checkpoints", str(KILL_STEPS), "data", "metadata")) as f:
            assert json.load(f) == {"next_batch": KILL_STEPS}
    resumed, expected = read_metrics(workdir), read_metrics(straight)
    assert [m["step"] for m in resumed] == list(range(1, KILL_STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in expected]


@pytest.mark.slow
@pytest.mark.subprocess
def test_kill_9_during_a_save_and_between_steps_then_resume(straight, tmp_path):
    """SIGKILL while the step-4 save is in flight, then (rerun) once step 5 is logged; the third
    run ends with the parameters, data position and losses of an uninterrupted run, bitwise."""
    workdir = str(tmp_path / "killed")
    base = os.path.join(workdir, "checkpoints")
    in_flight = lambda: glob.glob(f"{base}/4.orbax-checkpoint-tmp*")  # noqa: E731
    assert run_until(workdir, tmp_path / "run1.log", in_flight) == -signal.SIGKILL
    assert in_flight() and committed(workdir) == [2]  # killed during the save of step 4

    log2 = tmp_path / "run2.log"
    logged_5 = lambda: f"step 5/{KILL_STEPS} " in log2.read_text()  # noqa: E731
    assert run_until(workdir, log2, logged_5) == -signal.SIGKILL
    assert f"resuming {workdir} from its checkpoint of step 2" in log2.read_text()
    # Usually 4; 2 if the step-4 save was cut short again, 6 if the kill came that late.
    last = committed(workdir)[-1]
    assert 2 <= last < KILL_STEPS

    log3 = tmp_path / "run3.log"
    assert run_until(workdir, log3) == 0, log3.read_text()[-3000:]
    assert f"resuming {workdir} from its checkpoint of step {last}" in log3.read_text()
    assert not glob.glob(f"{base}/*.orbax-checkpoint-tmp*")

    assert_same_run(workdir, straight)


def test_train_stops_on_a_corrupted_checkpoint_or_falls_back(straight, tmp_path):
    """A flipped byte in the last checkpoint of a finished run: resuming raises CheckpointError
    naming step and file; with train.restore_fallback the run resumes from the step before,
    redoes the last steps and ends where the straight run ended."""
    workdir = str(tmp_path / "run")
    shutil.copytree(straight, workdir)
    path = largest_file(os.path.join(workdir, "checkpoints", str(KILL_STEPS)))
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x80]))
    message = f"^checkpoint step {KILL_STEPS}: {re.escape(path)}: .*corrupted"
    with pytest.raises(CheckpointError, match=message):
        train.train(kill_config(), workdir)
    train.train(kill_config(train__restore_fallback=True), workdir)
    assert os.path.isdir(os.path.join(workdir, "corrupt_checkpoints", str(KILL_STEPS)))
    assert_same_run(workdir, straight)


@pytest.fixture
def small_disk(tmp_path):
    """A 100 MB tmpfs mounted for the test (one checkpoint of the tiny run fits, two do not);
    skipped where mounting is not allowed (not root, no tmpfs)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.subprocess
def test_a_full_disk_is_one_line_and_the_committed_steps_resume(small_disk):
    """Orbax's failed save threads printed hundreds of traceback lines; now one line names the
    checkpoint, the space left and the size one takes. The committed checkpoint restores, and
    with room made the same command resumes from it."""
    workdir = str(small_disk / "run")
    command = train_command(workdir)[1:] + ["--config.train.save_every=2"]
    proc = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=python_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("I")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: no space left on device writing {workdir}/checkpoints/")
    assert "MB free there" in lines[0] and "a checkpoint of this run takes about" in lines[0]
    assert lines[0].endswith("the committed steps are intact: 2"), lines[0]
    _, _, step = wd.load_model(workdir, step=2)  # its checksums verified
    assert step == 2
    subprocess.run(["mount", "-o", "remount,size=400m", str(small_disk)], check=True)
    again = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=python_env(), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming {workdir} from its checkpoint of step 2" in again.stderr
    assert wd.load_model(workdir)[2] == KILL_STEPS
