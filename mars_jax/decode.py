"""MARS threshold decoding with a functional KV cache (arXiv 2604.07023, Sec. 3.3).

Each forward scores the next ``block_size`` positions of every row at once: the committed
text followed by ``<|mask|>`` tokens. With the right-shifted logits, the output at the last
committed position n-1 is the ordinary AR prediction of token n, and the output at the mask
standing for position n+i-1 predicts token n+i (i = 1..B-1). Candidates are accepted left to
right while their confidence (probability of the chosen token) is >= ``threshold``; the first is
always accepted, so threshold 1.0 is one-token mode and reproduces greedy AR decoding exactly.
The mask for position n+B-1 would only predict a token outside the block and, under causal
attention, influences no candidate, so it is not fed.

Unlike the reference's block cache, every row keeps its own cursor: a row never waits for the
others at block boundaries. Per step and row, the forward window starts at the first position
whose key/value is not cached yet (the tokens accepted by the previous step, 1..B of them), so
the window has ``2B - 1`` slots: at most B committed tokens and B-1 masks. Cache slots at or
past a row's cursor may hold stale values; they are always rewritten before being attended.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax.model import Qwen2, init_cache
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, MASK_ID

DEFAULT_EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)


@dataclasses.dataclass
class DecodeOutput:
    """Result of `generate` for a batch of R prompts.

    tokens: int32 [R, max_new_tokens], the completion cut before the first EOS, then padded with
      <|endoftext|>. lengths: int32 [R], completion lengths (EOS excluded).
    accepted: int32 [R], tokens accepted per row, the EOS included (what the forwards produced).
    row_forwards: int32 [R], decoding forwards in which each row was still active.
    forwards: int, decoding forwards of the whole batch (the prefill is not counted).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    accepted: np.ndarray
    row_forwards: np.ndarray
    forwards: int

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens per decoding forward, summed over rows (1.0 in one-token mode)."""
        return float(self.accepted.sum() / max(self.row_forwards.sum(), 1))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, rows: int | None = None):
    """Right-pads token-id lists into the inputs of `generate`.

    Returns (prompt_ids int32 [rows, P], prompt_lengths int32 [rows]) with P the longest prompt;
    ``rows`` (default: len(prompts)) may add filler rows (one pad token each) so that every
    batch has the same shape and compiles once. Raises ValueError for an empty prompt.
    """
    rows = len(prompts) if rows is None else rows
    ids = np.full((rows, max(map(len, prompts))), pad_id, np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        ids[i, : len(p)], lengths[i] = p, len(p)
    return ids, lengths


def _rowwise_slice(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """x [R, N, ...] -> [R, size, ...], row r starting at start[r]."""
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size, axis=0))(x, start)


def _rowwise_update(x: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    return jax.vmap(lambda r, u, s: jax.lax.dynamic_update_slice_in_dim(r, u, s, axis=0))(
        x, update, start
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "block_size", "max_new_tokens", "eos_ids", "mask_id", "sampling"),
)
def _generate(
    graphdef,
    params,
    prompt_ids,
    prompt_lengths,
    threshold,
    temperature,
    rng,
    *,
    block_size: int,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    mask_id: int,
    sampling: bool,
):
    model: Qwen2 = nnx.merge(graphdef, params)
    rows, prompt_len = prompt_ids.shape
    b, window = block_size, 2 * block_size - 1
    slots = prompt_len + max_new_tokens + 2 * window
    slot_ids = jnp.arange(slots)

    # Prefill: every prompt token's key/value; slots past a row's prompt hold stale values.
    cache = init_cache(model.cfg, rows, slots)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (rows, prompt_len))
    _, cache = model(
        prompt_ids,
        positions,
        slot_ids[None, None, :] <= positions[:, :, None],
        cache,
        jnp.zeros((rows,), jnp.int32),
    )

    seq = jnp.zeros((rows, slots), jnp.int32).at[:, :prompt_len].set(prompt_ids)
    eos = jnp.asarray(eos_ids, jnp.int32)
    one_token_mode = threshold >= 1.0

    def step(state):
        cache, seq, committed, cached, new, done, row_forwards, forwards = state
        # Window: uncached committed tokens, then masks; slot j sits at position cached + j.
        pos = cached[:, None] + jnp.arange(window)
        ids = jnp.where(pos < committed[:, None], _rowwise_slice(seq, cached, window), mask_id)
        mask = slot_ids[None, None, :] <= pos[:, :, None]
        hidden, cache = model(ids, pos, mask, cache, cached)
        # Outputs at positions committed-1 .. committed+B-2 predict tokens committed .. +B-1.
        logits = model.logits(_rowwise_slice(hidden, committed - cached - 1, b))  # [R, B, V]
        if sampling:
            logits = logits / temperature
            token = jax.random.categorical(jax.random.fold_in(rng, forwards), logits, axis=-1)
        else:
            token = jnp.argmax(logits, axis=-1)
        token = token.astype(jnp.int32)
        conf = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), token[..., None], axis=-1)[
            ..., 0
        ]
        # Accept left to right: the first always, then while confident; stop after an EOS and at
        # the token budget.
        ok = (conf >= threshold) & ~one_token_mode
        ok = ok.at[:, 0].set(True)
        is_eos = jnp.isin(token, eos)
        after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
        run = jnp.cumprod(ok & ~after_eos, axis=1)
        count = jnp.minimum(run.sum(axis=1), max_new_tokens - new)
        hit_eos = jnp.any(is_eos & (jnp.arange(b)[None] < count[:, None]), axis=1)
        active = ~done
        count = jnp.where(active, count, 0)
        seq = jnp.where(active[:, None], _rowwise_update(seq, token, committed), seq)
        cached = jnp.where(active, committed, cached)
        return (
            cache,
            seq,
            committed + count,
            cached,
            new + count,
            done | hit_eos | (new + count >= max_new_tokens),
            row_forwards + active,
            forwards + 1,
        )

    state = (
        cache,
        seq,
        prompt_lengths,
        prompt_lengths - 1,
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows,), bool),
        jnp.zeros((rows,), jnp.int32),
        jnp.int32(0),
    )
    _, seq, committed, _, new, _, row_forwards, forwards = jax.lax.while_loop(
        lambda s: ~jnp.all(s[5]), step, state
    )

    out = _rowwise_slice(seq, prompt_lengths, max_new_tokens)
    within = jnp.arange(max_new_tokens)[None] < new[:, None]
    is_eos = jnp.isin(out, eos) & within
    lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), new)
    out = jnp.where(jnp.arange(max_new_tokens)[None] < lengths[:, None], out, ENDOFTEXT_ID)
    return out, lengths, new, row_forwards, forwards


def generate(
    model: Qwen2,
    prompt_ids: np.ndarray,
    prompt_lengths: np.ndarray,
    *,
    block_size: int,
    threshold: float,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: Sequence[int] = DEFAULT_EOS_IDS,
    mask_id: int = MASK_ID,
    seed: int = 0,
) -> DecodeOutput:
    """Decodes a batch of prompts with MARS threshold decoding (one jitted program).

    Args:
      model: a `Qwen2` (MARS-trained, or any AR model with threshold 1.0).
      prompt_ids: int [R, P] prompts, right-padded with any id; which tokens are valid comes only
        from ``prompt_lengths`` (a prompt may itself contain <|endoftext|>).
      prompt_lengths: int [R], each in 1..P.
      block_size: B, the most tokens accepted per forward (the training block size).
      threshold: confidence needed to accept a candidate after the first; >= 1.0 accepts
        exactly one token per forward (AR decoding), even where a probability rounds to 1.0.
      max_new_tokens: completion budget per row.
      temperature: 0 for greedy; > 0 samples each candidate from softmax(logits / temperature)
        and uses the sampled token's probability as its confidence.
      eos_ids: tokens that end a row; the output is cut before the first one, even where a
        forward accepted tokens past it.
      mask_id: id of <|mask|>.
      seed: PRNG seed for sampling.

    Returns:
      A `DecodeOutput`. Raises ValueError for inconsistent shapes or lengths, block_size or
      max_new_tokens < 1, or a negative temperature.
    """
    prompt_ids = np.asarray(prompt_ids, np.int32)
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    if prompt_ids.ndim != 2 or prompt_lengths.shape != prompt_ids.shape[:1]:
        raise ValueError(
            f"prompt_ids must be [R, P] and prompt_lengths [R]; got "
            f"{prompt_ids.shape} and {prompt_lengths.shape}"
        )
    if prompt_lengths.min() < 1 or prompt_lengths.max() > prompt_ids.shape[1]:
        raise ValueError(f"prompt_lengths must lie in 1..{prompt_ids.shape[1]}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if block_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"block_size ({block_size}) and max_new_tokens ({max_new_tokens}) must be >= 1"
        )
    graphdef, params = nnx.split(model)
    out = _generate(
        graphdef,
        params,
        jnp.asarray(prompt_ids),
        jnp.asarray(prompt_lengths),
        jnp.float32(threshold),
        jnp.float32(temperature),
        jax.random.key(seed),
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        eos_ids=tuple(int(e) for e in eos_ids),
        mask_id=int(mask_id),
        sampling=temperature > 0,
    )
    tokens, lengths, accepted, row_forwards, forwards = jax.device_get(out)
    return DecodeOutput(tokens, lengths, accepted, row_forwards, int(forwards))
