"""gs:// paths against a real GCS-protocol server (fake-gcs-server on 127.0.0.1, started here):
the storage layer's files, generations and checksums; the run lock; checkpoints with their
checksums; metrics; data, tokenizer and Hugging Face directories read from and written to a
bucket; and whole training runs on a gs:// workdir (kill -9 and resume, the server stopped
during a save, evaluate / generate / export), each compared with the same thing on local disk.
"""

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import google_crc32c
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars_jax import storage, train
from mars_jax import workdir as wd
from mars_jax.checkpoints import CHECKSUMS, CheckpointError, Checkpoints
from mars_jax.errors import NotFound
from mars_jax.metrics import MetricsWriter
from mars_jax.rows import read_rows
from mars_jax.tokenizer import load_tokenizer
from tests.gcs_emulator import serving
from tests.helpers import ROOT, python_env
from tests.train_runs import cli_flags, flat_params, get_config
from tests.training.test_checkpoints import (
    KILL_STEPS,
    abstract,
    assert_same_state,
    kill_config,
    run_until,
    tiny_state,
    train_command,
)

BUCKET = "runs"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator, with this process's clients pointed at it and bucket ``runs``."""
    with serving(tmp_path_factory.mktemp("gcs"), BUCKET) as emulator:
        yield emulator


def fresh(name: str) -> str:
    """A new gs:// prefix in the test bucket."""
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------------------------
# The storage layer.


def test_files_round_trip_and_checksums(gcs, tmp_path):
    root = fresh("files")
    data = os.urandom(3000)
    storage.write_bytes(storage.join(root, "a", "b.bin"), data)
    storage.write_text(storage.join(root, "c.txt"), "héllo")
    assert storage.read_bytes(storage.join(root, "a", "b.bin")) == data
    assert storage.read_text(storage.join(root, "c.txt")) == "héllo"
    assert storage.isdir(root) and storage.isdir(storage.join(root, "a"))
    assert storage.isfile(storage.join(root, "c.txt")) and not storage.exists(root + "/nope")
    assert storage.listdir(root) == ["a", "c.txt"]
    assert storage.files_under(root) == ["a/b.bin", "c.txt"]
    assert storage.size(storage.join(root, "a", "b.bin")) == 3000
    # The store's crc32c, as GCS defines it (big-endian, base64), computed here independently.
    crc = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    assert storage.checksum(storage.join(root, "a", "b.bin")) == f"crc32c:{crc}"
    (tmp_path / "b.bin").write_bytes(data)
    local = storage.checksum(tmp_path / "b.bin")
    assert local == "sha256:" + hashlib.sha256(data).hexdigest()
    # Copies both ways keep every byte.
    storage.copy_tree(root, tmp_path / "copy")
    assert (tmp_path / "copy" / "a" / "b.bin").read_bytes() == data
    with storage.local_dir(root, ["c.txt", "missing.txt"]) as local_dir:
        assert sorted(os.listdir(local_dir)) == ["c.txt"]
    storage.remove_tree(root)
    assert not storage.exists(storage.join(root, "c.txt"))


def test_create_new_and_generation_preconditions(gcs):
    path = fresh("gen") + "/lock"
    first = storage.create_new(path, "one")
    with pytest.raises(FileExistsError):
        storage.create_new(path, "two")
    assert storage.read_with_generation(path) == ("one", first)
    second = storage.replace_if_unchanged(path, "three", first)
    with pytest.raises(FileExistsError):  # the generation moved on
        storage.replace_if_unchanged(path, "four", first)
    assert not storage.delete_if_unchanged(path, first)
    assert storage.delete_if_unchanged(path, second)
    assert storage.read_with_generation(path) is None


# ----------------------------------------------------------------------------------------------
# The run lock.


def test_run_lock_on_gs(gcs):
    workdir = fresh("lock")
    lock_path = storage.join(workdir, "lock")
    with wd.RunLock(workdir):
        holder = json.loads(storage.read_text(lock_path))
        assert holder["pid"] == os.getpid()
        with pytest.raises(wd.WorkdirInUse, match=f"pid {os.getpid()} on "):
            wd.RunLock(workdir).__enter__()
    assert not storage.exists(lock_path)  # released
    # A lock left by a process of this host that no longer runs: taken over at once; but not
    # when it was written in another pid namespace (a container with the same host name).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    me = wd._process_identity(os.getpid())
    left = {**me, "pid": dead.pid, "since": "then", "heartbeat": now}
    storage.write_text(lock_path, json.dumps({**left, "pid_namespace": -1}))
    with pytest.raises(wd.WorkdirInUse, match=f"pid {dead.pid} on "):
        wd.RunLock(workdir).__enter__()
    storage.write_text(lock_path, json.dumps(left))
    with wd.RunLock(workdir):
        assert json.loads(storage.read_text(lock_path))["pid"] == os.getpid()
    # A pid of this host that runs, but is another process than the one that wrote the lock.
    storage.write_text(lock_path, json.dumps({**me, "start": me["start"] - 1, "heartbeat": now}))
    with wd.RunLock(workdir):
        pass
    # Another host's: live while its heartbeat is fresh, stale once it is old.
    other = {"pid": 1, "host": "another-host", "since": "then", "heartbeat": now}
    storage.write_text(lock_path, json.dumps(other))
    with pytest.raises(wd.WorkdirInUse, match="pid 1 on another-host"):
        wd.RunLock(workdir).__enter__()
    storage.write_text(lock_path, json.dumps({**other, "heartbeat": now - 1000}))
    with wd.RunLock(workdir):
        pass
    # A holder whose lock was taken over learns it at check().
    with wd.RunLock(workdir, heartbeat_s=0.05) as lock:
        storage.write_text(lock_path, json.dumps(other))  # a new generation: not its own
        deadline = time.time() + 20
        while not lock._lost and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(wd.WorkdirInUse, match="lost its run lock"):
            lock.check()
    assert json.loads(storage.read_text(lock_path))["host"] == "another-host"  # left alone


# ----------------------------------------------------------------------------------------------
# Checkpoints and metrics.


def save_steps(workdir, steps):
    with Checkpoints(workdir, writer=True) as checkpoints:
        for step in steps:
            checkpoints.save(step, tiny_state(step))


def test_checkpoints_on_gs_are_checked_by_crc32c(gcs):
    workdir = fresh("ckpt")
    save_steps(workdir, [1, 2])
    step_dir = storage.join(workdir, "checkpoints", "2")
    sums = json.loads(storage.read_text(storage.join(step_dir, CHECKSUMS)))
    assert sums and all(d.startswith("crc32c:") for d, _ in sums.values())
    assert {n.split("/")[0] for n in sums} == {"params", "opt_state", "data"}
    for rel, (digest, size) in sums.items():  # each entry is the object's own crc32c and size
        data = storage.read_bytes(storage.join(step_dir, rel))
        assert size == len(data)
        assert (
            digest == "crc32c:" + base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
        )
    with Checkpoints(workdir) as reader:
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 2
    assert_same_state(state, tiny_state(2))

    # The largest object replaced by a truncated copy, then by same-size different bytes.
    rel = max(sums, key=lambda n: sums[n][1])
    target = storage.join(step_dir, rel)
    original = storage.read_bytes(target)
    storage.write_bytes(target, original[:-7])
    with Checkpoints(workdir) as reader, pytest.raises(CheckpointError, match="truncated") as e:
        reader.restore_latest(abstract(tiny_state(0)))
    assert str(e.value).startswith(f"checkpoint step 2: {target}: ")
    storage.write_bytes(target, bytes([original[0] ^ 1]) + original[1:])
    with Checkpoints(workdir) as reader, pytest.raises(CheckpointError, match="crc32c differs"):
        reader.restore_latest(abstract(tiny_state(0)))
    # The fallback sets the step aside in the bucket and restores the one before.
    with Checkpoints(workdir, writer=True) as checkpoints:
        state, step = checkpoints.restore_latest(abstract(tiny_state(0)), fallback=True)
    assert step == 1
    assert_same_state(state, tiny_state(1))
    assert storage.exists(storage.join(workdir, "corrupt_checkpoints", "2", CHECKSUMS))
    assert not storage.exists(step_dir)


def test_metrics_on_gs_are_rewritten_whole(gcs):
    workdir = fresh("metrics")
    path = storage.join(workdir, "metrics.jsonl")
    record = dict(loss=1.0, grad_norm=1.0, learning_rate=1e-3, tokens_per_s=1.0, eta_s=0.0)
    writer = MetricsWriter(workdir, 0, 4, flush_every_s=3600)
    for step in (1, 2, 3):
        writer.write({"step": step, "progress": step / 4, **record})
    assert storage.read_text(path) == ""  # not yet flushed (nothing can be appended)
    writer.flush()
    assert [json.loads(x)["step"] for x in storage.read_text(path).splitlines()] == [1, 2, 3]
    writer.close()
    # A run resumed from step 2 drops step 3 (about to be redone) and appends its own.
    writer = MetricsWriter(workdir, 2, 4, flush_every_s=0)
    writer.write({"step": 3, "progress": 0.75, **{**record, "loss": 0.5}})
    writer.close()
    lines = [json.loads(x) for x in storage.read_text(path).splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(1, 1.0), (2, 1.0), (3, 0.5)]
    events = storage.listdir(storage.join(workdir, "tensorboard"))
    assert len(events) == 2 and all(n.startswith("events.out.tfevents.") for n in events)


# ----------------------------------------------------------------------------------------------
# Data, tokenizer and Hugging Face directories.


def test_rows_from_gs_jsonl_and_parquet(gcs, tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a #### {i}"} for i in range(5)]
    root = fresh("data")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    storage.write_text(storage.join(root, "train.jsonl"), text)
    (tmp_path / "train.parquet").unlink(missing_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    storage.write_bytes(
        storage.join(root, "train.parquet"), (tmp_path / "train.parquet").read_bytes()
    )
    assert read_rows(storage.join(root, "train.jsonl")) == rows
    assert read_rows(storage.join(root, "train.parquet")) == rows
    storage.write_text(storage.join(root, "bad.jsonl"), text + "{oops\n")
    with pytest.raises(ValueError, match=f"^{root}/bad.jsonl:6: "):
        read_rows(storage.join(root, "bad.jsonl"))


def test_tokenizer_to_and_from_gs(gcs):
    tok = load_tokenizer(None)
    root = fresh("tokenizer")
    tok.save(root)
    assert "tokenizer.json" in storage.listdir(root)
    again = load_tokenizer(root)
    text = "What is 12 * 7? <|im_end|>"
    assert again.encode(text) == tok.encode(text)
    assert again.mask_id == tok.mask_id and again.chat_template == tok.chat_template
    with pytest.raises(NotFound, match=f"^{fresh('none')[:-9]}"):
        load_tokenizer(fresh("none"))


# ----------------------------------------------------------------------------------------------
# Training runs on a gs:// workdir.


def committed(gcs, workdir) -> list[int]:
    """Steps whose commit marker is on the server's disk (what Orbax counts on GCS)."""
    base = gcs.object_path(storage.join(workdir, "checkpoints"))
    if not base.exists():
        return []
    return sorted(int(p.name) for p in base.iterdir() if (p / "commit_success.txt").exists())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("local") / "straight")
    train.train(kill_config(), workdir)
    return workdir


@pytest.fixture(scope="module")
def gs_run(gcs, straight, tmp_path_factory):
    """A gs:// workdir trained by a process killed during the step-4 save and after logging step
    5, then run to its end; with the logs of its three runs."""
    tmp = tmp_path_factory.mktemp("gs_run")
    workdir = fresh("killed")
    step4 = gcs.object_path(storage.join(workdir, "checkpoints", "4"))
    in_flight = lambda: step4.exists() and not (step4 / "commit_success.txt").exists()  # noqa: E731
    assert run_until(workdir, tmp / "run1.log", in_flight, python_env(**gcs.env)) == -signal.SIGKILL
    assert committed(gcs, workdir) == [2]
    log2 = tmp / "run2.log"
    logged_5 = lambda: f"step 5/{KILL_STEPS} " in log2.read_text()  # noqa: E731
    assert run_until(workdir, log2, logged_5, python_env(**gcs.env)) == -signal.SIGKILL
    assert f"resuming {workdir} from its checkpoint of step 2" in log2.read_text()
    last = committed(gcs, workdir)[-1]
    log3 = tmp / "run3.log"
    assert run_until(workdir, log3, env=python_env(**gcs.env)) == 0, log3.read_text()[-3000:]
    assert f"resuming {workdir} from its checkpoint of step {last}" in log3.read_text()
    return workdir


@pytest.mark.slow
@pytest.mark.subprocess
def test_kill_9_on_a_gs_workdir_then_resume_equals_a_local_run(gs_run, straight):
    a, _, step_a = wd.load_model(gs_run)
    b, _, step_b = wd.load_model(straight)
    assert step_a == step_b == KILL_STEPS
    pa_, pb_ = flat_params(a), flat_params(b)
    assert pa_.keys() == pb_.keys()
    for key in pa_:
        assert np.array_equal(pa_[key], pb_[key]), key
    read = lambda text: [json.loads(line) for line in text.splitlines()]  # noqa: E731
    resumed = read(storage.read_text(storage.join(gs_run, "metrics.jsonl")))
    with open(os.path.join(straight, "metrics.jsonl")) as f:
        expected = read(f.read())
    assert [m["step"] for m in resumed] == list(range(1, KILL_STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in expected]
    assert not storage.exists(storage.join(gs_run, "lock"))  # released at the end


def run_program(gcs, *args, check=True):
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=python_env(**gcs.env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


EVAL_FLAGS = ["--config.eval.num_examples=4", "--config.eval.thresholds=(1.0,)"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_evaluate_generate_and_export_read_and_write_gs(gcs, gs_run, straight, tmp_path):
    """evaluate / generate / export of the gs:// run agree with the same commands on the local
    run of the same parameters; the export written to gs:// loads back."""
    for workdir in (gs_run, straight):
        run_program(
            gcs,
            "-m",
            "mars_jax.evaluate",
            "--config=configs/tiny.py:ar",
            f"--workdir={workdir}",
            *cli_flags(),
            *EVAL_FLAGS,
        )
    gs_report = json.loads(storage.read_text(storage.join(gs_run, "eval.json")))
    with open(os.path.join(straight, "eval.json")) as f:
        local_report = json.load(f)
    keys = ("accuracy", "tokens_per_forward", "mean_length")
    assert [{k: r[k] for k in keys} for r in gs_report["results"]] == [
        {k: r[k] for k in keys} for r in local_report["results"]
    ]
    assert storage.exists(storage.join(gs_run, "eval.png"))
    outputs = [
        run_program(
            gcs,
            "-m",
            "mars_jax.generate",
            f"--workdir={w}",
            "--prompt=What is 2+3?",
            "--max_new_tokens=6",
            "--json",
        ).stdout
        for w in (gs_run, straight)
    ]
    assert outputs[0] == outputs[1]
    hf = fresh("hf")
    run_program(gcs, "-m", "mars_jax.export", f"--workdir={gs_run}", f"--output={hf}")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(
        storage.listdir(hf)
    )
    from mars_jax import huggingface

    exported = flat_params(huggingface.load_hf(hf))
    model, _, _ = wd.load_model(straight)
    for key, value in flat_params(model).items():
        assert np.array_equal(exported[key], value), key


@pytest.mark.slow
def test_init_from_a_gs_hf_directory_with_gs_data(gcs, tmp_path):
    """Training from a gs:// Hugging Face directory on gs:// JSON Lines (eval: parquet) equals
    the same run from the local copies."""
    from tests.programs.test_train import make_hf_checkpoint

    local_hf = tmp_path / "hf"
    make_hf_checkpoint(local_hf)
    hf = fresh("hf_in")
    storage.copy_tree(local_hf, hf)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{i} + {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
        }
        for i in range(8)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "eval.parquet")
    data = fresh("sft")
    storage.copy_tree(tmp_path, data)
    results = []
    for base, init in ((data, hf), (str(tmp_path), str(local_hf))):
        cfg = get_config(
            "ar",
            init_from=init,
            data__source="messages",
            data__train_path=storage.join(base, "train.jsonl"),
            data__eval_path=storage.join(base, "eval.parquet"),
            train__num_steps=2,
        )
        workdir = fresh("from_hf") if base == data else str(tmp_path / "from_hf")
        results.append((train.train(cfg, workdir)["loss"], wd.load_model(workdir)[0]))
    assert results[0][0] == results[1][0]
    a, b = flat_params(results[0][1]), flat_params(results[1][1])
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.slow
@pytest.mark.subprocess
def test_server_stopped_during_a_save_then_started_again(gcs, straight, tmp_path):
    """The server goes away while the step-4 save is in flight and comes back 3 s later: no
    committed step is lost, and the run (rerun if it failed) ends as the local run did. With the
    server down, a command on the bucket fails with one line naming the bucket and the retry."""
    workdir = fresh("outage")
    step4 = gcs.object_path(storage.join(workdir, "checkpoints", "4"))
    with open(tmp_path / "run1.log", "w") as err:
        proc = subprocess.Popen(
            train_command(workdir),
            cwd=ROOT,
            env=python_env(**gcs.env),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.time() + 300
        while not (step4.exists() and not (step4 / "commit_success.txt").exists()):
            assert proc.poll() is None and time.time() < deadline, (
                tmp_path / "run1.log"
            ).read_text()
            time.sleep(0.002)
        gcs.stop()
        time.sleep(3)
        assert committed(gcs, workdir) == [2]
        gcs.start()
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Finished (the save went on once the server was back; retention then dropped step 2), or
    # failed with step 2 still committed.
    assert (
        committed(gcs, workdir)[-1] == KILL_STEPS if status == 0 else 2 in committed(gcs, workdir)
    )
    if status != 0:  # the save failed for good: the error says what to do, and doing it works
        log = (tmp_path / "run1.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert errors and errors[0].startswith("error: the object store failed a request"), log
        assert "bucket 'runs'" in errors[0] and "rerun the same command" in errors[0]
        assert run_until(workdir, tmp_path / "run2.log", env=python_env(**gcs.env)) == 0
    a, b = wd.load_model(workdir)[0], wd.load_model(straight)[0]
    pa_, pb_ = flat_params(a), flat_params(b)
    assert all(np.array_equal(pa_[k], pb_[k]) for k in pb_)

    gcs.stop()
    try:
        proc = run_program(
            gcs, "-m", "mars_jax.generate", f"--workdir={workdir}", "--prompt=hi", check=False
        )
    finally:
        gcs.start()
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: the object store failed a request"), last_line
    assert "bucket 'runs'" in last_line and "rerun the same command" in last_line


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_on_a_gs_workdir_killed_and_resumed(gcs, tmp_path):
    """2 processes x 2 CPU devices (fsdp over all 4) write their shards into one gs://
    checkpoint directory; both are killed with SIGKILL once step 2 is committed and relaunched:
    the resumed run ends with the parameters of a local one-process run (to the roundoff of
    the cross-process collectives, as in test_distributed) and with one metrics line a step."""
    from tests.base.test_distributed import (
        OVERRIDES,
        TIMEOUT_S,
        free_port,
        launch,
        max_diff,
        wait_all,
    )

    workdir = fresh("two")
    logs = tmp_path

    def launch_two(mode):
        port = free_port()
        settings = {
            **OVERRIDES,
            "distributed.coordinator_address": f"localhost:{port}",
            "distributed.num_processes": 2,
        }
        return [
            launch(
                workdir,
                logs,
                {**settings, "distributed.process_id": i},
                mode,
                devices=2,
                process_id=i,
            )
            for i in range(2)
        ]

    procs = launch_two("straight")
    deadline = time.time() + TIMEOUT_S
    try:
        while 2 not in committed(gcs, workdir):
            assert all(p.poll() is None for p in procs), [
                p.log_path.read_text()[-2000:] for p in procs
            ]
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert 3 not in committed(gcs, workdir)  # killed before the end
    procs = launch_two("straight")
    wait_all(procs, TIMEOUT_S)
    assert "resuming " in (logs / "process0.log").read_text()
    one = tmp_path / "one"
    wait_all([launch(one, logs, OVERRIDES, "straight", devices=4)], TIMEOUT_S)

    def params(run):
        model, _, step = wd.load_model(str(run))
        assert step == 3
        return flat_params(model)

    lr_sum = sum(
        json.loads(line)["learning_rate"]
        for line in (one / "metrics.jsonl").read_text().splitlines()
    )
    assert max_diff(params(workdir), params(one)) <= 1e-2 * lr_sum
    lines = storage.read_text(storage.join(workdir, "metrics.jsonl")).splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


@pytest.mark.slow
def test_stage_2_from_a_gs_run_equals_stage_2_from_the_local_run(gs_run, straight, tmp_path):
    """init_from a gs:// run (stage 1 on the bucket) continues as from the same run on disk."""
    results = []
    for init, workdir in ((gs_run, fresh("stage2")), (straight, str(tmp_path / "stage2"))):
        cfg = get_config("mars", init_from=init, train__num_steps=2)
        results.append((train.train(cfg, workdir)["loss"], flat_params(wd.load_model(workdir)[0])))
    assert results[0][0] == results[1][0]
    assert all(np.array_equal(results[0][1][k], results[1][1][k]) for k in results[1][1])


def test_a_run_copied_between_disk_and_bucket_verifies_by_its_own_digests(gcs, tmp_path):
    """A local run copied into a bucket is checked by the SHA-256 it was saved with (computed
    from the objects' bytes); a bucket's run copied to disk by its crc32c (computed locally)."""
    local = str(tmp_path / "local")
    save_steps(local, [3])
    remote = fresh("copied")
    storage.copy_tree(local, remote)
    with Checkpoints(remote) as reader:
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 3
    assert_same_state(state, tiny_state(3))

    bucket_run = fresh("saved")
    save_steps(bucket_run, [4])
    back = str(tmp_path / "back")
    storage.copy_tree(bucket_run, back)
    with Checkpoints(back) as reader:
        state, step = reader.restore_latest(abstract(tiny_state(0)))
    assert step == 4
    assert_same_state(state, tiny_state(4))
    # ... and a changed byte is still caught there.
    manifest = json.loads((tmp_path / "back" / "checkpoints" / "4" / CHECKSUMS).read_text())
    rel = max(manifest, key=lambda n: manifest[n][1])
    target = tmp_path / "back" / "checkpoints" / "4" / rel
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    with Checkpoints(back) as reader, pytest.raises(CheckpointError, match="crc32c differs"):
        reader.restore_latest(abstract(tiny_state(0)))
