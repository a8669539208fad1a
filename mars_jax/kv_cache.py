"""The decoder's KV cache and the per-row windows that read and write it.

A KV cache is a functional pytree (arrays in, arrays out): {"k", "v"}, each [L, R, S, K, H] (L
layers, R rows, S slots, K kv heads, H head dim). A cached forward only reads it
(`mars_jax.attention.attend_cache`, the slots the rows hold) and returns its new keys and
values; `write_new` then writes them into it in place, once per forward, outside the layer loop
and outside the decoder's branches (nothing of the cache's size is copied or rewritten per step).

`write_window` and `read_window` address row r of an array [R, N, ...] (the decoder's token ids,
hidden states and log-probabilities) at its own offset, exactly, with one implementation per
platform (see the comment above `SELECT_MAX_SLOTS`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from mars_jax.sharding import with_logical_constraint

KVCache = dict[str, jax.Array]  # {"k": [L, R, S, K, H], "v": [L, R, S, K, H]}, L layers
# Logical axes of each KV cache array [L, R, S, K, H]: rows over the batch axes, KV heads over
# the tensor axis (as their k/v projections), so a cache shards like the model that fills it.
CACHE_AXES = ("layers", "batch", "length", "kv_heads", None)


# Per-row windows: row r of an array [R, N, ...] at its own offset start[r] (a KV cache
# [R, S, K, H]; the decoder's token ids [R, S] and hidden states [R, T, D]). A vmapped
# dynamic_update_slice or dynamic_slice is a scatter or gather, which libtpu compiles (for the
# cache and token writes and the token-window read of decoding) to a serial while loop over the
# rows (jax-ml/jax#21367); an explicit scatter compiles to relayout copies of the whole cache
# instead. So on TPU, windows of at most SELECT_MAX_SLOTS positions (every decoding step: T = 1
# for AR, 2B - 1 for MARS blocks of B <= 8) are written with T elementwise selects over all N
# positions and read with a one-hot select-and-sum: no loop, one fused pass over the array, local
# to each row when rows are sharded (benchmarks/decode_hlo.py). Elsewhere, and for longer windows
# (the prefill, once per decode; T selects per element would be T times the work), the vmapped
# dynamic slices, which work in place: on CPU the selects' extra pass over the cache makes a
# decoding step slower.
SELECT_MAX_SLOTS = 16


def _write_dynamic(x, new, start):
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=0))(
        x, new, start
    )


def _write_select(x, new, start):
    offset = jnp.arange(x.shape[1])[None, :] - start[:, None]  # [R, N]: position - start
    offset = offset.reshape(offset.shape + (1,) * (x.ndim - 2))
    for i in range(new.shape[1]):
        x = jnp.where(offset == i, new[:, i : i + 1], x)
    return x


def _read_dynamic(x, start, size):
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size, axis=0))(x, start)


def _read_select(x, start, size):
    hit = jnp.arange(x.shape[1]) == (start[:, None] + jnp.arange(size))[:, :, None]  # [R, size, N]
    hit = hit.reshape(hit.shape + (1,) * (x.ndim - 2))
    return jnp.sum(jnp.where(hit, x[:, None], jnp.zeros((), x.dtype)), axis=2, dtype=x.dtype)


def write_window(x: jax.Array, new: jax.Array, start: jax.Array | None) -> jax.Array:
    """``x`` [R, N, ...] with ``new`` [R, T, ...] written at positions ``start[r] .. start[r] +
    T - 1`` of each row r; ``start`` int [R], each window inside the array
    (0 <= start[r] <= N - T), or None for position 0 of every row (a static slice: no per-row
    offsets, e.g. a prefill). Exact. On TPU, T <= `SELECT_MAX_SLOTS` is T elementwise selects
    (see the comment above `SELECT_MAX_SLOTS`)."""
    if start is None:
        return x.at[:, : new.shape[1]].set(new)
    if new.shape[1] > SELECT_MAX_SLOTS:
        return _write_dynamic(x, new, start)
    return jax.lax.platform_dependent(x, new, start, tpu=_write_select, default=_write_dynamic)


def read_window(x: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """[R, size, ...]: positions ``start[r] .. start[r] + size - 1`` of each row r of ``x``
    [R, N, ...]; ``start`` int [R], each window inside the array (0 <= start[r] <= N - size).
    Exact (on TPU, but for the sign of a zero). On TPU, size <= `SELECT_MAX_SLOTS` is a one-hot
    select-and-sum over the N positions (see the comment above `SELECT_MAX_SLOTS`)."""
    if size > SELECT_MAX_SLOTS:
        return _read_dynamic(x, start, size)
    return jax.lax.platform_dependent(
        x,
        start,
        tpu=functools.partial(_read_select, size=size),
        default=functools.partial(_read_dynamic, size=size),
    )


def write_new(x: jax.Array, new: jax.Array, start: jax.Array | None) -> jax.Array:
    """The stacked cache array ``x`` [L, R, S, K, H] with a forward's new keys or values ``new``
    [L, R, T, K, H] written at slots ``start[r] .. start[r] + T - 1`` of each row r (every
    layer; each window inside the cache), or from slot 0 of every row where ``start`` is None.

    In place: XLA updates the buffer where it lies, so a step writes L x R x T slots and
    touches nothing else. Off TPU one scatter of the R x T windows [L, K, H] (an in-place loop
    over them on CPU, one kernel on GPU); on TPU one ``dynamic_update_slice`` per row (R small
    in-place writes: libtpu compiles a scatter or a vmapped dynamic slice into a serial row loop
    or relayout copies of the whole cache, jax-ml/jax#21367). Exact."""
    new = new.astype(x.dtype)
    if start is None:
        return jax.lax.dynamic_update_slice(x, new, (0,) * x.ndim)
    return jax.lax.platform_dependent(x, new, start, tpu=_write_rows, default=_write_scatter)


def write_cache(cache: KVCache, new: KVCache, start: jax.Array | None) -> KVCache:
    """``cache`` with the new keys and values ``new`` ({"k", "v"} [L, R, T, K, H]) written by
    `write_new`."""
    return {n: write_new(cache[n], new[n], start) for n in cache}


def _write_scatter(x, new, start):
    r, t = new.shape[1:3]
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], (r, t))
    slots = start[:, None] + jnp.arange(t)
    return x.at[:, rows, slots].set(
        new, indices_are_sorted=True, unique_indices=True, mode="promise_in_bounds"
    )


def _write_rows(x, new, start):
    zero = jnp.zeros((), jnp.int32)
    for r in range(new.shape[1]):
        at = (zero, jnp.int32(r), start[r].astype(jnp.int32), zero, zero)
        x = jax.lax.dynamic_update_slice(x, new[:, r : r + 1], at)
    return x


def init_cache(cfg, batch: int, slots: int, dtype: Any = None) -> KVCache:
    """Zeroed KV cache {"k", "v"} of the model of ``cfg`` (a `mars_jax.model.ModelConfig`), each
    [num_layers, batch, slots, K, H] ([L, R, S, K, H]) in the compute dtype (or ``dtype``),
    sharded by `CACHE_AXES` where a mesh and rules are active (see
    `mars_jax.sharding.with_logical_constraint`)."""
    shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return {n: with_logical_constraint(jnp.zeros(shape, dtype), CACHE_AXES) for n in ("k", "v")}
