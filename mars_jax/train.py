r"""Training entry point: stage 1 (AR SFT) and stage 2 (MARS), arXiv 2604.07023 Sec. 4.

  python -m mars_jax.train --config=configs/tiny.py --workdir=runs/ar
  python -m mars_jax.train --config=configs/tiny.py:mars --workdir=runs/mars \
      --config.init_from=runs/ar

A restart with the same workdir resumes from its latest checkpoint (parameters, optimizer state
and data position). ``init_from`` starts a fresh run from a Hugging Face directory or from the
latest checkpoint of another run's workdir (stage 2 from stage 1).
"""

from __future__ import annotations

import json
import math
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

import orbax.checkpoint as ocp

from mars_jax import checkpoint, data, sharding, workdir as wd
from mars_jax.model import ModelConfig, Qwen2
from mars_jax.objectives import check_config, loss_denominator, loss_fn
from mars_jax.tokenizer import load_tokenizer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Run config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, logs).", required=True)


def model_config(cfg) -> ModelConfig:
    """The model to train: from ``init_from`` (HF dir or workdir) if set, else ``cfg.model``."""
    dtypes = {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype}
    if cfg.init_from and not os.path.isdir(cfg.init_from):
        raise FileNotFoundError(f"init_from={cfg.init_from!r} is not a directory")
    if cfg.init_from and wd.is_workdir(cfg.init_from):
        return wd.read_model_config(cfg.init_from, **dtypes)
    if cfg.init_from:
        path = os.path.join(cfg.init_from, "config.json")
        with open(path) as f:
            return checkpoint.config_from_hf(json.load(f), source=path, **dtypes)
    return ModelConfig(**cfg.model)


def tokenizer_source(cfg) -> str | None:
    """``tokenizer_path`` if set; else the tokenizer of ``init_from`` (a run's tokenizer/ or the
    HF directory); else None, the offline Qwen2.5 default."""
    if cfg.tokenizer_path:
        return cfg.tokenizer_path
    if cfg.init_from and wd.is_workdir(cfg.init_from):
        return os.path.join(cfg.init_from, "tokenizer")
    return cfg.init_from or None


def objective_config(cfg, mask_id: int, examples) -> types.SimpleNamespace:
    """Static objective settings closed over by the jitted step.

    ``max_label_tokens`` 0 means: the most labelled tokens of any training example, rounded up
    to a multiple of 8 (logits are computed at that many positions per row).
    """
    obj = types.SimpleNamespace(**cfg.objective.to_dict(), mask_id=mask_id)
    check_config(obj)
    if not obj.max_label_tokens:
        longest = max(int((labels != data.IGNORE_INDEX).sum()) for _, labels in examples)
        obj.max_label_tokens = -(-longest // 8) * 8
    return obj


def optimizer(cfg, num_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup (``warmup_ratio`` of the steps) and linear decay to 0,
    after clipping the global gradient norm to ``grad_clip``."""
    t = cfg.train
    warmup = max(1, int(round(t.warmup_ratio * num_steps)))
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, t.learning_rate, warmup),
            optax.linear_schedule(t.learning_rate, 0.0, max(1, num_steps - warmup)),
        ],
        [warmup],
    )
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=t.weight_decay),
    ), schedule


def optimizer_shardings(tx: optax.GradientTransformation, abstract_params, mesh):
    """Shardings of ``tx``'s state: per-parameter moments as their parameters, scalars (e.g. the
    step count) replicated. ``abstract_params`` carries the parameter shardings."""
    param_shardings = jax.tree.map(lambda x: x.sharding, abstract_params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        jax.eval_shape(tx.init, abstract_params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )


def make_train_step(graphdef, tx, obj, grad_accum_steps: int):
    """A pure step (params, opt_state, batch) -> (params, opt_state, metrics).

    The batch ({input_ids, labels} int32 [batch, L]) is split into ``grad_accum_steps``
    micro-batches (lax.scan); their gradients and metrics are combined with weights
    proportional to their loss denominators, so the update equals that of the whole batch.
    """

    def grads_of(params, micro):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), micro, obj)

        return jax.grad(loss, has_aux=True)(params)

    def step(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)
        denominators = jax.vmap(lambda l: loss_denominator(l, obj.normalization))(micro["labels"])
        weights = denominators / jnp.maximum(denominators.sum(), 1)

        def body(acc, inputs):
            mb, w = inputs
            g, m = grads_of(params, mb)
            return jax.tree.map(lambda a, x: a + w * x, acc, (g, m)), None

        zeros = jax.eval_shape(grads_of, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), zeros)
        (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, weights))
        metrics["label_tokens"] = (batch["labels"][:, 1:] != data.IGNORE_INDEX).sum()
        metrics["grad_norm"] = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return step


def initial_params(cfg, model_cfg: ModelConfig, graphdef, abstract):
    """Parameters of a fresh run: random, from a HF directory, or from another run's workdir."""
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    if not cfg.init_from:
        init = jax.jit(
            lambda: nnx.state(Qwen2(model_cfg, rngs=nnx.Rngs(cfg.seed))), out_shardings=shardings
        )
        return init()
    if wd.is_workdir(cfg.init_from):
        with wd.checkpoint_manager(cfg.init_from) as manager:
            params, step = wd.restore_params(manager, abstract)
        logging.info("initialized from %s step %d", cfg.init_from, step)
        return params
    logging.info("initialized from Hugging Face checkpoint %s", cfg.init_from)
    return jax.device_put(checkpoint.load_hf_state(cfg.init_from, model_cfg), shardings)


def load_train_examples(cfg, tok):
    """Tokenized training examples of ``cfg.data`` (see `mars_jax.data`)."""
    d = cfg.data
    if d.source == data.SYNTHETIC:
        rows, fmt, name = (
            data.load_rows(data.SYNTHETIC, num_rows=d.num_synthetic_train, seed=cfg.seed),
            "gsm8k",
            "synthetic",
        )
    else:
        rows, fmt, name = data.read_rows(d.train_path), d.source, d.train_path
    examples, _ = data.build_examples(
        rows,
        tok,
        fmt,
        max_length=d.max_length,
        block_size=cfg.objective.block_size,
        all_assistant_turns=d.all_assistant_turns,
        max_label_tokens=cfg.objective.max_label_tokens or None,
        source_name=name,
    )
    return examples


def train(cfg, workdir: str) -> dict:
    """Runs (or resumes) training in ``workdir``; returns the last logged metrics."""
    check_config(cfg.objective)
    model_cfg = model_config(cfg)
    tok = load_tokenizer(tokenizer_source(cfg))
    examples = load_train_examples(cfg, tok)
    t = cfg.train
    num_steps = t.num_steps or max(1, int(t.num_epochs * (len(examples) // t.batch_size)))
    if t.batch_size % t.grad_accum_steps:
        raise ValueError(
            f"train.batch_size {t.batch_size} is not divisible by "
            f"train.grad_accum_steps {t.grad_accum_steps}"
        )
    dataset = data.batched_dataset(
        examples, batch_size=t.batch_size, max_length=cfg.data.max_length, seed=cfg.seed
    )

    obj = objective_config(cfg, tok.mask_id, examples)
    mesh = sharding.make_mesh(**cfg.mesh)
    graphdef, abstract = wd.abstract_params(model_cfg, mesh)
    tx, schedule = optimizer(cfg, num_steps)
    run_config = cfg.to_json_best_effort(indent=2)
    manager = wd.checkpoint_manager(workdir, max_to_keep=t.max_to_keep)

    param_shardings = jax.tree.map(lambda x: x.sharding, abstract)
    abstract_opt = jax.eval_shape(tx.init, abstract)
    opt_shardings = optimizer_shardings(tx, abstract, mesh)
    start = manager.latest_step()
    if start is None:
        params = initial_params(cfg, model_cfg, graphdef, abstract)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
        wd.write_run_files(workdir, run_config, model_cfg, tok)
        start = 0
    else:
        wd.check_same_run(workdir, run_config)
        params, _ = wd.restore_params(manager, abstract, start)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_opt,
            opt_shardings,
        )
        opt_state = manager.restore(
            start, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(target))
        ).opt_state
        logging.info("resumed from %s step %d", workdir, start)

    step_fn = jax.jit(
        make_train_step(graphdef, tx, obj, t.grad_accum_steps),
        in_shardings=(param_shardings, opt_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(param_shardings, opt_shardings, None),
        donate_argnums=(0, 1),
    )
    if start >= num_steps:
        logging.info("%s is already at step %d of %d: nothing to do", workdir, start, num_steps)
    else:
        logging.info(
            "training %s from step %d to %d (%d examples, batch %d, loss at <= %d positions/row)",
            cfg.objective.name,
            start,
            num_steps,
            len(examples),
            t.batch_size,
            obj.max_label_tokens,
        )
    metrics_file = _open_metrics(os.path.join(workdir, "metrics.jsonl"), start)
    last, t0, tokens, window_start = {}, time.time(), 0, time.time()
    for step in range(start, num_steps):
        batch = dataset[step]
        tokens += int(_sequence_lengths(batch["labels"]).sum())
        batch = jax.device_put(batch, sharding.batch_sharding(mesh))
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        done = step + 1
        if done % t.log_every == 0 or done == num_steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.time()
            rate = (done - start) / (now - t0)
            last = {
                "step": done,
                **metrics,
                "learning_rate": float(schedule(step)),
                "tokens_per_s": tokens / (now - window_start),
                "progress": done / num_steps,
                "eta_s": (num_steps - done) / rate,
            }
            tokens, window_start = 0, now
            parts = "".join(
                f" {k} {last[k]:.4f}" for k in ("noisy_loss", "clean_loss") if k in last
            )
            logging.info(
                "step %d/%d (%.0f%%) loss %.4f%s lr %.2e tokens/s %.0f ETA %s",
                done,
                num_steps,
                100 * last["progress"],
                last["loss"],
                parts,
                last["learning_rate"],
                last["tokens_per_s"],
                _hms(last["eta_s"]),
            )
            if not math.isfinite(last["loss"]):
                raise FloatingPointError(f"loss is {last['loss']} at step {done}")
            metrics_file.write(json.dumps(last) + "\n")
            metrics_file.flush()
        if done % t.save_every == 0 or done == num_steps:
            manager.save(
                done,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(nnx.to_pure_dict(params)),
                    opt_state=ocp.args.StandardSave(opt_state),
                ),
                force=True,
            )
    manager.wait_until_finished()
    manager.close()
    metrics_file.close()
    return last


def _sequence_lengths(labels: np.ndarray) -> np.ndarray:
    """Tokens per row up to its last labelled token (rows end there; batch padding excluded)."""
    labelled = labels != data.IGNORE_INDEX
    return np.where(labelled.any(1), labels.shape[1] - np.argmax(labelled[:, ::-1], axis=1), 0)


def _open_metrics(path: str, start: int):
    """Opens the metrics log for appending, first dropping records of steps after ``start``
    (logged by an interrupted run after its last checkpoint, and about to be redone)."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                try:
                    if json.loads(line)["step"] <= start:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):  # a line torn by a kill
                    logging.warning("%s:%d: dropping unreadable metrics record", path, number)
        with open(path, "w") as f:
            f.writelines(kept)
    return open(path, "a")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def main(argv):
    del argv
    wd.quiet_library_logs()
    train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
