"""benchmarks/decode_hlo.py: on TPU, the cached decode forward has no serial while loop over the
rows, nor do the per-row writes and reads of `mars_jax.model` (compiled ahead of time for TPU v5e
topologies through libtpu, in a subprocess on CPU; skipped where libtpu is not installed).

The vmapped dynamic_update_slice / dynamic_slice that these replaced do compile to row loops
(jax-ml/jax#21367); they are checked too, so that the loop detection is known to see one."""

import importlib.util
import json

import pytest

from tests.helpers import python_env, run_python

LAYERS = 2  # configs/tiny.py
ROWS = 12  # rows per device (12 on one chip, 3 on four) differ from the layers and windows

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.subprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason='libtpu is not installed (pip install "jax[tpu]" at the installed jax version)',
    ),
]


def compile_rows(topology: str, *extra: str) -> list[dict]:
    """The script's JSON rows for the tiny model, R = 12, S = 64, T = 1 and 7 (AR, MARS B = 4);
    ``extra`` flags replace the defaults."""
    env = python_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # compile only: no chip, no lock file needed
    out = run_python(
        "benchmarks/decode_hlo.py",
        "--config=configs/tiny.py",
        f"--topology={topology}",
        f"--rows={ROWS}",
        "--slots=64",
        "--windows=1,7",
        "--writes=model,vmap_dus",
        "--reads=model,vmap_ds",
        "--cpu_repeats=0",
        "--json",
        *extra,
        env=env,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def by(rows, **keys):
    found = [r for r in rows if all(r.get(k) == v for k, v in keys.items())]
    assert found, keys
    return found


def test_no_row_loop_on_one_v5e_chip():
    rows = compile_rows("v5e:1x1")
    assert len(rows) == 2 * (2 + 2 * 2 + 2 * 2)  # windows x (forwards + writes + reads)
    for t in (1, 7):
        # The model's forward: the layer scan is its only loop.
        (fwd,) = by(rows, kind="forward", scheme="model", window=t)
        assert fwd["row_loops"] == 0
        assert [(lp["bound"], lp["source"]) for lp in fwd["loops"]] == [(LAYERS, "while")]
        assert "scatter" not in fwd["ops"]
        for r in by(rows, scheme="model", window=t):
            assert r["while_loops"] == 0 or r["kind"] == "forward", r

        # Before: one row loop per cache write (keys and values) in the layer scan.
        (old,) = by(rows, kind="forward", scheme="vmap_dus", window=t)
        assert old["row_loops"] == 2
        assert sorted(lp["bound"] for lp in old["loops"]) == [LAYERS, ROWS, ROWS]
        for r in by(rows, kind="write", scheme="vmap_dus", window=t):
            assert [(lp["bound"], lp["source"]) for lp in r["loops"]] == [(ROWS, "scatter")], r

    # The token window of a MARS step, read per row with a vmapped dynamic_slice: a row loop.
    (old_read,) = by(rows, kind="read", array="tokens", scheme="vmap_ds", window=7)
    assert [(lp["bound"], lp["source"]) for lp in old_read["loops"]] == [(ROWS, "gather")]


def test_rows_stay_local_on_v5e_2x2():
    # Rows split over 4 chips: no loop over a device's rows, and no collective.
    rows = compile_rows("v5e:2x2")
    for r in by(rows, scheme="model"):
        assert r["devices"] == 4 and r["row_loops"] == 0, r
        assert not {"all-gather", "all-reduce", "all-to-all", "collective-permute"} & set(r["ops"])
    # Before: the row loops run over each device's 3 rows.
    (old,) = by(rows, kind="forward", scheme="vmap_dus", window=7)
    assert old["row_loops"] == 2
    assert sorted(lp["bound"] for lp in old["loops"]) == sorted([LAYERS, ROWS // 4, ROWS // 4])


@pytest.mark.slow  # 90-100 s each on a shared 2-core CPU
@pytest.mark.parametrize("topology", ["v5e:1x1", "v5e:2x2"])
def test_whole_decoders_have_no_row_loop(topology):
    """Every decoder, lowered whole (prefill, step loop, output): its loops are the step loop
    and the layer scans (inside the step and in the prefill), never one over rows."""
    names = ["ar", "sliding", "block", "verify", "none"]
    rows = by(
        compile_rows(
            topology, "--writes=", "--reads=", "--windows=", f"--decoders={','.join(names)}"
        ),
        kind="decoder",
    )
    assert [r["scheme"] for r in rows] == names
    for r in rows:
        assert r["row_loops"] == 0, r
        assert {lp["source"] for lp in r["loops"]} == {"while"}, r
        bounds = {lp["bound"] for lp in r["loops"]}
        assert r["max_forwards"] in bounds and LAYERS in bounds, r
        if r["devices"] > 1:
            assert not {"all-to-all", "collective-permute"} & set(r["ops"]), r
