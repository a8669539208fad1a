"""Vocabulary trimming for runs trained from scratch (``data.trim_vocab``).

A trimmed model has one embedding (and tied output) row per kept Qwen2.5 id instead of 151,936:
the ids that occur in the training and evaluation data, the control tokens ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` and ``<|mask|>``, and filler ids (the lowest absent ids) up to
a multiple of `ROW_MULTIPLE` rows, so the vocabulary axis still splits over a tensor mesh axis.
Every row is a real Qwen2.5 id, so whatever row the decoder picks maps back to a token.

The map is a sorted array of the kept ids: model id ``m`` is Qwen id ``ids[m]``. Ids are mapped
at the boundaries: training examples once tokenized, and decoding, evaluation and generation
through `MappedTokenizer`, whose ids are model ids. What users get back (generated ``tokens``)
is mapped to Qwen ids again (`qwen_ids`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Sequence

import numpy as np

from mars_jax import storage
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.errors import InputError
from mars_jax.tokenizer import Tokenizer

ROW_MULTIPLE = 128  # kept rows are padded with filler ids to a multiple of this


class VocabMap:
    """The kept Qwen2.5 ids of a trimmed model, ``ids`` (int32 [V], sorted, unique).

    Raises ValueError for ids that are not sorted and unique or are negative.
    """

    def __init__(self, ids: Sequence[int] | np.ndarray):
        self.ids = np.asarray(ids, np.int32)
        if (
            self.ids.ndim != 1
            or self.ids.size == 0
            or self.ids[0] < 0
            or np.any(np.diff(self.ids) <= 0)
        ):
            raise InputError("a vocabulary map needs non-negative ids, sorted and unique")
        # Dense Qwen id -> model id table (-1: not kept): one lookup per token, where a search
        # per example took 40 s for GSM8K's 7,473 training rows.
        self._table = np.full(int(self.ids[-1]) + 1, -1, np.int32)
        self._table[self.ids] = np.arange(self.ids.size, dtype=np.int32)

    def __len__(self) -> int:
        """The number of model rows (kept ids)."""
        return int(self.ids.size)

    def to_model(self, qwen_ids, where: str = "") -> np.ndarray:
        """Qwen ids (any int array-like) -> model ids (int32, same shape).

        Raises ValueError naming the first id that is not kept (and ``where`` it came from).
        """
        q = np.asarray(qwen_ids, np.int64)
        model = self._lookup(q)
        if np.any(model < 0):
            raise InputError(
                f"{where + ': ' if where else ''}token id {self.missing(q)[0]} is not in the "
                f"trimmed vocabulary ({len(self)} ids kept from the run's training and "
                "evaluation data)"
            )
        return model

    def _lookup(self, q: np.ndarray) -> np.ndarray:
        """Model ids of int64 Qwen ids ``q`` (int32, same shape); -1 where an id is not kept."""
        inside = (q >= 0) & (q < self._table.size)
        return np.where(inside, self._table[np.where(inside, q, 0)], -1).astype(np.int32)

    def missing(self, qwen_ids) -> list[int]:
        """The ids of ``qwen_ids`` that are not kept, in order of first occurrence."""
        q = np.ravel(np.asarray(qwen_ids, np.int64))
        return list(dict.fromkeys(q[self._lookup(q) < 0].tolist()))

    def to_qwen(self, model_ids) -> np.ndarray:
        """Model ids (ints in [0, V)) -> Qwen ids (int32, same shape). Raises IndexError for an
        id outside [0, V)."""
        m = np.asarray(model_ids, np.int64)
        if m.size and (m.min() < 0 or m.max() >= len(self)):
            raise IndexError(f"model ids must lie in [0, {len(self)}), got {m.min()}..{m.max()}")
        return self.ids[m]

    def map_examples(self, examples, where: str = "") -> list:
        """Training examples [`batches.Example`] of Qwen ids -> the same in model ids
        (IGNORE_INDEX labels and source rows kept). Raises ValueError as `to_model`, naming
        ``where`` and the example's source row."""
        out = []
        for e in examples:
            at = f"{where + ': ' if where else ''}row {e.row}"
            mapped = np.where(e.labels == IGNORE_INDEX, 0, e.labels)
            out.append(
                e._replace(
                    input_ids=self.to_model(e.input_ids, at),
                    labels=np.where(
                        e.labels == IGNORE_INDEX, IGNORE_INDEX, self.to_model(mapped, at)
                    ),
                )
            )
        return out

    def save(self, path: str) -> None:
        """Writes the map as JSON: ``{"qwen_ids": [sorted ids], "sha256": digest of the ids}``."""
        ids = self.ids.tolist()
        storage.write_text(path, json.dumps({"qwen_ids": ids, "sha256": _digest(ids)}))

    @classmethod
    def load(cls, path: str) -> "VocabMap":
        """The map saved at ``path`` by `save`. Raises ValueError naming the file when it holds
        no sorted, unique id list, or ids that differ from its checksum (one id changed would
        still be a sorted list, and every token it maps would decode as another); a map
        written before the checksum was kept is read without it."""
        raw = storage.read_bytes(path)
        try:  # a JSONDecodeError (truncated file) and a UnicodeDecodeError are ValueErrors
            data = json.loads(raw)
            out = cls(data["qwen_ids"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}: not a vocabulary map ({e})") from None
        if "sha256" in data and data["sha256"] != _digest(out.ids.tolist()):
            raise InputError(
                f"{path}: its ids do not match its sha256 (the file was changed after the run "
                "wrote it): the model's ids would decode as other tokens; restore the run's map"
            )
        return out


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def build(
    token_ids: Iterable[np.ndarray],
    mask_id: int,
    vocab_size: int,
    control_ids: Sequence[int],
) -> VocabMap:
    """The map of a trimmed run: the ids in ``token_ids`` (arrays of Qwen ids, e.g. every
    example's input_ids), the ``control_ids`` (the tokenizer's pad, BOS and stop ids) and ``mask_id``, plus the lowest absent ids as filler up to a multiple of
    `ROW_MULTIPLE` (at most ``vocab_size``, the full vocabulary's rows).

    Raises ValueError for an id outside [0, vocab_size).
    """
    control = np.array([*control_ids, mask_id])
    kept = np.unique(np.concatenate([control, *(np.ravel(t) for t in token_ids)]))
    if kept[0] < 0 or kept[-1] >= vocab_size:
        raise InputError(f"token ids {kept[0]}..{kept[-1]} lie outside [0, {vocab_size})")
    rows = min(-(-len(kept) // ROW_MULTIPLE) * ROW_MULTIPLE, vocab_size)
    filler = np.setdiff1d(np.arange(rows), kept)[: rows - len(kept)]
    return VocabMap(np.union1d(kept, filler))


class MappedTokenizer:
    """A `Tokenizer` whose ids are a trimmed model's ids: ``encode``/``encode_batch``/
    ``apply_chat_template`` return model ids (ValueError naming a Qwen id the map lacks),
    ``decode`` takes model ids, and ``pad_id``, ``bos_id``, ``eos_id`` and ``mask_id`` are model
    ids. ``render_chat``, ``chat_template`` and ``save`` are the wrapped tokenizer's.

    Args:
        tok: the run's Qwen2.5 tokenizer.
        vocab: the run's `VocabMap`.
    """

    def __init__(self, tok: Tokenizer, vocab: VocabMap):
        self.qwen, self.vocab = tok, vocab
        self.chat_template = tok.chat_template
        self.render_chat, self.save = tok.render_chat, tok.save
        self.control_strings = tok.control_strings
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = (
            int(i) for i in vocab.to_model([tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id])
        )

    def __len__(self) -> int:
        """The number of model ids."""
        return len(self.vocab)

    def model_ids(self, ids: list[int]) -> list[int]:
        """Model ids of the tokenizer's ``ids``; InputError naming the first the map lacks."""
        if missing := self.vocab.missing(ids):
            token = self.qwen.decode(missing[:1], skip_special_tokens=False)
            raise InputError(
                f"token {token!r} (id {missing[0]}) is not in this run's trimmed vocabulary "
                f"({len(self.vocab)} ids, vocab_map.json): it never occurs in the run's "
                "training or evaluation data"
            )
        return self.vocab.to_model(ids).tolist()

    def encode(self, text: str) -> list[int]:
        """Model ids of ``text`` (see `Tokenizer.encode`). Raises ValueError naming the first
        token of ``text`` that the map lacks."""
        return self.model_ids(self.qwen.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Model ids of each string (see `Tokenizer.encode_batch`); raises as `encode`."""
        return [self.model_ids(ids) for ids in self.qwen.encode_batch(texts)]

    @property
    def backend(self):
        """The Qwen2.5 tokenizer's `tokenizers.Tokenizer` (its ids: `backend_ids`)."""
        return self.qwen.backend

    def backend_ids(self, ids) -> list[int]:
        """Model ids ``ids`` as the backend's (Qwen2.5) ids."""
        return self.vocab.to_qwen(list(ids)).tolist()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of model id ``token_id`` (see `Tokenizer.token_bytes`)."""
        return self.qwen.token_bytes(self.backend_ids([token_id])[0])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of model ids ``ids`` (see `Tokenizer.decode`)."""
        return self.qwen.decode(self.vocab.to_qwen(list(ids)), skip_special_tokens)

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt=False,
        tools=None,
        content_as_text=True,
        continue_final_message=False,
    ) -> list[int]:
        """Model ids of the rendered chat (see `Tokenizer.apply_chat_template`)."""
        qwen = self.qwen.apply_chat_template(
            messages, add_generation_prompt, tools, content_as_text, continue_final_message
        )
        return self.model_ids(qwen)


def stop_ids(tok) -> list[int]:
    """The ids that end a completion (the tokenizer's ``eos_ids``) in ``tok``'s id space."""
    if isinstance(tok, MappedTokenizer):
        return tok.vocab.to_model(list(tok.qwen.eos_ids)).tolist()
    return [int(i) for i in tok.eos_ids]


def model_ids(tok, qwen_ids: Sequence[int]) -> list[int]:
    """``qwen_ids`` in ``tok``'s id space: mapped for a `MappedTokenizer`, else unchanged."""
    if isinstance(tok, MappedTokenizer):
        return tok.vocab.to_model(qwen_ids).tolist()
    return [int(i) for i in qwen_ids]


def qwen_ids(tok, ids: Sequence[int]) -> list[int]:
    """Ids of ``tok``'s space as Qwen2.5 ids: mapped for a `MappedTokenizer`, else unchanged."""
    if isinstance(tok, MappedTokenizer):
        return tok.vocab.to_qwen(list(ids)).tolist()
    return [int(i) for i in ids]


def special_tokens(tok, tokenizer_config: dict, add_bos_token: bool | None):
    """(ids before, ids after) the text that transformers' tokenizer of these files adds to an
    encoding with ``add_special_tokens=True``, loaded as HFLM loads it (with ``add_bos_token``
    when that model argument is given), in ``tok``'s ids. transformers (5.x) replaces the
    tokenizer.json post-processor by ``[bos] $A [eos]`` when ``add_bos_token`` or
    ``add_eos_token`` is given (in tokenizer_config.json or as that argument) or tokenizer.json
    has none (a bos_token / eos_token only where the files name one); else tokenizer.json's own
    post-processor applies (Llama 3's adds ``<|begin_of_text|>``, Qwen2.5's has none)."""
    base = getattr(tok, "qwen", tok)  # a trimmed run's tokenizer: its Qwen2.5 one
    backend = tok.backend
    if (
        add_bos_token is not None
        or {"add_bos_token", "add_eos_token"} & set(tokenizer_config)
        or backend.post_processor is None
    ):
        bos = tokenizer_config.get("add_bos_token") if add_bos_token is None else add_bos_token
        named = base.roles["bos_token"]
        before = [backend.token_to_id(named)] if bos and named is not None else []
        after = [base.eos_id] if tokenizer_config.get("add_eos_token") else []
    else:
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        at = [k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain]
        if not at:
            raise InputError(
                "mars_jax: the tokenizer's post-processor does not keep the text's ids together: "
                "its special tokens cannot be added as transformers adds them"
            )
        before, after = full[: at[0]], full[at[0] + len(plain) :]
    return model_ids(tok, before), model_ids(tok, after)
