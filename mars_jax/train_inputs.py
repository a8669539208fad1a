"""What a training run is made of before its first step: the model's config (the run's, or
``init_from``'s with the run's execution settings), its initial parameters (a Hugging Face
directory, another run's checkpoint, or random), the tokenizer and the training examples
(read, trimmed to the run's vocabulary, packed), checked against each other (`run_data`), and
the batches of this process (`train_dataset`). The run loop is `mars_jax.train`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from absl import logging
from flax import nnx

from mars_jax import (
    config,
    distributed,
    huggingface,
    objectives,
    packing,
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
from mars_jax.checkpoints import Checkpoints
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError, SettingError
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


@dataclasses.dataclass(frozen=True)
class RunData:
    """What a run trains on: the tokenizer (a trimmed run's mapped one), its vocabulary map
    (None: not trimmed), the model's config (its rows as the tokenizer needs), the batch units
    (examples, or the sequences they are packed into) and the run's number of steps."""

    tok: Any
    vocab_map: Any
    model_cfg: ModelConfig
    units: list
    num_steps: int


def run_data(cfg, workdir: str) -> RunData:
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
            f"{len(units)} {what} cannot fill a batch of {t.batch_size}: give "
            f"train.batch_size <= {len(units)}, or more training rows",
        )
    num_steps = t.num_steps or max(1, int(t.num_epochs * (len(units) // t.batch_size)))
    return RunData(tok, vocab_map, model_cfg, units, num_steps)


def train_dataset(cfg, data: RunData, step: train_step.TrainStep, obj):
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
