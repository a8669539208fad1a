"""The serving engine on an 8-device (data 2, fsdp 2, tensor 2) CPU mesh (tests/multidevice/
conftest.py sets the device count): with the model's parameters spread over the mesh and its
batch state sharded by the decoder's rules, staggered requests with mixed settings and chunked
prefills complete exactly as one device decodes each prompt alone."""

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import engine, sharding
from tests.decode_oracles import MAX_NEW, make_batch, make_model, qwen_engine, qwen_generate

B = 4


@pytest.fixture(scope="module")
def result():
    rules = sharding.logical_rules()
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model = make_model(300.0)
    graphdef, state = nnx.split(model)
    placed = nnx.merge(
        graphdef, jax.device_put(state, sharding.param_shardings(state, mesh, rules))
    )
    eng = qwen_engine(
        placed,
        slots=4,
        max_prompt_len=12,
        max_new_tokens=MAX_NEW,
        block_size=B,
        steps_per_call=2,
        prefill_chunk=5,
        mesh=mesh,
        axis_rules=rules,
    )
    _, _, prompts = make_batch([3, 12, 7, 1, 9, 11], seed=4)
    reqs = [
        engine.Request(tuple(p), max_tokens=m, threshold=t, temperature=temp, seed=i)
        for i, (p, m, t, temp) in enumerate(
            zip(
                prompts,
                [16, 5, 12, 16, 9, 16],
                [1.0, 0.9, 0.5, 0.9, 1.0, 0.7],
                [0, 0, 0, 0.7, 0, 0],
            )
        )
    ]
    streams = [eng.submit(r) for r in reqs[:4]]
    eng.run_once()
    streams += [eng.submit(r) for r in reqs[4:]]
    while eng.run_once():
        pass
    got = [s.result(timeout=1)[0] for s in streams]
    alone = []
    for r in reqs:
        out = qwen_generate(
            model,
            np.asarray([r.prompt_ids], np.int32),
            np.asarray([len(r.prompt_ids)], np.int32),
            block_size=B,
            threshold=r.threshold,
            max_new_tokens=r.max_tokens,
            temperature=r.temperature,
            seed=r.seed,
        )
        alone.append(out.tokens[0, : out.lengths[0]].tolist())
    k = eng.state.cache["k"]
    return dict(got=got, alone=alone, cache_shard=list(k.sharding.shard_shape(k.shape)), k=k.shape)


def test_engine_on_a_mesh_equals_each_prompt_alone_on_one_device(result):
    assert result["got"] == result["alone"]


def test_the_engine_state_is_sharded(result):
    layers, rows, slots, kv_heads, head_dim = result["k"]
    # rows over (data, fsdp) = 4, KV heads over tensor = 2
    assert result["cache_shard"] == [layers, rows // 4, slots, kv_heads // 2, head_dim]
