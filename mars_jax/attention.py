"""Attention implementations for grouped-query attention under an arbitrary boolean mask.

`attend` computes softmax(q k^T / sqrt(H)) v where the mask allows, with fp32 scores and
softmax, by one of `IMPLEMENTATIONS` (``ModelConfig.attention``):

- "xla": ``jax.nn.dot_product_attention`` over the dense mask (any backend). Its backward pass
  keeps fp32 scores [R, N, T, S]: for the MARS layout (T = S = 2L) the dominant training
  activation (about 1.3 GiB per row for Qwen2.5-0.5B at L = 512).
- "chunked": the same arithmetic a block of ``QUERY_CHUNK`` queries at a time (``lax.map``),
  each block rematerialised in the backward pass, so at most [R, N, QUERY_CHUNK, S] scores
  exist at once (any backend; the portable memory-saving path).
- "splash": the Pallas TPU splash-attention kernel (``jax.experimental.pallas.ops.tpu``), which
  skips the blocks the mask rules out; the mask must be a concrete numpy array (the MARS and
  causal masks of `mars_jax.objectives` are), since a traced mask cannot be analysed into
  block sparsity. Under a mesh it runs inside ``shard_map`` (rows and heads split as the
  logical rules say). ``interpret=True`` runs it on CPU (tests).
- "cudnn": cuDNN's fused attention through ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` (NVIDIA GPUs only; not exercised on CPU).

Decoding attends with `attend_cache` instead: a window of new positions sees itself (causally)
and the KV cache's slots before it, read ``CACHE_CHUNK`` slots at a time up to the longest live
row (an online softmax), so a step costs what the rows hold, not the slots allocated.

Packed sequences (several rows in one, `mars_jax.packing`) pass a `Segmented` mask: a static
pattern and segment ids, a query attending only to keys of its own segment; splash takes the
segment ids as its kernel's ``SegmentIds``, the other implementations fold them into the mask.

Shapes: R rows, T queries, S keys, N query heads, K KV heads (N % K == 0), H head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.core.spmd
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mars_jax.errors import InputError

IMPLEMENTATIONS = ("xla", "chunked", "splash", "cudnn")
QUERY_CHUNK = 128  # queries per block of the "chunked" implementation


class Segmented(NamedTuple):
    """A self-attention mask of packed sequences: query t may attend to key s where the static
    ``pattern`` (numpy bool [T, S] or [1, T, S], as for an unpacked row) allows it and both lie
    in the same segment: ``segment_ids`` int32 [R, T] (T == S), one id per packed row (padding
    its own segment)."""

    pattern: np.ndarray
    segment_ids: jax.Array

    def dense(self) -> jax.Array:
        """The mask as bool [R, T, S]."""
        same = self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        return jnp.asarray(self.pattern).reshape(self.pattern.shape[-2:])[None] & same


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask,
    implementation: str = "xla",
    *,
    interpret: bool = False,
) -> jax.Array:
    """Grouped-query attention: q [R, T, N, H], k and v [R, S, K, H] -> [R, T, N, H] in q's dtype.

    ``mask``: bool, broadcastable to [R, T, S], True where query t may attend to key s; for
    "splash" a numpy array [T, S] or [1, T, S] (the same pattern for every row and head); or a
    `Segmented` mask (packed sequences). Every query must be allowed at least one key.

    Raises ValueError for an unknown implementation, or "splash" with a traced or per-row mask.
    """
    if implementation == "splash":
        return _splash(q, k, v, mask, interpret=interpret)
    if isinstance(mask, Segmented):
        mask = mask.dense()
    if implementation == "xla":
        return _dense(q, k, v, mask)
    if implementation == "chunked":
        return _chunked(q, k, v, mask)
    if implementation == "cudnn":
        return _dense(q, k, v, mask, fused="cudnn")
    raise InputError(
        f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
    )


def _dense(q, k, v, mask, fused: str | None = None):
    """``jax.nn.dot_product_attention`` over the mask broadcast to [R, 1, T, S]; ``fused`` is its
    ``implementation`` (None: XLA)."""
    r, t, s = q.shape[0], q.shape[1], k.shape[1]
    full = jnp.broadcast_to(jnp.asarray(mask), (r, t, s))[:, None]
    return jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=full, implementation=fused
    )


def _chunked(q, k, v, mask):
    """`_dense` over blocks of QUERY_CHUNK queries (the last block padded), each block
    recomputed in the backward pass."""
    r, t, n, h = q.shape
    s = k.shape[1]
    if t <= QUERY_CHUNK:
        return _dense(q, k, v, mask)
    blocks = -(-t // QUERY_CHUNK)
    pad = blocks * QUERY_CHUNK - t
    full = jnp.broadcast_to(jnp.asarray(mask), (r, t, s))
    # Padded queries attend to key 0 only (a valid softmax); their outputs are dropped.
    full = jnp.pad(full, ((0, 0), (0, pad), (0, 0)))
    full = full.at[:, t:, 0].set(True) if pad else full
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    split = lambda x: x.reshape(r, blocks, QUERY_CHUNK, *x.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def block(args):
        qb, mb = args
        return _dense(qb, k, v, mb)

    out = jax.lax.map(block, (split(qp), split(full)))  # [blocks, R, QUERY_CHUNK, N, H]
    return out.swapaxes(0, 1).reshape(r, blocks * QUERY_CHUNK, n, h)[:, :t]


# Slots per chunk of `attend_cache`: the work past a batch's longest live row is under a chunk.
CACHE_CHUNK = 128


def attend_cache(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_k: jax.Array | None,
    cache_v: jax.Array | None,
    layer: jax.Array | int,
    cached: jax.Array | None,
    chunk: int = CACHE_CHUNK,
) -> jax.Array:
    """Grouped-query attention of a window of T new positions against itself and the KV cache:
    q [R, T, N, H] and the window's own keys and values k, v [R, T, K, H]; query t of row r
    attends to window keys 0..t (causal) and to slots 0 .. cached[r] - 1 of layer ``layer`` of
    the stacked cache cache_k, cache_v [L, R, S, K, H] (``cached`` int32 [R]: the slots before
    the window; None, or no cache: the window alone, a prefill). -> [R, T, N, H] in q's dtype.

    The cache is only read: ``chunk`` slots at a time up to the batch's largest ``cached`` (a
    ``while`` loop of ceil(max(cached) / chunk) trips; the last chunk of a cache whose S is not a
    multiple ends at S, the slots it repeats masked out), with an online softmax (fp32 scores,
    running max and sum) that starts from the window's scores. Nothing past the longest live row
    is read, no slice of the cache's size is made, and the caller writes the window's keys and
    values afterwards (`mars_jax.kv_cache.write_new`). The same arithmetic as `attend`'s "xla"
    path (keys and values in q's dtype, the scale after the product, probabilities cast to q's
    dtype) but for the order of the softmax's sums.
    """
    r, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    qg = q.reshape(r, t, kv, g, h)
    scale = jnp.float32(h**-0.5)
    neg = jnp.finfo(jnp.float32).min

    def part(keys, values, ok, m, l, acc):
        """The online softmax's state after keys, values [R, C, K, H] where ok [R, T, C]."""
        scores = jnp.einsum(
            "rtkgh,rckh->rkgtc", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32
        )
        ok = ok[:, None, None]  # [R, 1, 1, T, C]
        scores = jnp.where(ok, scores * scale, neg)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum(
            "rkgtc,rckh->rkgth",
            p.astype(q.dtype),
            values.astype(q.dtype),
            preferred_element_type=jnp.float32,
        )
        return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (r, t, t))
    m, l, acc = part(
        k,
        v,
        causal,
        jnp.full((r, kv, g, t), neg, jnp.float32),
        jnp.zeros((r, kv, g, t), jnp.float32),
        jnp.zeros((r, kv, g, t, h), jnp.float32),
    )
    if cache_k is not None and cached is not None:
        s = cache_k.shape[2]
        c = min(chunk, s)
        layer = jnp.asarray(layer, jnp.int32)
        zero = jnp.zeros((), jnp.int32)

        def body(i, carry):
            first = jnp.minimum(i * c, s - c)
            at = (layer, zero, first, zero, zero)
            keys = jax.lax.dynamic_slice(cache_k, at, (1, r, c, kv, h))[0]  # [R, C, K, H]
            values = jax.lax.dynamic_slice(cache_v, at, (1, r, c, kv, h))[0]
            slot = first + jnp.arange(c)
            ok = (slot >= i * c)[None, :] & (slot[None, :] < cached[:, None])  # [R, C]
            return part(keys, values, jnp.broadcast_to(ok[:, None], (r, t, c)), *carry)

        trips = (jnp.max(cached) + c - 1) // c
        m, l, acc = jax.lax.fori_loop(0, trips, body, (m, l, acc))
    out = acc / l[..., None]  # [R, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(r, t, n, h).astype(q.dtype)


SPLASH_BLOCK = 128  # the kernel's default tiles: 128 queries x 128 keys


def _static_mask(mask) -> np.ndarray:
    """The [T, S] numpy pattern of a splash mask, or ValueError."""
    if not isinstance(mask, np.ndarray):
        raise InputError(
            "attention 'splash' needs a concrete numpy mask (the same for every row), got a "
            f"{type(mask).__name__}; use 'xla' or 'chunked' for traced masks"
        )
    if mask.ndim == 3 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.ndim != 2:
        raise InputError(f"attention 'splash' needs a [T, S] mask, got shape {mask.shape}")
    if mask.shape[0] % SPLASH_BLOCK or mask.shape[1] % SPLASH_BLOCK:
        raise InputError(
            f"attention 'splash' needs query and key lengths that are multiples of "
            f"{SPLASH_BLOCK}, got {mask.shape} (MARS trains on 2 x data.max_length positions)"
        )
    return mask.astype(bool)


@functools.lru_cache(maxsize=32)
def _splash_kernel(mask_bytes: bytes, shape: tuple[int, int], group: int, interpret: bool):
    """The splash MQA kernel for one KV head and its ``group`` query heads (cached by mask)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    pattern = np.frombuffer(mask_bytes, dtype=bool).reshape(shape)
    heads = mask_lib.MultiHeadMask([mask_lib.NumpyMask(pattern)] * group)
    with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
        return kernel_lib.make_splash_mqa(heads, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q, k, v, mask, *, interpret: bool):
    segment_ids = mask.segment_ids if isinstance(mask, Segmented) else None
    pattern = _static_mask(mask.pattern if segment_ids is not None else mask)
    r, t, n, h = q.shape
    kv = k.shape[2]

    def local(q, k, v, segment_ids=None):
        # One kernel call per (row, KV head): q [N/K, T, H], k and v [S, H].
        kernel = _splash_kernel(pattern.tobytes(), pattern.shape, n // kv, interpret)
        rows, heads = q.shape[0], k.shape[2]
        qg = q.reshape(rows, t, heads, n // kv, h).transpose(0, 2, 3, 1, 4) * (h**-0.5)
        kg, vg = (x.astype(q.dtype).transpose(0, 2, 1, 3) for x in (k, v))
        if segment_ids is None:
            out = jax.vmap(jax.vmap(kernel))(qg, kg, vg)  # [rows, heads, N/K, T, H]
        else:  # a row's segment ids, the same for each of its KV heads

            def row(q, k, v, ids):
                segments = _segment_ids(ids)
                return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=segments))(q, k, v)

            out = jax.vmap(row)(qg, kg, vg, segment_ids)
        return out.transpose(0, 3, 1, 2, 4).reshape(rows, t, heads * (n // kv), h).astype(q.dtype)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    if jax.sharding.get_abstract_mesh().empty:
        return local(*args)
    rules = dict(flax.core.spmd.get_logical_axis_rules())
    batch, heads, kv_heads = rules.get("batch"), rules.get("heads"), rules.get("kv_heads")
    specs = (
        P(batch, None, heads, None),
        P(batch, None, kv_heads, None),
        P(batch, None, kv_heads, None),
        P(batch, None),
    )
    return jax.shard_map(
        local,
        in_specs=specs[: len(args)],
        out_specs=P(batch, None, heads, None),
        check_vma=False,
    )(*args)


def _segment_ids(ids: jax.Array):
    """The splash kernel's ``SegmentIds`` of one row's self-attention: ids [T] for both."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    return kernel_lib.SegmentIds(q=ids, kv=ids)
