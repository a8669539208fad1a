"""configs/smollm2_gsm8k.py and experiments/smollm2_report.py (the SmolLM2 GSM8K fine-tune's
config and its report) on made-up evaluation reports: the config passes the checks, and the
table holds each run's figures at each threshold."""

import json
import os

from experiments import smollm2_report
from mars_jax import config
from tests.helpers import config_file


def load(stage):
    return config_file("smollm2_gsm8k", stage)


def test_both_stages_pass_the_checks():
    for stage in ("mars", "ar"):
        cfg = load(stage)
        config.validate(cfg, training=True, paths=False)
        assert cfg.add_mask_token and cfg.init_from == "models/smollm2"
    assert load("mars").eval.block_size == 0 and load("ar").eval.thresholds == (1.0,)


def _report(accuracy, points):
    results = [
        {"threshold": t, "accuracy": a, "tokens_per_forward": k, "speedup": s}
        for t, a, k, s in [(1.0, accuracy, 1.0, 1.0), *points]
    ]
    return {"num_examples": 64, "ar_tokens_per_s": 50.0, "results": results}


def test_the_report_tables_every_run_and_plots(tmp_path):
    reports = {
        "untuned": _report(0.25, []),
        "ar": _report(0.3125, []),
        "mars": _report(0.296875, [(0.9, 0.28125, 1.5, 1.25)]),
    }
    for name, report in reports.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "eval.json").write_text(json.dumps(report))
    metrics = [{"step": 5, "loss": 2.0}, {"step": 10, "loss": None}]
    (tmp_path / "ar" / "metrics.jsonl").write_text("\n".join(map(json.dumps, metrics)))
    mars = [{"step": 5, "loss": 9.0, "noisy_loss": 7.0, "clean_loss": 2.0}]
    (tmp_path / "mars" / "metrics.jsonl").write_text(json.dumps(mars[0]))
    text = smollm2_report.write(str(tmp_path), str(tmp_path / "out"))
    rows = text.splitlines()
    assert rows[2].startswith("| SmolLM2-135M-Instruct | 64 | 0.250 | 50.0 | - |")
    assert rows[3].startswith("| AR control | 64 | 0.312 |")
    assert rows[4] == "| MARS B=4 | 64 | 0.297 | 50.0 | 1.50 / 0.281 / 1.25x |"
    for name in ("smollm2_gsm8k.md", "smollm2_gsm8k.json", "smollm2_gsm8k.png"):
        assert (tmp_path / "out" / name).exists()
    assert (tmp_path / "out" / "smollm2_gsm8k_loss.png").stat().st_size > 1000
