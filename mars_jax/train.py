r"""Training runs: stage 1 (AR SFT) and stage 2 (MARS), arXiv 2604.07023 Sec. 4.

  python -m mars_jax.train --config=configs/tiny.py --workdir=runs/ar
  python -m mars_jax.train --config=configs/tiny.py:mars --workdir=runs/mars \
      --config.init_from=runs/ar

From Python: ``train.train(config, workdir)`` with a ``ConfigDict`` (e.g.
``configs.tiny.get_config("mars")``).

A restart with the same workdir resumes from its latest committed checkpoint (parameters,
optimizer state and data position), also after a hard kill (see `checkpoints.Checkpoints`); a
checkpoint whose files fail their checksums stops the run, or with ``train.restore_fallback``
is set aside for the previous one. ``init_from`` starts a fresh run from a Hugging Face
directory or from the latest checkpoint of another run's workdir (stage 2 from stage 1).

Preemption: SIGTERM (a TPU VM's or a scheduler's notice) or SIGINT (Ctrl-C) stops the run after
the step in progress: it saves that step (as a regular save), waits for the write, logs which
step it saved and returns (the program exits 0 after SIGTERM, 130 after Ctrl-C, so that a
pipeline such as launch/two_stage.sh stops); the same command resumes it. A second signal
exits at once. A run that reached its final step is marked complete (`workdir.mark_complete`);
stage 2 refuses an ``init_from`` run that is not, and a resumed stage 2 whose ``init_from``
run moved on since it started (`check_init_from`, unless ``train.allow_partial_init``). In a multi-process run, SIGTERM goes through JAX's preemption sync service so
that all processes stop and save at the same step (see `Preemption`). This module holds the run
loop; the jitted step is `mars_jax.train_step`, the run directory `mars_jax.workdir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from mars_jax import (
    cli,
    config,
    distributed,
    platforms,
    sharding,
    train_step,
)
from mars_jax import (
    workdir as wd,
)
from mars_jax.checkpoints import Checkpoints, TrainState
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.metrics import MetricsWriter
from mars_jax.model import (
    abstract_params,
)
from mars_jax.train_inputs import (
    RunData,
    check_init_from,
    initial_params,
    run_data,
    train_dataset,
)


@platforms.releases_host_memory
def train(cfg, workdir: str) -> dict:
    """Runs (or resumes) training of run config ``cfg`` in ``workdir``; returns the last logged
    metrics record (empty if the run was already complete).

    In a multi-process run (see `mars_jax.distributed`) every process calls this with the same
    config (but its own ``distributed.process_id``) and workdir, on a filesystem they share;
    each feeds its rows of every batch, all take part in each checkpoint save and restore, and
    only process 0 writes the run files, metrics.jsonl and INFO logs.

    Settings are checked first (`config.validate`, then `config.check_devices`): a bad one
    raises `errors.SettingError` (a ValueError) or `errors.MissingPath` (a
    FileNotFoundError) naming the key, before any data is read or anything compiled.

    Raises ValueError for a bad config (see `sharding`, `distributed.initialize`) or a resume
    with another config, `workdir.WorkdirInUse` (a ValueError) while another process trains in
    ``workdir``,
    `checkpoints.CheckpointError` (a ValueError) for a corrupted checkpoint (without
    ``train.restore_fallback``), FileNotFoundError for a missing ``init_from`` or data file,
    FloatingPointError after ``train.max_consecutive_skips`` steps in a row with
    a non-finite loss or gradient norm (`SkippedSteps`).
    """
    config.validate(cfg, training=True)
    distributed.initialize(cfg.distributed)
    # Signals are caught from here on, so that one during the setup stops the run after its
    # first step; the workdir's run lock, taken in _train, is released on the way out. Training
    # runs in 32 bits even where JAX_ENABLE_X64 is set (optax would compute its schedule and
    # bias corrections in float64: every update a last bit off the same run without it).
    with contextlib.ExitStack() as stack, Preemption() as preemption, jax.enable_x64(False):
        return _train(cfg, workdir, preemption, stack)


def _restore_or_start(cfg, workdir, data: RunData, step, checkpoints, init) -> tuple:
    """(`TrainState`, its step): the workdir's latest checkpoint (the same run's: its config
    checked), or a fresh state of ``init()`` (params, opt_state) at step 0, the run files
    written."""
    run_config = cfg.to_json_best_effort(indent=2)
    if checkpoints.latest_step() is not None:
        wd.check_same_run(workdir, run_config)
    abstract = TrainState(step.abstract_params, step.abstract_opt_state, 0)
    state, start = checkpoints.restore_latest(abstract, fallback=cfg.train.restore_fallback)
    if start is not None:
        logging.info("resuming %s from its checkpoint of step %d", workdir, start)
        return state, start
    logging.info("no checkpoint in %s: starting a fresh run", workdir)
    params, opt_state = init()
    if distributed.is_primary():
        wd.write_run_files(workdir, run_config, data.model_cfg, data.tok)
        if data.vocab_map is not None:
            wd.write_vocab_map(workdir, data.vocab_map)
        if cfg.init_from and wd.is_workdir(cfg.init_from):
            with Checkpoints(cfg.init_from) as init_checkpoints:
                init_step = init_checkpoints.latest_step()
            wd.write_init_record(workdir, cfg.init_from, init_step)
    return TrainState(params, opt_state, data_position=0), 0


def _train(cfg, workdir: str, preemption: "Preemption", stack: contextlib.ExitStack) -> dict:
    """`train` after the settings checks, with ``preemption``'s signal handlers installed; the
    run lock goes on ``stack``."""
    check_init_from(cfg, workdir)
    data = run_data(cfg, workdir)
    t, num_steps = cfg.train, data.num_steps
    obj = train_step.objective_settings(cfg, data.tok.mask_id, data.units)
    mesh, rules = sharding.mesh_from_config(cfg.mesh)
    graphdef, abstract = abstract_params(data.model_cfg, mesh, rules)
    tx, schedule = train_step.optimizer(cfg, num_steps)
    step = train_step.build_train_step(cfg, graphdef, abstract, obj, tx, mesh, rules)
    lock = None
    if distributed.is_primary():  # one training process per workdir (workdir.WorkdirInUse)
        lock = stack.enter_context(wd.RunLock(workdir))
    checkpoints = Checkpoints(
        workdir, max_to_keep=t.max_to_keep, keep_every=t.keep_every, writer=True
    )

    def init():
        params = initial_params(cfg, data.model_cfg, abstract, mesh, rules)
        return params, jax.jit(tx.init, out_shardings=step.opt_state_shardings)(params)

    state, start = _restore_or_start(cfg, workdir, data, step, checkpoints, init)
    if start >= num_steps:
        logging.info("%s is already at step %d of %d: nothing to do", workdir, start, num_steps)
    else:
        logging.info(
            "training %s from step %d to %d (%d %s, batch %d, loss at <= %d positions/row)",
            cfg.objective.name,
            start,
            num_steps,
            len(data.units),
            "packed sequences" if cfg.data.packing else "examples",
            t.batch_size,
            obj.max_label_tokens,
        )
    metrics = MetricsWriter(workdir, start, num_steps, primary=distributed.is_primary())
    params, opt_state, position = state
    preemption.checkpoints = checkpoints
    trainer = Trainer(
        cfg=cfg,
        workdir=workdir,
        step=step,
        schedule=schedule,
        dataset=train_dataset(cfg, data, step, obj),
        checkpoints=checkpoints,
        metrics=metrics,
        preemption=preemption,
        lock=lock,
        params=params,
        opt_state=opt_state,
        position=position,
    )
    last = trainer.run(start, num_steps)
    del trainer  # the last step's parameters and optimizer state: freed before the closes
    checkpoints.close()
    metrics.close()
    return last


@dataclasses.dataclass(kw_only=True)
class Trainer:
    """Steps ``start`` .. ``num_steps`` of `train` (`run`), saving every ``train.save_every``, at
    the end, and at a preemption (then returning early); holds the loop's state: the run's
    parts, the `checkpoints.TrainState` (``params``, ``opt_state``, data ``position``) and, in
    `run`, the skip count and the throughput window of the next metrics record.

    A step with a non-finite loss or gradient norm leaves the parameters and optimizer state as
    they were (`train_step.make_train_step`); `SkippedSteps` counts it and logs its batch's
    rows. A skip never writes non-finite values into the parameters: a checkpoint after skipped
    steps holds those of the last applied update. `run` raises FloatingPointError after
    ``train.max_consecutive_skips`` skips in a row, once saves in flight are written.
    """

    cfg: Any
    workdir: str
    step: train_step.TrainStep
    schedule: optax.Schedule
    dataset: Any  # grain.MapDataset of batches (`batches.batched_dataset`)
    checkpoints: Checkpoints
    metrics: MetricsWriter
    preemption: Preemption
    lock: wd.RunLock | None
    params: Any
    opt_state: Any
    position: int
    # Set by `run`: its steps, the skip count, the metrics record and the throughput window.
    start: int = dataclasses.field(init=False, default=0)
    num_steps: int = dataclasses.field(init=False, default=0)
    skips: SkippedSteps = dataclasses.field(init=False)
    last: dict = dataclasses.field(init=False, default_factory=dict)
    t0: float = dataclasses.field(init=False, default=0.0)
    tokens: Any = dataclasses.field(init=False, default=0)  # then a device int32 scalar
    window_start: float = dataclasses.field(init=False, default=0.0)

    def run(self, start: int, num_steps: int) -> dict:
        """Steps ``start`` .. ``num_steps``; returns the last logged metrics record (with
        ``stopped_by`` after a preemption). A run that reaches ``num_steps`` is marked complete.
        """
        self.start, self.num_steps = start, num_steps
        skipped_before = start - _applied_updates(self.opt_state)
        self.skips = SkippedSteps(self.cfg.train.max_consecutive_skips, total=skipped_before)
        self.last, self.t0, self.tokens, self.window_start = {}, time.time(), 0, time.time()
        stop_at = self.cfg.train.stop_at
        if 0 < stop_at <= start < num_steps:
            logging.info(
                "%s is at step %d, train.stop_at=%d: nothing to do", self.workdir, start, stop_at
            )
            return {"stopped_by": "stop_at"}
        try:
            for i in range(start, num_steps):
                done = self._step(i)
                saved = done % self.cfg.train.save_every == 0 or done == num_steps
                if saved or done == stop_at:
                    self._save(done)
                if done < num_steps and done == stop_at:
                    self._stop_at(done)
                    break
                if done < num_steps and self._stop_for_preemption(done, saved):
                    break
            else:
                self.checkpoints.wait_until_finished()
                if distributed.is_primary():
                    wd.mark_complete(self.workdir, num_steps)
        except FloatingPointError:
            self.checkpoints.wait_until_finished()  # the last checkpoint is complete, and finite
            raise
        return self.last

    def _step(self, i: int) -> int:
        """Runs step ``i`` (0-based) on the batch at ``position``, logging it when due (every
        ``train.log_every`` and the last); returns the number of steps done."""
        t = self.cfg.train
        local = self.dataset[self.position]
        row_ids = local.pop("row_ids")  # host-side only, not a step input
        batch = distributed.global_batch(local, self.step.batch_sharding, t.batch_size)
        self.position += 1
        self.tokens = self.tokens + _batch_tokens(batch)
        self.params, self.opt_state, values = self.step.fn(self.params, self.opt_state, batch)
        done = i + 1
        self.skips.add(done, values["skipped"], row_ids)
        if done % t.log_every == 0 or done == self.num_steps:
            self._log(done, values)
        elif done == self.start + 1:  # a sign of life before the first record
            logging.info(
                "step %d done (%.0f s since the start, compilation included); metrics every %d "
                "steps",
                done,
                time.time() - self.t0,
                t.log_every,
            )
        return done

    def _log(self, done: int, values: dict) -> None:
        """Writes the metrics record of step ``done`` (its step ``values`` with the skip count,
        learning rate, throughput since the last record, progress and ETA) and keeps it."""
        self.skips.check()
        now = time.time()
        values = jax.device_get(values)
        # The rate of this step's update, or of the update it would have made if skipped.
        updates = _applied_updates(self.opt_state)
        self.last = {
            "step": done,
            **{k: float(v) for k, v in values.items()},
            "skipped_steps": self.skips.total,
            "learning_rate": float(self.schedule(updates - 1 + values["skipped"])),
            "tokens_per_s": int(self.tokens) / (now - self.window_start),
            "progress": done / self.num_steps,
            "eta_s": (self.num_steps - done) / ((done - self.start) / (now - self.t0)),
        }
        self.tokens, self.window_start = 0, now
        self.metrics.write(self.last)

    def _save(self, done: int) -> None:
        """Saves step ``done`` (asynchronously), after reading its skip flag (a FloatingPointError
        saves nothing) and `_before_save`."""
        self.skips.check()
        _before_save(self.lock, self.metrics)
        self.checkpoints.save(done, TrainState(self.params, self.opt_state, self.position))

    def _stop_at(self, done: int) -> None:
        """Ends the run at ``train.stop_at`` (step ``done``, saved): waits for the write."""
        self.checkpoints.wait_until_finished()
        logging.info(
            "stopped at train.stop_at=%d of %d: saved in %s; rerun with a later stop_at (or 0) "
            "to go on",
            done,
            self.num_steps,
            self.workdir,
        )
        self.last = {**self.last, "stopped_by": "stop_at"}

    def _stop_for_preemption(self, done: int, saved: bool) -> bool:
        """Whether a stop request (`Preemption.stop`) ends the run after step ``done``; if so,
        saves that step (unless ``saved`` already), waits for the write and logs it."""
        if not self.preemption.stop(done):
            return False
        self.skips.check()
        if not saved:
            self._save(done)
        self.checkpoints.wait_until_finished()
        logging.info(
            "stopped by %s: saved step %d of %d in %s; rerun the same command to resume",
            self.preemption.reason,
            done,
            self.num_steps,
            self.workdir,
        )
        self.last = {**self.last, "stopped_by": self.preemption.reason}
        return True


class SkippedSteps:
    """Counts a run's skipped steps (non-finite loss or gradient norm): ``total`` and
    ``consecutive``.

    Each step's ``skipped`` flag is read when the next step has been dispatched (`add`), so
    reading it does not leave the device idle while the host prepares a batch; `check` reads
    the latest one at once (before a metrics record or a save). Every process reads the same
    replicated flag, so all of them count alike and stop at the same step.

    Args:
      limit: ``train.max_consecutive_skips``: raise after this many skips in a row (0: never).
      total: skips before this process started (a resumed run's earlier skips).
    """

    def __init__(self, limit: int, total: int = 0):
        self.limit, self.total, self.consecutive = limit, total, 0
        self._pending = None  # (step, skipped flag on device, row ids) not read yet

    def add(self, step: int, skipped: jax.Array, row_ids: np.ndarray) -> None:
        """Reads the flag of the step before (`check`), then keeps this one: step number (1-based),
        bool scalar, and int32 source row ids of this process's rows of its batch (-1: padding;
        [rows, segments] for packed sequences).
        """
        self.check()
        self._pending = (step, skipped, row_ids)

    def check(self) -> None:
        """Reads the pending flag, waiting for its step. A skip is counted and logged as a
        WARNING with the step and its batch's row ids (padding excluded; in a multi-process run,
        each process logs its own rows).

        Raises FloatingPointError (one line) at ``limit`` skips in a row.
        """
        if self._pending is None:
            return
        step, skipped, row_ids = self._pending
        self._pending = None
        if not bool(skipped):
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        rows = [int(r) for r in np.ravel(row_ids) if r >= 0]
        whose = f"process {jax.process_index()}'s " if jax.process_count() > 1 else ""
        logging.warning(
            "step %d skipped: non-finite loss or gradient norm (%d in a row, %d in all); "
            "source rows (0-based) of %sits batch: %s",
            step,
            self.consecutive,
            self.total,
            whose,
            rows,
        )
        if self.limit and self.consecutive >= self.limit:
            raise FloatingPointError(
                f"step {step}: {self.consecutive} consecutive steps had a non-finite loss or "
                f"gradient norm (train.max_consecutive_skips={self.limit}); parameters are "
                "those of the last finite step. Look at: train.learning_rate (too high?), the "
                "data rows listed in the warnings above, fp16/bf16 overflow (model.dtype / "
                "model.param_dtype: try float32), train.grad_clip"
            )


def _before_save(lock: wd.RunLock | None, metrics: MetricsWriter) -> None:
    """Before each checkpoint save: stop if another process took the run lock over, and store
    every metrics record so far (a ``gs://`` workdir's metrics.jsonl is rewritten, not
    appended), so the step's records are stored before the step commits."""
    if lock is not None:
        lock.check()
    metrics.flush()


class Preemption(contextlib.AbstractContextManager):
    """Stop requests of a training run, checked between steps (`stop`).

    In a single-process run, SIGTERM and SIGINT set a flag (the handler only sets it: the save
    happens in the loop); a second one exits at once (status 128 + signal number). In a
    multi-process run every process must stop at the same step, since saving is collective:
    SIGTERM is left to JAX's preemption notifier and the step is agreed through Orbax's
    ``reached_preemption`` (JAX's preemption sync service), and SIGINT keeps Python's default
    (KeyboardInterrupt, no save). Handlers are installed only from the main thread, and the
    previous ones are restored on exit. ``checkpoints`` (the run's `checkpoints.Checkpoints`, set
    once they exist) answers the multi-process agreement.
    """

    def __init__(self):
        self.checkpoints: Checkpoints | None = None
        self._previous = {}
        self.reason: str | None = None

    def __enter__(self) -> "Preemption":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            name = signal.Signals(signum).name
            os.write(2, f"second {name}: exiting without saving\n".encode())
            os._exit(128 + signum)
        self.reason = signal.Signals(signum).name

    def stop(self, done: int) -> bool:
        """Whether to stop after step ``done`` (same answer on every process)."""
        if self.checkpoints is not None and self.checkpoints.reached_preemption(done):
            self.reason = self.reason or "SIGTERM (preemption notice)"
        elif jax.process_count() > 1:
            return False
        return self.reason is not None


def _applied_updates(opt_state) -> int:
    """The optimizer's count of applied updates (skipped steps not counted): the step that the
    learning-rate schedule of `train_step.optimizer` is at (optax's ScaleByScheduleState)."""
    return int(
        optax.tree.get(
            opt_state,
            "count",
            filtering=lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState",
        )
    )


@jax.jit
def _batch_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Tokens of a global batch: each row up to its last labelled token (rows end there; batch
    padding excluded; the packed rows' tokens of a packed batch), summed over all processes'
    rows. int32 scalar, replicated."""
    if "segment_ids" in batch:
        return (batch["segment_ids"] > 0).sum()
    labels = batch["labels"]
    labelled = labels != IGNORE_INDEX
    lengths = labels.shape[1] - jnp.argmax(labelled[:, ::-1], axis=1)
    return jnp.where(labelled.any(1), lengths, 0).sum()


def main() -> None:
    """``python -m mars_jax.train --config=CONFIG[:stage] --workdir=DIR [--config.key=value]``."""
    config = cli.config_flag()
    workdir = cli.workdir_flag("Run directory (checkpoints, logs).")

    def run():
        last = train(config.value, workdir.value)
        if last.get("stopped_by") == "SIGINT":  # the step is saved; a pipeline must stop here
            raise SystemExit(130)

    cli.run(run)


if __name__ == "__main__":
    main()
