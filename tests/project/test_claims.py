"""experiments/claims.py: which runs the claims need and how their results are tabulated (the
runs themselves are measured by the script, not here)."""

import pytest

from experiments import claims, claims_config


def test_run_configs_cover_the_three_claims():
    exp = claims_config.get_config("synthetic")
    runs = claims.run_configs(exp)
    # Block sizes 4, 8 and 16, each with and without the AR loss, and the first again with seed 1.
    assert (exp.block_sizes, exp.ar_weights, exp.extra_seeds) == ((4, 8, 16), (1.0, 0.0), (1,))
    assert list(runs) == [
        "stage1",
        "ar_control",
        "mars_b4_ar1",
        "mars_b4_ar0",
        "mars_b8_ar1",
        "mars_b8_ar0",
        "mars_b16_ar1",
        "mars_b16_ar0",
        "mars_b4_ar1_seed1",
    ]
    first = "mars_b4_ar1"
    # The epoch-matched control trains as long as each MARS run, with the AR objective.
    assert runs["stage1"].train.num_steps == exp.stage1_steps
    assert runs["ar_control"].train.num_steps == exp.stage2_steps
    assert (
        runs["ar_control"].objective.name == "ar" and runs["ar_control"].objective.block_size == 1
    )
    for b in exp.block_sizes:
        with_ar, without = runs[f"mars_b{b}_ar1"].objective, runs[f"mars_b{b}_ar0"].objective
        assert (with_ar.name, with_ar.block_size, with_ar.ar_weight) == ("mars", b, 1.0)
        assert with_ar.noisy_weighting == "none"
        # The paper's "w/o SFT loss" rows: no clean CE, noisy CE weighted by 1/(t + 1e-6).
        assert (without.ar_weight, without.noisy_weighting) == (0.0, "inverse_t")
        assert runs[f"mars_b{b}_ar1"].eval.thresholds == tuple(exp.thresholds)
    assert [runs[f"{first}_seed{s}"].seed for s in exp.extra_seeds] == list(exp.extra_seeds)
    assert runs["stage1"].seed == exp.run.seed not in exp.extra_seeds
    # Every run is a valid config of the trainer.
    from mars_jax import config

    for cfg in runs.values():
        config.validate(cfg, training=True)


def _report(step, accuracy_by_threshold, tpf, tokens_per_s=None):
    tokens_per_s = tokens_per_s or {t: 10.0 for t in accuracy_by_threshold}
    return {
        "step": step,
        "ar_nll": 0.5,
        "results": [
            {
                "threshold": t,
                "accuracy": a,
                "tokens_per_forward": tpf[t],
                "agreement_with_ar": 1.0,
                "tokens_per_s": tokens_per_s[t],
            }
            for t, a in accuracy_by_threshold.items()
        ],
    }


def test_tables_show_each_run_where_it_belongs():
    exp = claims_config.get_config("smoke")
    exp.thresholds = (1.0, 0.9)
    exp.headline_threshold = 0.9
    tpf = {1.0: 1.0, 0.9: 2.5}
    runs = {
        "stage1": {"report": _report(2, {1.0: 0.25}, tpf)},
        "ar_control": {"report": _report(2, {1.0: 0.5}, tpf)},
        "mars_b4_ar1": {"report": _report(2, {1.0: 0.75, 0.9: 0.625}, tpf)},
    }
    text = claims.tables(exp, runs)
    assert "| ar_control | 2 | 0.500 | 0.5000 |" in text
    assert "| mars_b4_ar1 | 1.00 / 0.750 / 1.00 | 2.50 / 0.625 / 1.00 |" in text
    assert "| 4 | 2.50 / 0.625 | - |" in text  # mars_b4_ar0 has not run yet
    assert "| 8 | - | - |" in text


def test_wall_clock_is_over_the_ar_control():
    """Speedup = a MARS run's tokens/s over the AR control's at threshold 1.0 (not over its own
    threshold 1.0, nor over stage 1's); conversion = speedup / tokens per forward."""
    exp = claims_config.get_config("smoke")
    exp.thresholds = (1.0, 0.9)
    tpf = {1.0: 1.0, 0.9: 2.5}
    runs = {
        "stage1": {"report": _report(2, {1.0: 0.25}, tpf, {1.0: 80.0})},
        "mars_b4_ar1": {"report": _report(2, {1.0: 0.75, 0.9: 0.625}, tpf, {1.0: 30.0, 0.9: 60.0})},
    }
    assert "Wall clock" not in claims.tables(exp, runs)  # no AR control evaluated yet
    runs["ar_control"] = {"report": _report(2, {1.0: 0.5}, tpf, {1.0: 40.0})}
    text = claims.tables(exp, runs)
    assert "over the AR control's 40.0 tokens/s" in text
    # 30 / 40 = 0.75x (/ 1.0 token per forward); 60 / 40 = 1.5x, / 2.5 = 0.60.
    assert "| mars_b4_ar1 | 0.75x / 0.75 | 1.50x / 0.60 |" in text


def test_unknown_experiment():
    with pytest.raises(ValueError, match="unknown experiment"):
        claims_config.get_config("nope")


def test_stage2_learning_rate_and_a_stage1_from_elsewhere(monkeypatch, tmp_path):
    exp = claims_config.get_config("synthetic_stage2_lr")
    runs = claims.run_configs(exp)
    assert list(runs) == ["stage1", "ar_control", "mars_b4_ar1"]
    assert runs["stage1"].train.learning_rate == exp.run.train.learning_rate
    assert exp.stage2_learning_rate not in (0, exp.run.train.learning_rate)
    for name in ("ar_control", "mars_b4_ar1"):
        assert runs[name].train.learning_rate == exp.stage2_learning_rate
    default = claims.run_configs(claims_config.get_config("synthetic"))
    assert {c.train.learning_rate for c in default.values()} == {exp.run.train.learning_rate}

    # run_each trains (resumes) stage 1 where stage1_workdir says, and starts every run from it.
    exp.stage1_workdir = str(tmp_path / "elsewhere" / "stage1")
    steps, trained = {}, []

    def fake_train(cfg, workdir):
        trained.append((workdir, cfg.init_from))
        steps[workdir] = cfg.train.num_steps

    class FakeCheckpoints:
        def __init__(self, workdir):
            self.workdir = workdir

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def latest_step(self):
            return steps[self.workdir]

    monkeypatch.setattr(claims.train, "train", fake_train)
    monkeypatch.setattr(claims, "Checkpoints", FakeCheckpoints)
    monkeypatch.setattr(claims.evaluate, "evaluate", lambda cfg, workdir: {"step": 0})
    done = [name for name, _ in claims.run_each(exp, str(tmp_path / "root"))]
    assert done == list(runs)
    root = str(tmp_path / "root")
    assert trained == [
        (exp.stage1_workdir, ""),
        (f"{root}/ar_control", exp.stage1_workdir),
        (f"{root}/mars_b4_ar1", exp.stage1_workdir),
    ]


def test_an_evaluation_made_with_other_eval_settings_is_not_reused(tmp_path):
    """A rerun reuses a run's eval.json only if it was made as the experiment now asks: after
    --config.run.eval.num_examples=... (or another cache mode or rule) the old figures would be
    reported as the new ones."""
    import json

    cfg = claims.run_configs(claims_config.get_config("smoke"))["mars_b4_ar1"]
    report = {
        "step": cfg.train.num_steps,
        "num_examples": cfg.eval.num_examples,
        "cache_mode": cfg.eval.cache_mode,
        "rule": cfg.eval.rule,
        "results": [{"threshold": float(t)} for t in cfg.eval.thresholds],
    }
    (tmp_path / "eval.json").write_text(json.dumps(report))
    assert claims._finished_eval(str(tmp_path), cfg) == report
    for key, other in (
        ("num_examples", cfg.eval.num_examples + 1),
        ("cache_mode", "block"),
        ("rule", "verify"),
    ):
        changed = cfg.copy_and_resolve_references()
        changed.eval[key] = other
        assert claims._finished_eval(str(tmp_path), changed) is None, key


def test_results_go_under_the_workdir_by_default(monkeypatch, tmp_path):
    """An experiment run writes its tables, JSON and plot to WORKDIR/results unless --results
    names another directory; the tracked experiments/results/ (committed results) is never the
    default."""
    import os

    exp = claims_config.get_config("smoke")
    exp.thresholds = (1.0, 0.9)
    tpf = {1.0: 1.0, 0.9: 2.5}
    fake = {
        "stage1": _report(2, {1.0: 0.25}, tpf),
        "ar_control": _report(2, {1.0: 0.5}, tpf),
        "mars_b4_ar1": _report(2, {1.0: 0.75, 0.9: 0.625}, tpf),
    }
    monkeypatch.setattr(
        claims,
        "run_each",
        lambda exp, root: (
            (name, {"report": r, "train_s": 1.0, "eval_s": 1.0}) for name, r in fake.items()
        ),
    )
    committed = sorted(os.listdir(os.path.join(os.path.dirname(claims.__file__), "results")))

    root = tmp_path / "runs"
    text = claims.claims(exp, str(root))
    assert text.startswith("### smoke: ") and "| mars_b4_ar1 | 1.00 / 0.750 / 1.00 |" in text
    assert sorted(os.listdir(root / "results")) == ["smoke.json", "smoke.md", "smoke.png"]
    assert (root / "results" / "smoke.md").read_text() == text
    elsewhere = tmp_path / "elsewhere"
    claims.claims(exp, str(root), str(elsewhere))
    assert sorted(os.listdir(elsewhere)) == ["smoke.json", "smoke.md", "smoke.png"]
    assert claims.results_dir("w") == os.path.join("w", "results")
    assert claims.results_dir("w", "x") == "x"
    assert (
        sorted(os.listdir(os.path.join(os.path.dirname(claims.__file__), "results"))) == committed
    )


def test_the_module_is_a_program():
    """``python -m experiments.claims`` needs its entry point (a refactor once dropped it)."""
    assert callable(claims.main)
    assert "main()" in open(claims.__file__).read().rsplit('if __name__ == "__main__":', 1)[1]
