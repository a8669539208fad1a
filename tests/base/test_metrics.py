"""TensorBoard event files of `metrics.MetricsWriter`, read back with TensorBoard's own reader
(``event_accumulator``, as ``tensorboard --logdir`` reads them): the same scalars at the same
steps as metrics.jsonl, a resumed run included."""

import json

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

from mars_jax.metrics import MetricsWriter

KEYS = ("loss", "noisy_loss", "clean_loss", "learning_rate", "tokens_per_s", "progress", "eta_s")


def _records(rng, steps, num_steps):
    return [
        {"step": s, **{k: float(rng.uniform(0.1, 1e4)) for k in KEYS}, "progress": s / num_steps}
        for s in steps
    ]


def _write(workdir, start_step, records, primary=True):
    writer = MetricsWriter(str(workdir), start_step, 8, primary=primary)
    for record in records:
        writer.write(record)
    writer.close()


def _scalars(logdir):
    """{tag: [(step, value)]} of every scalar TensorBoard shows for ``logdir``."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_files_hold_the_metrics_of_metrics_jsonl_after_a_resume(tmp_path):
    rng = np.random.default_rng(0)
    first, resumed = _records(rng, [2, 4, 6], 8), _records(rng, [6, 8], 8)
    _write(tmp_path, 0, first)
    # Resumed from the checkpoint at step 4: step 6 is redone with other values.
    _write(tmp_path, 4, resumed)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == first[:2] + resumed
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one event file per writer
    expected = {k: [(r["step"], float(np.float32(r[k]))) for r in kept] for k in KEYS}
    assert _scalars(tmp_path / "tensorboard") == expected


def test_only_the_primary_writer_writes_event_files(tmp_path):
    _write(tmp_path, 0, _records(np.random.default_rng(1), [2], 8), primary=False)
    assert not (tmp_path / "tensorboard").exists()
    assert not (tmp_path / "metrics.jsonl").exists()
