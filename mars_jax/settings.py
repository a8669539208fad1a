"""Checks of a run's settings before anything is compiled or read.

`check` runs first in `train.train` and `evaluate.evaluate`, `check_devices` once the device
count is known (after `distributed.initialize`). Each bad setting raises one error whose message
is one line naming the config key and its value: `SettingError` (a ValueError) or `MissingPath`
(a FileNotFoundError). `cli.run` prints either as one line and exits non-zero.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from typing import Iterable

from mars_jax import sharding

SOURCES = ("synthetic", "gsm8k", "messages")  # rows.SYNTHETIC and the row formats


class SettingError(ValueError):
    """A bad config value: ``key=value: reason`` on one line."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key}={value!r}: {reason}")
        self.key, self.value = key, value


class MissingPath(FileNotFoundError):
    """A path a run needs does not exist: ``key=path: reason`` on one line."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key}={value!r}: {reason}")
        self.key, self.value = key, value


def flat_keys(cfg, prefix: str = "") -> list[str]:
    """Every key path of ``cfg`` (sections and leaves), e.g. ``train``, ``train.batch_size``."""
    out = []
    for name, value in cfg.items():
        path = f"{prefix}{name}"
        out.append(path)
        if hasattr(value, "items") and path != "mesh.rules":  # rules: open logical names
            out.extend(flat_keys(value, path + "."))
    return out


def nearest_key(key: str, valid: Iterable[str]) -> str | None:
    """The valid key closest to ``key`` (difflib), or None when nothing is close."""
    valid = list(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not match:  # compare the last component within the same section
        section, _, leaf = key.rpartition(".")
        same = [v for v in valid if v.rpartition(".")[0] == section]
        leaves = difflib.get_close_matches(leaf, [v.rpartition(".")[2] for v in same], n=1)
        match = [f"{section}.{leaves[0]}" if section else leaves[0]] if leaves else []
    return match[0] if match else None


def unknown_key(cfg, path: str) -> str | None:
    """The first prefix of dotted ``path`` that is not a key of ``cfg`` (e.g. ``train.nonsense``
    for ``train.nonsense.x``), or None when the whole path exists."""
    node, parts = cfg, path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(node, "keys") or part not in node.keys():
            return ".".join(parts[: i + 1])
        node = node[part]
    return None


def unknown_key_message(cfg, key: str) -> str:
    """``unknown config key KEY; did you mean NEAREST?`` (one line)."""
    near = nearest_key(key, flat_keys(cfg))
    return f"unknown config key {key!r}" + (f"; did you mean {near!r}?" if near else "")


def _schema():
    """configs/tiny.py's config (the full schema), read by path next to the package; None
    where it is absent (mars_jax installed alone)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("_mars_jax_schema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def check_keys(cfg, schema=None) -> None:
    """Raises SettingError for a key of ``cfg`` not in ``schema`` (default: configs/tiny.py,
    the full schema; skipped when it cannot be imported). ``mesh.rules`` may hold any name."""
    schema = _schema() if schema is None else schema
    if schema is None:
        return
    valid = set(flat_keys(schema))
    for key in flat_keys(cfg):
        if key not in valid and not key.startswith("mesh.rules."):
            near = nearest_key(key, valid)
            hint = f"; did you mean {near!r}?" if near else ""
            raise SettingError(key, _get(cfg, key), f"unknown config key{hint}")


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def check(cfg, *, training: bool = True, schema=None) -> None:
    """Checks what can be checked without devices or data: keys, lengths, evaluation settings
    and the paths the run needs (``training``: train data, init_from and the eval file a later
    evaluation reads; else evaluation only). Raises SettingError or MissingPath."""
    check_keys(cfg, schema)
    d, o, e = cfg.data, cfg.objective, cfg.eval
    if not isinstance(o.block_size, int) or o.block_size <= 0:
        raise SettingError("objective.block_size", o.block_size, "must be a positive integer")
    if o.block_size > d.max_length or d.max_length % o.block_size:
        raise SettingError(
            "objective.block_size",
            o.block_size,
            f"must divide data.max_length={d.max_length}",
        )
    if e.block_size < 0:
        raise SettingError("eval.block_size", e.block_size, "must be >= 0 (0: as trained)")
    if not len(e.thresholds):
        raise SettingError("eval.thresholds", tuple(e.thresholds), "must list a threshold")
    for t in e.thresholds:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            # NaN fails the comparison too.
            raise SettingError("eval.thresholds", tuple(e.thresholds), f"{t!r} is outside (0, 1]")
    # eval.num_examples 0 or less read no synthetic problem ("no evaluation examples ... set
    # data.eval_format") and eval.nll_examples 0 failed after all the decoding.
    for key in ("eval.batch_size", "eval.max_new_tokens", "eval.num_examples", "eval.nll_examples",
                "eval.timing_repeats"):
        if _get(cfg, key) < 1:
            raise SettingError(key, _get(cfg, key), "must be >= 1")
    t = cfg.train
    if t.batch_size < 1:
        raise SettingError("train.batch_size", t.batch_size, "must be >= 1")
    if t.max_consecutive_skips < 0:
        raise SettingError(
            "train.max_consecutive_skips", t.max_consecutive_skips, "must be >= 0 (0: never stop)"
        )
    if t.grad_accum_steps < 1:
        raise SettingError("train.grad_accum_steps", t.grad_accum_steps, "must be >= 1")
    if t.batch_size % t.grad_accum_steps:
        raise SettingError(
            "train.batch_size",
            t.batch_size,
            f"must be divisible by train.grad_accum_steps={t.grad_accum_steps}",
        )
    if not 0 <= d.max_bad_fraction <= 1:  # NaN fails too; the ConfigDict keeps it a float
        raise SettingError("data.max_bad_fraction", d.max_bad_fraction, "must lie in [0, 1]")
    for key in ("train.save_every", "train.log_every", "train.max_to_keep"):
        if _get(cfg, key) < 1:
            raise SettingError(key, _get(cfg, key), "must be >= 1")
    if t.num_steps < 0:
        raise SettingError("train.num_steps", t.num_steps, "must be >= 0 (0: from num_epochs)")
    if not t.num_steps and not t.num_epochs > 0:
        raise SettingError("train.num_epochs", t.num_epochs, "must be > 0 when num_steps is 0")
    for key in ("train.learning_rate", "train.weight_decay", "train.warmup_ratio"):
        if not 0 <= _get(cfg, key) < float("inf"):  # NaN fails too
            raise SettingError(key, _get(cfg, key), "must be a finite number >= 0")
    if t.warmup_ratio > 1:
        raise SettingError("train.warmup_ratio", t.warmup_ratio, "must lie in [0, 1]")
    if not t.grad_clip > 0:
        raise SettingError("train.grad_clip", t.grad_clip, "must be > 0")
    if t.keep_every < 0:
        raise SettingError("train.keep_every", t.keep_every, "must be >= 0 (0: none)")
    if d.source not in SOURCES:
        raise SettingError("data.source", d.source, f"must be one of {SOURCES}")
    if d.source != "synthetic":
        if training:
            _need_file(cfg, "data.train_path")
        _need_file(cfg, "data.eval_path")
    if training and cfg.init_from and not os.path.isdir(cfg.init_from):
        raise MissingPath("init_from", cfg.init_from, "is not a directory")
    if cfg.tokenizer_path and not os.path.isdir(cfg.tokenizer_path):
        raise MissingPath("tokenizer_path", cfg.tokenizer_path, "is not a directory")
    if training and cfg.init_from:
        _check_trim_vocab(cfg)


def _check_trim_vocab(cfg) -> None:
    """``data.trim_vocab`` must match ``init_from``: a trimmed run starts from scratch or from
    a trimmed run (whose id map it keeps), an untrimmed one never from a trimmed run."""
    is_run = os.path.exists(os.path.join(cfg.init_from, "model.json"))
    trimmed = os.path.exists(os.path.join(cfg.init_from, "vocab_map.json"))
    if cfg.data.trim_vocab and not is_run:
        raise SettingError(
            "data.trim_vocab",
            True,
            f"init_from={cfg.init_from!r} is a Hugging Face checkpoint, whose rows are the full "
            "vocabulary; trimming is for runs from scratch or from a trimmed run",
        )
    if cfg.data.trim_vocab and not trimmed:
        raise SettingError(
            "data.trim_vocab",
            True,
            f"init_from={cfg.init_from!r} is an untrimmed run; a trimmed run starts from scratch "
            "or from a trimmed run",
        )
    if trimmed and not cfg.data.trim_vocab:
        raise SettingError(
            "data.trim_vocab",
            False,
            f"init_from={cfg.init_from!r} is a trimmed run (vocab_map.json): set "
            "data.trim_vocab=True to continue with its id map",
        )


def _need_file(cfg, key: str) -> None:
    path = _get(cfg, key)
    if not path:
        raise MissingPath(key, path, f"is empty; data.source={cfg.data.source!r} needs a file")
    if not os.path.isfile(path):
        raise MissingPath(key, path, "does not exist")


def mesh_sizes(mesh_cfg, num_devices: int) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes of config ``mesh`` on ``num_devices`` devices (-1 resolved).

    Raises SettingError when they do not multiply to ``num_devices``."""
    sizes = {a: mesh_cfg[a] for a in sharding.MESH_AXES}
    shown = ",".join(f"{a}={s}" for a, s in sizes.items())
    if list(sizes.values()).count(-1) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
        raise SettingError("mesh", shown, "sizes must be >= 1, with at most one -1")
    known = math.prod(s for s in sizes.values() if s != -1)
    for a, s in sizes.items():
        if s == -1:
            sizes[a] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise SettingError("mesh", shown, f"the product must equal the {num_devices} devices")
    return sizes


def check_devices(cfg, num_devices: int, heads: tuple[int, int] | None = None) -> None:
    """Mesh, head and batch checks for ``num_devices`` devices; ``heads`` (num_heads,
    num_kv_heads) of the model to train, default ``cfg.model``'s. Raises SettingError."""
    sizes = mesh_sizes(cfg.mesh, num_devices)
    rules = dict(sharding.logical_rules(cfg.mesh.rules))

    def size(name):
        axes = rules.get(name)
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return math.prod(sizes[a] for a in axes)

    heads = (cfg.model.num_heads, cfg.model.num_kv_heads) if heads is None else heads
    where = f"the model of init_from={cfg.init_from!r}" if cfg.init_from else "model"
    for name, count in zip(("heads", "kv_heads"), heads):
        if count % size(name):
            raise SettingError(
                f"mesh.rules.{name}",
                rules.get(name),
                f"size {size(name)} (mesh {sizes}) splits the {count} {name} of {where}",
            )
    dp, bs = size("batch"), cfg.train.batch_size
    if bs % dp:
        raise SettingError(
            "train.batch_size",
            bs,
            f"must be divisible by the data-parallel size {dp} (mesh axes "
            f"{rules.get('batch')!r} of {sizes})",
        )
