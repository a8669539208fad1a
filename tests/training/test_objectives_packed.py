"""Packed batches (``data.packing``) in the objectives and the train step, against the same rows
unpacked: the packed MARS mask is each row's own mask placed on the diagonal, and the loss, its
gradients and an accumulated train step equal those of the rows one per batch row (fp32, 1e-5),
for both objectives, both normalisations and every attention implementation that runs on CPU
(splash interpreted)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mars_jax import attention, packing, train_step
from mars_jax.batches import Example, batched_dataset
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import CausalLM, ModelConfig
from mars_jax.objectives import loss_fn, mars_attention_mask, mars_loss, target_positions

V, B, L = 128, 4, 128
MASK_ID, EOS_ID, PAD_ID = V - 1, V - 2, V - 3
CFG = ModelConfig(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    tie_word_embeddings=False,
)
# (prompt, answer) lengths: very different, one row filling a whole sequence, one of one block.
SHAPES = [(3, 1), (20, 90), (5, 7), (60, 68), (2, 30), (10, 13), (40, 2), (1, 3), (7, 50)]


def rows(shapes=SHAPES, seed=0):
    """`batches.Example`s as build_examples makes them: prompt (IGNORE), labelled answer, labelled
    EOS padding to a multiple of B."""
    rng = np.random.default_rng(seed)
    out = []
    for r, (p, a) in enumerate(shapes):
        ids = rng.integers(0, V - 3, p + a).astype(np.int32)
        labels = np.where(np.arange(p + a) >= p, ids, IGNORE_INDEX)
        pad = np.full(-(p + a) % B, EOS_ID, np.int32)
        out.append(Example(np.concatenate([ids, pad]), np.concatenate([labels, pad]), r))
    return out


def batches(examples, sequences=None):
    """(packed batch of every packed sequence, unpacked batch of every row), device arrays."""
    sequences = sequences or packing.pack(examples, max_length=L, block_size=B, seed=0)
    make = lambda units: {
        k: jnp.asarray(v)
        for k, v in batched_dataset(
            units, batch_size=len(units), max_length=L, seed=0, shuffle=False, pad_id=PAD_ID
        )[0].items()
        if k != "row_ids"
    }
    return make(sequences), make(examples)


def obj(name="mars", normalization="sequence", **kw):
    return ObjectiveConfig(
        name=name,
        block_size=B,
        normalization=normalization,
        max_label_tokens=kw.pop("max_label_tokens", None),
        mask_id=MASK_ID,
        **kw,
    )


class Spy:
    """A stand-in model that records what the objective feeds it."""

    def __call__(self, ids, positions, mask):
        self.ids, self.positions, self.mask = ids, positions, mask
        return jnp.zeros((*ids.shape, 8)), None

    def logits(self, h):
        return jnp.zeros((*h.shape[:-1], V))


def test_packed_mars_mask_is_each_rows_mask_on_the_diagonal():
    examples = rows()
    sequences = packing.pack(examples, max_length=L, block_size=B, seed=0)
    packed, _ = batches(examples, sequences)
    spy = Spy()
    mars_loss(spy, packed, obj())
    assert isinstance(spy.mask, attention.Segmented)
    dense = np.asarray(spy.mask.dense())
    for i, seq in enumerate(sequences):
        expected = np.zeros((2 * L, 2 * L), bool)
        segments = np.asarray(packed["segment_ids"][i])
        for s in range(1, len(seq.rows) + 1):
            where = np.flatnonzero(segments == s)
            n = len(where)
            own = mars_attention_mask(n, B)[0]  # the row alone: [noisy | clean] of 2n
            index = np.concatenate([where, L + where])  # its 2n positions in the packed layout
            expected[np.ix_(index, index)] = own
        pad = np.flatnonzero(segments == 0)
        index = np.concatenate([pad, L + pad])
        inside = np.ix_(index, index)
        expected[inside] = mars_attention_mask(L, B)[0][inside]  # padding: only itself
        np.testing.assert_array_equal(dense[i], expected)
        # Positions restart in every row, in both halves; labelled tokens are masked.
        pos = np.asarray(spy.positions[i])
        np.testing.assert_array_equal(pos[:L], pos[L:])
        np.testing.assert_array_equal(pos[:L], np.asarray(packed["positions"][i]))
        labelled = np.asarray(packed["labels"][i]) != IGNORE_INDEX
        np.testing.assert_array_equal(np.asarray(spy.ids[i, :L])[labelled], MASK_ID)


def test_packed_ar_mask_is_causal_within_each_row():
    examples = rows()
    packed, _ = batches(examples)
    spy = Spy()
    loss_fn(spy, packed, obj("ar"))
    segments = np.asarray(packed["segment_ids"])
    t = np.arange(L)
    expected = (t[None, :, None] >= t[None, None, :]) & (
        segments[:, :, None] == segments[:, None, :]
    )
    np.testing.assert_array_equal(np.asarray(spy.mask.dense()), expected)


def test_no_target_crosses_a_row_boundary():
    """A row whose first token is labelled (no prompt) packed after another: the last token of
    the first row must not be trained to predict it."""
    labels = jnp.asarray([[IGNORE_INDEX, 5, 6, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX]])
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 0, 0]])
    _, targets, valid = target_positions(labels, None, segments)
    assert np.asarray(targets)[np.asarray(valid)].tolist() == [5, 6, 7, 9]


@pytest.fixture(scope="module")
def params():
    return nnx.state(CausalLM(CFG, rngs=nnx.Rngs(0)))


def value_and_grad(params, batch, objective, implementation="xla"):
    import dataclasses

    cfg = dataclasses.replace(CFG, attention=implementation)
    graphdef = nnx.graphdef(CausalLM(cfg, rngs=nnx.Rngs(0)))
    loss = lambda p, b: loss_fn(nnx.merge(graphdef, p), b, objective)[0]
    return jax.jit(jax.value_and_grad(loss))(params, batch)


def assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_b))
    assert scale > 1e-3
    for g, r in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("name", ["ar", "mars"])
def test_packed_loss_and_gradients_equal_the_rows_unpacked(params, name, normalization):
    packed, unpacked = batches(rows())
    assert packed["input_ids"].shape[0] < unpacked["input_ids"].shape[0]
    objective = obj(name, normalization)
    assert_same(
        value_and_grad(params, packed, objective), value_and_grad(params, unpacked, objective)
    )


@pytest.mark.parametrize("implementation", ["chunked", "splash"])
@pytest.mark.parametrize("name", ["ar", "mars"])
def test_packed_attention_implementations_equal_the_rows_unpacked(
    params, name, implementation, monkeypatch
):
    if implementation == "splash":  # the TPU kernel, interpreted on CPU
        real = attention._splash
        monkeypatch.setattr(attention, "_splash", lambda *a, **k: real(*a, interpret=True))
    packed, unpacked = batches(rows())
    objective = obj(name, ce_chunk_size=16)
    assert_same(
        value_and_grad(params, packed, objective, implementation),
        value_and_grad(params, unpacked, objective),
    )


@pytest.mark.parametrize("name", ["ar", "mars"])
def test_packed_accumulated_step_equals_the_rows_unpacked(params, name):
    """One train step (plain SGD, lr 1: the update is minus the gradient) over 4 packed
    sequences in 2 micro-batches equals one over the same rows unpacked in one batch."""
    examples = rows(SHAPES * 2, seed=1)
    sequences = packing.pack(examples, max_length=L, block_size=B, seed=0)[:4]
    kept = sorted(r for s in sequences for r in s.rows)
    packed, unpacked = batches([examples[r] for r in kept], sequences)
    objective = obj(name)
    graphdef = nnx.graphdef(CausalLM(CFG, rngs=nnx.Rngs(0)))
    sgd = optax.sgd(1.0)
    out = {}
    for key, batch, accum in (("packed", packed, 2), ("unpacked", unpacked, 1)):
        step = jax.jit(train_step.make_train_step(graphdef, sgd, objective, accum))
        new, _, metrics = step(params, sgd.init(params), batch)
        out[key] = (new, jax.device_get(metrics))
    (new_p, m_p), (new_u, m_u) = out["packed"], out["unpacked"]
    assert m_p["loss"] == pytest.approx(m_u["loss"], rel=1e-5)
    assert m_p["rows"] == m_u["rows"] == len(kept)
    assert m_p["label_tokens"] == m_u["label_tokens"]
    assert m_p["grad_norm"] == pytest.approx(m_u["grad_norm"], rel=1e-5)
    scale = float(m_u["grad_norm"])
    for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(new_u)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)
