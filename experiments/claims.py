r"""The paper's three claims (arXiv 2604.07023, Sec. 5) side by side, at a scale one machine runs.

  python -m experiments.claims --config=experiments/claims_config.py:synthetic \
      --workdir=runs/claims_synthetic

One stage-1 (AR SFT) run, then from its final checkpoint:

  ar_control          AR SFT continued for the stage-2 steps (the epoch-matched control)
  mars_b<B>_ar<w>     MARS with block size B and ar_weight w, for every B x w of the config;
                      w = 0 uses the reference's no-SFT weighting (``noisy_weighting=inverse_t``)
  ..._seed<s>         the first MARS run again with run seed s, to show the noise: the seed orders
                      the data, and for the built-in problems draws the training problems (s)
                      and the held-out ones (s + 1) too

Each run has its own directory under ``--workdir`` and is resumable: a rerun of the same command
skips finished training (`mars_jax.train` resumes or returns) and finished evaluations (a run's
``eval.json`` of its final step with the configured thresholds). The tables (markdown), the
reports (JSON, with the device and the measured times) and the Pareto plot (PNG: tokens per
forward vs accuracy, one line per run) go to ``--results`` (default ``<workdir>/results``) as
``<name>.md/.json/.png``, rewritten after every run. The tracked ``experiments/results/`` holds
committed results: a run updates it only when asked with ``--results=experiments/results``.

Claims: (a) one-token mode: MARS at threshold 1.0 vs the AR control, accuracy and held-out AR
NLL; (b) the speed/quality curve over thresholds: tokens per forward, accuracy, agreement with
threshold 1.0, and the wall-clock speedup of each MARS run's decoding over the AR control's
(generated tokens/s, from their evaluation reports) with its conversion (speedup / tokens per
forward); (c) block size x the AR term.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import flags, logging

from mars_jax import cli, evaluate, plots, train
from mars_jax.checkpoints import Checkpoints


def run_configs(exp) -> dict:
    """The run ConfigDicts of experiment ``exp``, by run name, in the order they run.

    Stage 1 comes first; every other run starts from its final checkpoint (``init_from`` is
    filled in by `run_each`) with learning rate ``exp.stage2_learning_rate`` (0: stage 1's). AR
    runs train with block_size 1 and are evaluated with one-token (AR) decoding only.
    """

    def make(
        objective, steps, *, stage2=True, block_size=1, ar_weight=1.0, seed=None, thresholds=(1.0,)
    ):
        cfg = exp.run.copy_and_resolve_references()
        cfg.objective.name = objective
        cfg.objective.block_size = block_size
        cfg.objective.ar_weight = ar_weight
        cfg.objective.noisy_weighting = (
            "inverse_t" if objective == "mars" and not ar_weight else "none"
        )
        cfg.train.num_steps = steps
        if stage2:
            cfg.train.learning_rate = exp.stage2_learning_rate or exp.run.train.learning_rate
        cfg.seed = exp.run.seed if seed is None else seed
        cfg.eval.thresholds = tuple(thresholds)
        cfg.eval.block_size = 0  # as trained
        return cfg

    runs = {
        "stage1": make("ar", exp.stage1_steps, stage2=False),
        "ar_control": make("ar", exp.stage2_steps),
    }
    for b in exp.block_sizes:
        for w in exp.ar_weights:
            runs[f"mars_b{b}_ar{w:g}"] = make(
                "mars", exp.stage2_steps, block_size=b, ar_weight=w, thresholds=exp.thresholds
            )
    first = f"mars_b{exp.block_sizes[0]}_ar{exp.ar_weights[0]:g}"
    for seed in exp.extra_seeds:
        runs[f"{first}_seed{seed}"] = make(
            "mars",
            exp.stage2_steps,
            block_size=exp.block_sizes[0],
            ar_weight=exp.ar_weights[0],
            seed=seed,
            thresholds=exp.thresholds,
        )
    return runs


def _finished_eval(workdir: str, cfg) -> dict | None:
    """The run's eval.json if it evaluates the final step as configured: the same thresholds,
    number of examples, cache mode and rule (an experiment whose ``eval`` settings changed
    since, e.g. more examples, is evaluated again, not reported with the old figures)."""
    path = os.path.join(workdir, "eval.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        report = json.load(f)
    e = cfg.eval
    done = report["step"] == cfg.train.num_steps
    same = [r["threshold"] for r in report["results"]] == [float(t) for t in e.thresholds] and (
        report.get("num_examples"),
        report.get("cache_mode"),
        report.get("rule"),
    ) == (e.num_examples, e.cache_mode, e.rule)
    return report if done and same else None


def run_each(exp, root: str):
    """Trains and evaluates every run of `run_configs` under ``root`` (stage 1 in
    ``exp.stage1_workdir`` where set, e.g. another experiment's; skipping finished work),
    yielding (name, {"report": evaluation report, "train_s": s, "eval_s": s}) as each run ends,
    with the seconds this invocation spent on it (0 for skipped work). Returns early when a run
    stops before its last step (SIGTERM or Ctrl-C: `mars_jax.train` saves and returns), so no
    later run starts from an unfinished stage 1."""
    stage1 = exp.stage1_workdir or os.path.join(root, "stage1")
    for name, cfg in run_configs(exp).items():
        workdir = stage1 if name == "stage1" else os.path.join(root, name)
        if name != "stage1":
            cfg.init_from = stage1
        start = time.perf_counter()
        logging.info("claims: training %s", name)
        train.train(cfg, workdir)
        with Checkpoints(workdir) as checkpoints:
            if checkpoints.latest_step() != cfg.train.num_steps:  # stopped by SIGTERM / Ctrl-C
                logging.info("claims: %s stopped early; rerun the command to resume", name)
                return
        trained = time.perf_counter()
        report = _finished_eval(workdir, cfg)
        if report is None:
            logging.info("claims: evaluating %s", name)
            report = evaluate.evaluate(cfg, workdir)
        yield (
            name,
            {
                "report": report,
                "train_s": trained - start,
                "eval_s": time.perf_counter() - trained,
            },
        )


def _at(report: dict, threshold: float) -> dict | None:
    return next((r for r in report["results"] if r["threshold"] == threshold), None)


def tables(exp, runs: dict) -> str:
    """The three claims as markdown tables of the finished ``runs`` (a run not finished yet is
    left out, or shown as "-")."""
    one = lambda name: _at(runs[name]["report"], 1.0)
    lines = [
        "**(a) One-token mode** (threshold 1.0: one token per forward)",
        "",
        "| run | steps | accuracy | held-out AR NLL (nats/token) |",
        "|---|---|---|---|",
    ]
    for name in [n for n in ("stage1", "ar_control") if n in runs] + [
        n for n in runs if n.startswith("mars")
    ]:
        r = runs[name]["report"]
        lines.append(f"| {name} | {r['step']} | {one(name)['accuracy']:.3f} | {r['ar_nll']:.4f} |")
    lines += _threshold_table(
        exp,
        runs,
        "**(b) Speed and quality over thresholds** (tokens per forward / accuracy / agreement "
        "with threshold 1.0)",
        lambda r: (
            f"{r['tokens_per_forward']:.2f} / {r['accuracy']:.3f} / {r['agreement_with_ar']:.2f}"
        ),
    )
    lines += _wall_clock(exp, runs)
    t = exp.headline_threshold
    lines += [
        "",
        f"**(c) Block size x AR term** at threshold {t:g} (tokens per forward / accuracy)",
        "",
        "| block size | " + " | ".join(f"ar_weight {w:g}" for w in exp.ar_weights) + " |",
        "|---|" + "---|" * len(exp.ar_weights),
    ]
    for b in exp.block_sizes:
        cells = []
        for w in exp.ar_weights:
            run = runs.get(f"mars_b{b}_ar{w:g}")
            r = run and _at(run["report"], float(t))
            cells.append(f"{r['tokens_per_forward']:.2f} / {r['accuracy']:.3f}" if r else "-")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _threshold_table(exp, runs: dict, title: str, cell) -> list[str]:
    """Markdown lines of a table with a row per MARS run and a column per threshold, each cell
    ``cell(result row of that threshold)``."""
    lines = [
        "",
        title,
        "",
        "| run | " + " | ".join(f"{t:g}" for t in exp.thresholds) + " |",
        "|---|" + "---|" * len(exp.thresholds),
    ]
    for name in (n for n in runs if n.startswith("mars")):
        cells = [cell(_at(runs[name]["report"], float(t))) for t in exp.thresholds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _wall_clock(exp, runs: dict) -> list[str]:
    """Markdown lines of the wall-clock table: per MARS run and threshold, speedup = its
    tokens/s over the AR control's at threshold 1.0, and conversion = speedup / tokens per
    forward (none before the AR control is evaluated)."""
    ar = "ar_control" in runs and _at(runs["ar_control"]["report"], 1.0)
    if not ar:
        return []

    def cell(r):
        speedup = r["tokens_per_s"] / ar["tokens_per_s"]
        return f"{speedup:.2f}x / {speedup / r['tokens_per_forward']:.2f}"

    return _threshold_table(
        exp,
        runs,
        "**(b) Wall clock** (speedup over the AR control's "
        f"{ar['tokens_per_s']:.1f} tokens/s at threshold 1.0 / conversion = speedup / tokens "
        "per forward)",
        cell,
    )


def results_dir(workdir: str, results: str = "") -> str:
    """Where an invocation writes its tables, JSON and plot: ``results`` if given, else
    ``<workdir>/results``. The tracked ``experiments/results/`` holds committed results only; a
    run writes there only when asked with ``--results=experiments/results``."""
    return results or os.path.join(workdir, "results")


def write_results(exp, runs: dict, results_dir: str, seconds: float) -> str:
    """Writes ``<name>.md`` (tables, device, times), ``<name>.json`` and ``<name>.png`` (Pareto
    plot of the MARS runs) into ``results_dir``; returns the markdown."""
    os.makedirs(results_dir, exist_ok=True)
    device = f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}) x {jax.device_count()}"
    train_s = sum(r["train_s"] for r in runs.values())
    eval_s = sum(r["eval_s"] for r in runs.values())
    text = (
        f"### {exp.name}: {exp.description}\n\n"
        f"Device: {device}. This invocation: {seconds / 60:.1f} min ({train_s / 60:.1f} training, "
        f"{eval_s / 60:.1f} evaluating; work already done by an earlier invocation counts 0).\n\n"
        + tables(exp, runs)
        + "\n"
    )
    base = os.path.join(results_dir, exp.name)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump({"device": device, "seconds": seconds, "runs": runs}, f, indent=2)
    mars = {n: r["report"]["results"] for n, r in runs.items() if n.startswith("mars")}
    if mars:
        plots.pareto_plot(mars, base + ".png", title=f"{exp.name}: tokens per forward vs accuracy")
    return text


def claims(exp, root: str, results: str = "") -> str:
    """Runs experiment ``exp`` under ``root`` (`run_each`), writing the results to
    `results_dir` (``results``, default ``<root>/results``) after every run (`write_results`);
    returns the final markdown."""
    out = results_dir(root, results)
    start, runs, text = time.perf_counter(), {}, ""
    for name, run in run_each(exp, root):
        runs[name] = run
        text = write_results(exp, runs, out, time.perf_counter() - start)
    return text


def main() -> None:
    """``python -m experiments.claims --config=experiments/claims_config.py:NAME --workdir=DIR
    [--results=DIR]``."""
    config = cli.config_flag("experiments/claims_config.py:synthetic", "Experiment config.")
    workdir = cli.workdir_flag("Directory of the runs (one subdirectory per run).")
    results = flags.DEFINE_string(
        "results",
        "",
        "Where the tables, JSON report and plot go; default WORKDIR/results. The tracked "
        "experiments/results/ keeps committed results: pass it explicitly to update them.",
    )
    cli.run(lambda: print(claims(config.value, workdir.value, results.value)))


if __name__ == "__main__":
    main()
