"""experiments/claims.py: which runs the claims need and how their results are tabulated (the
runs themselves are measured by the script, not here)."""

import pytest

from experiments import claims, claims_config


def test_run_configs_cover_the_three_claims():
    exp = claims_config.get_config("synthetic")
    runs = claims.run_configs(exp)
    first = f"mars_b{exp.block_sizes[0]}_ar1"
    assert list(runs) == ["stage1", "ar_control"] + [
        f"mars_b{b}_ar{w:g}" for b in exp.block_sizes for w in exp.ar_weights
    ] + [f"{first}_seed{s}" for s in exp.extra_seeds]
    # The epoch-matched control trains as long as each MARS run, with the AR objective.
    assert runs["stage1"].train.num_steps == exp.stage1_steps
    assert runs["ar_control"].train.num_steps == exp.stage2_steps
    assert runs["ar_control"].objective.name == "ar" and runs["ar_control"].objective.block_size == 1
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
    from mars_jax import settings
    for cfg in runs.values():
        settings.check(cfg, training=True)


def _report(step, accuracy_by_threshold, tpf):
    return {
        "step": step,
        "ar_nll": 0.5,
        "results": [
            {"threshold": t, "accuracy": a, "tokens_per_forward": tpf[t], "agreement_with_ar": 1.0}
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


def test_unknown_experiment():
    with pytest.raises(ValueError, match="unknown experiment"):
        claims_config.get_config("nope")
