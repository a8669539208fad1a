"""A run's Orbax checkpoints, ``workdir/checkpoints/<step>/{params, opt_state, data}``: atomic
and asynchronous saves of a `TrainState`, retention, and SHA-256 checksums of every file
(``sha256.json``; crc32c of objects in a ``gs://`` workdir) checked on every restore
(`CheckpointError`). Parameters are stored as nested
dicts of arrays (``nnx.to_pure_dict``, readable without this package).

`Checkpoints` is the only code that names the Orbax items.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from mars_jax import storage
from mars_jax.errors import InputError, NotFound, StorageUnavailable

# The Orbax items of a checkpoint step.
_PARAMS, _OPT_STATE, _DATA = "params", "opt_state", "data"
# The checksum manifest in each step directory: {relative path: [digest, size in bytes]}: the
# SHA-256 hex of a file saved on a local disk (as earlier versions wrote), "crc32c:<base64>" of
# an object saved in a bucket (as the store computed it; nothing is downloaded to hash it).
CHECKSUMS = "sha256.json"


class TrainState(NamedTuple):
    """What a checkpoint step holds.

    params: parameter State (leaves as in ``model.abstract_params``).
    opt_state: the optax state of ``train_step.optimizer``.
    data_position: int, index of the next training batch (``batches.batched_dataset`` element).
    """

    params: nnx.State
    opt_state: Any
    data_position: int


class CheckpointError(InputError):
    """A committed checkpoint step whose files do not match the checksums written when it was
    saved (a file truncated, overwritten or missing): ``checkpoint step S: DIR/FILE: reason``."""

    def __init__(self, step: int, path: str, reason: str):
        super().__init__(f"checkpoint step {step}: {path}: {reason}")
        self.step, self.path = step, path


def _file_problem(path: str, digest: str, size: int) -> str | None:
    """What is wrong with file ``path`` given its ``digest`` and ``size`` in bytes when saved,
    or None."""
    if not storage.exists(path):
        return "missing"
    if (now := storage.size(path)) != size:
        return f"{now} bytes, {size} when saved (truncated?)"
    expected = digest if ":" in digest else "sha256:" + digest
    kind = expected.split(":", 1)[0]  # the kind it was saved with, wherever it is now
    if storage.checksum(path, kind) != expected:
        return f"{kind} differs from the one written at save (corrupted)"
    return None


def write_checksums(step_dir: str) -> None:
    """Writes ``step_dir/sha256.json``: {path relative to ``step_dir``: [digest, bytes]} for
    every file of the Orbax items (subdirectories) of the step (`storage.checksum`: nothing is
    downloaded in an object store). Orbax's own ``commit_success.txt`` markers are left out: it
    writes the step's last one while committing, after this runs. Written whole
    (`storage.write_text`): a reader sees the old manifest or the new one."""
    sums = {}
    for rel in storage.files_under(step_dir):
        if "/" in rel and os.path.basename(rel) != "commit_success.txt":
            path = storage.join(step_dir, rel)
            digest = storage.checksum(path)
            sums[rel] = [digest.removeprefix("sha256:"), storage.size(path)]
    manifest = json.dumps(sums, indent=0, sort_keys=True)
    storage.write_text(storage.join(step_dir, CHECKSUMS), manifest, atomic=True)


class Checkpoints:
    """The Orbax checkpoints of a run, ``workdir/checkpoints/<step>``; usable as a context
    manager (closing waits for asynchronous saves).

    Each step holds the items of a `TrainState`. Saves are asynchronous and atomic: Orbax writes
    ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` once every item is
    written; a step directory that was never renamed (a killed save) is not a step (never
    restored; the same step can be saved again). Before the rename, process 0 adds
    ``sha256.json`` (`write_checksums`), and every restore checks the files of the items it
    reads against it (`CheckpointError`). In a multi-process run every process creates its
    `Checkpoints` on the same (shared) directory and calls each save and restore: Orbax writes
    each process's shards of the arrays, and process 0 the metadata and checksums.

    Retention: the newest ``max_to_keep`` steps (None: all) and every step divisible by
    ``keep_every`` (0: none) are kept; Orbax deletes the others after each save. ``writer``:
    this is the run that saves here, which also deletes the temporary directories of saves
    that never completed when it starts (never set it for a reader of a live run).
    """

    def __init__(
        self,
        workdir: str,
        *,
        max_to_keep: int | None = None,
        keep_every: int = 0,
        writer: bool = False,
    ):
        self.workdir = workdir
        policies = [ocp.checkpoint_managers.LatestN(max_to_keep)]
        if keep_every:
            policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
        self._saving: int | None = None
        self._manager = ocp.CheckpointManager(
            storage.join(storage.absolute(workdir), "checkpoints"),
            options=ocp.CheckpointManagerOptions(
                create=True,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
                cleanup_tmp_directories=writer,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._checksum_save),
            ),
        )

    def _checksum_save(self) -> None:
        """Orbax's post-finalization callback of the save of step ``self._saving`` (every
        process, in Orbax's save thread): process 0 writes the checksums into the step's
        directory, the temporary one where Orbax has not yet renamed it (Orbax 0.12 calls this
        just before the rename, so the checksums are committed with the step). In an object
        store Orbax writes the step directory itself and commits it by its last
        ``commit_success.txt``, which it writes after this returns."""
        if jax.process_index() != 0:
            return
        base = str(self._manager.directory)
        prefix = f"{self._saving}.orbax-checkpoint-tmp"
        pending = [n for n in storage.listdir(base) if n.startswith(prefix)]
        pending = [storage.join(base, n) for n in pending]
        write_checksums(
            max(pending, key=os.path.getmtime) if pending else storage.join(base, str(self._saving))
        )

    def verify(self, step: int, items: tuple[str, ...] = (_PARAMS, _OPT_STATE, _DATA)) -> None:
        """Checks the files of ``items`` of committed ``step`` against its ``sha256.json``: the
        manifest exists and lists every file of each item (no more, no fewer), and each file has
        its size and SHA-256. Raises `CheckpointError` naming the step and the first bad file
        (missing, truncated, changed, or not in the manifest) or the manifest (missing,
        unreadable, without an item). Each process hashes its share of the files; all raise
        together."""
        step_dir = storage.join(str(self._manager.directory), str(step))
        manifest = storage.join(step_dir, CHECKSUMS)
        try:
            sums = json.loads(storage.read_text(manifest))
        except FileNotFoundError as e:
            raise CheckpointError(
                step,
                manifest,
                "missing: the step cannot be verified (a damaged step, or one "
                "saved by a mars-jax without checksums)",
            ) from e
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(step, manifest, f"unreadable checksums ({e})") from e
        if not isinstance(sums, dict):
            raise CheckpointError(step, manifest, "not a JSON object of checksums")
        # Manifests list paths with "/" (earlier local ones with os.sep, the same on POSIX).
        names = sorted(n for n in sums if n.split("/")[0] in items)
        for item in items:
            if not any(n.split("/")[0] == item for n in names):
                raise CheckpointError(step, manifest, f"lists no file of item {item!r}")
        for item in items:
            for rel in storage.files_under(storage.join(step_dir, item)):
                rel = f"{item}/{rel}"
                if os.path.basename(rel) != "commit_success.txt" and rel not in sums:
                    raise CheckpointError(step, storage.join(step_dir, rel), f"not in {CHECKSUMS}")
        first, reason = len(names), "failed its check on another process"
        for i in range(jax.process_index(), len(names), jax.process_count()):
            reason = _file_problem(storage.join(step_dir, names[i]), *sums[names[i]])
            if reason:
                first = i
                break
        if jax.process_count() > 1:  # the first bad file of any process, on every process
            mine, first = first, int(np.min(multihost_utils.process_allgather(np.int32(first))))
            reason = reason if first == mine else "failed its check on another process"
        if first < len(names):
            raise CheckpointError(step, storage.join(step_dir, names[first]), reason)

    def restore_latest(self, abstract: TrainState, *, fallback: bool = False):
        """The newest committed step restored as in `restore`: returns (TrainState, step), or
        (None, None) without checkpoints.

        A step that fails `verify` raises its `CheckpointError`, unless ``fallback``: then it
        is logged as a warning, moved to ``workdir/corrupt_checkpoints/<step>`` (so that the
        step can be saved again) and the previous committed step is tried. The error of the
        oldest step is raised in any case.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        for i, step in enumerate(steps):
            try:
                return self.restore(step, abstract), step
            except CheckpointError as e:
                if not fallback or i + 1 == len(steps):
                    raise
                logging.warning("%s; moving it aside and restoring step %d", e, steps[i + 1])
                self._set_aside(step)
        return None, None

    def _set_aside(self, step: int) -> None:
        """Moves step directory ``step`` to ``workdir/corrupt_checkpoints/<step>`` (process 0;
        every process waits for it) and rereads the steps."""
        if jax.process_index() == 0:
            target = storage.join(self.workdir, "corrupt_checkpoints", str(step))
            if storage.exists(target):  # set aside before: keep both
                target += f".{time.time_ns()}"
            storage.move_tree(storage.join(str(self._manager.directory), str(step)), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"mars_jax checkpoint {step} set aside")
        self._manager.reload()

    def latest_step(self) -> int | None:
        """The newest saved step, or None."""
        return self._manager.latest_step()

    @contextlib.contextmanager
    def _writing(self):
        """Turns a write that the object store failed (`storage.unreachable`) into
        `StorageUnavailable` (the bucket, and that rerunning resumes from the last committed
        step); other errors pass unchanged."""
        try:
            yield
        except Exception as e:
            directory = str(self._manager.directory)
            if not (storage.is_remote(directory) and storage.unreachable(e)):
                raise
            raise StorageUnavailable(storage.unreachable_message([directory], e)) from e

    def save(self, step: int, state: TrainState) -> None:
        """Starts writing ``state`` as checkpoint ``step`` (returns before the write ends)."""
        with self._writing():
            self._save(step, state)

    def _save(self, step: int, state: TrainState) -> None:
        self._manager.wait_until_finished()  # `_checksum_save` reads self._saving
        self._saving = step
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _PARAMS: ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
                    _OPT_STATE: ocp.args.StandardSave(state.opt_state),
                    _DATA: ocp.args.JsonSave({"next_batch": int(state.data_position)}),
                }
            ),
            force=True,
        )

    def restore(self, step: int, abstract: TrainState) -> TrainState:
        """Checkpoint ``step`` restored into the structure and shardings of ``abstract`` (its
        params and opt_state are trees of ``jax.ShapeDtypeStruct``; its data_position is
        ignored). Raises `CheckpointError` if its files fail `verify`."""
        self.verify(step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _PARAMS: ocp.args.StandardRestore(nnx.to_pure_dict(abstract.params)),
                    _OPT_STATE: ocp.args.StandardRestore(abstract.opt_state),
                    _DATA: ocp.args.JsonRestore(),
                }
            ),
        )
        return TrainState(
            _fill(abstract.params, restored[_PARAMS]),
            restored[_OPT_STATE],
            int(restored[_DATA]["next_batch"]),
        )

    def restore_params(self, abstract: nnx.State, step: int | None = None):
        """The parameters of checkpoint ``step`` (default: the latest) in ``abstract``'s
        structure and shardings. Returns (State, step). Raises FileNotFoundError without
        checkpoints or for a ``step`` that was not saved (naming the saved ones),
        `CheckpointError` if the parameter files fail `verify`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise NotFound(f"no checkpoint in {self._manager.directory}")
        if step not in (saved := list(self._manager.all_steps())):
            raise NotFound(
                f"no checkpoint step {step} in {self._manager.directory} (saved steps: "
                f"{', '.join(map(str, sorted(saved)))})"
            )
        self.verify(step, (_PARAMS,))
        target = nnx.to_pure_dict(abstract)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_PARAMS: ocp.args.StandardRestore(target)})
        )
        return _fill(abstract, restored[_PARAMS]), step

    def reached_preemption(self, step: int) -> bool:
        """Whether every process of a multi-process run has agreed to stop after ``step``
        because one of them got SIGTERM (Orbax's check of JAX's preemption sync service, which
        `jax.distributed.initialize` starts; all processes reach the same answer at the same
        step). Always False in a single-process run."""
        return self._manager.reached_preemption(step)

    def wait_until_finished(self) -> None:
        """Blocks until every started save is on disk."""
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        with self._writing():
            self._manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fill(abstract: nnx.State, pure: dict) -> nnx.State:
    """A copy of ``abstract`` with the arrays of the pure dict ``pure``."""
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, pure)
    return state
