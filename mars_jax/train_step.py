"""The jitted train step: objective, gradient accumulation and the AdamW update, as a pure
function over parameter and optimizer-state pytrees (arXiv 2604.07023, Sec. 4).

`build_train_step` is the one place that builds the step from a config and a mesh: the jitted
function with its shardings, plus abstract inputs (``jax.ShapeDtypeStruct`` with shardings) to
lower and compile it ahead of time without any weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mars_jax import sharding
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig, objective_config
from mars_jax.objectives import NOISY_WEIGHT, loss_denominator, loss_fn


def objective_settings(cfg, mask_id: int, examples) -> ObjectiveConfig:
    """The static objective settings closed over by the jitted step (`config.objective_config`):
    ``cfg.objective`` with ``mask_id``; ``max_label_tokens`` 0 becomes the most labelled tokens of
    any of ``examples`` (a sequence of `batches.Example`), rounded up to a multiple of 8."""
    longest = max((int((e.labels != IGNORE_INDEX).sum()) for e in examples), default=0)
    return objective_config(cfg, mask_id, longest)


def optimizer(cfg, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW, its learning-rate schedule): linear warmup over ``train.warmup_ratio`` of the
    steps, then (``train.schedule``) linear decay to 0 ("linear") or the peak held to the end
    ("constant"), after clipping the global gradient norm to ``train.grad_clip``.
    """
    t = cfg.train
    warmup = max(1, int(round(t.warmup_ratio * num_steps)))
    after = (
        optax.constant_schedule(t.learning_rate)
        if t.schedule == "constant"
        else optax.linear_schedule(t.learning_rate, 0.0, max(1, num_steps - warmup))
    )
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, t.learning_rate, warmup), after], [warmup]
    )
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=t.weight_decay),
    ), schedule


def abstract_opt_state(tx: optax.GradientTransformation, abstract_params, mesh: Mesh):
    """``tx``'s state for ``abstract_params`` as ``jax.ShapeDtypeStruct`` leaves with shardings:
    per-parameter moments placed as their parameters, scalars (e.g. the step count) replicated.
    ``abstract_params`` carries the parameter shardings (``jax.eval_shape`` drops them)."""
    param_shardings = sharding.shardings_of(abstract_params)
    shapes = jax.eval_shape(tx.init, abstract_params)
    shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        shapes,
        param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def micro_batches(batch: dict[str, jax.Array], grad_accum_steps: int) -> dict[str, jax.Array]:
    """[A * M, L] arrays -> [A, M, L] with micro-batch i = rows i, i + A, i + 2A, ... (A =
    ``grad_accum_steps``). Strided, not contiguous: each device holds a contiguous block of
    the batch's rows, so every micro-batch takes rows from every device and is spread over the
    whole mesh (a contiguous split would leave each micro-batch on 1/A of the devices)."""
    return jax.tree.map(
        lambda x: x.reshape(-1, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1), batch
    )


def make_train_step(
    graphdef, tx: optax.GradientTransformation, obj, grad_accum_steps: int, param_shardings=None
):
    """A pure step (params, opt_state, batch) -> (params, opt_state, metrics).

    The batch ({input_ids, labels} int32 [batch, L], plus positions and segment_ids int32
    [batch, L] when packed, noisy_weight fp32 [batch] with the "inverse_t" weighting) is split
    into ``grad_accum_steps``
    micro-batches (`micro_batches`, lax.scan); their gradients and metrics are combined with
    weights proportional to their loss denominators, so the update equals that of the whole
    batch. The fp32 gradient accumulators are placed like the parameters when
    ``param_shardings`` is given. metrics: fp32 scalars loss (and noisy_loss / clean_loss),
    label_tokens, rows (rows with a labelled token: packed rows counted apart), grad_norm
    (global L2 norm of the gradient, before clipping); bool scalar skipped.

    A step whose loss or gradient norm is not finite is skipped: it returns ``params`` and
    ``opt_state`` unchanged (bitwise) and ``skipped`` True. The optimizer's step count is part
    of that state, so a skipped step does not advance the learning-rate schedule: the batch
    counts as if it was not there.
    """

    def grads_of(params, micro):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), micro, obj)

        return jax.grad(loss, has_aux=True)(params)

    def step(params, opt_state, batch):
        micro = micro_batches(batch, grad_accum_steps)
        denominators = jax.vmap(lambda mb: loss_denominator(mb, obj.normalization))(micro)
        weights = (denominators / jnp.maximum(denominators.sum(), 1)).astype(jnp.float32)

        def body(acc, inputs):
            mb, w = inputs
            g, m = grads_of(params, mb)
            return jax.tree.map(lambda a, x: (a + w * x).astype(a.dtype), acc, (g, m)), None

        zeros = jax.eval_shape(grads_of, params, jax.tree.map(lambda x: x[0], micro))
        grads, metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), zeros)
        if param_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        (grads, metrics), _ = jax.lax.scan(body, (grads, metrics), (micro, weights))
        metrics["label_tokens"] = loss_denominator(batch, "token")
        metrics["rows"] = loss_denominator(batch, "sequence")  # with labels; packed rows apart
        metrics["grad_norm"] = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A select rather than optax.apply_if_finite: that looks at the gradients only (not the
        # loss), adds state of its own (checkpoints of earlier runs would not restore), returns
        # zero updates (p + 0 turns -0.0 into 0.0, so "unchanged" would not be bitwise), and
        # applies a non-finite update after max_consecutive_errors skips; here the run loop
        # stops instead (`train.Trainer`). The select is elementwise, fusable into the update.
        params, opt_state = optax.tree.where(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        metrics["skipped"] = ~finite
        return params, opt_state, metrics

    return step


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A jitted train step and what it runs on.

    fn: jitted (params, opt_state, batch) -> (params, opt_state, metrics) of `make_train_step`;
      params and opt_state are donated; batch as ``abstract_batch``.
    abstract_params / abstract_opt_state / abstract_batch: its inputs as trees of
      ``jax.ShapeDtypeStruct`` with shardings (``fn.lower(*step.abstract_inputs)`` compiles it
      without allocating anything).
    batch_sharding: where a host batch goes (``jax.device_put(batch, batch_sharding)``).
    """

    fn: Callable
    abstract_params: Any
    abstract_opt_state: Any
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    batch_sharding: NamedSharding

    @property
    def abstract_inputs(self) -> tuple:
        """(params, opt_state, batch) as abstract arrays: ``fn.lower(*abstract_inputs)``."""
        return self.abstract_params, self.abstract_opt_state, self.abstract_batch

    @property
    def opt_state_shardings(self):
        """The optimizer state's NamedShardings (e.g. ``out_shardings`` of ``tx.init``)."""
        return sharding.shardings_of(self.abstract_opt_state)


def build_train_step(
    cfg, graphdef, abstract_params, obj, tx: optax.GradientTransformation, mesh: Mesh, rules
) -> TrainStep:
    """The jitted step of run config ``cfg`` on ``mesh``.

    Args:
      cfg: run config (``train.batch_size``, ``train.grad_accum_steps``, ``data.max_length``,
        ``data.packing``).
      graphdef, abstract_params: from `model.abstract_params` (leaves carry shardings).
      obj: the `config.ObjectiveConfig` of `objective_settings`.
      tx: the optimizer of `optimizer`.
      mesh, rules: the mesh and logical-axis rules (batches go on the "batch" rule's axes).
    """
    t = cfg.train  # train.batch_size divisible by train.grad_accum_steps: config.validate
    param_shardings = sharding.shardings_of(abstract_params)
    abstract_opt = abstract_opt_state(tx, abstract_params, mesh)
    opt_shardings = sharding.shardings_of(abstract_opt)
    batch_sharding = sharding.batch_sharding(mesh, rules)
    row = jax.ShapeDtypeStruct(
        (t.batch_size, cfg.data.max_length), jnp.int32, sharding=batch_sharding
    )
    abstract_batch = {"input_ids": row, "labels": row}
    if cfg.data.packing:  # rows packed into sequences (mars_jax.packing)
        abstract_batch.update(positions=row, segment_ids=row)
    if obj.noisy_weighting == "inverse_t":  # per-row weights, placed as the rows
        abstract_batch[NOISY_WEIGHT] = jax.ShapeDtypeStruct(
            (t.batch_size,), jnp.float32, sharding=sharding.batch_sharding(mesh, rules, ndim=1)
        )
    step = make_train_step(graphdef, tx, obj, t.grad_accum_steps, param_shardings)

    def on_mesh(*args):
        # Activation constraints in the model read the mesh and the logical rules from here.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(rules):
            return step(*args)

    fn = jax.jit(
        on_mesh,
        in_shardings=(param_shardings, opt_shardings, sharding.shardings_of(abstract_batch)),
        out_shardings=(param_shardings, opt_shardings, None),
        donate_argnums=(0, 1),
    )
    return TrainStep(fn, abstract_params, abstract_opt, abstract_batch, batch_sharding)
