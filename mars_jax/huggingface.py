"""Hugging Face interop: CausalLM checkpoints (safetensors) and config.json in and out.

A Hugging Face directory holds ``config.json`` and either ``model.safetensors`` or sharded
``*.safetensors`` files listed in ``model.safetensors.index.json`` (the layout written by
transformers' ``save_pretrained``). Loading is strict: every tensor must be consumed, every
parameter must be found, and shapes must match; the one tensor a model does not use that is
accepted is a tied model's stored ``lm_head.weight`` equal to its embedding (see
`_check_tied_head`). Names follow transformers' Qwen2ForCausalLM;
linear weights are stored [out, in] there and [in, out] (``kernel``) here. `load_hf_sharded`
reads a checkpoint straight into a sharded layout, each process reading only the parts of the
tensors that its devices hold. Only safetensors and JSON are read: pickle-based weights
(``pytorch_model.bin``, ``*.pt``, ...) are refused unopened, and no code that a checkpoint
names (``auto_map``) is imported or run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  numpy's "bfloat16", which safetensors' numpy reader asks for
import numpy as np
from absl import logging
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mars_jax import storage
from mars_jax.errors import AlreadyExists, InputError, NotFound
from mars_jax.model import ROPE_TYPES, CausalLM, ModelConfig, abstract_model

_SUPPORTED_ACT = "silu"
# config.json model types -> `ModelConfig.family`: transformers' own, and the names under which
# the MARS reference's wrapper (A2D) saves the same architectures.
MODEL_TYPES = {
    "qwen2": "qwen2",
    "a2d-qwen2": "qwen2",
    "qwen3": "qwen3",
    "a2d-qwen3": "qwen3",
    "llama": "llama",
    "a2d-llama": "llama",
}
# What each family's transformers class is called, and its config defaults where config.json
# leaves a field out (transformers' Qwen2Config, Qwen3Config, LlamaConfig).
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
_DEFAULTS = {
    "qwen2": dict(rope_theta=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "qwen3": dict(rope_theta=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "llama": dict(rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6),
}
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def config_from_hf(
    hf: dict[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    source: str = "config.json",
) -> ModelConfig:
    """Builds a ModelConfig from a transformers Qwen2 ``config.json`` dict.

    Embedding rows come from ``vocab_size`` (151,936 or 152,064 for Qwen2.5), never from a
    tokenizer. ``model_type`` qwen2, qwen3 or llama (`MODEL_TYPES`; "a2d-qwen2", the paper's
    released MARS checkpoints, is a Qwen2 under the reference wrapper's name). Fields left out
    take the family's transformers defaults (``rope_theta`` 10000, ``max_position_embeddings``
    32768, or 2048 for Llama, untied head, ``rms_norm_eps`` 1e-6). Raises ValueError (naming
    ``source`` and the field) for another model type, an enabled sliding window, rope scaling
    of another type than "default" or "llama3", MLP biases, or another activation.
    """

    def fail(field, why):
        raise InputError(f"{source}: unsupported {field}: {why}")

    model_type = hf.get("model_type", "qwen2")
    if model_type not in MODEL_TYPES:
        fail("model_type", f"{model_type!r} (expected one of {tuple(MODEL_TYPES)})")
    family = MODEL_TYPES[model_type]
    defaults = _DEFAULTS[family]
    if hf.get("use_sliding_window"):
        fail("use_sliding_window", "sliding-window attention is not implemented")
    if hf.get("hidden_act", _SUPPORTED_ACT) != _SUPPORTED_ACT:
        fail("hidden_act", repr(hf.get("hidden_act")))
    if hf.get("mlp_bias"):
        fail("mlp_bias", "MLP biases are not implemented")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        fail("rope scaling", f"{rope_type!r} (plain RoPE and llama3 are implemented)")
    scaling = {}
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE if k not in rope]
        if missing:
            fail("rope scaling", f"llama3 without {', '.join(missing)}")
        scaling = {f"rope_{k}": rope[k] for k in _LLAMA3_ROPE}
    theta = rope.get("rope_theta", hf.get("rope_theta", defaults["rope_theta"]))
    heads = hf["num_attention_heads"]
    return ModelConfig(
        family=family,
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        rope_type=rope_type,
        **scaling,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(theta),
        max_position_embeddings=int(
            hf.get("max_position_embeddings", defaults["max_position_embeddings"])
        ),
        rms_norm_eps=hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def token_ids(tok) -> dict[str, Any]:
    """A tokenizer's ids as config.json and generation_config.json name them:
    ``bos_token_id``, ``eos_token_id`` (the stop ids, the end of a turn first) and
    ``pad_token_id``."""
    return {
        "bos_token_id": int(tok.bos_id),
        "eos_token_id": [int(i) for i in tok.eos_ids],
        "pad_token_id": int(tok.pad_id),
    }


def config_to_hf(
    cfg: ModelConfig,
    *,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    special_ids: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The transformers ``Qwen2Config`` dict (config.json) describing ``cfg``.

    With ``special_ids`` (`token_ids` of the model's tokenizer) it carries ``bos_token_id``
    and ``eos_token_id`` (the end of a turn), as a release's own config.json does (the
    generation stop ids are in `generation_config_to_hf`). ``mask_token_id`` (MARS's
    <|mask|>) and ``block_size`` (written ``mars_block_size``: the most tokens per forward the
    model was trained to decode) are added when given; transformers keeps such keys as plain
    config attributes, and `config_from_hf` reads only the keys it needs.
    """
    family = {
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"use_sliding_window": False, "attention_bias": cfg.attention_bias},
        "llama": {"attention_bias": cfg.attention_bias, "mlp_bias": False},
    }[cfg.family]
    rope = {}
    if cfg.rope_type == "llama3":
        rope = {
            "rope_scaling": {
                "rope_type": "llama3",
                **{k: getattr(cfg, f"rope_{k}") for k in _LLAMA3_ROPE},
            }
        }
    return {
        "architectures": [_ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        **family,
        **rope,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": _SUPPORTED_ACT,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": cfg.param_dtype,
        **(
            {}
            if special_ids is None
            else {
                "bos_token_id": special_ids["bos_token_id"],
                "eos_token_id": special_ids["eos_token_id"][0],
            }
        ),
        **({} if mask_token_id is None else {"mask_token_id": int(mask_token_id)}),
        **({} if block_size is None else {"mars_block_size": int(block_size)}),
    }


def generation_config_to_hf(special_ids: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` dict with which transformers' ``generate`` (and any tool
    that reads the file for its defaults) decodes as `mars_jax.decode.generate` does at
    threshold 1.0: greedy (``do_sample: false``), stopping at each of the tokenizer's stop ids
    and padding with its pad id (``special_ids``: `token_ids`)."""
    return {**special_ids, "do_sample": False}


def _hf_names(path: tuple, num_layers: int) -> tuple[list[str], bool, bool]:
    """NNX state path -> (its HF tensor names, whether each is stored transposed, whether the
    parameter stacks them on a leading layer axis).

    A decoder-layer parameter is stacked here ([num_layers, ...]) and one tensor per layer in a
    HF checkpoint (``model.layers.<i>.<name>``); every other parameter is one tensor.
    """
    keys = [
        str(getattr(k, "key", getattr(k, "idx", None)))
        for k in path
        if not isinstance(k, jax.tree_util.GetAttrKey)
    ]
    name = ".".join(keys)
    transposed = name.endswith(".kernel")
    name = re.sub(r"\.(kernel|embedding)$", ".weight", name)
    if name.startswith("layers."):
        rest = name.removeprefix("layers.")
        return [f"model.layers.{i}.{rest}" for i in range(num_layers)], transposed, True
    return [name if name.startswith("lm_head.") else "model." + name], transposed, False


# Weight files in pickle-based formats (PyTorch's torch.save and plain pickles, and their shard
# indexes). Unpickling can run any code the file names, so they are refused, never opened.
_PICKLE_SUFFIXES = (".bin", ".bin.index.json", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _checkpoint_files(path: str) -> list[str]:
    """The safetensors files of the HF directory ``path`` (names relative to it).

    Only safetensors weights are read (a format of raw tensors: loading one runs no code).
    As in transformers, ``model.safetensors`` wins over an index beside it (whose shards are
    then ignored; `_local_weights` logs that once per load); else the files the index's
    ``weight_map`` names.
    Raises FileNotFoundError without model.safetensors or model.safetensors.index.json; when
    the directory holds pickle-based weights instead (``pytorch_model.bin``, ``*.pt``,
    ``*.pth``, ``*.ckpt``, ...), the message names them and gives the transformers command
    that converts them to safetensors; the pickles are never opened. Raises ValueError for an
    index whose ``weight_map`` names a file that is not ``.safetensors``.
    """
    if storage.exists(storage.join(path, "model.safetensors")):
        return ["model.safetensors"]
    weight_map = _weight_map(path)
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    pickled = [f for f in storage.listdir(path) if f.endswith(_PICKLE_SUFFIXES)]
    if pickled:
        raise NotFound(
            f"{path}: no model.safetensors, only pickle-based weights ({', '.join(pickled)}), "
            "which are not loaded: unpickling can run arbitrary code. If you trust them, "
            'convert them to safetensors once with transformers: python -c "import transformers '
            f'as t; d = {path!r}; t.AutoModelForCausalLM.from_pretrained(d).save_pretrained(d)"'
        )
    raise NotFound(f"{path}: no model.safetensors or model.safetensors.index.json")


def _weight_map(path: str) -> dict[str, str] | None:
    """The index's tensor -> file map of a sharded HF directory ``path`` (None without an
    index, or with a model.safetensors beside it, which wins). Raises ValueError for a file
    that is not ``.safetensors``."""
    index = storage.join(path, "model.safetensors.index.json")
    if storage.exists(storage.join(path, "model.safetensors")) or not storage.exists(index):
        return None
    weight_map = json.loads(storage.read_text(index))["weight_map"]
    for file in sorted(set(weight_map.values())):
        if not file.endswith(".safetensors"):
            raise InputError(f"{index}: weight_map names {file!r}, not a .safetensors file")
    return weight_map


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one parameter lives in a HF directory: its tensor names (one per layer for a
    stacked parameter) and their files, and whether they are stored transposed."""

    files: tuple[str, ...]
    names: tuple[str, ...]
    transposed: bool
    stacked: bool


_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# Bytes (as float64) of each tensor that `_check_tied_head` compares per block of rows.
_COMPARE_CHUNK_BYTES = 64 << 20


def _sources(path: str, cfg: ModelConfig, state: nnx.State) -> nnx.State:
    """The `_Source` of every parameter of ``state`` (leaves with .shape), same tree, checked
    against the safetensors headers: names and shapes.

    Then, for a tied model (``cfg.tie_word_embeddings``) whose checkpoint also stores
    ``lm_head.weight`` (some releases do; transformers ignores it), that tensor is compared
    with the embedding by `_check_tied_head`; this is the only tensor data read here, and it
    is read only once every header check has passed.

    Raises FileNotFoundError as `_checkpoint_files`; ValueError for a missing tensor, a tensor
    of the wrong shape, or a tensor no parameter uses, naming the tensor (and its file), and
    as `_check_tied_head` for a stored head that differs from the tied embedding.
    """
    origin, shapes = {}, {}
    weight_map = _weight_map(path)
    for file in _checkpoint_files(path):
        with safe_open(os.path.join(path, file), framework="np") as f:
            for name in f.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    if name not in weight_map:
                        raise InputError(
                            f"{path}/{file}: tensor {name!r} is not in "
                            "model.safetensors.index.json's weight_map"
                        )
                    logging.warning(
                        "%s/%s: a copy of %r, which the index reads from %s, is ignored",
                        path,
                        file,
                        name,
                        weight_map[name],
                    )
                    continue
                origin[name], shapes[name] = file, tuple(f.get_slice(name).get_shape())
    for name, file in (weight_map or {}).items():
        if name not in origin:
            raise InputError(
                f"{path}: model.safetensors.index.json reads tensor {name!r} from {file}, "
                "which does not hold it"
            )
    used = set()

    def source(p, leaf):
        names, transposed, stacked = _hf_names(p, cfg.num_layers)
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        expected = shape[::-1] if transposed else shape
        for name in names:
            if name not in shapes:
                raise InputError(f"{path}: missing tensor {name!r} required by the config")
            if shapes[name] != expected:
                raise InputError(
                    f"{path}/{origin[name]}: tensor {name!r} has shape {shapes[name]}, "
                    f"expected {expected}"
                )
        used.update(names)
        files = tuple(os.path.join(path, origin[n]) for n in names)
        return _Source(files, tuple(names), transposed, stacked)

    sources = jax.tree_util.tree_map_with_path(source, state)
    tied_head = cfg.tie_word_embeddings and _HEAD in shapes and _EMBEDDING in used
    if tied_head and shapes[_HEAD] != shapes[_EMBEDDING]:
        raise InputError(
            f"{path}/{origin[_HEAD]}: tensor {_HEAD!r} has shape {shapes[_HEAD]}, but the "
            f"config ties it to {_EMBEDDING!r} ({origin[_EMBEDDING]}) of shape "
            f"{shapes[_EMBEDDING]}"
        )
    unused = sorted(set(shapes) - used - ({_HEAD} if tied_head else set()))
    if unused:
        raise InputError(
            f"{path}: tensors not used by the model (config mismatch?): "
            + ", ".join(f"{n} ({origin[n]})" for n in unused[:10])
        )
    if tied_head:
        _check_tied_head(path, origin[_HEAD], origin[_EMBEDDING], shapes[_HEAD])
    return sources


def _check_tied_head(path: str, head_file: str, embedding_file: str, shape: tuple) -> None:
    """Checks that the stored ``lm_head.weight`` of a tied checkpoint equals
    ``model.embed_tokens.weight`` exactly, and logs that it is skipped.

    Both tensors, of ``shape`` [vocab, hidden] (checked by the caller), are compared as values
    (float64, so across on-disk dtypes; NaN equals NaN), a block of rows at a time
    (`_COMPARE_CHUNK_BYTES` per tensor and read), from the files ``head_file`` and
    ``embedding_file`` of the directory ``path``. The whole of both tensors is read once, by
    every process, also by `load_hf_sharded`, which otherwise reads only a process's own
    parts: a check on those parts alone could pass in one process and fail in another (which
    would then leave the others waiting in a collective), and a shared verdict would need a
    collective of its own before the model exists. The cost is reading the embedding twice
    (1 GB per tensor for Qwen2.5-7B in bfloat16), never holding more than a block of each on
    the host; a differing head is caught before any parameter is read.

    Raises ValueError naming both tensors and files, the first differing row and the largest
    absolute difference, when any value differs: the checkpoint's head is not tied, and
    loading it as tied would silently change the model (set ``tie_word_embeddings`` to false
    in config.json to load the stored head).
    """
    rows = max(1, _COMPARE_CHUNK_BYTES // (8 * int(np.prod(shape[1:], dtype=np.int64))))
    first, largest = None, 0.0
    with (
        safe_open(os.path.join(path, head_file), framework="np") as fh,
        safe_open(os.path.join(path, embedding_file), framework="np") as fe,
    ):
        head, embedding = fh.get_slice(_HEAD), fe.get_slice(_EMBEDDING)
        for start in range(0, shape[0], rows):
            index = (slice(start, min(start + rows, shape[0])),) + (slice(None),) * (len(shape) - 1)
            a = np.asarray(head[index], np.float64)
            b = np.asarray(embedding[index], np.float64)
            differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
            if differ.any():
                diff = np.abs(a - b)[differ]  # NaN against a number: infinitely different
                largest = max(largest, float(np.where(np.isnan(diff), np.inf, diff).max()))
                if first is None:
                    first = start + int(np.argwhere(differ)[0][0])
    if first is not None:
        raise InputError(
            f"{path}: config.json ties the LM head to the embedding (tie_word_embeddings: "
            f"true), but the stored {_HEAD!r} ({head_file}) differs from {_EMBEDDING!r} "
            f"({embedding_file}): first at row {first}, largest absolute difference {largest:g}; "
            "set tie_word_embeddings to false in config.json to load the stored head"
        )
    logging.info(
        "%s: %r (%s) equals the tied %r (%s); it is not loaded (tie_word_embeddings: true)",
        path,
        _HEAD,
        head_file,
        _EMBEDDING,
        embedding_file,
    )


def _read(source: _Source, index: tuple[slice, ...], dtype) -> np.ndarray:
    """The part ``index`` (one slice per dimension, in our layout) of a parameter, read from
    its safetensors files as ``dtype``: only that part of each tensor is read (safetensors'
    lazy slicing of the memory-mapped file). A stacked parameter's leading index selects
    layers; a transposed one's index is reversed for the HF tensor and the part transposed
    back. Each file is opened for one tensor read, so none of it stays mapped afterwards.
    """
    layers = range(len(source.names))
    if source.stacked:
        layers, index = layers[index[0]], index[1:]
    hf_index = index[::-1] if source.transposed else index
    parts = []
    for i in layers:
        with safe_open(source.files[i], framework="np") as f:
            part = f.get_slice(source.names[i])[hf_index]
        parts.append((part.T if source.transposed else part).astype(dtype))
    return np.ascontiguousarray(np.stack(parts) if source.stacked else parts[0])


def load_hf_state(path: str, cfg: ModelConfig) -> nnx.State:
    """Reads a HF Qwen2 directory into an NNX parameter State of host (numpy) arrays.

    The arrays are cast to ``cfg.param_dtype`` (from any dtype on disk, bfloat16 included);
    place them on devices with `jax.device_put` (see `mars_jax.sharding`), or use
    `load_hf_sharded` to read only what each device holds. Raises ValueError for an unused
    tensor (e.g. a dropped q/k/v bias would leave one), a missing parameter (e.g. an untied
    model without ``lm_head``), or a shape mismatch, naming the tensor and its file; all are
    checked from the file headers before any tensor is read. A tied model's checkpoint may
    also store ``lm_head.weight`` if it equals the embedding exactly (it is then skipped, and
    the log says so); a differing one raises ValueError naming both tensors (`_sources`).
    Raises FileNotFoundError without safetensors weights (`_checkpoint_files`).
    """
    state = nnx.state(abstract_model(cfg), nnx.Param)
    with _local_weights(path) as local:
        sources = _sources(local, cfg, state)
        full = lambda leaf: (slice(None),) * len(leaf.shape)
        return jax.tree.map(lambda leaf, s: _read(s, full(leaf), leaf.dtype), state, sources)


def _local_weights(path: str):
    """`storage.local_dir` of the weight files of HF directory ``path`` (a ``gs://`` one is
    copied to local disk: safetensors reads through a memory map)."""
    names = ["model.safetensors.index.json", *_checkpoint_files(path)]
    if names[1] == "model.safetensors" and storage.exists(storage.join(path, names[0])):
        logging.warning(
            "%s: both model.safetensors and model.safetensors.index.json; model.safetensors is "
            "loaded (as transformers does), the index and its shards are ignored",
            path,
        )
    return storage.local_dir(path, names)


def load_hf_sharded(path: str, cfg: ModelConfig, abstract: nnx.State) -> nnx.State:
    """Reads a HF Qwen2 directory straight into the sharded layout ``abstract``.

    ``abstract`` is a parameter State of ``jax.ShapeDtypeStruct`` leaves with shardings (see
    `mars_jax.model.abstract_params`); the result has the same tree with global
    ``jax.Array`` leaves of those shapes, dtypes (converted from the dtype on disk, e.g.
    bfloat16) and shardings. Each process reads from the safetensors files only the parts
    that its own devices hold, each distinct part once (devices holding the same part, e.g.
    along a data axis, share the read), so a process never holds the whole model on the host.

    Raises FileNotFoundError without safetensors files (pickled weights are refused unopened,
    `_checkpoint_files`), and ValueError, as `load_hf_state`,
    for a missing, unused or wrongly shaped tensor, before any tensor data is read. A tied
    model's stored ``lm_head.weight`` is compared with the embedding as in `load_hf_state`;
    that comparison reads both whole tensors on every process, a block of rows at a time,
    before any parameter is read (`_check_tied_head` says why). A ``gs://`` directory's weight
    files are first copied whole to each process's local disk.
    """
    with _local_weights(path) as local:
        return _load_sharded(_sources(local, cfg, abstract), abstract)


def _load_sharded(sources: nnx.State, abstract: nnx.State) -> nnx.State:
    def place(leaf, source):
        parts = {}

        def part(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in parts:
                parts[key] = _read(source, index, leaf.dtype)
            return parts[key]

        return jax.make_array_from_callback(leaf.shape, leaf.sharding, part)

    return jax.tree.map(place, abstract, sources)


def read_hf_config(path: str, *, dtype: str = "float32", param_dtype: str = "float32"):
    """The `ModelConfig` of the HF directory ``path`` (its config.json; see `config_from_hf`).

    The directory's weights are checked to be safetensors here already (`_checkpoint_files`),
    so a run started from it stops before reading data or compiling. config.json is data: an
    ``auto_map`` naming custom model code is ignored, with a logged warning (no code of the
    checkpoint is imported or run; the weights load into this package's Qwen2).

    Raises FileNotFoundError without config.json, and as `_checkpoint_files` without
    safetensors weights (pickled ones are refused); ValueError as `config_from_hf`."""
    source = storage.join(path, "config.json")
    if not storage.exists(source):
        raise NotFound(f"{source} not found: {path} is not a Hugging Face model directory")
    hf = json.loads(storage.read_text(source))
    _checkpoint_files(path)
    if "auto_map" in hf:
        names = json.dumps(hf["auto_map"])
        logging.warning(
            "%s: auto_map %s names custom code; it is not run (CausalLM is)", source, names
        )
    return config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, source=source)


def load_hf(path: str, *, dtype: str = "float32", param_dtype: str = "float32") -> CausalLM:
    """Loads a HF Qwen2/Qwen2.5 checkpoint directory into a single-host `CausalLM` model.

    Raises as `read_hf_config` and `load_hf_state`."""
    cfg = read_hf_config(path, dtype=dtype, param_dtype=param_dtype)
    model = abstract_model(cfg)
    nnx.update(model, jax.tree.map(jnp.asarray, load_hf_state(path, cfg)))
    return model


def export_hf(
    model: CausalLM,
    path: str,
    *,
    max_shard_bytes: int = 4 << 30,
    dtype: str | None = None,
    mask_token_id: int | None = None,
    block_size: int | None = None,
    special_ids: dict[str, Any] | None = None,
) -> None:
    """Writes ``model`` as a directory that ``transformers.AutoModelForCausalLM`` loads.

    Writes config.json (`config_to_hf`) and model.safetensors, or several shards plus
    model.safetensors.index.json when the weights exceed ``max_shard_bytes``. A tied model
    writes no lm_head. ``dtype`` (e.g. "bfloat16") casts the saved weights; default: param dtype.
    With ``special_ids`` (`token_ids` of the model's tokenizer) config.json records the bos
    and eos ids and generation_config.json is written (`generation_config_to_hf`: greedy, the
    stop ids), so that transformers' ``generate`` stops where `mars_jax.decode.generate`
    does; config.json records ``mask_token_id`` when given; ``block_size`` (the
    training block size, e.g. `mars_jax.workdir.trained_block_size`) is recorded as
    ``mars_block_size`` when given. Tokenizer files are not written here (see
    `mars_jax.export.export_run`). Every file written has mode 0666 less the umask (0644
    under the usual 022), the weights included.

    Raises FileExistsError if ``path`` already holds safetensors weights (stale shards next to
    new ones would be ambiguous); ValueError for a ``mask_token_id`` or special id outside the
    embedding or a ``block_size`` < 1.
    """
    named = {} if special_ids is None else dict(special_ids)
    if mask_token_id is not None:
        named["mask_token_id"] = mask_token_id
    for name, ids in named.items():
        for token_id in ids if isinstance(ids, (list, tuple)) else [ids]:
            if not 0 <= token_id < model.cfg.vocab_size:
                raise InputError(
                    f"{name} {token_id} is not a row of the {model.cfg.vocab_size}-row embedding"
                )
    if block_size is not None and block_size < 1:
        raise InputError(f"block_size must be >= 1, got {block_size}")
    storage.makedirs(path)
    names = storage.listdir(path) if storage.exists(path) else []
    stale = [f for f in names if f.endswith(".safetensors") or f.endswith(".index.json")]
    if stale:
        raise AlreadyExists(
            f"{path} already holds weights ({', '.join(sorted(stale))}); "
            "export into an empty or new directory"
        )
    if storage.is_remote(path):  # safetensors writes local files: write here, then upload
        with tempfile.TemporaryDirectory(prefix="mars_jax_") as local:
            export_hf(
                model,
                local,
                max_shard_bytes=max_shard_bytes,
                dtype=dtype,
                mask_token_id=mask_token_id,
                block_size=block_size,
                special_ids=special_ids,
            )
            storage.copy_tree(local, path)
        return
    cfg = model.cfg if dtype is None else dataclasses.replace(model.cfg, param_dtype=dtype)
    tensors = {}
    for p, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        names, transposed, stacked = _hf_names(p, cfg.num_layers)
        value = np.asarray(jax.device_get(leaf).astype(jnp.dtype(cfg.param_dtype)))
        for name, part in zip(names, value if stacked else [value]):
            tensors[name] = np.ascontiguousarray(part.T if transposed else part)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensors[name], size + nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata=metadata)
            weight_map.update({name: fname for name in shard})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(
                {
                    "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                    "weight_map": weight_map,
                },
                f,
                indent=2,
            )
    with open(os.path.join(path, "config.json"), "w") as f:
        hf_config = config_to_hf(
            cfg, mask_token_id=mask_token_id, block_size=block_size, special_ids=special_ids
        )
        json.dump(hf_config, f, indent=2)
    if special_ids is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config_to_hf(special_ids), f, indent=2)
    # safetensors writes its files with mode 0600 (a private temporary file renamed into place);
    # give them the mode every other file gets: 0666 less the umask.
    umask = os.umask(0)
    os.umask(umask)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.chmod(os.path.join(path, f), 0o666 & ~umask)
