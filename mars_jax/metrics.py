"""Training metrics of a run: the progress line in the log, ``workdir/metrics.jsonl`` and
TensorBoard event files in ``workdir/tensorboard/`` (``tensorboard --logdir=workdir``).

Every logged training record goes through `MetricsWriter.write`, the one place that writes
metrics.
"""

from __future__ import annotations

import json
import os

from absl import logging


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
    """

    def __init__(self, workdir: str, start_step: int, num_steps: int, *, primary: bool = True):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.num_steps = num_steps
        self._file = self._tensorboard = None
        if not primary:
            return
        kept = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                for number, line in enumerate(f, start=1):
                    try:
                        if json.loads(line)["step"] <= start_step:
                            kept.append(line)
                    except (json.JSONDecodeError, KeyError):
                        logging.warning(
                            "%s:%d: dropping unreadable metrics record", self.path, number
                        )
            with open(self.path, "w") as f:
                f.writelines(kept)
        self._file = open(self.path, "a")
        from tensorboardX import SummaryWriter  # lazily: it imports torch where installed

        # Event file names hold the time in seconds and the host: the suffix keeps a writer
        # resumed within the same second from overwriting the previous file.
        self._tensorboard = SummaryWriter(
            os.path.join(workdir, "tensorboard"),
            purge_step=start_step + 1 if start_step else None,
            filename_suffix=f".{os.getpid()}.from_step_{start_step}",
        )

    def write(self, record: dict) -> None:
        """Logs and appends ``record``: {step, loss, [noisy_loss, clean_loss,] grad_norm,
        skipped (1.0: this step's update was skipped), skipped_steps (skips so far),
        learning_rate, tokens_per_s, progress (fraction), eta_s (seconds), ...} of numbers.

        A skipped step's loss may be NaN or infinite: it is written as NaN / Infinity, which is
        not strict JSON but which Python's json reads back.
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
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            for key, value in record.items():
                if key != "step":
                    self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """Closes metrics.jsonl and the event file, writing the events still queued (a
        non-primary writer has neither)."""
        if self._file is not None:
            self._file.close()
            self._tensorboard.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
