"""benchmarks/decode_hlo.py: on TPU, the cached decode forward has no serial while loop over the
rows, nor do the per-row writes and reads of `mars_jax.model` (compiled ahead of time for TPU v5e
topologies through libtpu, in a subprocess on CPU; skipped where libtpu is not installed).

The vmapped dynamic_update_slice / dynamic_slice that these replaced do compile to row loops
(jax-ml/jax#21367); they are checked too, so that the loop detection is known to see one."""

import importlib.util
import json

import numpy as np
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


def bounds(row) -> list[str]:
    """The row's loops' bounds, sorted, as text ("[]": a loop whose trip count is computed, as
    the attention's loop over the cache's chunks)."""
    return sorted(str(lp["bound"]) for lp in row["loops"])


def by(rows, **keys):
    found = [r for r in rows if all(r.get(k) == v for k, v in keys.items())]
    assert found, keys
    return found


def test_no_row_loop_on_one_v5e_chip():
    rows = compile_rows("v5e:1x1")
    assert len(rows) == 2 * (2 + 2 * 2 + 2 * 2)  # windows x (forwards + writes + reads)
    for t in (1, 7):
        # The model's forward: the layer scan and its attention's loop over cache chunks.
        (fwd,) = by(rows, kind="forward", scheme="model", window=t)
        assert fwd["row_loops"] == 0
        assert bounds(fwd) == sorted([str(LAYERS), "[]"])
        assert {lp["source"] for lp in fwd["loops"]} == {"while"}
        assert "scatter" not in fwd["ops"]
        for r in by(rows, scheme="model", window=t):
            assert r["while_loops"] == 0 or r["kind"] == "forward", r

        # Before: one row loop per cache write (keys and values).
        (old,) = by(rows, kind="forward", scheme="vmap_dus", window=t)
        assert old["row_loops"] == 2
        assert bounds(old) == sorted([str(LAYERS), "[]", str(ROWS), str(ROWS)])
        for r in by(rows, kind="write", scheme="vmap_dus", window=t):
            assert [(lp["bound"], lp["source"]) for lp in r["loops"]] == [(ROWS, "scatter")], r

    # The token window of a MARS step, read per row with a vmapped dynamic_slice: a row loop.
    (old_read,) = by(rows, kind="read", array="tokens", scheme="vmap_ds", window=7)
    assert [(lp["bound"], lp["source"]) for lp in old_read["loops"]] == [(ROWS, "gather")]


def test_rows_stay_local_on_v5e_2x2():
    # Rows split over 4 chips: no loop over a device's rows, and no collective of the cache's size.
    rows = compile_rows("v5e:2x2")
    for r in by(rows, scheme="model"):
        assert r["devices"] == 4 and r["row_loops"] == 0, r
        # The collectives: the batch's highest cached slot (a scalar), the trip count of the
        # attention's loop over cache chunks; and, in a forward that writes the cache, one row's new
        # window [L, 1, T, K, H] (kv_cache._write_rows slices each row of the row-sharded window,
        # which the partitioner gathers: 2 x rows tiny all-reduces a step, a known cost left to fix
        # with a per-device write). Nothing of the cache's size crosses chips.
        w = r["window"]
        windows = {f"all-reduce f32[{LAYERS},1,{w},2,16]", f"all-reduce f32[1,{w},2,16]"}
        assert set(r["collectives"]) <= {"all-reduce s32[]"} | windows, r
    # Before: the row loops run over each device's 3 rows.
    (old,) = by(rows, kind="forward", scheme="vmap_dus", window=7)
    assert old["row_loops"] == 2
    assert bounds(old) == sorted([str(LAYERS), "[]", str(ROWS // 4), str(ROWS // 4)])


@pytest.mark.slow  # 90-100 s each on a shared 2-core CPU
@pytest.mark.parametrize("topology", ["v5e:1x1", "v5e:2x2"])
def test_whole_decoders_have_no_row_loop_and_write_the_cache_in_place(topology):
    """Every decoder, lowered whole (prefill, step loop, output), and the engine's
    `Decoder.steps` (one chip), in bf16 with a cache wider than a chunk: its loops are the step
    loop, the layer scans (inside the step and in the prefill) and their attention's loops over
    cache chunks, never one over rows; and on one chip nothing inside a loop copies, broadcasts,
    transposes or rewrites a cache-shaped buffer (`cache_rewrites`, naming the instruction)."""
    names = ["ar", "sliding", "block", "verify", "none"] + (
        ["steps"] if topology == "v5e:1x1" else []
    )
    rows = by(
        compile_rows(
            topology,
            "--writes=",
            "--reads=",
            "--windows=",
            f"--decoders={','.join(names)}",
            "--prompt_len=150",
            "--config.model.dtype=bfloat16",
            "--config.model.param_dtype=bfloat16",
        ),
        kind="decoder",
    )
    assert [r["scheme"] for r in rows] == names
    for r in rows:
        assert r["row_loops"] == 0, r
        assert {lp["source"] for lp in r["loops"]} == {"while"}, r
        ints = {b for lp in r["loops"] for b in np.atleast_1d(lp["bound"]).tolist()}
        assert r["max_forwards"] in ints and LAYERS in ints, r
        if r["devices"] > 1:
            assert not {"all-to-all", "collective-permute"} & set(r["ops"]), r
        else:
            # Rows split over chips: layout assignment relayouts each chip's cache as it enters
            # the layer scan (docs/decoding.md); on one chip nothing is copied.
            assert r["cache_rewrites"] == [], "\n".join(r["cache_rewrites"])
