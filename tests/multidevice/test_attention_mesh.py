"""Splash attention (the Pallas TPU kernel, interpreted on CPU) under a mesh of 4 of the 8
simulated CPU devices (tests/multidevice/conftest.py sets the device count)."""

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import attention, sharding
from mars_jax import model as model_lib
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import CausalLM, ModelConfig
from mars_jax.objectives import mars_loss

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)
OBJ = ObjectiveConfig(name="mars", block_size=4, normalization="sequence", mask_id=127)


def test_splash_under_a_mesh_matches_dense(monkeypatch):
    """On a (data 2, tensor 2) mesh of 4 CPU devices splash runs inside shard_map (rows over
    data, heads over tensor): the MARS loss and gradients equal dense attention's."""
    real = attention._splash
    monkeypatch.setattr(attention, "_splash", lambda *a, **k: real(*a, interpret=True))
    cfg = CFG
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 120, (4, 64)).astype(np.int32)
    labels = np.where(np.arange(64)[None] >= 20, ids, IGNORE_INDEX).astype(np.int32)
    obj = OBJ
    host = jax.device_get(nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0))))
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    rules = sharding.logical_rules()
    result = {}
    for impl in ("xla", "splash"):
        c = ModelConfig(**{**cfg.__dict__, "attention": impl})
        graphdef, abstract = model_lib.abstract_params(c, mesh, rules)
        params = jax.device_put(host, jax.tree.map(lambda x: x.sharding, abstract))
        batch = jax.device_put(
            {"input_ids": ids, "labels": labels}, sharding.batch_sharding(mesh, rules)
        )

        def loss(p, b):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(rules):
                return mars_loss(nnx.merge(graphdef, p), b, obj)[0]

        value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
        result[impl] = [float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]]
    (dense_loss, dense_grads), (splash_loss, splash_grads) = result["xla"], result["splash"]
    assert splash_loss == pytest.approx(dense_loss, rel=1e-6)
    scale = max(np.abs(np.asarray(g)).max() for g in dense_grads)
    for g, r in zip(splash_grads, dense_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * scale)


def test_packed_splash_under_a_mesh_matches_the_rows_unpacked(monkeypatch):
    """Packed sequences (data.packing) on the (data 2, tensor 2) mesh: splash with the segment
    ids inside shard_map, and dense attention with them folded into the mask, give the MARS
    loss and gradients of the same rows unpacked, without a mesh."""
    from mars_jax import packing
    from mars_jax.batches import Example, batched_dataset

    real = attention._splash
    monkeypatch.setattr(attention, "_splash", lambda *a, **k: real(*a, interpret=True))
    cfg = CFG
    rng = np.random.default_rng(1)
    rows = []
    for r, (p, a) in enumerate([(3, 5), (9, 40), (2, 2), (30, 26), (5, 11), (12, 4), (1, 15)]):
        ids = rng.integers(0, 120, p + a + (-(p + a) % 4)).astype(np.int32)
        labels = np.where(np.arange(len(ids)) >= p, ids, IGNORE_INDEX).astype(np.int32)
        rows.append(Example(ids, labels, r))
    sequences = packing.pack(rows, max_length=64, block_size=4, seed=0)
    sequences += sequences[: len(sequences) % 2]  # an even number of rows for data 2
    obj = OBJ

    def host_batch(units):
        batch = batched_dataset(
            units, batch_size=len(units), max_length=64, seed=0, shuffle=False, pad_id=125
        )[0]
        batch.pop("row_ids")
        return batch

    host = jax.device_get(nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0))))
    graphdef = nnx.graphdef(CausalLM(cfg, rngs=nnx.Rngs(0)))
    unpacked = [rows[r] for s in sequences for r in s.rows]  # the rows the packed batch holds
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p, b: mars_loss(nnx.merge(graphdef, p), b, obj)[0])
    )(host, host_batch(unpacked))
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    rules = sharding.logical_rules()
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(ref_grads))
    for impl in ("xla", "splash"):
        c = ModelConfig(**{**cfg.__dict__, "attention": impl})
        graphdef, abstract = model_lib.abstract_params(c, mesh, rules)
        params = jax.device_put(host, jax.tree.map(lambda x: x.sharding, abstract))
        batch = jax.device_put(host_batch(sequences), sharding.batch_sharding(mesh, rules))

        def loss(p, b):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(rules):
                return mars_loss(nnx.merge(graphdef, p), b, obj)[0]

        value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
        assert float(value) == pytest.approx(float(ref_loss), rel=1e-5), impl
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * scale)
