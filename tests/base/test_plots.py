"""The Pareto plot of an evaluation (`plots.pareto_plot`, written by `evaluate.write_report`):
a readable PNG whose lines hold exactly the reports' tokens per forward and accuracies, one
line per run, each point labelled with its threshold."""

import numpy as np
import pytest
from matplotlib import image

from mars_jax import evaluate, plots


def report(step, thresholds, seed, workdir="runs/x"):
    """An evaluation report as `evaluate.evaluate` returns it, with random figures."""
    rng = np.random.default_rng(seed)
    results = [
        {
            "threshold": t,
            "accuracy": float(rng.uniform()),
            "tokens_per_forward": float(rng.uniform(1, 4)),
            "tokens_per_s": float(rng.uniform(10, 100)),
            "mean_length": float(rng.uniform(10, 50)),
            "agreement_with_ar": float(rng.uniform()),
            "examples": [],
        }
        for t in thresholds
    ]
    return {
        "workdir": workdir,
        "step": step,
        "num_examples": 8,
        "block_size": 4,
        "cache_mode": "sliding",
        "rule": "prob",
        "ar_nll": 1.5,
        "results": results,
    }


def _check_png(path):
    pixels = image.imread(str(path))
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
    assert pixels.std() > 0.01  # not a blank canvas


def _points(records):
    """(tokens per forward, accuracy, threshold label) from 1.0 down."""
    ordered = sorted(records, key=lambda r: r["threshold"], reverse=True)
    return [(r["tokens_per_forward"], r["accuracy"], f"{r['threshold']:g}") for r in ordered]


def test_one_line_per_run_through_its_thresholds(tmp_path):
    runs = {
        "ar": report(10, [0.9, 1.0, 0.7], seed=0)["results"],
        "mars": report(10, [1.0, 0.95, 0.8, 0.5], seed=1)["results"],
    }
    fig = plots.pareto_plot(runs, str(tmp_path / "p.png"), title="two runs")
    _check_png(tmp_path / "p.png")
    (ax,) = fig.axes
    assert ax.get_title() == "two runs"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("tokens per forward", "accuracy")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ar", "mars"]
    labels = [(t.xy, t.get_text()) for t in ax.texts]
    for line, records in zip(ax.lines, runs.values(), strict=True):
        expected = _points(records)
        assert list(zip(line.get_xdata(), line.get_ydata())) == [(x, y) for x, y, _ in expected]
        for x, y, threshold in expected:
            assert ((x, y), threshold) in labels
    assert len(labels) == 7


def test_coinciding_points_share_one_label(tmp_path):
    records = report(1, [1.0, 0.95, 0.9], seed=5)["results"]
    records[1].update(accuracy=records[0]["accuracy"], tokens_per_forward=1.0)
    records[0]["tokens_per_forward"] = 1.0
    fig = plots.pareto_plot({"run": records}, str(tmp_path / "p.png"))
    r = records[2]
    assert sorted((t.xy, t.get_text()) for t in fig.axes[0].texts) == sorted(
        [
            ((1.0, records[0]["accuracy"]), "1, 0.95"),
            ((r["tokens_per_forward"], r["accuracy"]), "0.9"),
        ]
    )


def test_nothing_to_plot_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"nothing to plot in .*p\.png"):
        plots.pareto_plot({"a": report(1, [1.0], 0)["results"], "b": []}, str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


def test_write_report_puts_the_plot_beside_each_json(tmp_path, monkeypatch):
    figures = []
    pareto_plot = plots.pareto_plot
    monkeypatch.setattr(plots, "pareto_plot", lambda *a, **k: figures.append(pareto_plot(*a, **k)))
    first, second = report(7, [1.0, 0.9], seed=2), report(7, [1.0, 0.5, 0.3], seed=3)
    paths = [evaluate.write_report(str(tmp_path), r) for r in (first, second)]
    for path in paths:
        _check_png(path.removesuffix(".json") + ".png")
    # eval.png is the latest evaluation's plot.
    latest = paths[1].removesuffix(".json") + ".png"
    assert (tmp_path / "eval.png").read_bytes() == open(latest, "rb").read()
    (ax,) = figures[1].axes
    expected = _points(second["results"])
    assert list(zip(ax.lines[0].get_xdata(), ax.lines[0].get_ydata())) == [
        (x, y) for x, y, _ in expected
    ]
    assert ax.get_title().startswith("runs/x step 7\n8 examples, block size 4")
