"""Sharded decoding on an 8-device (data 2, fsdp 2, tensor 2) CPU mesh (tests/multidevice/
conftest.py sets the device count): the decoder gives one device's tokens in every cache mode,
and its KV cache really is split over rows and KV heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax import decode, sharding
from mars_jax.decode_state import RowSettings
from tests.decode_oracles import MAX_NEW, make_batch, make_model, qwen_generate, qwen_settings


@pytest.fixture(scope="module")
def result():
    rules = sharding.logical_rules()
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model = make_model(300.0)
    graphdef, state = nnx.split(model)
    placed = nnx.merge(
        graphdef, jax.device_put(state, sharding.param_shardings(state, mesh, rules))
    )

    ids, lengths, _ = make_batch([5, 2, 11, 7], seed=2)
    q = placed.layers.self_attn.q_proj.kernel[...]
    out = {"q_shard": list(q.sharding.shard_shape(q.shape))}
    for name, kw in {
        "sliding": dict(threshold=0.9),
        "ar": dict(threshold=1.0, block_size=1),
        "block": dict(threshold=0.9, cache_mode="block"),
        "verify": dict(threshold=0.5, rule="verify"),
    }.items():
        kw = {"block_size": 4, "max_new_tokens": MAX_NEW, **kw}
        one = qwen_generate(model, ids, lengths, **kw)
        sharded = qwen_generate(placed, ids, lengths, mesh=mesh, axis_rules=rules, **kw)
        out[name] = {
            f: [np.asarray(getattr(o, f)).tolist() for o in (one, sharded)]
            for f in ("tokens", "accepted", "row_forwards")
        }
        out[name]["tpf"] = one.tokens_per_forward

    # The compiled sharded program carries the cache [L, R, S, K, H] per device as
    # [L, R/4, S, K/2, H]: rows over (data, fsdp), KV heads over tensor.
    settings = qwen_settings(mesh=mesh, axis_rules=rules)
    gd, params = nnx.split(placed)
    compiled = (
        decode._generate.lower(
            params,
            jnp.asarray(ids),
            jnp.asarray(lengths),
            RowSettings.build(
                4, threshold=0.9, max_accept=4, max_new_tokens=settings.max_new_tokens
            ),
            graphdef=gd,
            settings=settings,
        )
        .compile()
        .as_text()
    )
    slots = ids.shape[1] + MAX_NEW + 2 * 7
    out["cache_local"] = f"f32[2,1,{slots},1,8]" in compiled
    out["cache_global"] = f"f32[2,4,{slots},2,8]" in compiled
    return out


@pytest.mark.parametrize("mode", ["sliding", "ar", "block", "verify"])
def test_sharded_decoding_equals_one_device(result, mode):
    # q_proj [2 layers, 32, 32] split over fsdp x tensor: the model really is spread.
    assert result["q_shard"] == [2, 16, 16]
    r = result[mode]
    for field in ("tokens", "accepted", "row_forwards"):
        one, sharded = r[field]
        assert one == sharded, (mode, field)
    if mode == "sliding":
        assert r["tpf"] > 1.0


def test_kv_cache_is_sharded_over_rows_and_kv_heads(result):
    assert result["cache_local"]
    assert not result["cache_global"]
