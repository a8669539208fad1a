"""Attention implementations and execution settings (remat, scanned layers) against the plain
path (dense XLA attention, no remat, layers unrolled): same outputs, same MARS loss and
gradients. Splash attention (a Pallas TPU kernel) runs here in interpret mode; under a mesh of
CPU devices it is tests/multidevice/test_attention_mesh.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax import attention
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import CausalLM, ModelConfig, causal_mask
from mars_jax.objectives import mars_attention_mask, mars_loss

BLOCK = 4
# 2L = 192 queries: not a multiple of the chunked path's 128; splash tiles by 128, 2L = 256.
LENGTH = {"chunked": 96, "splash": 128}


def qkv(t, seed=0, rows=2, n=4, k=2, h=16):
    rng = np.random.default_rng(seed)
    make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return make(rows, t, n, h), make(rows, t, k, h), make(rows, t, k, h)


def loss_and_grads(implementation, mask, **kw):
    def f(q, k, v):
        out = attention.attend(q, k, v, mask, implementation, **kw)
        return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum(), out

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = grad(*qkv(mask.shape[-1]))
    return out, grads


@pytest.mark.parametrize("implementation", ["chunked", "splash"])
@pytest.mark.parametrize("which", ["mars", "causal"])
def test_implementations_match_dense_attention(implementation, which):
    length = LENGTH[implementation]
    mask = mars_attention_mask(length, BLOCK) if which == "mars" else causal_mask(2 * length)
    ref_out, ref_grads = loss_and_grads("xla", mask)
    kw = {"interpret": True} if implementation == "splash" else {}
    out, grads = loss_and_grads(implementation, mask, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        scale = float(jnp.abs(r).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * scale)


def test_splash_refuses_what_it_cannot_run():
    q, k, v = qkv(256)
    with pytest.raises(ValueError, match="concrete numpy mask"):
        jax.jit(lambda m: attention.attend(q, k, v, m, "splash"))(jnp.asarray(causal_mask(256)))
    with pytest.raises(ValueError, match="multiples of 128"):
        attention.attend(*qkv(192), causal_mask(192), "splash")
    with pytest.raises(ValueError, match="must be one of"):
        attention.attend(q, k, v, causal_mask(256), "flash")


CFG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    tie_word_embeddings=False,
)


def mars_batch(seed=0, rows=3, length=2 * 64):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 120, (rows, length)).astype(np.int32)
    prompt = rng.integers(4, 40, rows)
    labels = np.where(np.arange(length)[None] >= prompt[:, None], ids, IGNORE_INDEX)
    return {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels.astype(np.int32))}


@pytest.fixture(scope="module")
def reference():
    """MARS loss and gradients of the plain model: dense attention, no remat, layers unrolled
    one after another."""
    params = nnx.state(CausalLM(CFG, rngs=nnx.Rngs(0)))
    return params, _mars_value_and_grad(params, remat="none", scan_layers=False, attention="xla")


def _mars_value_and_grad(params, **execution):
    cfg = ModelConfig(**{**CFG.__dict__, **execution})
    graphdef = nnx.graphdef(CausalLM(cfg, rngs=nnx.Rngs(0)))
    obj = ObjectiveConfig(
        name="mars",
        block_size=BLOCK,
        ar_weight=1.0,
        normalization="sequence",
        max_label_tokens=None,
        mask_id=127,
        ce_chunk_size=0,
        noisy_weighting="none",
    )
    loss = lambda p: mars_loss(nnx.merge(graphdef, p), mars_batch(), obj)[0]
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
    "execution",
    [
        dict(remat="none", scan_layers=True, attention="xla"),
        dict(remat="full", scan_layers=True, attention="xla"),
        dict(remat="dots", scan_layers=False, attention="xla"),
        dict(remat="full", scan_layers=True, attention="chunked"),
        dict(remat="none", scan_layers=True, attention="splash"),
    ],
    ids=lambda e: "-".join(f"{v}" for v in e.values()),
)
def test_execution_settings_keep_loss_and_gradients(reference, execution, monkeypatch):
    """Scanned layers, rematerialisation and the attention implementations change memory and
    speed, not the function: the MARS loss and every gradient match the plain model (fp32
    roundoff: 1e-5 relative to the largest gradient)."""
    params, (ref_loss, ref_grads) = reference
    if execution["attention"] == "splash":  # the TPU kernel, interpreted on CPU
        real = attention._splash
        monkeypatch.setattr(attention, "_splash", lambda *a, **k: real(*a, interpret=True))
    loss, grads = _mars_value_and_grad(params, **execution)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    assert scale > 1e-3
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=1e-5 * scale)
