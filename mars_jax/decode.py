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

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax.model import KVCache, Qwen2, init_cache
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, MASK_ID

DEFAULT_EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)


@dataclasses.dataclass
class DecodeOutput:
    """Result of `generate` for a batch of R prompts.

    tokens: int32 [R, max_new_tokens], the completion cut before the first EOS, then padded with
      <|endoftext|>. lengths: int32 [R], completion lengths (EOS excluded).
    accepted: int32 [R], tokens accepted per row, the EOS included (what the forwards produced).
    row_forwards: int32 [R], decoding forwards in which each row was still active.
    forwards: int, decoding forwards of the whole batch (the prefill is not counted); summed
      over batches by `concatenate`.
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

    @property
    def row_tokens_per_forward(self) -> np.ndarray:
        """float64 [R]: each row's accepted tokens per forward in which it was active."""
        return self.accepted / np.maximum(self.row_forwards, 1)

    def completions(self) -> list[list[int]]:
        """Each row's completion as a list of token ids (EOS excluded)."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]

    @classmethod
    def concatenate(cls, outputs: Sequence["DecodeOutput"], rows: int | None = None):
        """The outputs of several batches as one, row after row, keeping the first ``rows``
        rows (default: all; drops filler rows)."""
        cat = lambda f: np.concatenate([getattr(o, f) for o in outputs])[:rows]
        fields = ("tokens", "lengths", "accepted", "row_forwards")
        return cls(*map(cat, fields), forwards=sum(o.forwards for o in outputs))


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


def _accepted(token, conf, threshold, eos, budget):
    """How many of a step's B candidates each row accepts (Sec. 3.3).

    token int32 [R, B] and conf float32 [R, B]: the candidates and their confidences; budget
    int32 [R]: tokens left to each row. The first candidate is always accepted, later ones left
    to right while conf >= threshold (none when threshold >= 1.0, one-token mode); acceptance
    stops after an EOS and at the budget. Returns (count int32 [R] in 1..B where budget >= 1,
    hit_eos bool [R]: an accepted candidate is an EOS).
    """
    ok = (conf >= threshold) & ~(threshold >= 1.0)
    ok = ok.at[:, 0].set(True)
    is_eos = jnp.isin(token, eos)
    after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
    count = jnp.minimum(jnp.cumprod(ok & ~after_eos, axis=1).sum(axis=1), budget)
    hit_eos = jnp.any(is_eos & (jnp.arange(token.shape[1])[None] < count[:, None]), axis=1)
    return count, hit_eos


@flax.struct.dataclass
class DecodeState:
    """The state carried by the decoding loop (`_generate`'s ``lax.while_loop``), for R rows
    and S cache slots (positions; prompt + budget + room for one window).

    cache: `KVCache`, per layer {"k", "v"} [R, S, K, H]; row r's slots below ``cache_cursor[r]``
      hold the keys/values of its committed tokens (later slots are stale or empty).
    tokens: int32 [R, S], each row's prompt then its accepted tokens (entries at or past
      ``committed`` are stale).
    committed: int32 [R], tokens committed so far (prompt + accepted): the position of the next
      token to decode.
    cache_cursor: int32 [R], first position whose key/value is not cached yet; the tokens
      between it and ``committed`` (those accepted by the last step) start the next window.
    new_tokens: int32 [R], tokens accepted so far (an EOS included).
    done: bool [R], the row accepted an EOS or reached ``max_new_tokens``.
    row_forwards: int32 [R], forwards in which the row was active.
    forwards: int32 [], forwards of the batch.
    """

    cache: KVCache
    tokens: jax.Array
    committed: jax.Array
    cache_cursor: jax.Array
    new_tokens: jax.Array
    done: jax.Array
    row_forwards: jax.Array
    forwards: jax.Array


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
    window = 2 * block_size - 1  # at most B uncached committed tokens, then B-1 masks
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

    eos = jnp.asarray(eos_ids, jnp.int32)

    def step(s: DecodeState) -> DecodeState:
        # Window: uncached committed tokens, then masks; slot j sits at position cache_cursor + j.
        pos = s.cache_cursor[:, None] + jnp.arange(window)
        ids = jnp.where(
            pos < s.committed[:, None], _rowwise_slice(s.tokens, s.cache_cursor, window), mask_id
        )
        mask = slot_ids[None, None, :] <= pos[:, :, None]
        hidden, cache = model(ids, pos, mask, s.cache, s.cache_cursor)
        # Outputs at positions committed-1 .. committed+B-2 predict tokens committed .. +B-1.
        first = s.committed - s.cache_cursor - 1
        logits = model.logits(_rowwise_slice(hidden, first, block_size))  # [R, B, V]
        if sampling:
            logits = logits / temperature
            key = jax.random.fold_in(rng, s.forwards)
            token = jax.random.categorical(key, logits, axis=-1)
        else:
            token = jnp.argmax(logits, axis=-1)
        token = token.astype(jnp.int32)
        probs = jax.nn.softmax(logits, axis=-1)
        conf = jnp.take_along_axis(probs, token[..., None], axis=-1)[..., 0]
        count, hit_eos = _accepted(token, conf, threshold, eos, max_new_tokens - s.new_tokens)
        active = ~s.done
        count = jnp.where(active, count, 0)
        new_tokens = s.new_tokens + count
        return DecodeState(
            cache=cache,
            tokens=jnp.where(
                active[:, None], _rowwise_update(s.tokens, token, s.committed), s.tokens
            ),
            committed=s.committed + count,
            cache_cursor=jnp.where(active, s.committed, s.cache_cursor),
            new_tokens=new_tokens,
            done=s.done | hit_eos | (new_tokens >= max_new_tokens),
            row_forwards=s.row_forwards + active,
            forwards=s.forwards + 1,
        )

    def cond(s: DecodeState) -> jax.Array:
        # Every active row accepts >= 1 token per forward, so max_new_tokens forwards finish
        # every row; the bound also ends the loop should a step ever accept nothing.
        return ~jnp.all(s.done) & (s.forwards < max_new_tokens)

    init = DecodeState(
        cache=cache,
        tokens=jnp.zeros((rows, slots), jnp.int32).at[:, :prompt_len].set(prompt_ids),
        committed=prompt_lengths,
        cache_cursor=prompt_lengths - 1,
        new_tokens=jnp.zeros((rows,), jnp.int32),
        done=jnp.zeros((rows,), bool),
        row_forwards=jnp.zeros((rows,), jnp.int32),
        forwards=jnp.int32(0),
    )
    s = jax.lax.while_loop(cond, step, init)

    out = _rowwise_slice(s.tokens, prompt_lengths, max_new_tokens)
    within = jnp.arange(max_new_tokens)[None] < s.new_tokens[:, None]
    is_eos = jnp.isin(out, eos) & within
    lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), s.new_tokens)
    out = jnp.where(jnp.arange(max_new_tokens)[None] < lengths[:, None], out, ENDOFTEXT_ID)
    return out, lengths, s.new_tokens, s.row_forwards, s.forwards


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


def generate_batched(
    model: Qwen2,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    pad_id: int = ENDOFTEXT_ID,
    **kwargs,
) -> DecodeOutput:
    """Decodes any number of prompts (lists of token ids) in batches of ``batch_size`` rows.

    Every batch has the same shape [batch_size, longest prompt] (the last one is filled with
    one-token filler rows), so the decoder compiles once. ``kwargs`` go to `generate`
    (block_size, threshold, max_new_tokens, ...). Returns one `DecodeOutput` with a row per
    prompt, in order. Raises ValueError as `pad_prompts` and `generate`.
    """
    num_batches = -(-len(prompts) // batch_size)
    ids, lengths = pad_prompts(prompts, pad_id, rows=num_batches * batch_size)
    outputs = [
        generate(model, ids[i : i + batch_size], lengths[i : i + batch_size], **kwargs)
        for i in range(0, len(ids), batch_size)
    ]
    return DecodeOutput.concatenate(outputs, rows=len(prompts))
