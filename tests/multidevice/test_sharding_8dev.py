"""Sharding on an 8-device (data=2, fsdp=2, tensor=2) CPU mesh (tests/multidevice/conftest.py
sets the device count): parameter placement, a train step matching one device, and the
configuration errors."""

import json
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import model as model_lib
from mars_jax import sharding
from mars_jax.checkpoints import Checkpoints, TrainState
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import CausalLM, ModelConfig
from mars_jax.objectives import loss_fn
from mars_jax.train_step import build_train_step, optimizer
from tests.helpers import tiny_config

# The placement of every parameter under sharding.DEFAULT_RULES, written out by hand from the
# rules (vocab, heads, kv_heads, mlp -> tensor; embed -> fsdp; layers, norm -> replicated).
EXPECTED_SPECS = {
    "embed_tokens.embedding": ["tensor", "fsdp"],
    "lm_head.kernel": ["fsdp", "tensor"],
    "norm.weight": [None],
    # Decoder layers: stacked on a leading "layers" axis (replicated by default).
    "layers.input_layernorm.weight": [None, None],
    "layers.post_attention_layernorm.weight": [None, None],
    "layers.self_attn.q_proj.kernel": [None, "fsdp", "tensor"],
    "layers.self_attn.q_proj.bias": [None, "tensor"],
    "layers.self_attn.k_proj.kernel": [None, "fsdp", "tensor"],
    "layers.self_attn.k_proj.bias": [None, "tensor"],
    "layers.self_attn.v_proj.kernel": [None, "fsdp", "tensor"],
    "layers.self_attn.v_proj.bias": [None, "tensor"],
    "layers.self_attn.o_proj.kernel": [None, "tensor", "fsdp"],
    "layers.mlp.gate_proj.kernel": [None, "fsdp", "tensor"],
    "layers.mlp.up_proj.kernel": [None, "fsdp", "tensor"],
    "layers.mlp.down_proj.kernel": [None, "tensor", "fsdp"],
}


def compute():
    """What the tests below check, computed once: {name: JSON-like value}."""
    rules = sharding.logical_rules()

    out = {"devices": len(jax.devices())}
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        tie_word_embeddings=False,
    )

    # --- placement ----------------------------------------------------------------------------
    mesh8 = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    out["mesh8"] = dict(mesh8.shape)
    graphdef, abstract = model_lib.abstract_params(cfg, mesh8, rules)
    out["specs"] = {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): [
            list(a) if isinstance(a, tuple) else a for a in x.sharding.spec
        ]
        for p, x in jax.tree_util.tree_leaves_with_path(abstract)
    }
    # flax's own tooling reads the same placement from the parameters' metadata.
    state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    with nnx.logical_axis_rules(rules):
        flax_specs = nnx.get_partition_spec(state)
    out["flax_specs"] = {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): [
            list(a) if isinstance(a, tuple) else a for a in v.get_value()
        ]
        for p, v in jax.tree_util.tree_leaves_with_path(
            flax_specs, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    }
    out["logical_q_spec"] = list(
        nnx.get_partition_spec(state)["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    )
    # Rules from a config table: replicate "embed", put "mlp" on (fsdp, tensor).
    custom = sharding.logical_rules(
        {**sharding.DEFAULT_RULES, "embed": (), "mlp": ("fsdp", "tensor")}
    )
    _, abstract_custom = model_lib.abstract_params(cfg, mesh8, custom)
    out["custom_up_spec"] = [
        list(a) if isinstance(a, tuple) else a
        for a in abstract_custom["layers"]["mlp"]["up_proj"]["kernel"].sharding.spec
    ]
    out["batch_spec"] = [
        list(a) if isinstance(a, tuple) else a for a in sharding.batch_sharding(mesh8, rules).spec
    ]

    # --- one training run on a mesh -----------------------------------------------------------
    rng = np.random.default_rng(0)
    rows, length = 8, 16
    ids = rng.integers(0, 94, (rows, length)).astype(np.int32)
    prompt = rng.integers(2, 7, rows)
    answer = rng.integers(1, 9, rows)
    col = np.arange(length)[None]
    labelled = (col >= prompt[:, None]) & (col < (prompt + answer)[:, None])
    batch = {"input_ids": ids, "labels": np.where(labelled, ids, IGNORE_INDEX).astype(np.int32)}
    obj = ObjectiveConfig(
        name="mars",
        block_size=4,
        ar_weight=0.5,
        normalization="sequence",
        max_label_tokens=12,
        mask_id=95,
        ce_chunk_size=0,
        noisy_weighting="none",
    )
    run_cfg = tiny_config(
        "mars",
        train__warmup_ratio=0.0,
        train__schedule="linear",
        train__learning_rate=1e-2,
        train__grad_clip=1.0,
        train__weight_decay=0.01,
        train__batch_size=rows,
        train__grad_accum_steps=2,
        data__max_length=length,
        data__packing=False,
    )

    host_params = jax.device_get(nnx.state(CausalLM(cfg, rngs=nnx.Rngs(0))))

    def train(mesh, steps=3):
        graphdef, abstract = model_lib.abstract_params(cfg, mesh, rules)
        shardings = jax.tree.map(lambda x: x.sharding, abstract)
        params = jax.device_put(host_params, shardings)
        init = jax.tree.map(np.asarray, params)
        tx, _ = optimizer(run_cfg, 10)
        # The step as training builds it: shardings, donation, activation constraints on the mesh.
        step = build_train_step(run_cfg, graphdef, abstract, obj, tx, mesh, rules)
        opt_state = jax.jit(tx.init, out_shardings=step.opt_state_shardings)(params)
        losses = []
        for _ in range(steps):
            b = jax.device_put(batch, step.batch_sharding)
            params, opt_state, metrics = step.fn(params, opt_state, b)
            losses.append(float(metrics["loss"]))
        return init, params, losses, opt_state

    def grads(mesh):
        graphdef, abstract = model_lib.abstract_params(cfg, mesh, rules)
        params = jax.device_put(host_params, jax.tree.map(lambda x: x.sharding, abstract))
        b = jax.device_put(batch, sharding.batch_sharding(mesh, rules))
        g = jax.jit(jax.grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), b, obj)[0]))(params, b)
        return [np.asarray(x) for x in jax.tree.leaves(g)]

    init8, params8, losses8, opt8 = train(mesh8)
    q = params8["layers"]["self_attn"]["q_proj"]["kernel"][...]
    out["q_spec"] = [a for a in q.sharding.spec]
    out["q_shard_shapes"] = sorted({tuple(s.data.shape) for s in q.addressable_shards})
    out["q_num_devices"] = len(q.sharding.device_set)
    mu = [x for x in jax.tree.leaves(opt8) if getattr(x, "shape", ()) == q.shape]
    out["mu_specs"] = sorted({str(x.sharding.spec) for x in mu})
    mesh1 = sharding.make_mesh(devices=jax.devices()[:1])
    out["mesh1"] = dict(mesh1.shape)
    init1, params1, losses1, _ = train(mesh1)
    out["losses8"], out["losses1"] = losses8, losses1

    def flat(tree):
        return [np.asarray(x) for x in jax.tree.leaves(tree)]

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(flat(a), flat(b)))

    out["init_diff"] = max_diff(init8, init1)
    out["param_diff"] = max_diff(params8, params1)
    out["param_change"] = max_diff(params1, init1)
    out["num_params"] = len(flat(params1))
    g8, g1 = grads(mesh8), grads(mesh1)
    out["grad_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(g8, g1))
    out["grad_scale"] = max(float(np.abs(b).max()) for b in g1)
    out["lr_sum"] = sum(float(optimizer(run_cfg, 10)[1](i)) for i in range(3))

    # --- a checkpoint saved on one mesh shape continues on another ------------------------------
    def continue_from(directory, mesh, steps=2):
        # Restores step 1 of `directory` onto `mesh` and trains `steps` more steps.
        graphdef, abstract = model_lib.abstract_params(cfg, mesh, rules)
        tx, _ = optimizer(run_cfg, 10)
        step = build_train_step(run_cfg, graphdef, abstract, obj, tx, mesh, rules)
        with Checkpoints(directory) as checkpoints:
            params, opt_state, position = checkpoints.restore(
                1, TrainState(abstract, step.abstract_opt_state, 0)
            )
        shard = params["layers"]["mlp"]["up_proj"]["kernel"][...].addressable_shards[0].data.shape
        losses = []
        for _ in range(steps):
            params, opt_state, metrics = step.fn(
                params, opt_state, jax.device_put(batch, step.batch_sharding)
            )
            losses.append(float(metrics["loss"]))
        return losses, position, list(shard)

    with tempfile.TemporaryDirectory() as directory:
        graphdef, abstract = model_lib.abstract_params(cfg, mesh8, rules)
        tx, _ = optimizer(run_cfg, 10)
        step = build_train_step(run_cfg, graphdef, abstract, obj, tx, mesh8, rules)
        params = jax.device_put(host_params, jax.tree.map(lambda x: x.sharding, abstract))
        opt_state = jax.jit(tx.init, out_shardings=step.opt_state_shardings)(params)
        params, opt_state, _ = step.fn(
            params, opt_state, jax.device_put(batch, step.batch_sharding)
        )
        with Checkpoints(directory) as checkpoints:
            checkpoints.save(1, TrainState(params, opt_state, 1))
        out["resharded_same"] = continue_from(directory, mesh8)
        out["resharded_other"] = continue_from(
            directory, sharding.make_mesh(data=1, fsdp=8, tensor=1)
        )

    # --- errors -------------------------------------------------------------------------------
    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    out["mesh_errors"] = [
        error(lambda: sharding.make_mesh(data=3)),
        error(lambda: sharding.make_mesh(data=-1, fsdp=3)),
        error(lambda: sharding.make_mesh(data=-1, fsdp=-1, tensor=2)),
    ]
    out["mesh_rest"] = dict(sharding.make_mesh(data=-1, fsdp=2, tensor=2).shape)
    mesh_142 = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    for name, bad in [
        ("vocab", dict(vocab_size=97)),
        ("hidden", dict(hidden_size=30, num_heads=2, num_kv_heads=2, head_dim=8)),
    ]:
        bad_cfg = ModelConfig(**{**cfg.__dict__, **bad})
        state = nnx.state(nnx.eval_shape(lambda: CausalLM(bad_cfg, rngs=nnx.Rngs(0))))
        out["divisible_error_" + name] = error(
            lambda: sharding.param_shardings(state, mesh_142, rules)
        )
    # tensor=4 divides the flattened q width (14 heads x 4 = 56) but not the 2 KV heads.
    heads_cfg = ModelConfig(
        **{**cfg.__dict__, "hidden_size": 56, "num_heads": 14, "num_kv_heads": 2, "head_dim": 4}
    )
    mesh_214 = sharding.make_mesh(data=2, fsdp=1, tensor=4)
    out["heads_error"] = error(lambda: model_lib.abstract_params(heads_cfg, mesh_214, rules))
    out["rules_error"] = error(lambda: sharding.logical_rules({"embed": ("model",)}))
    twice = sharding.logical_rules({**sharding.DEFAULT_RULES, "embed": ("fsdp", "tensor")})
    out["twice_error"] = error(lambda: model_lib.abstract_params(cfg, mesh8, twice))
    ok_state = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    out["divisible_ok"] = error(lambda: sharding.param_shardings(ok_state, mesh_142, rules))
    return json.loads(json.dumps(out))  # as the tests read it: tuples as lists


@pytest.fixture(scope="module")
def result():
    return compute()


def test_mesh_shape(result):
    assert result["devices"] == 8
    assert result["mesh8"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert result["mesh1"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert result["mesh_rest"] == {"data": 2, "fsdp": 2, "tensor": 2}


def test_param_partition_specs(result):
    specs = result["specs"]
    for name, spec in EXPECTED_SPECS.items():
        assert specs[name] == spec, (name, specs[name])
    assert len(specs) == 3 + 12  # embed, lm_head, norm + stacked 2 norms, 7 kernels, 3 biases
    assert result["batch_spec"] == [["data", "fsdp"], None]


def test_params_are_really_distributed(result):
    assert result["q_spec"] == [None, "fsdp", "tensor"]
    assert result["q_num_devices"] == 8
    # [2 layers, 32, 32] split 2 x 2 on the last two axes, replicated over data.
    assert result["q_shard_shapes"] == [[2, 16, 16]]
    # Adam moments of the stacked [2, 32, 32] kernels (q_proj, o_proj) stay sharded like them.
    assert result["mu_specs"] == ["P(None, 'fsdp', 'tensor')", "P(None, 'tensor', 'fsdp')"]


def test_gradients_on_8_devices_match_1_device(result):
    # fp32 sums taken in another order differ by roundoff, ~1e-7 of the largest term (2e-7
    # measured); a
    # sharding error (a missing or doubled reduction, a wrong micro-batch) is O(1) of it.
    assert result["grad_scale"] > 1e-2
    assert result["grad_diff"] <= 1e-5 * result["grad_scale"]


def test_train_step_on_8_devices_matches_1_device(result):
    assert result["init_diff"] == 0.0
    l8, l1 = result["losses8"], result["losses1"]
    assert len(l8) == len(l1) == 3
    for a, b in zip(l8, l1):
        assert abs(a - b) < 1e-5, (l8, l1)
    assert l1[2] < l1[1]  # the optimizer really moved (step 0 runs at warmup learning rate 0)
    assert result["param_change"] > 1e-3
    # AdamW moves each coordinate by at most about lr per step, whatever the gradient's size, so
    # roundoff in a gradient coordinate near zero can change that coordinate's step by a
    # fraction of lr (measured on a 2-core x86 CPU: 6e-4 of the summed lr, where the gradients
    # differed by 2e-7 of their largest coordinate). A sharding error changes steps by O(lr).
    # The bound, 1% of the summed learning rate, lies between the two.
    assert result["param_diff"] <= 1e-2 * result["lr_sum"]


def test_partitioning_is_flax_metadata(result):
    """flax's own tooling (nnx.get_partition_spec under the rules) reads every parameter's
    placement from its metadata: the hand-written table, as placed."""
    assert result["flax_specs"] == EXPECTED_SPECS
    assert result["logical_q_spec"] == ["layers", "embed", "heads"]


def test_rules_come_from_the_table(result):
    assert result["custom_up_spec"] == [None, None, ["fsdp", "tensor"]]
    err = result["rules_error"]
    assert err is not None and "mesh.rules.embed" in err and "model" in err
    # embed -> (fsdp, tensor) meets vocab/heads/mlp -> tensor in one parameter.
    err = result["twice_error"]
    assert err is not None and "mesh axis twice" in err and "parameter" in err


def test_tensor_parallel_must_not_split_heads(result):
    err = result["heads_error"]
    assert err is not None and "num_heads 14" in err and "num_kv_heads 2" in err and "4" in err


def test_checkpoint_restores_onto_another_mesh(result):
    """Saved on (data 2, fsdp 2, tensor 2), restored onto (data 1, fsdp 8, tensor 1): the
    parameters take the new placement and the next steps give the losses of continuing on the
    original mesh (fp32 roundoff of reductions in another order)."""
    (same, position_same, shard_same), (other, position_other, shard_other) = (
        result["resharded_same"],
        result["resharded_other"],
    )
    # up_proj [2 layers, 32, 64]: split 2 x 2 on (fsdp, tensor), then 8 ways on fsdp.
    assert shard_same == [2, 16, 32] and shard_other == [2, 4, 64]
    assert position_same == position_other == 1
    assert same[1] < same[0]  # training continues
    np.testing.assert_allclose(other, same, rtol=1e-5)


def test_mesh_errors(result):
    e1, e2, e3 = result["mesh_errors"]
    assert e1 is not None and "does not use the 8 devices" in e1 and "'data': 3" in e1
    assert e2 is not None and "does not use the 8 devices" in e2
    assert e3 is not None and "at most one mesh axis may be -1" in e3


def test_non_divisible_parameter_is_an_error(result):
    vocab = result["divisible_error_vocab"]
    assert vocab is not None and "embed_tokens" in vocab and "97" in vocab and "tensor" in vocab
    hidden = result["divisible_error_hidden"]
    assert hidden is not None and "30" in hidden and "fsdp" in hidden
    assert result["divisible_ok"] is None
