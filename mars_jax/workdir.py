"""A run's working directory: its files and every Orbax checkpoint item.

Layout of ``workdir``:
  config.json       the run config (ml_collections ConfigDict as JSON)
  model.json        the `ModelConfig` of the checkpoints
  tokenizer/        the tokenizer files (transformers-loadable, with <|mask|>)
  vocab_map.json    only in a trimmed run (data.trim_vocab): the Qwen2.5 id of each model
                    row (`mars_jax.vocab.VocabMap`)
  checkpoints/<step>/{params, opt_state, data}   Orbax checkpoints (atomic, written
                    asynchronously): parameters as nested dicts of arrays (``nnx.to_pure_dict``,
                    readable without this package), the optax state, and the data position
  metrics.jsonl     one JSON object per logged training step (`mars_jax.metrics`)
  eval.json         the latest evaluation (`mars_jax.evaluate`)
  eval/step_<step>_<UTC time>.json   every evaluation, one file each, never overwritten

`Checkpoints` is the only code that names the Orbax items.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from mars_jax import sharding, vocab
from mars_jax.model import ModelConfig
from mars_jax.tokenizer import Tokenizer, load_tokenizer

# The Orbax items of a checkpoint step.
_PARAMS, _OPT_STATE, _DATA = "params", "opt_state", "data"


class TrainState(NamedTuple):
    """What a checkpoint step holds.

    params: parameter State (leaves as in ``sharding.abstract_params``).
    opt_state: the optax state of ``train_step.optimizer``.
    data_position: int, index of the next training batch (``data.batched_dataset`` element).
    """

    params: nnx.State
    opt_state: Any
    data_position: int


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


VOCAB_MAP = "vocab_map.json"


def write_vocab_map(workdir: str, vmap: vocab.VocabMap) -> None:
    """Writes the id map of a trimmed run to ``workdir/vocab_map.json``."""
    os.makedirs(workdir, exist_ok=True)
    vmap.save(os.path.join(workdir, VOCAB_MAP))


def read_vocab_map(workdir: str) -> vocab.VocabMap | None:
    """The id map of the run in ``workdir``, or None for an untrimmed run (no vocab_map.json).
    Raises ValueError for a malformed file."""
    path = os.path.join(workdir, VOCAB_MAP)
    return vocab.VocabMap.load(path) if os.path.exists(path) else None


# Keys that may differ when a run is resumed: they do not change what is computed. The
# distributed keys differ between the processes of one run (config.json holds process 0's), and
# a run may resume on another number of processes: global batches do not depend on it.
_RESUMABLE_CHANGES = (
    "train.log_every",
    "train.save_every",
    "train.max_to_keep",
    "distributed.coordinator_address",
    "distributed.num_processes",
    "distributed.process_id",
)
# Sections that only configure other commands: eval is read by `mars_jax.evaluate`, and
# `two_stage.sh` passes the same flags to training and evaluation.
_RESUMABLE_SECTIONS = ("eval.",)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_run_config(workdir: str) -> dict:
    """``workdir/config.json`` as a dict. Raises FileNotFoundError if it is missing."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} holds no run config")
    with open(path) as f:
        return json.load(f)


def check_same_run(workdir: str, run_config_json: str) -> None:
    """Before resuming: raises ValueError if ``workdir/config.json`` differs from the new run
    config in any key but logging/saving cadence and the distributed launch (a different batch
    size, schedule, objective, model or data would silently mix two runs). The message lists
    the differing keys."""
    saved = _flatten(read_run_config(workdir))
    new = _flatten(json.loads(run_config_json))
    diff = [
        f"{k}: {saved.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(saved.keys() | new.keys())
        if saved.get(k) != new.get(k)
        and k not in _RESUMABLE_CHANGES
        and not k.startswith(_RESUMABLE_SECTIONS)
    ]
    if diff:
        raise ValueError(
            f"{workdir} holds a run with another config ({'; '.join(diff)}): resume it with its "
            "own config, or start the new run in a new workdir"
        )


def trained_block_size(workdir: str) -> int:
    """The ``objective.block_size`` the run in ``workdir`` was trained with."""
    return int(read_run_config(workdir)["objective"]["block_size"])


def sharding_rules(workdir: str) -> sharding.Rules:
    """The logical-axis rules of the run in ``workdir`` (its ``mesh.rules``).

    Raises ValueError for a run written before the rules were part of the config (its
    checkpoints also store the decoder layers unstacked, which this version cannot restore).
    """
    mesh = read_run_config(workdir)["mesh"]
    if "rules" not in mesh:
        raise ValueError(
            f"{workdir} was written by an earlier mars-jax (no mesh.rules; decoder layers saved "
            "one by one): export it with that version and start from the export (init_from)"
        )
    return sharding.logical_rules(mesh["rules"])


def read_model_config(workdir: str, **overrides) -> ModelConfig:
    """The `ModelConfig` saved in ``workdir/model.json``, with field ``overrides`` (e.g. dtype)."""
    path = os.path.join(workdir, "model.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir} is not a mars-jax run directory")
    with open(path) as f:
        return dataclasses.replace(ModelConfig(**json.load(f)), **overrides)


class Checkpoints:
    """The Orbax checkpoints of a run, ``workdir/checkpoints/<step>``; usable as a context
    manager (closing waits for asynchronous saves).

    Each step holds the items of a `TrainState`. Saves are asynchronous and atomic: a step
    appears only once all of its items are written. In a multi-process run every process
    creates its `Checkpoints` on the same (shared) directory and calls each save and restore:
    Orbax writes each process's shards of the arrays, and process 0 the metadata.
    """

    def __init__(self, workdir: str, *, max_to_keep: int | None = None):
        self.workdir = workdir
        self._manager = ocp.CheckpointManager(
            os.path.join(os.path.abspath(workdir), "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        """The newest saved step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState) -> None:
        """Starts writing ``state`` as checkpoint ``step`` (returns before the write ends)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _PARAMS: ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
                    _OPT_STATE: ocp.args.StandardSave(state.opt_state),
                    _DATA: ocp.args.JsonSave({"next_batch": int(state.data_position)}),
                }
            ),
            force=True,
        )

    def restore(self, step: int, abstract: TrainState) -> TrainState:
        """Checkpoint ``step`` restored into the structure and shardings of ``abstract`` (its
        params and opt_state are trees of ``jax.ShapeDtypeStruct``; its data_position is
        ignored)."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _PARAMS: ocp.args.StandardRestore(nnx.to_pure_dict(abstract.params)),
                    _OPT_STATE: ocp.args.StandardRestore(abstract.opt_state),
                    _DATA: ocp.args.JsonRestore(),
                }
            ),
        )
        return TrainState(
            _fill(abstract.params, restored[_PARAMS]),
            restored[_OPT_STATE],
            int(restored[_DATA]["next_batch"]),
        )

    def restore_params(self, abstract: nnx.State, step: int | None = None):
        """The parameters of checkpoint ``step`` (default: the latest) in ``abstract``'s
        structure and shardings. Returns (State, step). Raises FileNotFoundError without
        checkpoints."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        target = nnx.to_pure_dict(abstract)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_PARAMS: ocp.args.StandardRestore(target)})
        )
        return _fill(abstract, restored[_PARAMS]), step

    def reached_preemption(self, step: int) -> bool:
        """Whether every process of a multi-process run has agreed to stop after ``step``
        because one of them got SIGTERM (Orbax's check of JAX's preemption sync service, which
        `jax.distributed.initialize` starts; all processes reach the same answer at the same
        step). Always False in a single-process run."""
        return self._manager.reached_preemption(step)

    def wait_until_finished(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fill(abstract: nnx.State, pure: dict) -> nnx.State:
    """A copy of ``abstract`` with the arrays of the pure dict ``pure``."""
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, pure)
    return state


def load_model(workdir: str, *, mesh: Mesh | None = None, step: int | None = None, **overrides):
    """Rebuilds the trained model of ``workdir``: returns (Qwen2, Tokenizer, step). For a
    trimmed run the tokenizer is a `vocab.MappedTokenizer` (model ids in and out).

    ``overrides`` replace `ModelConfig` fields (e.g. ``dtype="bfloat16"``); ``mesh`` defaults to
    all devices on the data axis; parameters are placed by the run's ``mesh.rules``.
    Raises FileNotFoundError for a directory that is not a run or has no checkpoint.
    """
    cfg = read_model_config(workdir, **overrides)
    graphdef, abstract = sharding.abstract_params(
        cfg, mesh or sharding.make_mesh(), sharding_rules(workdir)
    )
    with Checkpoints(workdir) as checkpoints:
        params, step = checkpoints.restore_params(abstract, step)
    tok = load_tokenizer(os.path.join(workdir, "tokenizer"))
    if (vmap := read_vocab_map(workdir)) is not None:
        tok = vocab.MappedTokenizer(tok, vmap)
    return nnx.merge(graphdef, params), tok, step
