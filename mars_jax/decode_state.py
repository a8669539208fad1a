"""The values of MARS threshold decoding (arXiv 2604.07023, Sec. 3.3): what a decoder program is (`DecoderSettings`,
static), what its rows are told (`RowSettings`, per row), what it carries from forward to
forward (`DecodeState`), and what a host reads back (`DecodeResult`, `NewTokens`). Pytrees and
frozen dataclasses only: the functions over them are `mars_jax.decoder.Decoder`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mars_jax.decode_options import DecodeOptions
from mars_jax.errors import InputError
from mars_jax.kv_cache import KVCache


def seed_keys(seeds) -> jax.Array:
    """PRNG keys [R], ``jax.random.key`` of each of the integer ``seeds`` [R] (0..2**32-1): the
    rows' sampling keys (`RowSettings.keys`)."""
    return jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seeds).astype(np.uint32)))


def mask_id_for(mask_id: int | None, block_size: int) -> int:
    """``mask_id`` as the decoder's setting: None (a model without ``<|mask|>``) is refused
    for block_size > 1, and is never fed at block size 1 (no masks after the one token)."""
    if mask_id is None:
        if block_size > 1:
            raise InputError(
                f"mask_id: None; block size {block_size} feeds <|mask|> tokens, and this model "
                "has none (decode with block size 1)"
            )
        return -1
    return int(mask_id)


@flax.struct.dataclass
class RowSettings:
    """Each row's decoding settings, one value per row (rows of one batch may differ), carried
    inside the `DecodeState`: a new per-row knob is one field here and the line that reads it.

    threshold: float32 [R], confidence needed after the first candidate (1.0: one token).
    max_accept: int32 [R], most tokens accepted per forward.
    max_new_tokens: int32 [R], the row's budget (at most `DecoderSettings.max_new_tokens`, which
      sizes the slots): the row is done at it, inside a `Decoder.steps` call too.
    temperature: float32 [R], 0 greedy, else sampled (only where the decoder samples).
    keys: PRNG keys [R], each row's sampling key (noise is keyed by key and position).
    top_p: float32 [R], nucleus sampling: a sampling row draws from the smallest set of tokens
      whose probabilities (after its temperature) sum to >= top_p (1.0: all).
    want_logprobs: bool [R], record the row's log-probabilities (where the decoder records).
    """

    threshold: jax.Array
    max_accept: jax.Array
    max_new_tokens: jax.Array
    temperature: jax.Array
    keys: jax.Array
    top_p: jax.Array
    want_logprobs: jax.Array

    @classmethod
    def build(
        cls,
        rows: int,
        *,
        threshold,
        max_accept,
        max_new_tokens,
        temperature=0.0,
        seed=0,
        top_p=1.0,
        want_logprobs=False,
    ) -> RowSettings:
        """``rows`` rows' settings, each value one for every row or one per row [R]; ``seed``
        integers in 0..2**32-1 (made keys by `seed_keys`). Unchecked: `DecodeOptions` and the
        engine's requests are checked where they are made."""
        per_row = lambda x, dtype: np.broadcast_to(np.asarray(x, dtype), (rows,))
        return cls(
            threshold=per_row(threshold, np.float32),
            max_accept=per_row(max_accept, np.int32),
            max_new_tokens=per_row(max_new_tokens, np.int32),
            temperature=per_row(temperature, np.float32),
            keys=seed_keys(np.broadcast_to(np.asarray(seed), (rows,))),
            top_p=per_row(top_p, np.float32),
            want_logprobs=per_row(want_logprobs, bool),
        )

    @classmethod
    def of(cls, options: DecodeOptions, rows: int, *, seed=0) -> RowSettings:
        """The settings of ``rows`` rows decoded as ``options`` say (its threshold one value or
        one per row), with ``seed`` (one or one per row)."""
        return cls.build(
            rows,
            threshold=options.threshold,
            max_accept=options.accept_limit,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            seed=seed,
            top_p=options.top_p,
        )


@flax.struct.dataclass
class DecodeState:
    """Everything a decoding step reads and writes, for R rows and S slots (positions: prompt +
    budget + room for one window). The model's parameters travel beside it.

    row_settings: `RowSettings`, each row's settings ([R] arrays).
    prompt_lengths: int32 [R], where each completion starts.

    Decoding progress:
    cache: `KVCache`, per layer {"k", "v"} [R, S, K, H] (None in ``none`` mode); row r's slots
      below ``cache_cursor[r]`` hold the keys/values of its committed tokens.
    tokens: int32 [R, S], each row's prompt then its accepted tokens; past ``committed`` it holds
      the row's pending drafts (``verify``), or the prefix's prediction of the block's first
      token (``block``), then stale entries.
    committed: int32 [R], tokens committed so far (prompt + accepted): the position of the next
      token to decode.
    cache_cursor: int32 [R], first position whose key/value is not cached yet (``block``: the
      start of the row's current block); the tokens from it up to ``committed`` start the next
      window.
    num_drafts: int32 [R], drafts waiting at tokens[committed : committed + num_drafts], fed as
      ordinary tokens by the next forward (``verify`` only; 0 otherwise).
    new_tokens: int32 [R], tokens accepted so far (an EOS included).
    done: bool [R], the row accepted an EOS or reached ``max_new_tokens``.
    row_forwards: int32 [R], forwards in which the row was active.
    token_forwards: int32 [R, S], at each committed position of a completion, the row's forwards
      up to the one that accepted the token (a server counts an answer's forwards up to the
      token that ends it, not those a device call ran after).
    forwards: int32 [], forwards of the batch.

    Log-probabilities (None unless `DecoderSettings.logprobs` is set; K its value):
    logprobs: float32 [R, S], at each committed position the token's log-probability under the
      model's distribution in the forward that chose it (before temperature and top_p).
    top_ids, top_logprobs: int32 / float32 [R, S, K], the K most likely tokens there.
    """

    row_settings: RowSettings
    prompt_lengths: jax.Array
    cache: KVCache | None
    tokens: jax.Array
    committed: jax.Array
    cache_cursor: jax.Array
    num_drafts: jax.Array
    new_tokens: jax.Array
    done: jax.Array
    row_forwards: jax.Array
    token_forwards: jax.Array
    forwards: jax.Array
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


@flax.struct.dataclass
class DecodeResult:
    """The device-side result of a decode (`DecodeOutput` is its host copy; fields as there):
    tokens int32 [R, max_new_tokens], lengths, accepted, row_forwards int32 [R], forwards
    int32 []."""

    tokens: jax.Array
    lengths: jax.Array
    accepted: jax.Array
    row_forwards: jax.Array
    forwards: jax.Array


@flax.struct.dataclass
class NewTokens:
    """What a host loop reads back after some steps (`Decoder.new_tokens`, on the device, or
    `Decoder.read_new_tokens`, its host copy), for R rows, ``sent`` int32 [R] tokens of each
    already seen:
    tokens: int32 [R, W], row r's tokens from position prompt_lengths[r] + sent[r]; only the first
      new_tokens[r] - sent[r] are committed (the rest are drafts or stale).
    new_tokens, row_forwards: int32 [R], as in `DecodeState`. forwards: int32 [], the batch's.
    token_forwards: int32 [R, W], those of ``tokens`` (`DecodeState`).
    logprobs [R, W], top_ids and top_logprobs [R, W, K]: those of ``tokens`` (`DecodeState`),
      None where the decoder records none."""

    tokens: Any
    new_tokens: Any
    row_forwards: Any
    forwards: Any
    token_forwards: Any = None
    logprobs: Any = None
    top_ids: Any = None
    top_logprobs: Any = None


@dataclasses.dataclass(frozen=True)
class DecoderSettings:
    """The static settings of one decoder program (hashable: part of the jit cache key).
    ``rule`` is a name of `ACCEPTANCE_RULES`; ``sampling`` whether any row samples;
    ``logprobs`` (None: none) records each committed token's log-probability and the
    ``logprobs`` most likely alternatives for the rows that ask (``sliding`` and ``none``)."""

    block_size: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    mask_id: int
    sampling: bool
    cache_mode: str
    rule: str
    adaptive_window: bool
    mesh: Mesh | None
    axis_rules: Any  # flax logical-axis rules ((name, mesh axes), ...) or None
    on_accept: Callable | None
    logprobs: int | None = None

    @classmethod
    def of(
        cls,
        options: DecodeOptions,
        *,
        eos_ids: Sequence[int],
        mask_id: int | None,
        sampling: bool | None = None,
        mesh: Mesh | None = None,
        axis_rules: Any = None,
        on_accept: Callable | None = None,
        logprobs: int | None = None,
    ) -> DecoderSettings:
        """The program's settings of (already checked) ``options``: the one place they turn
        into static settings. ``sampling`` defaults to whether the options sample; the mask id
        as `mask_id_for` (None only at block size 1)."""
        if logprobs is not None and (logprobs < 0 or options.cache_mode.value == "block"):
            raise InputError(f"logprobs: {logprobs}; needs >= 0 and cache_mode sliding or none")
        return cls(
            block_size=options.block_size,
            max_new_tokens=options.max_new_tokens,
            eos_ids=tuple(int(e) for e in eos_ids),
            mask_id=mask_id_for(mask_id, options.block_size),
            sampling=options.sampling if sampling is None else sampling,
            cache_mode=options.cache_mode.value,
            rule=options.rule_name,
            adaptive_window=options.adaptive_window,
            mesh=mesh,
            axis_rules=None if axis_rules is None else tuple(axis_rules),
            on_accept=on_accept,
            logprobs=logprobs,
        )

    @property
    def max_forwards(self) -> int:
        """Forwards that finish every row: each active row accepts >= 1 token per forward,
        except in ``block`` mode, which adds one cache-writing forward per block."""
        b, n = self.block_size, self.max_new_tokens
        return n + (-(-n // b) if self.cache_mode == "block" and b > 1 else 0)

    @property
    def window(self) -> int:
        """Query slots of a full sliding window: at most B uncached tokens (or 1 token and B-1
        drafts), then B-1 masks."""
        return 2 * self.block_size - 1

    def slots(self, prompt_len: int) -> int:
        """Cache and token slots per row for prompts of ``prompt_len``: the prompt, the budget
        and room for two windows past it."""
        return prompt_len + self.max_new_tokens + 2 * self.window
