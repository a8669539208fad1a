"""Non-finite losses and gradients: the jitted step skips the update, the run
loop counts and logs the skip with its batch's source rows, and stops after
train.max_consecutive_skips skips in a row; row ids travel with the data."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mars_jax import config, errors, objectives, train, train_inputs, train_step
from mars_jax import workdir as wd
from mars_jax.batches import batched_dataset, build_examples
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import CausalLM, ModelConfig
from mars_jax.rows import load_rows
from mars_jax.tokenizer import MASK_ID, load_tokenizer
from tests.helpers import complete, python_env, run_python, tiny_config


def leaf_bytes(tree):
    """Every leaf's raw bytes (bitwise comparison: -0.0 differs from 0.0)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------------------------
# The jitted step alone.

BAD = 120  # a token id placed only in row 3 of the bad batch


def has_bad(batch):
    return (batch["input_ids"] == BAD).any()


def nan_loss(model, batch, obj):
    """The reported loss is NaN on a bad micro-batch; its gradients stay finite."""
    loss, metrics = objectives.loss_fn(model, batch, obj)
    return loss, {**metrics, "loss": jnp.where(has_bad(batch), jnp.nan, metrics["loss"])}


def steep_loss(model, batch, obj):
    """A finite loss whose gradient entries are finite but whose global norm overflows fp32 on
    a bad micro-batch: 1e30 * |params|^2 has gradient 2e30 * params."""
    loss, metrics = objectives.loss_fn(model, batch, obj)
    squares = sum(jnp.sum(x**2) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return loss + jnp.where(has_bad(batch), 1e30, 0.0) * squares, metrics


@pytest.mark.parametrize("case", ["forward", "loss", "grad"])
def test_step_skips_a_nonfinite_update_and_keeps_the_state_bitwise(case, monkeypatch):
    """Bad token in one row (one of 2 micro-batches): the whole update is skipped, parameters
    and optimizer state come back bit for bit; the same step on a clean batch updates."""
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
    )
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
    if case == "forward":  # an infinite embedding row: RMSNorm gives inf * 0 = NaN in its row
        embedding = params["embed_tokens"]["embedding"]
        embedding[...] = embedding[...].at[BAD].set(jnp.inf)
    else:
        monkeypatch.setattr(train_step, "loss_fn", {"loss": nan_loss, "grad": steep_loss}[case])
    ids = np.random.RandomState(0).randint(1, 100, (4, 8)).astype(np.int32)
    labels = ids.copy()
    labels[:, :3] = IGNORE_INDEX
    clean = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}
    bad = {"input_ids": clean["input_ids"].at[3, 5].set(BAD), "labels": clean["labels"]}
    obj = ObjectiveConfig(
        name="ar",
        normalization="sequence",
        noisy_weighting="none",
        max_label_tokens=None,
        ce_chunk_size=0,
    )
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    step = jax.jit(train_step.make_train_step(graphdef, tx, obj, grad_accum_steps=2))

    new_params, new_opt, metrics = step(params, opt_state, bad)
    if case == "forward":  # the premise, from the objective alone: row 3's micro-batch is NaN
        micro = jax.tree.map(lambda x: x[jnp.array([1, 3])], bad)
        loss, _ = objectives.loss_fn(nnx.merge(graphdef, params), micro, obj)
        assert not np.isfinite(float(loss))
        assert not np.isfinite(float(metrics["loss"]))
    elif case == "loss":
        assert not np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    else:
        assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) == np.inf
    assert bool(metrics["skipped"])
    assert leaf_bytes(new_params) == leaf_bytes(params)
    assert leaf_bytes(new_opt) == leaf_bytes(opt_state)
    assert int(new_opt[0].count) == 0  # the schedule's step did not advance

    new_params, new_opt, metrics = step(params, opt_state, clean)
    assert not bool(metrics["skipped"]) and np.isfinite(float(metrics["loss"]))
    assert int(new_opt[0].count) == 1
    assert leaf_bytes(new_params) != leaf_bytes(params)


# ----------------------------------------------------------------------------------------------
# A training run with poisoned batches.

LR = 3e-3
NUM_STEPS = 6
POISONED = (1, 3, 4)  # batch positions (steps 2, 4 and 5) that get a marked example


# configs/tiny.py (stage ar) shrunk to a few seconds a step.
SMALL_RUN = {
    "train.num_steps": NUM_STEPS,
    "train.batch_size": 4,
    "train.log_every": 1,
    "train.save_every": 1,
    "train.max_to_keep": 10,
    "train.learning_rate": LR,
    "train.max_consecutive_skips": 2,
    "data.num_synthetic_train": 32,
    "model.num_layers": 1,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.head_dim": 8,
}


def flat_params(workdir, step):
    model, _, _ = wd.load_model(workdir, step=step)
    return leaf_bytes(nnx.state(model, nnx.Param))


def test_run_skips_poisoned_batches_logs_rows_and_stops(tmp_path, monkeypatch, caplog):
    """Steps 2, 4 and 5 see a batch whose loss is NaN (a marked example; the gradient stays
    finite, so only the loss check can catch it). With max_consecutive_skips 2: step 2 is
    skipped, step 3 trains, steps 4 and 5 are skipped and the run stops at step 5. Resumed with
    max_consecutive_skips 0, it skips step 5 again and finishes."""
    cfg = tiny_config("ar", SMALL_RUN)
    examples = {}

    def marked_examples(cfg, tok):
        """The real examples, with <|mask|> (never in an AR input) as the first token of the
        first example of each POISONED batch."""
        out = real_examples(cfg, tok)
        batches = batched_dataset(out, batch_size=4, max_length=cfg.data.max_length, seed=cfg.seed)
        rows = {int(batches[p]["row_ids"][0]) for p in POISONED}
        out = [
            e._replace(input_ids=np.r_[MASK_ID, e.input_ids[1:]]) if e.row in rows else e
            for e in out
        ]
        examples["list"] = out
        return out

    def poisoned_loss(model, batch, obj):
        loss, metrics = objectives.loss_fn(model, batch, obj)
        loss = jnp.where((batch["input_ids"] == MASK_ID).any(), jnp.nan, loss)
        return loss, {**metrics, "loss": loss}

    real_examples = train_inputs.load_train_examples
    monkeypatch.setattr(train_inputs, "load_train_examples", marked_examples)
    monkeypatch.setattr(train_step, "loss_fn", poisoned_loss)
    caplog.set_level("WARNING", logger="absl")
    workdir = str(tmp_path / "run")
    with pytest.raises(FloatingPointError) as raised:
        train.train(cfg, workdir)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("step 5: 2 consecutive steps had a non-finite loss")
    for hint in ("train.learning_rate", "data rows", "bf16", "train.grad_clip"):
        assert hint in message, hint

    # The warnings name each skipped step and the source rows of its batch: the rows whose
    # examples the batch holds (an oracle by content).
    warned = {}
    for record in caplog.records:
        text = record.getMessage()
        if "skipped: non-finite" in text:
            warned[int(text.split()[1])] = json.loads(text.rsplit(": ", 1)[1])
    assert sorted(warned) == [2, 4, 5]
    by_row = {e.row: e for e in examples["list"]}
    batches = batched_dataset(
        examples["list"], batch_size=4, max_length=cfg.data.max_length, seed=cfg.seed
    )
    for step, rows in warned.items():
        ids = batches[step - 1]["input_ids"]
        assert len(rows) == 4 and MASK_ID in ids
        for j, row in enumerate(rows):
            expected = by_row[row].input_ids
            np.testing.assert_array_equal(ids[j, : len(expected)], expected)

    # A skipped step saves the parameters of the step before, bit for bit; step 3 trained.
    assert sorted(map(int, os.listdir(os.path.join(workdir, "checkpoints")))) == [1, 2, 3, 4]
    p1, p2, p3, p4 = (flat_params(workdir, s) for s in (1, 2, 3, 4))
    assert p2 == p1 and p4 == p3
    assert p3 != p2

    def strict(value):  # a strict JSON reader: NaN / Infinity are not JSON
        raise ValueError(f"not JSON: {value}")

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line, parse_constant=strict) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["skipped"] for r in records] == [0, 1, 0, 1]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 2]
    assert [r["loss"] is not None and math.isfinite(r["loss"]) for r in records] == [1, 0, 1, 0]

    # Warmup 1 step from 0, then linear decay to 0 over 5 updates; skips do not advance it.
    def rate(updates):
        return 0.0 if updates == 0 else LR * (1 - (updates - 1) / (NUM_STEPS - 1))

    np.testing.assert_allclose(
        [r["learning_rate"] for r in records], [rate(0), rate(1), rate(1), rate(2)], rtol=1e-6
    )

    # Resuming with the limit changed (allowed) and 0 (never stop): step 5 skips again.
    caplog.clear()
    last = train.train(tiny_config("ar", SMALL_RUN, train__max_consecutive_skips=0), workdir)
    assert last["step"] == NUM_STEPS and last["skipped"] == 0 and last["skipped_steps"] == 3
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 2, 3, 3]
    assert records[-1]["learning_rate"] == pytest.approx(rate(2), rel=1e-6)  # 3rd update
    assert [m for m in caplog.messages if "skipped: non-finite" in m][0].startswith("step 5 ")


def test_max_consecutive_skips_setting_is_checked():
    cfg = tiny_config("ar", SMALL_RUN)
    config.validate(cfg, training=True)
    cfg.train.max_consecutive_skips = -1
    with pytest.raises(errors.SettingError, match=r"^train\.max_consecutive_skips=-1: "):
        config.validate(cfg, training=True)


# ----------------------------------------------------------------------------------------------
# Row ids in the data pipeline.


def test_examples_and_batches_carry_source_row_ids():
    """A skipped row leaves a gap in the row ids; batches hold each example's row, -1 for
    padding rows, and a process's part holds its rows' ids."""
    tok = load_tokenizer(None)
    rows = load_rows("synthetic", num_rows=6, seed=0)
    rows[2] = {"question": "no answer"}  # skipped: missing_field
    examples, skips = build_examples(rows, tok, "gsm8k", max_length=128, block_size=4)
    assert skips == {"missing_field": 1}
    assert [e.row for e in examples] == [0, 1, 3, 4, 5]
    for e in examples:  # each example is its row's tokenization
        alone, _ = build_examples([rows[e.row]], tok, "gsm8k", max_length=128, block_size=4)
        np.testing.assert_array_equal(alone[0].input_ids, e.input_ids)

    kw = dict(
        batch_size=4, max_length=128, seed=0, shuffle=False, num_epochs=1, drop_remainder=False
    )
    batches = batched_dataset(examples, **kw)
    assert [b["row_ids"].tolist() for b in batches] == [[0, 1, 3, 4], [5, -1, -1, -1]]
    assert batches[0]["row_ids"].dtype == np.int32
    part = batched_dataset(examples, **kw, rows=[1, 3])
    assert [b["row_ids"].tolist() for b in part] == [[1, 4], [-1, -1]]


X64_SCRIPT = """
import json, sys
import jax
from tests.helpers import complete, tiny_config
from mars_jax import train
assert jax.config.jax_enable_x64  # JAX_ENABLE_X64=1, as some environments set it
cfg = tiny_config("mars", model__num_layers=1, train__num_steps=2, train__batch_size=4)
train.train(cfg, sys.argv[1])
out = [
    complete(sys.argv[1], ["What is 2 + 3?"], threshold=0.5, max_new_tokens=4, **kw)
    for kw in ({}, {"temperature": 0.8})
]
print(json.dumps([o[0]["tokens"] for o in out]))
"""


@pytest.mark.subprocess
def test_jax_enable_x64_trains_and_decodes_the_same(tmp_path):
    """JAX_ENABLE_X64=1 once failed at the first training step; now a run under it ends with the
    same parameters, bit for bit, and decodes (greedy and sampled) the same tokens."""
    x64 = tmp_path / "x64"
    proc = run_python("-c", X64_SCRIPT, str(x64), env=python_env(JAX_ENABLE_X64="1"))
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = str(tmp_path / "plain")
    cfg = tiny_config("mars", model__num_layers=1, train__num_steps=2, train__batch_size=4)
    train.train(cfg, plain)
    ours = [
        complete(plain, ["What is 2 + 3?"], threshold=0.5, max_new_tokens=4, **kw)[0]
        for kw in ({}, {"temperature": 0.8})
    ]
    assert theirs == [o["tokens"] for o in ours]
    a, b = (nnx.state(wd.load_model(w)[0]) for w in (str(x64), plain))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
