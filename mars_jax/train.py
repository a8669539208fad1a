r"""Training runs: stage 1 (AR SFT) and stage 2 (MARS), arXiv 2604.07023 Sec. 4.

  python -m mars_jax.train --config=configs/tiny.py --workdir=runs/ar
  python -m mars_jax.train --config=configs/tiny.py:mars --workdir=runs/mars \
      --config.init_from=runs/ar

From Python: ``train.train(config, workdir)`` with a ``ConfigDict`` (e.g.
``configs.tiny.get_config("mars")``).

A restart with the same workdir resumes from its latest committed checkpoint (parameters,
optimizer state and data position), also after a hard kill (see `checkpoints.Checkpoints`); a
checkpoint whose files fail their checksums stops the run, or with ``train.restore_fallback``
is set aside for the previous one. ``init_from`` starts a fresh run from a Hugging Face
directory or from the latest checkpoint of another run's workdir (stage 2 from stage 1).

Preemption: SIGTERM (a TPU VM's or a scheduler's notice) or SIGINT (Ctrl-C) stops the run after
the step in progress: it saves that step (as a regular save), waits for the write, logs which
step it saved and returns (the program exits 0 after SIGTERM, 130 after Ctrl-C, so that a
pipeline such as launch/two_stage.sh stops); the same command resumes it. A second signal
exits at once. A run that reached its final step is marked complete (`workdir.mark_complete`);
stage 2 refuses an ``init_from`` run that is not, and a resumed stage 2 whose ``init_from``
run moved on since it started (`check_init_from`, unless ``train.allow_partial_init``). In a multi-process run, SIGTERM goes through JAX's preemption sync service so
that all processes stop and save at the same step (see `Preemption`). This module holds the run
loop; the jitted step is `mars_jax.train_step`, the run directory `mars_jax.workdir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from mars_jax import (
    cli,
    config,
    distributed,
    huggingface,
    objectives,
    packing,
    platforms,
    sharding,
    sources,
    storage,
    train_step,
    vocab,
)
from mars_jax import (
    workdir as wd,
)
from mars_jax.batches import batched_dataset, build_examples, eval_examples, eval_source
from mars_jax.checkpoints import Checkpoints, TrainState
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError, SettingError
from mars_jax.metrics import MetricsWriter
from mars_jax.model import (
    CausalLM,
    ModelConfig,
    abstract_params,
    add_vocab_rows,
    grown_vocab_size,
)
from mars_jax.rows import SYNTHETIC, load_rows, read_rows
from mars_jax.tokenizer import load_tokenizer

# ModelConfig fields taken from the run config even when init_from brings the architecture.
_EXECUTION_KEYS = ("dtype", "param_dtype", "remat", "attention", "scan_layers")


def model_config(cfg) -> ModelConfig:
    """The model to train: from ``init_from`` (HF dir or workdir) if set, else ``cfg.model``;
    dtypes and execution settings (remat, attention, scan_layers) always from ``cfg.model``.
    ``init_from`` is a directory (`config.validate`).
    """
    execution = {k: cfg.model[k] for k in _EXECUTION_KEYS}
    init = init_kind(cfg)
    if init == "run":
        return wd.read_model_config(cfg.init_from, **execution)
    if init == "hf":
        return dataclasses.replace(huggingface.read_hf_config(cfg.init_from), **execution)
    return ModelConfig(**cfg.model)


def init_kind(cfg) -> str | None:
    """What ``init_from`` is (`sources.kind`: ``"run"`` or ``"hf"``), None when unset."""
    return sources.kind(cfg.init_from) if cfg.init_from else None


def tokenizer_source(cfg) -> str | None:
    """``tokenizer_path`` if set; else the tokenizer of ``init_from`` (a run's tokenizer/ or the
    HF directory); else None, the offline Qwen2.5 default."""
    if cfg.tokenizer_path:
        return cfg.tokenizer_path
    if init_kind(cfg) == "run":
        return storage.join(cfg.init_from, "tokenizer")
    return cfg.init_from or None


def check_init_from(cfg, workdir: str) -> None:
    """Raises InputError (unless ``train.allow_partial_init``) when ``init_from`` is a run that
    has not reached its final step (a stage 1 stopped early), or when ``workdir`` resumes a run
    initialised from another step of ``init_from`` than the one it holds now (stage 1 went on
    after this stage 2 started from it)."""
    if init_kind(cfg) != "run" or cfg.train.allow_partial_init:
        return
    allow = "set train.allow_partial_init=True to go on anyway"
    record = wd.read_init_record(workdir) if wd.is_workdir(workdir) else None
    if record is not None:
        with Checkpoints(cfg.init_from) as checkpoints:
            latest = checkpoints.latest_step()
        if record["init_from"] == cfg.init_from and record["step"] != latest:
            raise InputError(
                f"{workdir} started from step {record['step']} of {cfg.init_from}, which now "
                f"holds step {latest}: start this stage afresh in a new workdir, or {allow}"
            )
        return
    if not wd.is_complete(cfg.init_from):
        raise InputError(
            f"init_from {cfg.init_from} has not reached its final step (it was stopped early): "
            f"finish it first (rerun its command), or {allow}"
        )


def with_mask_row(cfg, model_cfg: ModelConfig, tok) -> ModelConfig:
    """``model_cfg`` grown to hold the tokenizer's mask id (`model.grown_vocab_size`) where
    ``add_mask_token`` is set, ``init_from`` is a Hugging Face directory and the mask has no
    row; else ``model_cfg`` unchanged."""
    if not cfg.add_mask_token or init_kind(cfg) != "hf":
        return model_cfg
    rows = grown_vocab_size(model_cfg.vocab_size, tok.mask_id + 1)
    if rows != model_cfg.vocab_size:
        logging.info(
            "add_mask_token: <|mask|> is id %d, a new row: %d embedding rows (from %d)",
            tok.mask_id,
            rows,
            model_cfg.vocab_size,
        )
    return dataclasses.replace(model_cfg, vocab_size=rows)


def initial_params(
    cfg, model_cfg: ModelConfig, abstract: nnx.State, mesh=None, rules=None
) -> nnx.State:
    """Parameters of a fresh run, placed as ``abstract`` (leaves with shardings): random (seed
    ``cfg.seed``), from a HF directory (each process reading only its devices' parts, see
    `huggingface.load_hf_sharded`; rows `with_mask_row` adds are appended, `add_vocab_rows`),
    or from the latest checkpoint of another run."""
    init = init_kind(cfg)
    if init is None:
        shardings = sharding.shardings_of(abstract)
        init_random = jax.jit(
            lambda: nnx.state(CausalLM(model_cfg, rngs=nnx.Rngs(cfg.seed))), out_shardings=shardings
        )
        return init_random()
    if init == "run":
        with Checkpoints(cfg.init_from) as checkpoints:
            params, step = checkpoints.restore_params(abstract)
        logging.info("initialized from %s step %d", cfg.init_from, step)
        return params
    logging.info("initialized from Hugging Face checkpoint %s", cfg.init_from)
    stored = huggingface.read_hf_config(cfg.init_from).vocab_size
    if stored == model_cfg.vocab_size:
        return huggingface.load_hf_sharded(cfg.init_from, model_cfg, abstract)
    small = dataclasses.replace(model_cfg, vocab_size=stored)
    _, small_abstract = abstract_params(small, mesh, rules)
    params = huggingface.load_hf_sharded(cfg.init_from, small, small_abstract)
    grow = functools.partial(add_vocab_rows, cfg=small, rows=model_cfg.vocab_size, seed=cfg.seed)
    return jax.jit(grow, out_shardings=sharding.shardings_of(abstract))(params)


def check_token_rows(tok, rows: int, source: str) -> None:
    """Raises InputError when the tokenizer's pad, EOS or mask id has no row in the model's
    ``rows``-row embedding (a gather past it reads NaN, silently): e.g. a Llama 3 tokenizer,
    whose vocabulary fills its embedding, with ``<|mask|>`` added past it."""
    for name, token_id in (("eos_token", tok.eos_id), ("pad_token", tok.pad_id)):
        if not 0 <= token_id < rows:
            raise InputError(
                f"{source}: {name} id {token_id} has no row in the {rows}-row embedding"
            )
    if not 0 <= tok.mask_id < rows:
        raise InputError(
            f"{source}: <|mask|> id {tok.mask_id} has no row in the model's {rows}-row embedding; "
            "set add_mask_token=True to add it as a new row, or name an unused token that has "
            "one as mask_token in tokenizer_config.json (for Llama 3, one of its "
            "<|reserved_special_token_N|>)"
        )


def load_train_examples(cfg, tok):
    """Tokenized training examples of ``cfg.data`` (see `mars_jax.batches`)."""
    d = cfg.data
    if d.source == SYNTHETIC:
        rows, fmt, name = (
            load_rows(SYNTHETIC, num_rows=d.num_synthetic_train, seed=cfg.seed),
            "gsm8k",
            "synthetic",
        )
    else:
        rows = read_rows(d.train_path, max_bad_fraction=d.max_bad_fraction)
        fmt, name = d.source, d.train_path
    examples, _ = build_examples(
        rows,
        tok,
        fmt,
        max_length=d.max_length,
        block_size=cfg.objective.block_size,
        all_assistant_turns=d.all_assistant_turns,
        max_label_tokens=cfg.objective.max_label_tokens or None,
        source_name=name,
        truncate=d.truncate,
    )
    return examples


def pack_examples(cfg, examples) -> list[packing.Packed]:
    """``examples`` packed into sequences of ``data.max_length`` (`packing.pack`, seeded by
    ``cfg.seed``), logged with the padding they save.

    Raises SettingError when ``objective.max_label_tokens`` is set and a packed sequence holds
    more labelled tokens (its loss would drop some)."""
    d = cfg.data
    sequences = packing.pack(
        examples, max_length=d.max_length, block_size=cfg.objective.block_size, seed=cfg.seed
    )
    most = max(int((s.labels != IGNORE_INDEX).sum()) for s in sequences)
    cap = cfg.objective.max_label_tokens
    if cap and most > cap:
        raise SettingError(
            "objective.max_label_tokens",
            cap,
            f"a packed sequence of data.max_length={d.max_length} holds {most} labelled "
            f"tokens: set it to 0 (the most of any packed sequence) or to at least {most}",
        )
    logging.info(
        "packing: %d rows in %d sequences of %d tokens (%.2f rows each); padding %.1f%% of "
        "the tokens, %.1f%% unpacked",
        len(examples),
        len(sequences),
        d.max_length,
        len(examples) / len(sequences),
        100 * packing.padding_fraction(sequences, d.max_length),
        100 * packing.padding_fraction(examples, d.max_length),
    )
    return sequences


def build_vocab_map(cfg, workdir: str, tok, examples) -> vocab.VocabMap:
    """The id map of a trimmed run (``data.trim_vocab``): the one saved in ``workdir`` (a
    resumed run) or in ``init_from`` (a trimmed run continued), else built (`vocab.build`) from
    the Qwen ids of ``examples`` (the tokenized training data) and of the evaluation examples
    (every row of ``data.eval_path``; ``eval.num_examples`` synthetic ones), as evaluation
    tokenizes them."""
    for run in (workdir, cfg.init_from):
        if run and (saved := wd.read_vocab_map(run)) is not None:
            return saved
    source, fmt, seed = eval_source(cfg)
    num = cfg.eval.num_examples if source == SYNTHETIC else None
    rows = [
        {"messages": prompt + [{"role": "assistant", "content": answer}]}
        for prompt, answer in eval_examples(source, num_examples=num, fmt=fmt, seed=seed)
    ]
    evaluation, _ = build_examples(
        rows, tok, "messages", max_length=2**30, block_size=1, source_name=f"{source} (vocab)"
    )
    control = sorted({tok.pad_id, tok.bos_id, tok.eos_id, *tok.eos_ids})
    ids = (e.input_ids for e in examples + evaluation)
    return vocab.build(ids, tok.mask_id, len(tok), control_ids=control)


@platforms.releases_host_memory
def train(cfg, workdir: str) -> dict:
    """Runs (or resumes) training of run config ``cfg`` in ``workdir``; returns the last logged
    metrics record (empty if the run was already complete).

    In a multi-process run (see `mars_jax.distributed`) every process calls this with the same
    config (but its own ``distributed.process_id``) and workdir, on a filesystem they share;
    each feeds its rows of every batch, all take part in each checkpoint save and restore, and
    only process 0 writes the run files, metrics.jsonl and INFO logs.

    Settings are checked first (`config.validate`, then `config.check_devices`): a bad one
    raises `errors.SettingError` (a ValueError) or `errors.MissingPath` (a
    FileNotFoundError) naming the key, before any data is read or anything compiled.

    Raises ValueError for a bad config (see `sharding`, `distributed.initialize`) or a resume
    with another config, `workdir.WorkdirInUse` (a ValueError) while another process trains in
    ``workdir``,
    `checkpoints.CheckpointError` (a ValueError) for a corrupted checkpoint (without
    ``train.restore_fallback``), FileNotFoundError for a missing ``init_from`` or data file,
    FloatingPointError after ``train.max_consecutive_skips`` steps in a row with
    a non-finite loss or gradient norm (`SkippedSteps`).
    """
    config.validate(cfg, training=True)
    distributed.initialize(cfg.distributed)
    # Signals are caught from here on, so that one during the setup stops the run after its
    # first step; the workdir's run lock, taken in _train, is released on the way out. Training
    # runs in 32 bits even where JAX_ENABLE_X64 is set (optax would compute its schedule and
    # bias corrections in float64: every update a last bit off the same run without it).
    with contextlib.ExitStack() as stack, Preemption() as preemption, jax.enable_x64(False):
        return _train(cfg, workdir, preemption, stack)


@dataclasses.dataclass(frozen=True)
class _RunData:
    """What a run trains on: the tokenizer (a trimmed run's mapped one), its vocabulary map
    (None: not trimmed), the model's config (its rows as the tokenizer needs), the batch units
    (examples, or the sequences they are packed into) and the run's number of steps."""

    tok: Any
    vocab_map: Any
    model_cfg: ModelConfig
    units: list
    num_steps: int


def _run_data(cfg, workdir: str) -> _RunData:
    """The tokenizer, the training examples (trimmed to the run's vocabulary, packed) and the
    model config of ``cfg``'s run in ``workdir``, each checked against the others."""
    model_cfg = model_config(cfg)
    heads = (model_cfg.num_heads, model_cfg.num_kv_heads)
    config.check_devices(cfg, jax.device_count(), heads, jax.default_backend())
    tok = load_tokenizer(tokenizer_source(cfg))
    examples = load_train_examples(cfg, tok)
    vocab_map = build_vocab_map(cfg, workdir, tok, examples) if cfg.data.trim_vocab else None
    if vocab_map is not None:
        # A stage 2 on other data than its trimmed stage 1: name the row and whose map it is.
        source = cfg.data.train_path if cfg.data.source != SYNTHETIC else "synthetic data"
        owner = "the"
        if cfg.init_from and storage.exists(storage.join(cfg.init_from, wd.VOCAB_MAP)):
            owner = "init_from's"
        examples = vocab_map.map_examples(examples, f"{source} ({owner} vocab_map.json)")
        tok = vocab.MappedTokenizer(tok, vocab_map)
        model_cfg = dataclasses.replace(model_cfg, vocab_size=len(vocab_map))
        logging.info("trimmed vocabulary: %d rows", len(vocab_map))
    model_cfg = with_mask_row(cfg, model_cfg, tok)
    check_token_rows(tok, model_cfg.vocab_size, tokenizer_source(cfg) or "the Qwen2.5 tokenizer")
    t = cfg.train
    # What a batch is made of: the examples, or the sequences they are packed into.
    units = pack_examples(cfg, examples) if cfg.data.packing else examples
    if len(units) < t.batch_size:
        what = "packed sequences" if cfg.data.packing else "examples"
        raise SettingError(
            "train.batch_size",
            t.batch_size,
            f"{len(units)} {what} cannot fill a batch of {t.batch_size}",
        )
    num_steps = t.num_steps or max(1, int(t.num_epochs * (len(units) // t.batch_size)))
    return _RunData(tok, vocab_map, model_cfg, units, num_steps)


def _dataset(cfg, data: _RunData, step: train_step.TrainStep, obj):
    """The run's batches (`batches.batched_dataset`): this process's rows of each, with the
    noisy-row weights where ``objective.noisy_weighting`` is ``inverse_t``."""
    t = cfg.train
    rows = distributed.process_rows(step.batch_sharding, t.batch_size)
    dataset = batched_dataset(
        data.units,
        batch_size=t.batch_size,
        max_length=cfg.data.max_length,
        seed=cfg.seed,
        pad_id=data.tok.pad_id,
        rows=rows,
    )
    if obj.noisy_weighting == "inverse_t":
        dataset = dataset.map_with_index(
            lambda i, batch: {
                **batch,
                objectives.NOISY_WEIGHT: objectives.noisy_row_weights(cfg.seed, i, t.batch_size)[
                    list(rows)
                ],
            }
        )
    return dataset


def _restore_or_start(cfg, workdir, data: _RunData, step, checkpoints, init) -> tuple:
    """(`TrainState`, its step): the workdir's latest checkpoint (the same run's: its config
    checked), or a fresh state of ``init()`` (params, opt_state) at step 0, the run files
    written."""
    run_config = cfg.to_json_best_effort(indent=2)
    if checkpoints.latest_step() is not None:
        wd.check_same_run(workdir, run_config)
    abstract = TrainState(step.abstract_params, step.abstract_opt_state, 0)
    state, start = checkpoints.restore_latest(abstract, fallback=cfg.train.restore_fallback)
    if start is not None:
        logging.info("resuming %s from its checkpoint of step %d", workdir, start)
        return state, start
    logging.info("no checkpoint in %s: starting a fresh run", workdir)
    params, opt_state = init()
    if distributed.is_primary():
        wd.write_run_files(workdir, run_config, data.model_cfg, data.tok)
        if data.vocab_map is not None:
            wd.write_vocab_map(workdir, data.vocab_map)
        if cfg.init_from and wd.is_workdir(cfg.init_from):
            with Checkpoints(cfg.init_from) as init_checkpoints:
                init_step = init_checkpoints.latest_step()
            wd.write_init_record(workdir, cfg.init_from, init_step)
    return TrainState(params, opt_state, data_position=0), 0


def _train(cfg, workdir: str, preemption: "Preemption", stack: contextlib.ExitStack) -> dict:
    """`train` after the settings checks, with ``preemption``'s signal handlers installed; the
    run lock goes on ``stack``."""
    check_init_from(cfg, workdir)
    data = _run_data(cfg, workdir)
    t, num_steps = cfg.train, data.num_steps
    obj = train_step.objective_settings(cfg, data.tok.mask_id, data.units)
    mesh, rules = sharding.mesh_from_config(cfg.mesh)
    graphdef, abstract = abstract_params(data.model_cfg, mesh, rules)
    tx, schedule = train_step.optimizer(cfg, num_steps)
    step = train_step.build_train_step(cfg, graphdef, abstract, obj, tx, mesh, rules)
    lock = None
    if distributed.is_primary():  # one training process per workdir (workdir.WorkdirInUse)
        lock = stack.enter_context(wd.RunLock(workdir))
    checkpoints = Checkpoints(
        workdir, max_to_keep=t.max_to_keep, keep_every=t.keep_every, writer=True
    )

    def init():
        params = initial_params(cfg, data.model_cfg, abstract, mesh, rules)
        return params, jax.jit(tx.init, out_shardings=step.opt_state_shardings)(params)

    state, start = _restore_or_start(cfg, workdir, data, step, checkpoints, init)
    if start >= num_steps:
        logging.info("%s is already at step %d of %d: nothing to do", workdir, start, num_steps)
    else:
        logging.info(
            "training %s from step %d to %d (%d %s, batch %d, loss at <= %d positions/row)",
            cfg.objective.name,
            start,
            num_steps,
            len(data.units),
            "packed sequences" if cfg.data.packing else "examples",
            t.batch_size,
            obj.max_label_tokens,
        )
    metrics = MetricsWriter(workdir, start, num_steps, primary=distributed.is_primary())
    params, opt_state, position = state
    preemption.checkpoints = checkpoints
    trainer = Trainer(
        cfg=cfg,
        workdir=workdir,
        step=step,
        schedule=schedule,
        dataset=_dataset(cfg, data, step, obj),
        checkpoints=checkpoints,
        metrics=metrics,
        preemption=preemption,
        lock=lock,
        params=params,
        opt_state=opt_state,
        position=position,
    )
    last = trainer.run(start, num_steps)
    del trainer  # the last step's parameters and optimizer state: freed before the closes
    checkpoints.close()
    metrics.close()
    return last


@dataclasses.dataclass(kw_only=True)
class Trainer:
    """Steps ``start`` .. ``num_steps`` of `train` (`run`), saving every ``train.save_every``, at
    the end, and at a preemption (then returning early); holds the loop's state: the run's
    parts, the `checkpoints.TrainState` (``params``, ``opt_state``, data ``position``) and, in
    `run`, the skip count and the throughput window of the next metrics record.

    A step with a non-finite loss or gradient norm leaves the parameters and optimizer state as
    they were (`train_step.make_train_step`); `SkippedSteps` counts it and logs its batch's
    rows. A skip never writes non-finite values into the parameters: a checkpoint after skipped
    steps holds those of the last applied update. `run` raises FloatingPointError after
    ``train.max_consecutive_skips`` skips in a row, once saves in flight are written.
    """

    cfg: Any
    workdir: str
    step: train_step.TrainStep
    schedule: optax.Schedule
    dataset: Any  # grain.MapDataset of batches (`batches.batched_dataset`)
    checkpoints: Checkpoints
    metrics: MetricsWriter
    preemption: Preemption
    lock: wd.RunLock | None
    params: Any
    opt_state: Any
    position: int
    # Set by `run`: its steps, the skip count, the metrics record and the throughput window.
    start: int = dataclasses.field(init=False, default=0)
    num_steps: int = dataclasses.field(init=False, default=0)
    skips: SkippedSteps = dataclasses.field(init=False)
    last: dict = dataclasses.field(init=False, default_factory=dict)
    t0: float = dataclasses.field(init=False, default=0.0)
    tokens: Any = dataclasses.field(init=False, default=0)  # then a device int32 scalar
    window_start: float = dataclasses.field(init=False, default=0.0)

    def run(self, start: int, num_steps: int) -> dict:
        """Steps ``start`` .. ``num_steps``; returns the last logged metrics record (with
        ``stopped_by`` after a preemption). A run that reaches ``num_steps`` is marked complete.
        """
        self.start, self.num_steps = start, num_steps
        skipped_before = start - _applied_updates(self.opt_state)
        self.skips = SkippedSteps(self.cfg.train.max_consecutive_skips, total=skipped_before)
        self.last, self.t0, self.tokens, self.window_start = {}, time.time(), 0, time.time()
        stop_at = self.cfg.train.stop_at
        if 0 < stop_at <= start < num_steps:
            logging.info(
                "%s is at step %d, train.stop_at=%d: nothing to do", self.workdir, start, stop_at
            )
            return {"stopped_by": "stop_at"}
        try:
            for i in range(start, num_steps):
                done = self._step(i)
                saved = done % self.cfg.train.save_every == 0 or done == num_steps
                if saved or done == stop_at:
                    self._save(done)
                if done < num_steps and done == stop_at:
                    self._stop_at(done)
                    break
                if done < num_steps and self._stop_for_preemption(done, saved):
                    break
            else:
                self.checkpoints.wait_until_finished()
                if distributed.is_primary():
                    wd.mark_complete(self.workdir, num_steps)
        except FloatingPointError:
            self.checkpoints.wait_until_finished()  # the last checkpoint is complete, and finite
            raise
        return self.last

    def _step(self, i: int) -> int:
        """Runs step ``i`` (0-based) on the batch at ``position``, logging it when due (every
        ``train.log_every`` and the last); returns the number of steps done."""
        t = self.cfg.train
        local = self.dataset[self.position]
        row_ids = local.pop("row_ids")  # host-side only, not a step input
        batch = distributed.global_batch(local, self.step.batch_sharding, t.batch_size)
        self.position += 1
        self.tokens = self.tokens + _batch_tokens(batch)
        self.params, self.opt_state, values = self.step.fn(self.params, self.opt_state, batch)
        done = i + 1
        self.skips.add(done, values["skipped"], row_ids)
        if done % t.log_every == 0 or done == self.num_steps:
            self._log(done, values)
        elif done == self.start + 1:  # a sign of life before the first record
            logging.info(
                "step %d done (%.0f s since the start, compilation included); metrics every %d "
                "steps",
                done,
                time.time() - self.t0,
                t.log_every,
            )
        return done

    def _log(self, done: int, values: dict) -> None:
        """Writes the metrics record of step ``done`` (its step ``values`` with the skip count,
        learning rate, throughput since the last record, progress and ETA) and keeps it."""
        self.skips.check()
        now = time.time()
        values = jax.device_get(values)
        # The rate of this step's update, or of the update it would have made if skipped.
        updates = _applied_updates(self.opt_state)
        self.last = {
            "step": done,
            **{k: float(v) for k, v in values.items()},
            "skipped_steps": self.skips.total,
            "learning_rate": float(self.schedule(updates - 1 + values["skipped"])),
            "tokens_per_s": int(self.tokens) / (now - self.window_start),
            "progress": done / self.num_steps,
            "eta_s": (self.num_steps - done) / ((done - self.start) / (now - self.t0)),
        }
        self.tokens, self.window_start = 0, now
        self.metrics.write(self.last)

    def _save(self, done: int) -> None:
        """Saves step ``done`` (asynchronously), after reading its skip flag (a FloatingPointError
        saves nothing) and `_before_save`."""
        self.skips.check()
        _before_save(self.lock, self.metrics)
        self.checkpoints.save(done, TrainState(self.params, self.opt_state, self.position))

    def _stop_at(self, done: int) -> None:
        """Ends the run at ``train.stop_at`` (step ``done``, saved): waits for the write."""
        self.checkpoints.wait_until_finished()
        logging.info(
            "stopped at train.stop_at=%d of %d: saved in %s; rerun with a later stop_at (or 0) "
            "to go on",
            done,
            self.num_steps,
            self.workdir,
        )
        self.last = {**self.last, "stopped_by": "stop_at"}

    def _stop_for_preemption(self, done: int, saved: bool) -> bool:
        """Whether a stop request (`Preemption.stop`) ends the run after step ``done``; if so,
        saves that step (unless ``saved`` already), waits for the write and logs it."""
        if not self.preemption.stop(done):
            return False
        self.skips.check()
        if not saved:
            self._save(done)
        self.checkpoints.wait_until_finished()
        logging.info(
            "stopped by %s: saved step %d of %d in %s; rerun the same command to resume",
            self.preemption.reason,
            done,
            self.num_steps,
            self.workdir,
        )
        self.last = {**self.last, "stopped_by": self.preemption.reason}
        return True


class SkippedSteps:
    """Counts a run's skipped steps (non-finite loss or gradient norm): ``total`` and
    ``consecutive``.

    Each step's ``skipped`` flag is read when the next step has been dispatched (`add`), so
    reading it does not leave the device idle while the host prepares a batch; `check` reads
    the latest one at once (before a metrics record or a save). Every process reads the same
    replicated flag, so all of them count alike and stop at the same step.

    Args:
      limit: ``train.max_consecutive_skips``: raise after this many skips in a row (0: never).
      total: skips before this process started (a resumed run's earlier skips).
    """

    def __init__(self, limit: int, total: int = 0):
        self.limit, self.total, self.consecutive = limit, total, 0
        self._pending = None  # (step, skipped flag on device, row ids) not read yet

    def add(self, step: int, skipped: jax.Array, row_ids: np.ndarray) -> None:
        """Reads the flag of the step before (`check`), then keeps this one: step number (1-based),
        bool scalar, and int32 source row ids of this process's rows of its batch (-1: padding;
        [rows, segments] for packed sequences).
        """
        self.check()
        self._pending = (step, skipped, row_ids)

    def check(self) -> None:
        """Reads the pending flag, waiting for its step. A skip is counted and logged as a
        WARNING with the step and its batch's row ids (padding excluded; in a multi-process run,
        each process logs its own rows).

        Raises FloatingPointError (one line) at ``limit`` skips in a row.
        """
        if self._pending is None:
            return
        step, skipped, row_ids = self._pending
        self._pending = None
        if not bool(skipped):
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        rows = [int(r) for r in np.ravel(row_ids) if r >= 0]
        whose = f"process {jax.process_index()}'s " if jax.process_count() > 1 else ""
        logging.warning(
            "step %d skipped: non-finite loss or gradient norm (%d in a row, %d in all); "
            "source rows (0-based) of %sits batch: %s",
            step,
            self.consecutive,
            self.total,
            whose,
            rows,
        )
        if self.limit and self.consecutive >= self.limit:
            raise FloatingPointError(
                f"step {step}: {self.consecutive} consecutive steps had a non-finite loss or "
                f"gradient norm (train.max_consecutive_skips={self.limit}); parameters are "
                "those of the last finite step. Look at: train.learning_rate (too high?), the "
                "data rows listed in the warnings above, fp16/bf16 overflow (model.dtype / "
                "model.param_dtype: try float32), train.grad_clip"
            )


def _before_save(lock: wd.RunLock | None, metrics: MetricsWriter) -> None:
    """Before each checkpoint save: stop if another process took the run lock over, and store
    every metrics record so far (a ``gs://`` workdir's metrics.jsonl is rewritten, not
    appended), so the step's records are stored before the step commits."""
    if lock is not None:
        lock.check()
    metrics.flush()


class Preemption(contextlib.AbstractContextManager):
    """Stop requests of a training run, checked between steps (`stop`).

    In a single-process run, SIGTERM and SIGINT set a flag (the handler only sets it: the save
    happens in the loop); a second one exits at once (status 128 + signal number). In a
    multi-process run every process must stop at the same step, since saving is collective:
    SIGTERM is left to JAX's preemption notifier and the step is agreed through Orbax's
    ``reached_preemption`` (JAX's preemption sync service), and SIGINT keeps Python's default
    (KeyboardInterrupt, no save). Handlers are installed only from the main thread, and the
    previous ones are restored on exit. ``checkpoints`` (the run's `checkpoints.Checkpoints`, set
    once they exist) answers the multi-process agreement.
    """

    def __init__(self):
        self.checkpoints: Checkpoints | None = None
        self._previous = {}
        self.reason: str | None = None

    def __enter__(self) -> "Preemption":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            name = signal.Signals(signum).name
            os.write(2, f"second {name}: exiting without saving\n".encode())
            os._exit(128 + signum)
        self.reason = signal.Signals(signum).name

    def stop(self, done: int) -> bool:
        """Whether to stop after step ``done`` (same answer on every process)."""
        if self.checkpoints is not None and self.checkpoints.reached_preemption(done):
            self.reason = self.reason or "SIGTERM (preemption notice)"
        elif jax.process_count() > 1:
            return False
        return self.reason is not None


def _applied_updates(opt_state) -> int:
    """The optimizer's count of applied updates (skipped steps not counted): the step that the
    learning-rate schedule of `train_step.optimizer` is at (optax's ScaleByScheduleState)."""
    return int(
        optax.tree.get(
            opt_state,
            "count",
            filtering=lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState",
        )
    )


@jax.jit
def _batch_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Tokens of a global batch: each row up to its last labelled token (rows end there; batch
    padding excluded; the packed rows' tokens of a packed batch), summed over all processes'
    rows. int32 scalar, replicated."""
    if "segment_ids" in batch:
        return (batch["segment_ids"] > 0).sum()
    labels = batch["labels"]
    labelled = labels != IGNORE_INDEX
    lengths = labels.shape[1] - jnp.argmax(labelled[:, ::-1], axis=1)
    return jnp.where(labelled.any(1), lengths, 0).sum()


def main() -> None:
    """``python -m mars_jax.train --config=CONFIG[:stage] --workdir=DIR [--config.key=value]``."""
    config = cli.config_flag()
    workdir = cli.workdir_flag("Run directory (checkpoints, logs).")

    def run():
        last = train(config.value, workdir.value)
        if last.get("stopped_by") == "SIGINT":  # the step is saved; a pipeline must stop here
            raise SystemExit(130)

    cli.run(run)


if __name__ == "__main__":
    main()
