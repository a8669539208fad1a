"""launch/memory_plan.py: the tiny config's train step, its rows packed (data.packing, as in the
paper configs), compiles ahead of time for a TPU v5e 2x2 topology through libtpu, in a
subprocess on CPU (skipped where libtpu is not installed)."""

import importlib.util
import json

import pytest

from tests.helpers import python_env, run_python, tiny_config

GiB = 1 << 30

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.subprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason='libtpu is not installed (pip install "jax[tpu]" at the installed jax version)',
    ),
]


def tiny_param_count(m) -> int:
    """Parameters of a tied-embedding Qwen2 from its architecture (independent of the model code):
    embedding, per layer q/k/v (with biases), o, gate/up/down and two norms, final norm."""
    q = m.hidden_size * m.num_heads * m.head_dim + m.num_heads * m.head_dim
    kv = 2 * (m.hidden_size * m.num_kv_heads * m.head_dim + m.num_kv_heads * m.head_dim)
    o = m.num_heads * m.head_dim * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    layer = q + kv + o + mlp + 2 * m.hidden_size
    return m.vocab_size * m.hidden_size + m.num_layers * layer + m.hidden_size


def test_tiny_plan_on_v5e_2x2():
    # Compile only: no chip is opened, so the plan must not take libtpu's lock file from (or be
    # refused by) any other process using libtpu.
    env = python_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    out = run_python(
        "launch/memory_plan.py",
        "--config=configs/tiny.py:mars",
        "--topology=v5e:2x2",
        "--grad_accum_steps=1,3",
        "--remat=none",
        "--config.objective.max_label_tokens=64",
        "--config.data.packing=True",
        "--json",
        env=env,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    # libtpu's start-up says nothing when the script sets its host variables.
    for noise in ("Failed to find host bounds", "INVALID_ARGUMENT", "could not determine TPU"):
        assert noise not in out.stderr, out.stderr[-2000:]

    ok, bad = rows
    cfg = tiny_config("mars")
    assert ok["topology"] == "v5e:2x2" and ok["device_kind"] == "TPU v5 lite"
    assert ok["devices"] == 4 and ok["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert (ok["global_batch"], ok["micro_batch"]) == (16, 16)
    assert (ok["remat"], ok["attention"], ok["objective"]) == ("none", "xla", "mars")
    assert ok["hbm_bytes"] == 16 * GiB

    # Replicated fp32 parameters plus AdamW's two fp32 moments, and a quarter of the int32
    # [16, 128] input_ids, labels, positions and segment ids (packed); TPU tiling pads small
    # arrays, hence the 1% slack.
    state = 3 * 4 * tiny_param_count(cfg.model)
    batch = 4 * 16 * cfg.data.max_length * 4 // 4
    assert state + batch <= ok["argument_bytes"] <= 1.01 * (state + batch)
    # Parameters and optimizer state are donated: their outputs reuse the argument buffers.
    assert state <= ok["alias_bytes"] <= ok["output_bytes"] <= 1.01 * state + 4096
    # Activations: at least the fp32 logits of one half of the [noisy | clean] input,
    # [4 rows per device, 64 label positions, vocab] (the step computes both halves).
    assert ok["temp_bytes"] >= 4 * 64 * cfg.model.vocab_size * 4
    assert ok["code_bytes"] > 0
    assert ok["peak_bytes"] == (
        ok["argument_bytes"]
        + ok["output_bytes"]
        - ok["alias_bytes"]
        + ok["temp_bytes"]
        + ok["code_bytes"]
    )
    assert ok["peak_bytes"] < GiB and ok["fits"] is True

    # 16 rows do not split into 3 micro-batches: reported, not raised.
    assert (bad["grad_accum_steps"], bad["micro_batch"], bad["fits"]) == (3, None, False)
    assert bad["error"] == (
        "SettingError: train.batch_size=16: must be divisible by train.grad_accum_steps=3"
    )
