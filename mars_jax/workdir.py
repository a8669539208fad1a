"""A run's working directory: the layout of its files, the run config, model config and vocabulary
map files, the run lock, and loading the trained model.

Layout of ``workdir``:
  config.json       the run config (ml_collections ConfigDict as JSON)
  model.json        the `ModelConfig` of the checkpoints
  tokenizer/        the tokenizer files (transformers-loadable, with <|mask|>)
  vocab_map.json    only in a trimmed run (data.trim_vocab): the Qwen2.5 id of each model
                    row (`mars_jax.vocab.VocabMap`)
  checkpoints/<step>/{params, opt_state, data}   Orbax checkpoints (atomic, written
                    asynchronously): parameters as nested dicts of arrays (``nnx.to_pure_dict``,
                    readable without this package), the optax state, and the data position;
                    plus sha256.json, the SHA-256 and size of every file of those items
  corrupt_checkpoints/<step>   a step that failed its checksums, moved aside by a fallback
  lock              the run lock of the training process (`RunLock`)
  tensorboard/      TensorBoard event files of the training metrics (`mars_jax.metrics`)
  metrics.jsonl     one JSON object per logged training step (`mars_jax.metrics`)
  eval.json         the latest evaluation (`mars_jax.evaluate`)
  eval/step_<step>_<UTC time>.json   every evaluation, one file each, never overwritten

The checkpoints themselves are `mars_jax.checkpoints`. ``workdir`` may be a local path or a
``gs://`` URL (`mars_jax.storage`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import threading
import time

from absl import logging
from flax import nnx
from jax.sharding import Mesh

from mars_jax import sharding, storage, vocab
from mars_jax.checkpoints import Checkpoints
from mars_jax.errors import InputError, NotFound
from mars_jax.model import ModelConfig, abstract_params
from mars_jax.tokenizer import Tokenizer, load_tokenizer


def is_workdir(path: str) -> bool:
    """Whether ``path`` is a mars-jax run directory (has model.json)."""
    return storage.exists(storage.join(path, "model.json"))


def write_run_files(workdir: str, run_config_json: str, cfg: ModelConfig, tok: Tokenizer) -> None:
    """Writes config.json, model.json and tokenizer/ into ``workdir`` (created if missing)."""
    storage.makedirs(workdir)
    storage.write_text(storage.join(workdir, "config.json"), run_config_json)
    model = json.dumps(dataclasses.asdict(cfg), indent=2)
    storage.write_text(storage.join(workdir, "model.json"), model)
    tok.save(storage.join(workdir, "tokenizer"))


VOCAB_MAP = "vocab_map.json"


def write_vocab_map(workdir: str, vocab_map: vocab.VocabMap) -> None:
    """Writes the id map of a trimmed run to ``workdir/vocab_map.json``."""
    storage.makedirs(workdir)
    vocab_map.save(storage.join(workdir, VOCAB_MAP))


def read_vocab_map(workdir: str) -> vocab.VocabMap | None:
    """The id map of the run in ``workdir``, or None for an untrimmed run (no vocab_map.json).
    Raises ValueError for a malformed file, or one whose id count is not the embedding rows of
    ``workdir/model.json`` (where that exists): model id m would be read as another token."""
    path = storage.join(workdir, VOCAB_MAP)
    if not storage.exists(path):
        return None
    vocab_map = vocab.VocabMap.load(path)
    if storage.exists(storage.join(workdir, "model.json")):
        rows = read_model_config(workdir).vocab_size
        if len(vocab_map) != rows:
            raise InputError(
                f"{path}: {len(vocab_map)} ids, but the model (model.json) has {rows} embedding "
                "rows: the map is not this run's"
            )
    return vocab_map


def _check_vocab(workdir: str, vocab_map: vocab.VocabMap | None, tok: Tokenizer, rows: int) -> None:
    """Raises ValueError when a run's model ids cannot be read as tokens: a run trained with
    ``data.trim_vocab`` (config.json) but without vocab_map.json (its ids would be read as
    Qwen ids: garbage text), or a map whose ids lie past the tokenizer's."""
    path = storage.join(workdir, VOCAB_MAP)
    if vocab_map is None:
        config = storage.join(workdir, "config.json")
        trimmed = False
        if storage.exists(config):
            trimmed = bool(read_run_config(workdir).get("data", {}).get("trim_vocab", False))
        if trimmed:
            raise InputError(
                f"{path} not found: {workdir} was trained with data.trim_vocab=True ({rows} "
                "embedding rows), and its model ids mean nothing without the map"
            )
    elif int(vocab_map.ids[-1]) >= len(tok):
        raise InputError(
            f"{path}: id {int(vocab_map.ids[-1])} lies past the tokenizer's {len(tok)} ids"
        )


# Keys that may differ when a run is resumed: they do not change what is computed. The
# distributed keys differ between the processes of one run (config.json holds process 0's), and
# a run may resume on another number of processes: global batches do not depend on it.
_RESUMABLE_CHANGES = (
    "train.allow_partial_init",
    "train.log_every",
    "train.save_every",
    "train.max_to_keep",
    "train.keep_every",
    "train.restore_fallback",
    "train.max_consecutive_skips",
    "train.stop_at",
    "distributed.coordinator_address",
    "distributed.num_processes",
    "distributed.process_id",
)
# Sections that only configure other commands: eval is read by `mars_jax.evaluate`, and
# `two_stage.sh` passes the same flags to training and evaluation.
_RESUMABLE_SECTIONS = ("eval.",)
# Keys added to the config schema since runs were first saved, with the value that runs saved
# before them had: such a run resumes as it was.
_ADDED_KEYS = {"data.packing": False, "train.schedule": "linear", "train.stop_at": 0}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_run_config(workdir: str) -> dict:
    """``workdir/config.json`` as a dict. Raises FileNotFoundError if it is missing."""
    path = storage.join(workdir, "config.json")
    if not storage.exists(path):
        raise NotFound(f"{path} not found: {workdir} holds no run config")
    return json.loads(storage.read_text(path))


def check_same_run(workdir: str, run_config_json: str) -> None:
    """Before resuming: raises ValueError if ``workdir/config.json`` differs from the new run
    config in any key but logging/saving cadence and the distributed launch (a different batch
    size, schedule, objective, model or data would silently mix two runs). The message lists
    the differing keys."""
    saved = {**_ADDED_KEYS, **_flatten(read_run_config(workdir))}
    new = _flatten(json.loads(run_config_json))
    diff = [
        f"{k}: {saved.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(saved.keys() | new.keys())
        if saved.get(k) != new.get(k)
        and k not in _RESUMABLE_CHANGES
        and not k.startswith(_RESUMABLE_SECTIONS)
    ]
    if diff:
        raise InputError(
            f"{workdir} holds a run with another config ({'; '.join(diff)}): resume it with its "
            "own config, or start the new run in a new workdir"
        )


COMPLETE, INIT_FROM = "complete.json", "init_from.json"


def mark_complete(workdir: str, step: int) -> None:
    """Records that the run in ``workdir`` reached its final step (``step``)."""
    storage.write_text(storage.join(workdir, COMPLETE), json.dumps({"step": int(step)}) + "\n")


def is_complete(workdir: str) -> bool:
    """Whether the run in ``workdir`` reached its final step: `mark_complete`'s record, or for a
    run written before it, a last metrics.jsonl record at progress 1."""
    if storage.exists(storage.join(workdir, COMPLETE)):
        return True
    metrics = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(metrics):
        return False
    lines = storage.read_text(metrics).splitlines()
    try:
        return bool(lines) and json.loads(lines[-1]).get("progress") == 1.0
    except ValueError:
        return False


def write_init_record(workdir: str, init_from: str, step: int) -> None:
    """Records which run and step a fresh run in ``workdir`` was initialised from."""
    record = {"init_from": init_from, "step": int(step)}
    storage.write_text(storage.join(workdir, INIT_FROM), json.dumps(record) + "\n")


def read_init_record(workdir: str) -> dict | None:
    """`write_init_record`'s record, or None."""
    path = storage.join(workdir, INIT_FROM)
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def trained_block_size(workdir: str) -> int:
    """The ``objective.block_size`` the run in ``workdir`` was trained with."""
    return int(read_run_config(workdir)["objective"]["block_size"])


def sharding_rules(workdir: str) -> sharding.Rules:
    """The logical-axis rules of the run in ``workdir`` (its ``mesh.rules``).

    Raises ValueError for a run written before the rules were part of the config (its
    checkpoints also store the decoder layers unstacked, which this version cannot restore).
    """
    mesh = read_run_config(workdir)["mesh"]
    if "rules" not in mesh:
        raise InputError(
            f"{workdir} was written by an earlier mars-jax (no mesh.rules; decoder layers saved "
            "one by one): export it with that version and start from the export (init_from)"
        )
    return sharding.logical_rules(mesh["rules"])


def read_model_config(workdir: str, **overrides) -> ModelConfig:
    """The `ModelConfig` saved in ``workdir/model.json``, with field ``overrides`` (e.g. dtype)."""
    path = storage.join(workdir, "model.json")
    if not storage.exists(path):
        raise NotFound(f"{path} not found: {workdir} is not a mars-jax run directory")
    return dataclasses.replace(ModelConfig(**json.loads(storage.read_text(path))), **overrides)


class WorkdirInUse(InputError):
    """Another process holds ``workdir``'s run lock (`RunLock`)."""


class RunLock(contextlib.AbstractContextManager):
    """The run lock of ``workdir``, held by the process that trains there (process 0 of a
    multi-process run), so that a second training process on the same directory (a job
    restarted while the first one still saves, a command run twice) stops with `WorkdirInUse`
    instead of interleaving steps and deleting the other's pending save. ``workdir/lock`` names
    the holder (pid, host, start time).

    On a local disk: an exclusive ``flock``, released by the operating system when its process
    ends, however it ends (``kill -9`` included), so it is never stale (``flock`` may not exclude
    processes on other hosts of a network filesystem).

    In an object store (``gs://``): an object created only if absent (a generation
    precondition: of two processes, one wins). The holder rewrites it every ``heartbeat_s``
    seconds (only if it is still its own) and deletes it on exit. A lock left by a killed
    process is stale, and taken over, once its heartbeat is ``stale_after_s`` old, or at once if
    it names a process of this host that no longer runs. A holder whose lock was taken over
    (its heartbeat stalled that long) learns it at `check`, which the run calls before each
    save.
    """

    def __init__(self, workdir: str, *, heartbeat_s: float = 30.0, stale_after_s: float = 120.0):
        self.workdir = workdir
        self.path = storage.join(workdir, "lock")
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._file = None
        self._generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    def _holder(self) -> dict:
        return {
            **_process_identity(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "heartbeat": time.time(),
        }

    def _in_use(self, holder: str) -> WorkdirInUse:
        return WorkdirInUse(
            f"{self.workdir} is in use by another training process ({holder}); wait for it "
            "to end or stop it, or train in another workdir"
        )

    def __enter__(self) -> "RunLock":
        if storage.is_remote(self.path):
            self._acquire_object()
            return self
        os.makedirs(self.workdir, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown process"
            f.close()
            raise self._in_use(holder) from None
        f.truncate(0)
        h = self._holder()
        f.write(f"pid {h['pid']} on {h['host']} since {h['since']}\n")
        f.flush()
        self._file = f
        return self

    def _acquire_object(self) -> None:
        self._holder_record = self._holder()
        record = json.dumps(self._holder_record)
        for _ in range(3):  # the lock changing hands meanwhile: race again, at most 3 times
            try:
                self._generation = storage.create_new(self.path, record)
                break
            except FileExistsError:
                found = storage.read_with_generation(self.path)
                if found is None:
                    continue  # released meanwhile
                text, generation = found
                why = self._stale(text)
                if why is None:
                    raise self._in_use(_describe_holder(text)) from None
                try:  # replaced only if still the stale one: one of two racers wins
                    self._generation = storage.replace_if_unchanged(self.path, record, generation)
                except FileExistsError:
                    continue
                logging.warning("%s: took over a stale run lock (%s)", self.path, why)
                break
        else:
            raise self._in_use("the lock kept changing hands")
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._thread.start()

    def _stale(self, text: str) -> str | None:
        """Why the lock object holding ``text`` is stale, or None if it is live."""
        try:
            holder = json.loads(text)
            age = time.time() - float(holder["heartbeat"])
            pid = int(holder["pid"])
        except (ValueError, KeyError, TypeError):
            return "unreadable"
        if age > self.stale_after_s:  # hosts' clocks are assumed synchronized well within it
            return f"no heartbeat for {age:.0f} s"
        # Only where the holder's pid means the same process here: same host, same boot, same
        # pid namespace (containers sharing a host name have their own); then it is gone if
        # that pid no longer runs, or runs a process started at another time.
        here = _process_identity(pid)
        same = ("host", "boot_id", "pid_namespace")
        if all(holder.get(k) == here[k] is not None for k in same):
            if here["start"] is None or holder.get("start") != here["start"]:
                return f"pid {pid} no longer runs on {holder['host']}"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._holder_record["heartbeat"] = time.time()
            try:
                self._generation = storage.replace_if_unchanged(
                    self.path, json.dumps(self._holder_record), self._generation
                )
            except FileExistsError:
                self._lost = "another process took the lock over"
                return
            except Exception as e:  # noqa: BLE001 (a failed request: retried at the next beat)
                logging.warning("%s: run lock heartbeat failed: %s", self.path, e)

    def check(self) -> None:
        """Raises `WorkdirInUse` if this process no longer holds the lock."""
        if self._lost:
            raise self._in_use(f"this process lost its run lock: {self._lost}")

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(15)  # a heartbeat stuck retrying is a daemon: not waited for
            self._thread = None
            if not self._lost:
                try:  # best effort: a lock left behind goes stale; never hide the real error
                    storage.delete_if_unchanged(self.path, self._generation, patient=False)
                except Exception as e:  # noqa: BLE001
                    logging.warning("%s: run lock not removed (%s); it goes stale", self.path, e)


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']} since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "unknown process"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _process_identity(pid: int) -> dict:
    """Who process ``pid`` is here: host name, kernel boot id and pid namespace (Linux; None
    elsewhere), and its start time in clock ticks since boot (None if it does not run)."""
    stat = _read(f"/proc/{pid}/stat")
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = None
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": (_read("/proc/sys/kernel/random/boot_id") or "").strip() or None,
        "pid_namespace": namespace,
        # Field 22 of /proc/<pid>/stat, counted after the parenthesized command name.
        "start": int(stat.rsplit(")", 1)[1].split()[19]) if stat else None,
    }


def load_model(workdir: str, *, mesh: Mesh | None = None, step: int | None = None, **overrides):
    """Rebuilds the trained model of ``workdir``: returns (Qwen2, Tokenizer, step). For a
    trimmed run the tokenizer is a `vocab.MappedTokenizer` (model ids in and out).

    ``overrides`` replace `ModelConfig` fields (e.g. ``dtype="bfloat16"``); ``mesh`` defaults to
    all devices on the data axis; parameters are placed by the run's ``mesh.rules``. The
    training execution settings are not kept: attention is "xla" (the decoder's cached forwards
    are dense anyway, and a run trained with TPU splash attention is read on any device) and
    remat "none", unless overridden.
    Raises FileNotFoundError for a directory that is not a run or has no checkpoint.
    """
    cfg = read_model_config(workdir, **{"attention": "xla", "remat": "none", **overrides})
    graphdef, abstract = abstract_params(cfg, mesh or sharding.make_mesh(), sharding_rules(workdir))
    with Checkpoints(workdir) as checkpoints:
        params, step = checkpoints.restore_params(abstract, step)
    tok = load_tokenizer(storage.join(workdir, "tokenizer"))
    vocab_map = read_vocab_map(workdir)
    _check_vocab(workdir, vocab_map, tok, cfg.vocab_size)
    if vocab_map is not None:
        tok = vocab.MappedTokenizer(tok, vocab_map)
    return nnx.merge(graphdef, params), tok, step
