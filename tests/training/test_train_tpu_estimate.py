"""benchmarks/train_tpu_estimate.py: the train step of the tiny config compiled ahead of time for
one TPU v5e chip through libtpu, as a command in a subprocess on CPU (skipped where libtpu is
not installed); each row's step time, MFU and padding checked against what they are computed
from, and the compiler's FLOPs against the model's."""

import importlib.util
import json

import pytest

from tests.helpers import python_env, run_python

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.subprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason='libtpu is not installed (pip install "jax[tpu]")',
    ),
]
MICRO, BATCH, LENGTH = 2, 16, 128


@pytest.fixture(scope="module")
def estimate(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_tpu_estimate")
    rows = out / "rows.jsonl"  # GSM8K's format; answers of very different lengths
    rows.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + {i}?", "answer": "So " * (5 + 9 * i)}) + "\n"
            for i in range(12)
        )
    )
    run_python(
        "benchmarks/train_tpu_estimate.py",
        "--config=configs/tiny.py",
        "--topology=v5e:1x1",
        f"--micro_batch={MICRO}",
        "--objective=ar,mars",
        "--attention=xla",
        "--remat=none,full",
        "--packing=false,true",
        f"--rows={rows}",
        f"--output_dir={out}",
        f"--config.train.batch_size={BATCH}",
        f"--config.data.max_length={LENGTH}",
        "--config.objective.max_label_tokens=64",
        "--config.model.num_layers=2",
        env=python_env(PYTHONPATH="."),
    )
    lines = (out / "train_tpu_estimate.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], (out / "train_tpu_estimate.md").read_text()


def test_every_program_compiles_with_an_estimate(estimate):
    rows, text = estimate
    assert [(r["objective"], r["remat"], r["packing"]) for r in rows] == [
        (o, r, p) for o in ("ar", "mars") for r in ("none", "full") for p in (False, True)
    ]
    assert text.count("| v5e:1x1 |") == len(rows)
    for r in rows:
        assert "error" not in r, r
        a = BATCH // MICRO
        assert r["accumulation"] == a
        assert 0 < r["update_s"] < r["optimal_us"] / 1e6
        program = r["optimal_us"] / 1e6
        assert r["step_s"] == pytest.approx(a * (program - r["update_s"]) + r["update_s"])
        assert r["mfu"] == pytest.approx(r["model_flops"] / r["step_s"] / 197e12)
        assert r["row_mfu"] == pytest.approx(r["mfu"] * (1 - r["padding"]))
        # The compiler counts what the model formula counts (matmuls), and more with remat.
        ratio = r["compiler_over_model_flops"]
        assert 0.8 < ratio < 1.6 if r["remat"] == "none" else 1.0 < ratio < 2.2, ratio
    by = {(r["objective"], r["remat"], r["packing"]): r for r in rows}
    for objective in ("ar", "mars"):
        for packed in (False, True):
            none, full = by[(objective, "none", packed)], by[(objective, "full", packed)]
            assert full["flops"] > none["flops"]  # the recomputed forward
        unpacked, packed = by[(objective, "none", False)], by[(objective, "none", True)]
        assert packed["padding"] < unpacked["padding"]
        assert packed["model_flops"] == unpacked["model_flops"]  # the same shapes
    assert (
        by[("mars", "none", False)]["model_flops"] > 1.5 * by[("ar", "none", False)]["model_flops"]
    )
