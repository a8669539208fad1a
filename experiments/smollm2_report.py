r"""The table and plots of the SmolLM2-135M-Instruct GSM8K fine-tune (launch/smollm2_gsm8k.sh).

  python -m experiments.smollm2_report --run=runs/smollm2 --output_dir=experiments/results

Reads RUN/{untuned,ar,mars}/eval.json (`mars_jax.evaluate` reports) and RUN/{ar,mars}/
metrics.jsonl, and writes OUTPUT_DIR/smollm2_gsm8k.{md,json} (the table), smollm2_gsm8k.png
(tokens per forward against accuracy) and smollm2_gsm8k_loss.png (the loss curves).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from mars_jax import plots

RUNS = (("untuned", "SmolLM2-135M-Instruct"), ("ar", "AR control"), ("mars", "MARS B=4"))


def _at(report: dict, threshold: float) -> dict | None:
    return next((r for r in report["results"] if abs(r["threshold"] - threshold) < 1e-9), None)


def table(reports: dict[str, dict]) -> str:
    """The Markdown table: one row per run, accuracy at 1.0, then tokens per forward /
    accuracy, and speedup over AR (same run, same weights) at each lower threshold."""
    thresholds = sorted(
        {r["threshold"] for rep in reports.values() for r in rep["results"]} - {1.0}, reverse=True
    )
    head = ["run", "examples", "accuracy at 1.0", "AR tokens/s"]
    head += [f"at {t:g}: tokens/forward / accuracy / speedup" for t in thresholds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, label in RUNS:
        if name not in reports:
            continue
        rep = reports[name]
        one = _at(rep, 1.0)
        cells = [label, str(rep["num_examples"]), f"{one['accuracy']:.3f}" if one else "-"]
        cells.append(f"{rep['ar_tokens_per_s']:.1f}")
        for t in thresholds:
            r = _at(rep, t)
            cells.append(
                "-"
                if r is None
                else f"{r['tokens_per_forward']:.2f} / {r['accuracy']:.3f} / {r['speedup']:.2f}x"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _metrics(path: str) -> list[dict]:
    """metrics.jsonl's records; an AR run's loss is its clean (AR) loss."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r if "clean_loss" in r else {**r, "clean_loss": r.get("loss")} for r in records]


def write(run: str, output_dir: str) -> str:
    reports = {}
    for name, _ in RUNS:
        path = os.path.join(run, name, "eval.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[name] = json.load(f)
    if not reports:
        raise FileNotFoundError(f"no {run}/{{untuned,ar,mars}}/eval.json")
    os.makedirs(output_dir, exist_ok=True)
    base = os.path.join(output_dir, "smollm2_gsm8k")
    text = table(reports)
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(reports, f, indent=1)
    labels = dict(RUNS)
    plots.pareto_plot(
        {labels[n]: rep["results"] for n, rep in reports.items()},
        base + ".png",
        title="SmolLM2-135M-Instruct on GSM8K test: tokens per forward vs accuracy",
    )
    curves = {
        labels[n]: _metrics(os.path.join(run, n, "metrics.jsonl"))
        for n in ("ar", "mars")
        if os.path.exists(os.path.join(run, n, "metrics.jsonl"))
    }
    if curves:
        plots.loss_plot(
            curves,
            base + "_loss.png",
            keys=("clean_loss", "noisy_loss"),
            title="SmolLM2-135M-Instruct on GSM8K train: clean (AR) and noisy (MARS) losses",
        )
    return text


_RUN = flags.DEFINE_string("run", "runs/smollm2", "the launch/smollm2_gsm8k.sh run directory")
_OUT = flags.DEFINE_string("output_dir", "experiments/results", "where the files go")


def main(argv):
    del argv
    print(write(_RUN.value, _OUT.value), end="")


if __name__ == "__main__":
    app.run(main)
