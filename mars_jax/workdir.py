"""A run's working directory: Orbax checkpoints plus what is needed to rebuild the model.

Layout of ``workdir``:
  config.json       the run config (ml_collections ConfigDict as JSON)
  model.json        the `ModelConfig` of the checkpoints
  tokenizer/        the tokenizer files (transformers-loadable, with <|mask|>)
  checkpoints/<step>/{params, opt_state}   Orbax checkpoints (atomic, written asynchronously)
  metrics.jsonl     one JSON object per logged training step
Parameters are saved as nested dicts of arrays (``nnx.to_pure_dict``), readable without
this package.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import Mesh

from mars_jax import sharding
from mars_jax.model import ModelConfig, Qwen2
from mars_jax.tokenizer import Tokenizer, load_tokenizer


def quiet_library_logs() -> None:
    """Keeps INFO records of mars-jax only in absl's log handler (Orbax logs several per save,
    JAX reports absent TPU runtimes); warnings and errors of every library stay."""

    package = os.path.dirname(os.path.abspath(__file__))

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.pathname.startswith(package)

    absl_logging.get_absl_handler().addFilter(keep)


def is_workdir(path: str) -> bool:
    """Whether ``path`` is a mars-jax run directory (has model.json)."""
    return os.path.exists(os.path.join(path, "model.json"))


def write_run_files(workdir: str, run_config_json: str, cfg: ModelConfig, tok: Tokenizer) -> None:
    """Writes config.json, model.json and tokenizer/ into ``workdir`` (created if missing)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(run_config_json)
    with open(os.path.join(workdir, "model.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    tok.save(os.path.join(workdir, "tokenizer"))


# Keys that may differ when a run is resumed: they do not change what is computed.
_RESUMABLE_CHANGES = ("train.log_every", "train.save_every", "train.max_to_keep")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_run(workdir: str, run_config_json: str) -> None:
    """Before resuming: raises ValueError if ``workdir/config.json`` differs from the new run
    config in any key but logging/saving cadence (a different batch size, schedule, objective,
    model or data would silently mix two runs). The message lists the differing keys."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} has checkpoints but no run config")
    with open(path) as f:
        saved = _flatten(json.load(f))
    new = _flatten(json.loads(run_config_json))
    diff = [
        f"{k}: {saved.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(saved.keys() | new.keys())
        if saved.get(k) != new.get(k) and k not in _RESUMABLE_CHANGES
    ]
    if diff:
        raise ValueError(
            f"{workdir} holds a run with another config ({'; '.join(diff)}): resume it with its "
            "own config, or start the new run in a new workdir"
        )


def trained_block_size(workdir: str) -> int:
    """The ``objective.block_size`` the run in ``workdir`` was trained with."""
    with open(os.path.join(workdir, "config.json")) as f:
        return int(json.load(f)["objective"]["block_size"])


def read_model_config(workdir: str, **overrides) -> ModelConfig:
    """The `ModelConfig` saved in ``workdir/model.json``, with field ``overrides`` (e.g. dtype)."""
    path = os.path.join(workdir, "model.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a mars-jax run directory")
    with open(path) as f:
        return dataclasses.replace(ModelConfig(**json.load(f)), **overrides)


def checkpoint_manager(workdir: str, *, max_to_keep: int | None = None):
    """Orbax CheckpointManager over ``workdir/checkpoints`` (items ``params`` and ``opt_state``);
    the caller decides when to save."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"), options=options
    )


def abstract_params(cfg: ModelConfig, mesh: Mesh, rules=sharding.DEFAULT_RULES):
    """(graphdef, abstract parameter State with shardings) of a `Qwen2` on ``mesh``."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(0))))
    shardings = sharding.param_shardings(state, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return graphdef, abstract


def restore_params(manager: ocp.CheckpointManager, abstract: nnx.State, step: int | None = None):
    """Restores the ``params`` item of checkpoint ``step`` (default: latest) into ``abstract``'s
    structure and shardings. Returns (State, step). Raises FileNotFoundError without checkpoints.
    """
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    target = nnx.to_pure_dict(abstract)
    restored = manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
    ).params
    state = jax.tree.map(lambda x: x, abstract)  # a copy to fill
    nnx.replace_by_pure_dict(state, restored)
    return state, step


def load_model(workdir: str, *, mesh: Mesh | None = None, step: int | None = None, **overrides):
    """Rebuilds the trained model of ``workdir``: returns (Qwen2, Tokenizer, step).

    ``overrides`` replace `ModelConfig` fields (e.g. ``dtype="bfloat16"``); ``mesh`` defaults to
    all devices on the data axis (parameters replicated or sharded by the default rules).
    """
    cfg = read_model_config(workdir, **overrides)
    graphdef, abstract = abstract_params(cfg, mesh or sharding.make_mesh())
    with checkpoint_manager(workdir) as manager:
        params, step = restore_params(manager, abstract, step)
    tok = load_tokenizer(os.path.join(workdir, "tokenizer"))
    return nnx.merge(graphdef, params), tok, step
