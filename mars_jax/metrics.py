"""Training metrics of a run: the progress line in the log, ``workdir/metrics.jsonl`` and
TensorBoard event files in ``workdir/tensorboard/`` (``tensorboard --logdir=workdir``).

Every logged training record goes through `MetricsWriter.write`, the one place that writes
metrics.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

from absl import logging

from mars_jax import storage


class MetricsWriter:
    """Appends one JSON object per logged step to ``workdir/metrics.jsonl`` and logs it.

    On a resumed run (``start_step`` > 0) records of steps after ``start_step`` are dropped
    first: an interrupted run logged them after its last checkpoint, and they are about to be
    redone. A torn last line (a killed process) is dropped with a warning.

    Each record also goes to TensorBoard (tensorboardX): one scalar per key of the record but
    ``step``, tagged with the key, at global step ``record["step"]``, stored as float32. Each
    writer opens a new event file in ``workdir/tensorboard/``; a resumed one first marks the
    steps after ``start_step`` as purged, so TensorBoard hides the redone steps of the earlier
    file as metrics.jsonl drops them. Events reach the file in the background and at `close`.

    Only a ``primary`` writer (process 0 of a multi-process run) touches the files
    (`distributed` keeps the INFO log lines of other processes out of the log).

    In an object store (a ``gs://`` workdir) nothing can be appended to: metrics.jsonl is
    rewritten whole at `flush`, which `write` calls every ``flush_every_s`` seconds and the run
    calls before each checkpoint save, so every line of a step up to the last committed
    checkpoint is stored (later ones are redone on resume). TensorBoard's event file is
    written to a local staging directory and uploaded whole at each flush.
    """

    def __init__(
        self,
        workdir: str,
        start_step: int,
        num_steps: int,
        *,
        primary: bool = True,
        flush_every_s: float = 30.0,
    ):
        self.path = storage.join(workdir, "metrics.jsonl")
        self.num_steps = num_steps
        self.flush_every_s = flush_every_s
        self._file = self._tensorboard = self._lines = None
        if not primary:
            return
        kept = []
        text = storage.read_text(self.path) if storage.exists(self.path) else ""
        for number, line in enumerate(text.splitlines(keepends=True), start=1):
            try:
                if json.loads(line)["step"] <= start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError):
                logging.warning("%s:%d: dropping unreadable metrics record", self.path, number)
        self._events = storage.join(workdir, "tensorboard")
        self._staging = None
        if storage.is_remote(self.path):
            self._lines = kept
            self._flushed = 0.0
            self._staging = tempfile.TemporaryDirectory(prefix="mars_jax_events_")
        else:
            with open(self.path, "w") as f:
                f.writelines(kept)
            self._file = open(self.path, "a")
        from tensorboardX import SummaryWriter  # lazily: it imports torch where installed

        # Event file names hold the time in seconds and the host: the suffix keeps a writer
        # resumed within the same second from overwriting the previous file.
        self._tensorboard = SummaryWriter(
            self._staging.name if self._staging else self._events,
            purge_step=start_step + 1 if start_step else None,
            filename_suffix=f".{os.getpid()}.from_step_{start_step}",
        )
        if self._lines is not None:
            self.flush()

    def write(self, record: dict) -> None:
        """Logs and appends ``record``: {step, loss, [noisy_loss, clean_loss,] grad_norm,
        skipped (1.0: this step's update was skipped), skipped_steps (skips so far),
        learning_rate, tokens_per_s, progress (fraction), eta_s (seconds), ...} of numbers.

        A skipped step's loss may be NaN or infinite: metrics.jsonl has ``null`` there (strict
        JSON, which every reader accepts); the log line and TensorBoard keep the value.
        """
        parts = "".join(
            f" {k} {record[k]:.4f}" for k in ("noisy_loss", "clean_loss") if k in record
        )
        if record.get("skipped_steps"):
            parts += f" skipped steps {record['skipped_steps']}"
        logging.info(
            "step %d/%d (%.0f%%) loss %.4f%s lr %.2e tokens/s %.0f ETA %s",
            record["step"],
            self.num_steps,
            100 * record["progress"],
            record["loss"],
            parts,
            record["learning_rate"],
            record["tokens_per_s"],
            _hms(record["eta_s"]),
        )
        if self._tensorboard is None:
            return
        strict = {k: _finite_or_none(v) for k, v in record.items()}
        line = json.dumps(strict, allow_nan=False) + "\n"
        if self._lines is None:
            self._file.write(line)
            self._file.flush()
        else:
            self._lines.append(line)
        for key, value in record.items():
            if key != "step":
                self._tensorboard.add_scalar(key, value, record["step"])
        if self._lines is not None and time.monotonic() - self._flushed >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Stores every record written so far (metrics.jsonl and the event file)."""
        if self._tensorboard is None:
            return
        self._tensorboard.flush()
        self._upload()

    def _upload(self) -> None:
        if self._lines is not None:
            storage.write_text(self.path, "".join(self._lines))
            for name in os.listdir(self._staging.name):  # this writer's event file, whole
                with open(os.path.join(self._staging.name, name), "rb") as f:
                    storage.write_bytes(storage.join(self._events, name), f.read())
            self._flushed = time.monotonic()

    def close(self) -> None:
        """Closes metrics.jsonl and the event file, writing the events still queued (a
        non-primary writer has neither)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._upload()
            if self._file is not None:
                self._file.close()
            if self._staging is not None:
                self._staging.cleanup()
            self._tensorboard = None


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _finite_or_none(value):
    """``value``, or None for a NaN or infinite float (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
