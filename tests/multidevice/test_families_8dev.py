"""The Qwen3 and Llama 3 families on an 8-device (data 2, fsdp 2, tensor 2) CPU mesh
(tests/multidevice/conftest.py sets the device count): a tiny checkpoint of each loads straight
into the sharded layout by the training rules, with every parameter of the family placed (the
Qwen3 query/key norms replicated, the projections split), and decodes the tokens one device
decodes from the host load."""

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import huggingface, sharding
from mars_jax import model as model_lib
from tests.decode_oracles import qwen_generate
from tests.helpers import TINY, save_hf


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def result(request, tmp_path_factory):
    family = request.param
    path = str(tmp_path_factory.mktemp(family))
    save_hf(path, seed=21, family=family)
    rules = sharding.logical_rules()
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = huggingface.read_hf_config(path)
    graphdef, abstract = model_lib.abstract_params(cfg, mesh, rules)
    placed = nnx.merge(graphdef, huggingface.load_hf_sharded(path, cfg, abstract))
    host = huggingface.load_hf(path)
    ids = np.asarray([[5, 17, 33, 2, 9, 4], [44, 3, 61, 7, 7, 7], [8, 1, 2, 3, 4, 5], [9] * 6])
    lengths = np.asarray([5, 3, 6, 2], np.int32)
    kw = dict(block_size=4, threshold=0.5, max_new_tokens=10, eos_ids=(TINY["vocab_size"] - 2,))
    kw["mask_id"] = TINY["vocab_size"] - 1
    one = qwen_generate(host, ids, lengths, **kw)
    sharded = qwen_generate(placed, ids, lengths, mesh=mesh, axis_rules=rules, **kw)
    attn = placed.layers.self_attn
    shard = lambda p: list(p.sharding.shard_shape(p.shape))
    return dict(
        family=family,
        one=one.completions(),
        sharded=sharded.completions(),
        q_proj=(shard(attn.q_proj.kernel[...]), list(attn.q_proj.kernel[...].shape)),
        q_norm=(
            (shard(attn.q_norm.weight[...]), list(attn.q_norm.weight[...].shape))
            if cfg.qk_norm
            else None
        ),
        same_params=all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(nnx.state(placed)), jax.tree.leaves(nnx.state(host)))
        ),
    )


def test_sharded_family_loads_and_decodes_as_one_device(result):
    assert result["same_params"]
    assert result["sharded"] == result["one"]
    (local, full) = result["q_proj"]
    assert local == [full[0], full[1] // 2, full[2] // 2]  # embed over fsdp, heads over tensor
    if result["family"] == "qwen3":
        local, full = result["q_norm"]
        assert local == full  # replicated
