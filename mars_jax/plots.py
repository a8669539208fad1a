"""Plots and tables of evaluation results (`mars_jax.evaluate` reports)."""

from __future__ import annotations


def pareto_plot(runs: dict[str, list[dict]], path: str, *, title: str = ""):
    """Plots accuracy against tokens per forward, one line per run, and saves it to ``path``.

    ``runs`` maps a run's label (the legend entry) to its evaluation records, the ``results``
    of an `mars_jax.evaluate` report: dicts with at least ``threshold``, ``accuracy`` (fraction)
    and ``tokens_per_forward``. Each run is a line through one point per record, in order of
    decreasing threshold (from 1.0, AR decoding, on), each point labelled with its threshold
    (the thresholds of coinciding points share one label, "1, 0.95").
    The format follows ``path``'s extension (e.g. ".png"); rendered with matplotlib's Agg
    canvas, without pyplot's global state. Returns the matplotlib ``Figure``.

    Raises ValueError for no runs or a run without records; KeyError for a record missing
    one of those keys.
    """
    from matplotlib.figure import Figure  # lazily: only evaluation plots need matplotlib

    if not runs or not all(runs.values()):
        raise ValueError(f"nothing to plot in {path}: every run needs evaluation records")
    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, records in runs.items():
        records = sorted(records, key=lambda r: -r["threshold"])
        x = [r["tokens_per_forward"] for r in records]
        y = [r["accuracy"] for r in records]
        (line,) = ax.plot(x, y, marker="o", label=label)
        thresholds = {}  # one label per distinct point: "1, 0.95" where two coincide
        for r, point in zip(records, zip(x, y)):
            thresholds.setdefault(point, []).append(f"{r['threshold']:g}")
        for point, names in thresholds.items():
            ax.annotate(
                ", ".join(names),
                point,
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
                color=line.get_color(),
            )
    return _save(fig, ax, path, ("tokens per forward", "accuracy"), title)


def loss_plot(runs: dict[str, list[dict]], path: str, *, keys=("loss",), title: str = ""):
    """Plots training metrics against the step, one line per (run, key), and saves it.

    ``runs`` maps a label to its metrics records (metrics.jsonl's dicts with ``step`` and each
    of ``keys``; a record whose value is null, a skipped step, is left out). Returns the
    ``Figure``. Raises ValueError for no runs.
    """
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError(f"nothing to plot in {path}")
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for label, records in runs.items():
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=f"{label}: {key}")
    return _save(fig, ax, path, ("step", "cross-entropy (nats/token)"), title)


def _save(fig, ax, path: str, labels: tuple[str, str], title: str):
    """Labels, title, grid and legend of the one axes of ``fig``; saved to ``path``."""
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title, fontsize=9, wrap=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return fig


def format_table(report: dict) -> str:
    """The evaluation results as a Markdown table (speedup and conversion "-" in a report
    written before they were measured)."""
    ar = report.get("ar_tokens_per_s")
    timing = (
        f"; AR (block size 1) {ar:.1f} tokens/s, best of {report['timing_repeats']}"
        if ar is not None
        else ""
    )
    lines = [
        f"{report['workdir']} step {report['step']}: {report['num_examples']} examples, "
        f"block_size {report['block_size']}, AR teacher-forced NLL "
        f"{report['ar_nll']:.4f} nats/token{timing}",
        "| threshold | accuracy | tokens/forward | tokens/s | speedup | conversion | mean length "
        "| agreement with 1.0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        conversion = f"{r['conversion']:.2f}" if "conversion" in r else "-"
        tokens_per_s = f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else "-"
        lines.append(
            f"| {r['threshold']:.2f} | {r['accuracy']:.3f} | "
            f"{r['tokens_per_forward']:.2f} | {tokens_per_s} | {speedup} | "
            f"{conversion} | {r['mean_length']:.1f} | {r['agreement_with_ar']:.3f} |"
        )
    return "\n".join(lines)
