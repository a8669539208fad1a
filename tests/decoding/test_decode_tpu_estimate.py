"""benchmarks/decode_tpu_estimate.py: every decode-step program of the tiny shape compiles ahead
of time for one TPU v5e chip through libtpu, as a command in a subprocess on CPU (skipped where
libtpu is not installed); its rows and the derived fixed-acceptance table are checked against
what they are computed from."""

import importlib.util
import json
import math
import sys

import pytest

from tests.helpers import ROOT, python_env, run_python

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.subprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason='libtpu is not installed (pip install "jax[tpu]")',
    ),
]
BLOCK = 2


@pytest.fixture(scope="module")
def estimate(tmp_path_factory):
    out = tmp_path_factory.mktemp("tpu_estimate")
    run_python(
        "benchmarks/decode_tpu_estimate.py",
        "--shape=tiny",
        "--topology=v5e:1x1",
        "--tensor=1",
        "--batch_sizes=1",
        f"--block_sizes={BLOCK}",
        "--prompt_len=16",
        "--max_new_tokens=8",
        f"--output_dir={out}",
        env=python_env(PYTHONPATH="."),
    )
    lines = (out / "decode_tpu_estimate.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return rows, (out / "decode_tpu_estimate.md").read_text()


def test_every_program_compiles_with_an_estimate(estimate):
    rows, _ = estimate
    assert [r["program"] for r in rows] == ["ar", "narrow", "wide", "fill", "commit"]
    slots = 16 + 8 + 2 * (2 * BLOCK - 1)
    for r in rows:
        assert r["optimal_us"] > 0 and r["flops"] > 0
        # Every step reads at least its parameters (bf16; the argument bytes hold them).
        assert r["bytes_accessed"] >= 0.9 * r["argument_bytes"] > 0
        assert r["slots"] == (16 + 8 + 2 * 1 if r["program"] == "ar" else slots)
        assert r["compiler_over_roofline"] == pytest.approx(r["optimal_us"] / r["roofline_us"])
    by = {r["program"]: r for r in rows}
    # A wider window does more arithmetic: 2B-1 query slots against B against 1.
    assert by["ar"]["flops"] < by["narrow"]["flops"] < by["wide"]["flops"]


def test_fixed_acceptance_table_is_derived_from_the_programs(estimate):
    rows, md = estimate
    sys.path.insert(0, str(ROOT))
    from benchmarks import decode_tpu_estimate

    by = {r["program"]: r for r in rows}
    table = decode_tpu_estimate.fixed_acceptance(rows)
    assert [(t["mode"], t["accept"]) for t in table] == [
        (m, k) for k in range(1, BLOCK + 1) for m in ("sliding", "block")
    ]
    for t in table:
        k = t["accept"]
        if t["mode"] == "sliding":
            step = by["narrow" if k == 1 else "wide"]["optimal_us"]
            assert t["tokens_per_forward"] == k
        else:
            fills = math.ceil(BLOCK / k)
            step = (fills * by["fill"]["optimal_us"] + by["commit"]["optimal_us"]) / (fills + 1)
            assert t["tokens_per_forward"] == pytest.approx(BLOCK / (fills + 1))
        assert t["step_us"] == pytest.approx(step)
        assert t["conversion"] == pytest.approx(by["ar"]["optimal_us"] / step)
        assert t["speedup"] == pytest.approx(t["tokens_per_forward"] * t["conversion"])
    assert md.startswith("libtpu's estimate") and md.count("\n| tiny |") == len(rows) + len(table)
