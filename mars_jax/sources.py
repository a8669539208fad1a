"""Where a model to decode comes from: a mars-jax training run, or a Hugging Face directory.

Every command that decodes (generate, evaluate, serve, the lm-eval adapter, the benchmarks)
takes either as its ``--workdir``:

- a run (it has ``model.json``): its latest (or chosen) checkpoint, its tokenizer/ and its
  training block size (`mars_jax.workdir`);
- a Hugging Face directory (``config.json`` + safetensors, as transformers writes it: our
  exports, the paper's released MARS checkpoints with ``model_type: "a2d-qwen2"``, a plain
  Qwen2.5): its weights read straight into the mesh as training reads ``init_from``
  (`huggingface.load_hf_sharded`), its tokenizer files and chat template, ``<|mask|>``'s id
  from its tokenizer files, and the block size from ``mars_block_size`` in config.json
  (written by our exports) unless given.

A directory whose tokenizer files do not declare ``<|mask|>`` is not a MARS model: it decodes
one token per forward (block size 1), and asking it for more is refused (`check_mask`).

`open` is the one way an entry point opens a model: it returns an `Opened` with the model, its
tokenizer, step and block size, and the stop / pad / mask ids the decoder needs, all read from
the model's own files (never from module constants).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from absl import logging
from flax import nnx
from jax.sharding import Mesh

from mars_jax import huggingface, sharding, storage, vocab
from mars_jax import workdir as wd
from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import InputError, NotFound
from mars_jax.model import abstract_params
from mars_jax.tokenizer import load_tokenizer


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model directory (config.json, no model.json)."""
    return not wd.is_workdir(path) and storage.exists(storage.join(path, "config.json"))


def kind(path: str) -> str:
    """``"run"`` (a mars-jax run: model.json) or ``"hf"`` (a Hugging Face directory:
    config.json), the one test of what a model path is, for decoding and for training's
    ``init_from``. Raises NotFound for a path that does not exist, or a directory that is
    neither, naming what it lacks."""
    if wd.is_workdir(path):
        return "run"
    if not storage.exists(path):
        raise NotFound(f"{path}: does not exist")
    if storage.exists(storage.join(path, "config.json")):
        return "hf"
    raise NotFound(
        f"{path}: neither a mars-jax run (model.json) nor a Hugging Face model directory "
        "(config.json)"
    )


def _hf_config(path: str) -> dict:
    return json.loads(storage.read_text(storage.join(path, "config.json")))


def load_model(path: str, *, mesh: Mesh | None = None, step: int | None = None, **overrides):
    """(model, tokenizer, step) of the run or Hugging Face directory ``path`` (step 0 for a
    Hugging Face directory, which has no steps). ``mesh`` (default: every device on the data
    axis) and ``overrides`` (`ModelConfig` fields, e.g. dtype) as `workdir.load_model`.

    Raises FileNotFoundError for a directory that is neither (naming what it lacks);
    InputError for a ``step`` asked of a Hugging Face directory, or a config.json
    ``mask_token_id`` that is not the tokenizer's ``<|mask|>``; as `huggingface.load_hf_sharded`.
    """
    if kind(path) == "run":
        return wd.load_model(path, mesh=mesh, step=step, **overrides)
    if step is not None:
        raise InputError(f"step: {step}; {path} is a Hugging Face directory, which has no steps")
    cfg = huggingface.read_hf_config(path, **overrides)
    mesh = mesh or sharding.make_mesh()
    graphdef, abstract = abstract_params(cfg, mesh, sharding_rules(path))
    params = huggingface.load_hf_sharded(path, cfg, abstract)
    tok = load_tokenizer(path)
    recorded = _hf_config(path).get("mask_token_id")
    if recorded is not None and tok.mask_declared and int(recorded) != tok.mask_id:
        raise InputError(
            f"{storage.join(path, 'config.json')}: mask_token_id {recorded}, but the tokenizer "
            f"files give <|mask|> id {tok.mask_id}"
        )
    if not tok.mask_declared:
        tok.mask_id = None  # not a MARS model: `check_mask` refuses multi-token decoding
    return nnx.merge(graphdef, params), tok, 0


@dataclasses.dataclass(frozen=True)
class Opened:
    """A model opened for decoding (`open`): ``model`` (an nnx module on its mesh), its
    ``tokenizer``, the checkpoint ``step`` (0 for a Hugging Face directory), the ``block_size``
    it decodes at, and the token ids the decoder takes, in the model's id space: ``stop_ids``
    (end a completion), ``pad_id`` (prompt padding) and ``mask_id`` (None: not a MARS model)."""

    path: str
    model: Any
    tokenizer: Any
    step: int
    block_size: int
    stop_ids: tuple[int, ...]
    pad_id: int
    mask_id: int | None

    def options(self, **fields) -> DecodeOptions:
        """The `DecodeOptions` of ``fields`` at this model's block size (unless one is given)."""
        return DecodeOptions(**{"block_size": self.block_size, **fields})

    def decode_ids(self) -> dict:
        """``eos_ids``, ``mask_id`` and ``pad_id`` as `decode.generate` and the engine take them."""
        return {"eos_ids": self.stop_ids, "mask_id": self.mask_id, "pad_id": self.pad_id}

    def tokenizer_config(self) -> dict:
        """The tokenizer files' tokenizer_config.json ({} where there is none)."""
        folder = self.path if is_hf_dir(self.path) else storage.join(self.path, "tokenizer")
        path = storage.join(folder, "tokenizer_config.json")
        return json.loads(storage.read_text(path)) if storage.exists(path) else {}

    def special_tokens(self, add_bos_token: bool | None = None) -> tuple[list[int], list[int]]:
        """(ids before, ids after) the text that transformers' tokenizer of these files adds when
        it encodes text with its special tokens (`vocab.special_tokens`: Llama 3's BOS, nothing
        for Qwen2.5), in the model's ids."""
        return vocab.special_tokens(self.tokenizer, self.tokenizer_config(), add_bos_token)


def open(
    path: str,
    *,
    block_size: int | None = None,
    step: int | None = None,
    mesh: Mesh | None = None,
    **overrides,
) -> Opened:
    """Opens the run or Hugging Face directory ``path`` for decoding: its block size (``block_size``
    if given, else as `block_size` reads it, checked before any weight is read), its model and
    tokenizer (`load_model`, with ``step``, ``mesh`` and ``overrides``), refusing block sizes
    above 1 for a model without ``<|mask|>`` (`check_mask`)."""
    size = block_size_of(path, block_size)
    model, tok, at = load_model(path, mesh=mesh, step=step, **overrides)
    check_mask(tok, size, path)
    return Opened(
        path=path,
        model=model,
        tokenizer=tok,
        step=at,
        block_size=size,
        stop_ids=tuple(vocab.stop_ids(tok)),
        pad_id=int(tok.pad_id),
        mask_id=None if tok.mask_id is None else int(tok.mask_id),
    )


def sharding_rules(path: str) -> sharding.Rules:
    """The logical-axis rules of a run (its ``mesh.rules``), or the default rules for a
    Hugging Face directory."""
    return sharding.logical_rules() if is_hf_dir(path) else wd.sharding_rules(path)


def block_size_of(path: str, given: int | None = None) -> int:
    """``given`` if set; else a run's training block size, or a Hugging Face directory's
    ``mars_block_size`` (config.json); else 1 for a plain model (its tokenizer files declare no
    ``<|mask|>``: never trained with MARS, it decodes as AR). Raises InputError for a MARS
    model (it has ``<|mask|>``) that records no block size, saying how to give it."""
    if given is not None:
        return int(given)
    if kind(path) == "run":  # NotFound for a path that is neither (or does not exist)
        return wd.trained_block_size(path)
    recorded = _hf_config(path).get("mars_block_size")
    if recorded is not None:
        return int(recorded)
    if not load_tokenizer(path).mask_declared:
        logging.info("%s: a plain model (no <|mask|>): one token per forward (block size 1)", path)
        return 1
    raise InputError(
        f"{storage.join(path, 'config.json')} records no mars_block_size, and its tokenizer "
        "has <|mask|>: give the block size the model was trained with (--block_size, or "
        "eval.block_size for evaluate)"
    )


def check_mask(tok, block_size: int, path: str) -> None:
    """Raises InputError when ``block_size`` > 1 (MARS decoding) is asked of a model whose
    tokenizer files declare no ``<|mask|>`` (``tok.mask_id`` None, see `load_model`)."""
    if block_size > 1 and tok.mask_id is None:
        raise InputError(
            f"{path}: its tokenizer files declare no <|mask|> token, so it is not a MARS model "
            f"and cannot decode block size {block_size}; use block size 1 (one token per "
            "forward), or the tokenizer files the MARS model was trained with"
        )
