"""The run config: its schema and defaults (`defaults`), and its checks (`validate`).

`defaults` is the full schema, every key with its default value and a comment; configs/*.py
start from it (configs/tiny.py is `defaults` itself). A key outside it is an error naming the
nearest valid key, wherever mars-jax is installed.

`validate` is the one check of a run config: every entry point that takes one (``train.train``,
``evaluate.evaluate``, the benchmarks and launch tools that build a step from a config) calls it
first, before any file is read or anything is compiled. `check_devices` adds the checks that need
the device count (after `distributed.initialize`). Each bad setting raises one error whose message
is one line naming the config key and its value: `SettingError` (a ValueError) or `MissingPath`
(a FileNotFoundError), both `errors.UserError`s, which `cli.run` prints as one line.

`ObjectiveConfig` is the typed, static objective settings the loss functions and the jitted train
step read (`objective_config` builds it from a run config).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable

import ml_collections

from mars_jax import sharding, storage
from mars_jax.decode_options import DecodeOptions, OptionError
from mars_jax.errors import MissingPath, SettingError

SOURCES = ("synthetic", "gsm8k", "messages")  # rows.SYNTHETIC and the row formats
OBJECTIVE_NAMES = ("ar", "mars")  # objectives.OBJECTIVES
NORMALIZATIONS = ("sequence", "token")
# How each sequence's noisy CE is weighted: "none", or "inverse_t" (the reference's no-SFT trainer).
NOISY_WEIGHTINGS = ("none", "inverse_t")
SCHEDULES = ("linear", "constant")  # train.schedule: after the warmup
REMAT = ("none", "full", "dots")  # model.REMAT
ATTENTION = ("xla", "chunked", "splash", "cudnn")  # model.ATTENTION (attention.IMPLEMENTATIONS)


def defaults(stage: str = "ar") -> ml_collections.ConfigDict:
    """The default run config for ``stage`` "ar" (stage 1) or "mars" (stage 2): a tiny
    Qwen2.5-architecture model on the built-in arithmetic word problems (configs/tiny.py).

    Every key can be overridden with --config.<key>=<value>; an unknown key is an error.
    """
    return ml_collections.ConfigDict(
        {
            # Seed of the random initialization, the data order, the synthetic problems and sampling.
            "seed": 0,
            # "" (random init), a Hugging Face checkpoint directory, or another run's workdir
            # (its latest checkpoint: stage 2 starts from stage 1).
            "init_from": "",
            # "" = the tokenizer of init_from if set, else the offline Qwen2.5 tokenizer.
            "tokenizer_path": "",
            # With init_from a Hugging Face directory whose vocabulary fills its embedding
            # (SmolLM2, Llama 3) and whose tokenizer has no <|mask|>: add <|mask|> as a new
            # embedding row (rows padded to a multiple of 128, initialised as transformers'
            # resize_token_embeddings does), written to the run's tokenizer and exports.
            "add_mask_token": False,
            # Used for random init only; init_from brings its own architecture (dtypes, remat and
            # attention always come from here).
            "model": {
                "vocab_size": 151936,  # embedding rows (the Qwen2.5 vocabulary)
                "hidden_size": 64,  # width of the residual stream
                "intermediate_size": 192,  # width of the MLP
                "num_layers": 2,  # decoder layers
                "num_heads": 4,  # query heads
                "num_kv_heads": 2,  # key/value heads (grouped-query attention); divides num_heads
                "head_dim": 16,  # width of one head
                "rope_theta": 1e6,  # RoPE base
                "max_position_embeddings": 32768,  # context length recorded in exports
                "rms_norm_eps": 1e-6,  # epsilon of the RMS norms
                "tie_word_embeddings": True,  # the output head is the embedding matrix
                "dtype": "float32",  # compute dtype (e.g. bfloat16)
                "param_dtype": "float32",  # dtype of the parameters and the optimizer state
                # Execution, also applied with init_from: rematerialisation policy (none | full |
                # dots), attention implementation (xla | chunked | splash on TPU | cudnn on GPU; see
                # mars_jax/attention.py), layers in a lax.scan (else unrolled).
                "remat": "none",
                "attention": "xla",  # see mars_jax/attention.py
                "scan_layers": True,  # False: unrolled
            },
            "data": {
                "source": "synthetic",  # synthetic | gsm8k | messages
                "train_path": "",  # .jsonl / .json / .parquet (gsm8k, messages)
                "eval_path": "",  # evaluation rows (gsm8k, messages); "" with synthetic data
                "eval_format": "",  # row format of eval_path; "" = that of the training data
                "num_synthetic_train": 4000,  # synthetic training problems (source "synthetic")
                "max_length": 128,  # a multiple of objective.block_size
                # Training rows packed first-fit into sequences of max_length (mars_jax/packing.py):
                # no row attends to another, the loss is normalised per row. train.batch_size then
                # counts packed sequences per step, not rows. Evaluation stays one row per row.
                "packing": False,
                "all_assistant_turns": False,  # label every assistant turn, not only the last
                # JSON Lines training files: the largest fraction of non-blank lines that may hold no
                # row (invalid JSON or UTF-8, not an object); such lines are skipped, counted and
                # logged by file:line; past it the run stops. 0: any such line stops it.
                "max_bad_fraction": 0.01,
                # Rows longer than max_length: cut to it, keeping the labels that fit (True, the
                # reference's behaviour), or skipped and counted as too_long (False).
                "truncate": True,
                # Runs from scratch (or from a trimmed run): embedding rows only for the ids of the
                # training and evaluation data (+ control tokens), model.vocab_size ignored; the id
                # map is RUN/vocab_map.json (mars_jax/vocab.py). Such a run cannot be exported.
                "trim_vocab": False,
            },
            "objective": {
                "name": stage,  # ar (stage 1) | mars (stage 2)
                "block_size": 4,  # MARS block size B; divides data.max_length
                "ar_weight": 1.0,  # weight of the clean (AR) CE in the MARS loss
                # none | inverse_t: each sequence's noisy CE times 1 / (t + 1e-6), t ~ U(1e-3, 1)
                # (the reference's trainer for the "w/o SFT loss" ablation, with ar_weight 0).
                "noisy_weighting": "none",
                "normalization": "sequence",  # sequence | token
                "max_label_tokens": 0,  # 0: the most labelled tokens of any example
                # Cross-entropy over this many positions at a time (0: all at once); bounds the
                # [rows, positions, vocabulary] logits that exist at once.
                "ce_chunk_size": 0,
            },
            "train": {
                "batch_size": 16,  # rows per optimizer step (split into grad_accum_steps)
                "grad_accum_steps": 1,  # micro-batches per step; divides batch_size
                "num_epochs": 1.0,  # used when num_steps is 0
                "num_steps": 110,  # > 0 overrides num_epochs
                "learning_rate": 3e-3,  # peak of the learning-rate schedule
                "warmup_ratio": 0.03,  # fraction of the steps spent warming up, in [0, 1]
                # After the linear warmup: "linear" decay to 0 at the last step, or "constant"
                # (the peak held: a run whose checkpoints are compared along the way).
                "schedule": "linear",
                # > 0: stop after this step (saved, as a stop signal does) before num_steps; the
                # same command with a later stop_at (or 0) goes on. For runs in segments.
                "stop_at": 0,
                "weight_decay": 0.0,  # AdamW's decoupled weight decay
                "grad_clip": 1.0,  # the global gradient norm is clipped to this
                "log_every": 10,  # steps between metrics records
                # A checkpoint every 25 steps (~30 s of CPU steps here) bounds the work a crash
                # loses; SIGTERM / Ctrl-C save the step reached anyway (mars_jax/train.py).
                "save_every": 25,
                # Checkpoints kept: the newest max_to_keep, plus every step divisible by keep_every
                # (0: none), kept for good.
                "max_to_keep": 2,
                "keep_every": 0,  # 0: none kept for good
                # On resume, a checkpoint whose files fail their checksums (sha256.json) is an error
                # naming the step and file; True: warn, move it to corrupt_checkpoints/ and resume
                # from the previous checkpoint instead.
                "restore_fallback": False,
                # init_from a run that has not reached its final step (stopped early) is an error,
                # as is resuming a run whose init_from run has moved on since it started; True
                # allows both.
                "allow_partial_init": False,
                # A step with a non-finite loss or gradient norm is skipped (no update) and logged
                # with its data rows; this many skips in a row stop the run (0: never). A skip
                # leaves the state as it was and the next step reads the next batch, so 10
                # non-finite batches in a row point at the state or the settings (learning rate,
                # overflow) rather than at a few bad rows, and cost only 10 steps.
                "max_consecutive_skips": 10,
            },
            # Device mesh axes (-1: the remaining devices) and the logical-axis sharding rules:
            # logical name -> mesh axes, e.g. --config.mesh.rules.embed="('data','fsdp')".
            "mesh": {"data": -1, "fsdp": 1, "tensor": 1, "rules": dict(sharding.DEFAULT_RULES)},
            # Multi-process runs (one process per host): all three set, or none. Unset (the
            # defaults), a Slurm, Open MPI, Cloud TPU pod or Kubernetes launch of several processes
            # is detected from the environment; otherwise the run is one process. coordinator_address
            # is "host:port" of process 0, process_id this process's index in [0, num_processes).
            "distributed": {"coordinator_address": "", "num_processes": 0, "process_id": -1},
            "eval": {
                "num_examples": 64,  # evaluation prompts (the first of eval_path, or synthetic)
                "batch_size": 32,  # prompts decoded at once
                "thresholds": (1.0, 0.95, 0.9, 0.8, 0.7),  # confidence thresholds, each in (0, 1]
                "block_size": 0,  # 0: the block size the run was trained with
                "max_new_tokens": 64,  # completion budget per prompt
                "temperature": 0.0,  # 0: greedy; > 0 samples (prompt i with seed + i)
                "cache_mode": "sliding",  # decode.CACHE_MODES: sliding | block | none
                "rule": "prob",  # decode.RULES: prob | entropy | margin | verify
                "nll_examples": 64,  # reference answers scored by AR teacher-forced NLL
                # Wall clock: each threshold's decode, and that of the AR baseline (block size 1,
                # threshold 1.0), is timed this many times after an untimed warm-up (compilation);
                # the fastest counts (mars_jax/evaluate.py).
                "timing_repeats": 3,
            },
        }
    )


# --- keys ---------------------------------------------------------------------------------


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


def check_keys(cfg, schema=None) -> None:
    """Raises SettingError for a key of ``cfg`` not in ``schema`` (default: `defaults`, the full
    schema). ``mesh.rules`` may hold any logical name."""
    valid = set(flat_keys(defaults() if schema is None else schema))
    for key in flat_keys(cfg):
        if key not in valid and not key.startswith("mesh.rules."):
            near = nearest_key(key, valid)
            hint = f"; did you mean {near!r}?" if near else ""
            raise SettingError(key, _get(cfg, key), f"unknown config key{hint}")


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


# --- the checks ---------------------------------------------------------------------------


def validate(cfg, *, training: bool, paths: bool = True, schema=None) -> None:
    """Checks what can be checked without devices or data, before anything is read or compiled:
    keys (against `defaults`), the model's execution settings, the objective, lengths, training
    and evaluation settings (the decoder's ``eval.rule`` and ``eval.cache_mode`` among them), and
    last, with ``paths``, the paths the run needs (``training``: train data, init_from and the
    eval file a later evaluation reads; else the evaluation's only). ``paths=False`` is for tools
    that read no file of the config (memory plans, step benchmarks). Raises SettingError or
    MissingPath."""
    check_keys(cfg, schema)
    _check_model(cfg.model)
    _check_objective(cfg)
    _check_eval(cfg.eval)
    _check_train(cfg)
    if paths:
        _check_paths(cfg, training)


def _check_model(m) -> None:
    if m.remat not in REMAT:
        raise SettingError("model.remat", m.remat, f"must be one of {REMAT}")
    if m.attention not in ATTENTION:
        raise SettingError("model.attention", m.attention, f"must be one of {ATTENTION}")


def _check_objective(cfg) -> None:
    d, o = cfg.data, cfg.objective
    if o.name not in OBJECTIVE_NAMES:
        raise SettingError("objective.name", o.name, f"must be one of {list(OBJECTIVE_NAMES)}")
    if o.normalization not in NORMALIZATIONS:
        raise SettingError(
            "objective.normalization", o.normalization, f"must be one of {NORMALIZATIONS}"
        )
    if o.noisy_weighting not in NOISY_WEIGHTINGS:
        raise SettingError(
            "objective.noisy_weighting", o.noisy_weighting, f"must be one of {NOISY_WEIGHTINGS}"
        )
    if o.noisy_weighting != "none" and o.name != "mars":
        raise SettingError(
            "objective.noisy_weighting", o.noisy_weighting, "needs objective.name='mars'"
        )
    if o.noisy_weighting != "none" and d.packing:
        raise SettingError(
            "objective.noisy_weighting",
            o.noisy_weighting,
            "draws one weight per row of a batch: it needs data.packing=False",
        )
    if not isinstance(d.packing, bool):
        raise SettingError("data.packing", d.packing, "must be True or False")
    if not isinstance(o.block_size, int) or o.block_size <= 0:
        raise SettingError("objective.block_size", o.block_size, "must be a positive integer")
    if o.block_size > d.max_length or d.max_length % o.block_size:
        raise SettingError(
            "objective.block_size",
            o.block_size,
            f"must divide data.max_length={d.max_length}",
        )
    for key in ("objective.max_label_tokens", "objective.ce_chunk_size"):
        if _get(cfg, key) < 0:
            raise SettingError(key, _get(cfg, key), "must be >= 0 (0: see config.defaults)")


def _check_eval(e) -> None:
    if e.block_size < 0:
        raise SettingError("eval.block_size", e.block_size, "must be >= 0 (0: as trained)")
    if not len(e.thresholds):
        raise SettingError("eval.thresholds", tuple(e.thresholds), "must list a threshold")
    # eval.num_examples 0 or less read no synthetic problem ("no evaluation examples ... set
    # data.eval_format") and eval.nll_examples 0 failed after all the decoding.
    for key in ("batch_size", "max_new_tokens", "num_examples", "nll_examples"):
        if e[key] < 1:
            raise SettingError(f"eval.{key}", e[key], "must be >= 1")
    if e.timing_repeats < 0:
        raise SettingError("eval.timing_repeats", e.timing_repeats, "must be >= 0 (0: untimed)")
    # The decoding settings, refused here before a checkpoint is loaded (DecodeOptions' rules).
    for t in e.thresholds:
        DecodeOptions.from_eval(e, block_size=max(e.block_size, 1), threshold=t)


def _check_train(cfg) -> None:
    d, t = cfg.data, cfg.train
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
    if t.schedule not in SCHEDULES:
        raise SettingError("train.schedule", t.schedule, f"must be one of {SCHEDULES}")
    if t.stop_at < 0:
        raise SettingError("train.stop_at", t.stop_at, "must be >= 0 (0: run to the end)")
    if not t.grad_clip > 0:
        raise SettingError("train.grad_clip", t.grad_clip, "must be > 0")
    if t.keep_every < 0:
        raise SettingError("train.keep_every", t.keep_every, "must be >= 0 (0: none)")
    if d.source not in SOURCES:
        raise SettingError("data.source", d.source, f"must be one of {SOURCES}")


def _check_paths(cfg, training: bool) -> None:
    d = cfg.data
    if d.source != "synthetic":
        if training:
            _need_file(cfg, "data.train_path")
        _need_file(cfg, "data.eval_path")
    if training and cfg.init_from and not storage.isdir(cfg.init_from):
        raise MissingPath("init_from", cfg.init_from, "is not a directory")
    if cfg.tokenizer_path and not storage.isdir(cfg.tokenizer_path):
        raise MissingPath("tokenizer_path", cfg.tokenizer_path, "is not a directory")
    if training and cfg.init_from:
        _check_trim_vocab(cfg)


def _check_trim_vocab(cfg) -> None:
    """``data.trim_vocab`` must match ``init_from``: a trimmed run starts from scratch or from
    a trimmed run (whose id map it keeps), an untrimmed one never from a trimmed run."""
    is_run = storage.exists(storage.join(cfg.init_from, "model.json"))
    trimmed = storage.exists(storage.join(cfg.init_from, "vocab_map.json"))
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
    if not storage.isfile(path):
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


# The attention kernels bound to one kind of device (jax.default_backend()'s name for it).
_KERNEL_BACKENDS = {"splash": "tpu", "cudnn": "gpu"}


def check_devices(
    cfg, num_devices: int, heads: tuple[int, int] | None = None, backend: str | None = None
) -> None:
    """Mesh, head, batch and kernel checks for ``num_devices`` devices of ``backend`` (None: not
    checked); ``heads`` (num_heads, num_kv_heads) of the model to train, default ``cfg.model``'s.
    Raises SettingError."""
    kernel = _KERNEL_BACKENDS.get(cfg.model.attention)
    if backend is not None and kernel is not None and backend != kernel:
        here = [a for a in ATTENTION if _KERNEL_BACKENDS.get(a, backend) == backend]
        raise SettingError(
            "model.attention",
            cfg.model.attention,
            f"runs on {kernel.upper()} only and this run's devices are {backend.upper()}: pass "
            f"--config.model.attention=xla (or another that runs here: {', '.join(here[1:])})",
        )
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


# --- the objective ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static settings of a training objective (`mars_jax.objectives`), closed over by the jitted
    train step: the ``objective`` section of a run config plus the tokenizer's ``mask_id``.

    name: "ar" or "mars". block_size, ar_weight, noisy_weighting: MARS only (see
    `objectives.mars_loss`). normalization: "sequence" or "token". max_label_tokens: logits are
    computed at this many positions per row (None: all). ce_chunk_size: positions per chunk of
    the cross-entropy (0: all at once). Raises ValueError (`errors.InputError`) naming the
    config key for a value outside its choices.
    """

    name: str = "ar"
    block_size: int = 1
    ar_weight: float = 1.0
    noisy_weighting: str = "none"
    normalization: str = "sequence"
    max_label_tokens: int | None = None
    ce_chunk_size: int = 0
    mask_id: int = -1

    def __post_init__(self):
        from mars_jax.errors import InputError

        if self.name not in OBJECTIVE_NAMES:
            raise InputError(
                f"objective.name must be one of {sorted(OBJECTIVE_NAMES)}, got {self.name!r}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise InputError(
                f"objective.normalization must be one of {NORMALIZATIONS}, got "
                f"{self.normalization!r}"
            )
        if self.noisy_weighting not in NOISY_WEIGHTINGS:
            raise InputError(
                f"objective.noisy_weighting must be one of {NOISY_WEIGHTINGS}, "
                f"got {self.noisy_weighting!r}"
            )
        if self.noisy_weighting != "none" and self.name != "mars":
            raise InputError(
                f"objective.noisy_weighting={self.noisy_weighting!r} needs objective.name='mars'"
            )


def objective_config(cfg, mask_id: int, longest_labels: int = 0) -> ObjectiveConfig:
    """The `ObjectiveConfig` of run config ``cfg`` (its ``objective`` section) with ``mask_id``.

    ``objective.max_label_tokens`` 0 means: ``longest_labels`` (the most labelled tokens of any
    training example, `train_step.objective_settings`) rounded up to a multiple of 8 (logits are
    computed at that many positions per row)."""
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)} - {"mask_id"}
    obj = ObjectiveConfig(
        **{k: v for k, v in cfg.objective.items() if k in fields}, mask_id=mask_id
    )
    if not obj.max_label_tokens:
        obj = dataclasses.replace(obj, max_label_tokens=-(-longest_labels // 8) * 8)
    return obj


# --- decoding arguments -------------------------------------------------------------------


def check_decoding(*, prefix: str = "", **fields) -> DecodeOptions:
    """The `DecodeOptions` of the decoding settings a program takes as flags or arguments rather
    than from a run config (``generate``, the lm-eval adapter), built before a run is loaded:
    ``fields`` are DecodeOptions fields, None leaving a field at its default. Raises its
    `OptionError` with ``prefix`` before the message (``threshold must lie in (0, 1], got
    2.0``)."""
    try:
        return DecodeOptions(**{k: v for k, v in fields.items() if v is not None})
    except OptionError as err:
        raise err.prefixed(prefix) from None
