r"""A learning curve: one run trained in segments and evaluated at chosen steps, its points
appended to a JSON file and plotted as they come.

  python -m experiments.smollm2_curve --config=configs/smollm2_curve.py:mars \
      --workdir=runs/curve/mars --eval_steps=0,100,200,400,600,800,1000 \
      [--output=experiments/results/smollm2_curve.json] [--run=mars] [--config.key=value ...]

For each step s of ``--eval_steps`` whose rows ``--output`` does not hold yet for run ``--run``
(default: the objective, ``mars`` or ``ar``): train to s (`train.train` with
``train.stop_at=s``, resuming the workdir's last checkpoint), evaluate checkpoint s
(`evaluate.evaluate`: ``eval.*``, e.g. 32 GSM8K test questions at 1.0 / 0.95 / 0.9 / 0.8), and
append one row per threshold (the file is re-read under a lock before each write, so several
runs, e.g. ``mars`` and ``ar``, may add their points to one file at the same time):

  {run, step, rows_seen, threshold, tokens_per_forward, accuracy, agreement, nll, mean_length,
   learning_rate, train_hours}

``rows_seen`` sums the ``rows`` of every logged step up to s (``train.log_every`` must be 1),
``nll`` is the AR teacher-forced NLL of the reference answers, ``agreement`` the fraction of
completions equal to the threshold-1.0 one, ``train_hours`` the wall clock spent training this
run up to s (this machine, as measured by this script). Step 0 is the untuned ``init_from``
(a Hugging Face directory), evaluated at threshold 1.0 as an AR model (it has no mask row yet),
its report in ``untuned/`` beside the workdir (nothing is written into the model's own).
The plot (``--output`` with ".png"): tokens per forward at 0.9 and 0.8 against step and against
rows seen, and the AR NLL of every run. A rerun resumes where it stopped: a SIGTERM or Ctrl-C
saves the step reached and keeps its training time (the unfinished segment gives no point; the
script exits saying so), a kill loses the steps since the last checkpoint and the segment's
clock. The JSON is rewritten whole after each point.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

from absl import flags

from mars_jax import cli, evaluate, storage, train

ROW_KEYS = ("tokens_per_forward", "accuracy", "mean_length")


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def write_rows(path: str, rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: (r["run"], r["step"], -r["threshold"]))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    plot(rows, os.path.splitext(path)[0] + ".png")


def rows_seen(workdir: str, step: int) -> int:
    """Rows with labelled tokens in steps 1..``step`` of ``workdir``'s metrics.jsonl."""
    if step == 0:
        return 0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = {r["step"]: r for r in map(json.loads, f) if "rows" in r}
    missing = [s for s in range(1, step + 1) if s not in records]
    if missing:
        raise ValueError(
            f"{workdir}/metrics.jsonl has no record of steps {missing[:5]}...: the curve counts "
            "the rows of every step (train.log_every=1)"
        )
    return int(sum(records[s]["rows"] for s in range(1, step + 1)))


def point(cfg, workdir: str, step: int, run: str, train_hours: float) -> list[dict]:
    """The rows of one evaluation (`evaluate.evaluate`) of step ``step``."""
    if step == 0:
        c = cfg.copy_and_resolve_references()
        c.eval.thresholds, c.eval.block_size = (1.0,), 1
        untuned = os.path.join(os.path.dirname(os.path.abspath(workdir)), "untuned")
        report = evaluate.evaluate(c, cfg.init_from, output_dir=untuned)
    else:
        report = evaluate.evaluate(cfg, workdir, step=step)
    seen = rows_seen(workdir, step)
    return [
        {
            "run": run,
            "step": step,
            "rows_seen": seen,
            "threshold": r["threshold"],
            **{k: r[k] for k in ROW_KEYS},
            "agreement": r["agreement_with_ar"],
            "nll": report["ar_nll"],
            "learning_rate": cfg.train.learning_rate,
            "train_hours": round(train_hours, 4),
        }
        for r in report["results"]
    ]


def curve(cfg, workdir: str, steps: list[int], output: str, run: str) -> list[dict]:
    """Trains and evaluates the points of ``steps`` that ``output`` lacks (module docstring)."""
    rows = read_rows(output)
    done = {r["step"] for r in rows if r["run"] == run}
    clock_path = os.path.join(workdir, "curve_train_seconds.json")
    for step in sorted(set(steps)):
        if step in done:
            continue
        if step > cfg.train.num_steps:
            raise ValueError(f"--eval_steps: {step} is past train.num_steps={cfg.train.num_steps}")
        clock = json.loads(storage.read_text(clock_path)) if os.path.exists(clock_path) else {}
        if step:
            c = cfg.copy_and_resolve_references()
            c.train.stop_at = step if step < cfg.train.num_steps else 0
            start = time.time()
            last = train.train(c, workdir)
            reached = int(last.get("step", step))  # no "step": the run was already at ``step``
            # The clock is keyed by the step training reached (a signal may end it early), each
            # segment added to the time of the latest step before it.
            latest = max(map(int, clock), default=0)
            if reached > latest:
                clock[str(reached)] = clock.get(str(latest), 0.0) + time.time() - start
                storage.write_text(clock_path, json.dumps(clock))
            if reached != step:
                raise SystemExit(
                    f"{workdir}: training stopped at step {reached} ({last.get('stopped_by')}) "
                    f"before step {step}; rerun the same command to go on"
                )
        hours = clock.get(str(step), 0.0) / 3600
        new = point(cfg, workdir, step, run, hours)
        with _locked(output):  # other runs may add their points to the same file meanwhile
            rows = [r for r in read_rows(output) if not (r["run"] == run and r["step"] == step)]
            rows += new
            write_rows(output, rows)
    return rows


@contextlib.contextmanager
def _locked(output: str):
    """An exclusive lock on ``output`` (a lock file beside it) for a read-modify-write."""
    with open(output + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def plot(rows: list[dict], path: str) -> None:
    """Tokens per forward at 0.9 and 0.8 against step and rows seen; AR NLL against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = sorted({r["run"] for r in rows})
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        for threshold, style in ((0.9, "o-"), (0.8, "s--")):
            at = sorted(
                (r for r in mine if abs(r["threshold"] - threshold) < 1e-9), key=lambda r: r["step"]
            )
            if at:
                label = f"{run} at {threshold:g}"
                axes[0].plot(
                    [r["step"] for r in at],
                    [r["tokens_per_forward"] for r in at],
                    style,
                    label=label,
                )
                axes[1].plot(
                    [r["rows_seen"] for r in at],
                    [r["tokens_per_forward"] for r in at],
                    style,
                    label=label,
                )
        one = sorted((r for r in mine if r["threshold"] == 1.0), key=lambda r: r["step"])
        axes[2].plot([r["step"] for r in one], [r["nll"] for r in one], "o-", label=run)
    for ax, xlabel, ylabel in (
        (axes[0], "step", "tokens per forward"),
        (axes[1], "rows seen", "tokens per forward"),
        (axes[2], "step", "AR NLL of the reference answers (nats/token)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(path))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    config = cli.config_flag()
    workdir = cli.workdir_flag("The run's directory (checkpoints, metrics, evaluations).")
    eval_steps = flags.DEFINE_list("eval_steps", ["0", "100", "200"], "Steps to evaluate at.")
    output = flags.DEFINE_string(
        "output", "experiments/results/smollm2_curve.json", "The curve's JSON (plot beside it)."
    )
    name = flags.DEFINE_string("run", "", "The run's name in the rows (default: the objective).")

    def run():
        cfg = config.value
        steps = [int(s) for s in eval_steps.value]
        curve(cfg, workdir.value, steps, output.value, name.value or cfg.objective.name)

    cli.run(run)


if __name__ == "__main__":
    main()
