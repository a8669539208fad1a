r"""Soak: a long training run with periodic evaluations in one process, watching host memory
and XLA compilations.

  PYTHONPATH=. python benchmarks/soak.py --config=configs/tiny.py --workdir=runs/soak \
      [--steps=2000 --eval_every=200 --output=benchmarks/results/soak.json] [--config.key=value]

The run is the config's training run with ``train.num_steps`` set to ``--steps``, split into
segments of ``--eval_every`` steps. Each segment is one `train.train` call on the same workdir
that ends like a preemption: when the metrics record of the segment's last step is logged, the
script sends itself SIGTERM, so `train` saves that step and returns; then `evaluate.evaluate`
evaluates that checkpoint, and the next `train` call resumes it. This soaks resume and
preemption as well as training and evaluation, without a hook in `train`.

Measured:

- Host memory: the process's resident set size (psutil), after ``gc.collect()``, at the end of
  every segment's evaluation. Warm-up is the first segment and its evaluation; ``rss_growth``
  is (final - warm-up) / warm-up. Each segment also records the RSS at the first and the last
  step its `train` call logged, which separates growth during steps from growth between calls.
- Compilations: XLA backend compilations, counted with a ``jax.monitoring`` listener on
  ``/jax/core/compile/backend_compile_duration`` (one event per program compiled; a jit cache
  hit sends none). Each is attributed to the train or eval part of its segment and, inside
  `train`, to the last step logged before it. Every `train` call builds its step function
  again (JAX's compilation cache may still hit); ``train_compiles_after_first_step`` counts the
  compilations after the first logged step of a `train` call (target 0: steps never
  recompile), ``compiles_after_warmup`` all compilations after the first segment, with the
  compiled programs' names.

Prints a JSON summary (also written to ``--output``). The workdir must be new or empty: a soak
measures a run from its start.
"""

from __future__ import annotations

import collections
import gc
import json
import logging as std_logging
import os
import signal
import time

import jax
import psutil
from absl import flags, logging

from mars_jax import cli, evaluate, train

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _Progress(std_logging.Handler):
    """Follows the training step from `metrics.MetricsWriter`'s log records ("step %d/%d ..."),
    notes the RSS (MiB) at the first and the latest step logged by the current `train.train` call,
    and sends this process SIGTERM when step ``stop_at`` is logged (`train.Preemption` then saves
    it and `train.train` returns). `start` resets it for the next call."""

    def __init__(self):
        super().__init__()
        self._process = psutil.Process()
        self.start(None)

    def start(self, stop_at: int | None) -> None:
        self.stop_at = stop_at
        self.step = None  # last step logged by the current train() call
        self.first_rss = self.last_rss = None

    def emit(self, record: std_logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.startswith("step %d/%d")):
            return
        self.step = record.args[0]
        self.last_rss = round(self._process.memory_info().rss / 2**20, 1)
        self.first_rss = self.first_rss or self.last_rss
        if self.step == self.stop_at:
            signal.raise_signal(signal.SIGTERM)


def soak(cfg, workdir: str, *, steps: int, eval_every: int, output: str = "") -> dict:
    """Trains run config ``cfg`` for ``steps`` steps in ``workdir``, evaluating every
    ``eval_every`` steps as described in the module docstring; returns the summary (`_summary`),
    also written to ``output`` (if given) after every segment, so a stopped soak leaves the
    figures of the segments it finished.

    Raises ValueError when ``eval_every`` does not divide ``steps``, ``train.log_every`` does
    not divide ``eval_every``, or ``workdir`` already holds files.
    """
    if steps % eval_every:
        raise ValueError(f"--eval_every={eval_every} must divide --steps={steps}")
    if eval_every % cfg.train.log_every:
        raise ValueError(
            f"train.log_every={cfg.train.log_every} must divide --eval_every={eval_every}"
        )
    if os.path.isdir(workdir) and os.listdir(workdir):
        raise ValueError(f"--workdir={workdir} is not empty: a soak starts a fresh run")
    cfg = cfg.copy_and_resolve_references()
    cfg.train.num_steps = steps
    process = psutil.Process()
    progress = _Progress()
    phase = {"name": "train"}
    segments, compiles = [], []  # compiles: (segment, phase, last step logged, program name)

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append((len(segments), phase["name"], progress.step, kwargs.get("fun_name")))

    absl_logger = std_logging.getLogger("absl")
    absl_logger.addHandler(progress)
    logging.set_verbosity(logging.INFO)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for end in range(eval_every, steps + 1, eval_every):
            phase["name"] = "train"
            progress.start(end if end < steps else None)
            start = time.perf_counter()
            record = train.train(cfg, workdir)
            train_s = time.perf_counter() - start
            if record.get("step") != end:
                raise RuntimeError(f"the segment ending at step {end} stopped at {record}")
            phase["name"] = "eval"
            start = time.perf_counter()
            report = evaluate.evaluate(cfg, workdir, step=end)
            eval_s = time.perf_counter() - start
            gc.collect()
            mine = [c for c in compiles if c[0] == len(segments)]
            segments.append(
                {
                    "step": end,
                    "loss": round(record["loss"], 4),
                    "ar_nll": round(report["ar_nll"], 4),
                    "train_s": round(train_s, 1),
                    "eval_s": round(eval_s, 1),
                    "train_compiles": sum(c[1] == "train" for c in mine),
                    "train_compiles_after_first_step": sum(
                        c[1] == "train" and c[2] is not None for c in mine
                    ),
                    "eval_compiles": sum(c[1] == "eval" for c in mine),
                    "rss_first_step_mib": progress.first_rss,
                    "rss_last_step_mib": progress.last_rss,
                    "rss_mib": round(process.memory_info().rss / 2**20, 1),
                }
            )
            summary = _summary(steps, eval_every, segments, compiles)
            print("soak:", json.dumps(segments[-1]), flush=True)
            if output:
                os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
                with open(output, "w") as f:
                    f.write(json.dumps(summary, indent=1) + "\n")
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
        absl_logger.removeHandler(progress)
    return summary


def _summary(steps: int, eval_every: int, segments: list[dict], compiles: list[tuple]) -> dict:
    """{steps, eval_every, complete, segments: [{step, loss, ar_nll, train_s, eval_s,
    train_compiles, train_compiles_after_first_step, eval_compiles, rss_first_step_mib,
    rss_last_step_mib (RSS at the first and the last step logged by the segment's train call),
    rss_mib (after its evaluation)}], warmup_rss_mib,
    final_rss_mib, rss_growth (fraction), compiles, compiles_after_warmup (with the programs'
    names: compiles_after_warmup_by_program), train_compiles_after_first_step}."""
    warm, final = segments[0]["rss_mib"], segments[-1]["rss_mib"]
    later = collections.Counter(f"{c[1]}: {c[3]}" for c in compiles if c[0] > 0)
    return {
        "steps": steps,
        "eval_every": eval_every,
        "complete": segments[-1]["step"] == steps,
        "segments": segments,
        "warmup_rss_mib": warm,
        "final_rss_mib": final,
        "rss_growth": round((final - warm) / warm, 4),
        "compiles": len(compiles),
        "compiles_after_warmup": sum(later.values()),
        "compiles_after_warmup_by_program": dict(later),
        "train_compiles_after_first_step": sum(
            s["train_compiles_after_first_step"] for s in segments
        ),
    }


def main() -> None:
    """``python benchmarks/soak.py --config=CONFIG --workdir=DIR [--steps=N --eval_every=K]``."""
    config = cli.config_flag(help="Run config (the soak sets train.num_steps to --steps).")
    workdir = cli.workdir_flag("New run directory.")
    steps = flags.DEFINE_integer("steps", 2000, "Training steps in all.")
    eval_every = flags.DEFINE_integer("eval_every", 200, "Steps between evaluations.")
    output = flags.DEFINE_string(
        "output", "benchmarks/results/soak.json", "Where to write the JSON summary."
    )

    def run():
        summary = soak(
            config.value,
            workdir.value,
            steps=steps.value,
            eval_every=eval_every.value,
            output=output.value,
        )
        print(json.dumps(summary, indent=1))

    cli.run(run)


if __name__ == "__main__":
    main()
