"""Training objectives: next-token SFT (``ar``) and Mask AutoRegression (``mars``).

MARS (arXiv 2604.07023, Sec. 3) trains on ``[noisy | clean]`` inputs of length 2L: the noisy
half is the sequence with every labelled token replaced by ``<|mask|>``, the clean half is the
sequence; both halves use position ids 0..L-1. Attention: clean -> clean causal; noisy -> noisy
causal within a block of ``block_size`` positions; noisy -> clean only to earlier blocks.
Logits are right-shifted in both halves (the output at t-1 predicts token t), and

    loss = CE(noisy) + ar_weight * CE(clean),

each CE normalized per sequence and then over the batch ("sequence", the reference default) or
over all labelled tokens of the batch ("token"). ``ar_weight = 0`` is the paper's "no SFT loss"
ablation; the reference's trainer for it also weights each sequence's noisy CE by 1 / (t + 1e-6),
t ~ U(1e-3, 1) drawn per sequence (``noisy_weighting="inverse_t"``, see `noisy_row_weights`). Logits are computed only at the (at most ``max_label_tokens``) labelled positions of
each row, which is where all the loss is, and with ``ce_chunk_size`` a chunk of positions at a
time, so the logits over the vocabulary are never materialised for a whole micro-batch.

Packed batches (``data.packing``, `mars_jax.packing`) also hold ``positions`` and
``segment_ids`` int32 [R, L]: several rows per sequence, positions restarting in each. Both
objectives then attend within a row only (the mask of an unpacked row, and the same segment),
take no target across a row boundary, and normalise "sequence" per row, not per packed
sequence: the loss and gradients of a packed batch equal those of its rows unpacked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax import config
from mars_jax.attention import Segmented
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.model import CausalLM, causal_mask

# The batch key holding the per-row weights of "inverse_t" (float32 [R]; see `noisy_row_weights`).
NOISY_WEIGHT = "noisy_weight"


def mars_attention_mask(length: int, block_size: int) -> np.ndarray:
    """bool [1, 2L, 2L] mask of the ``[noisy | clean]`` layout (True = may attend); numpy, so
    attention kernels can read its block structure (`mars_jax.attention`)."""
    i = np.arange(2 * length)
    noisy, block = i < length, (i % length) // block_size
    pos = i % length
    nq, nk = noisy[:, None], noisy[None, :]
    causal = pos[None, :] <= pos[:, None]
    same_block = block[None, :] == block[:, None]
    earlier_block = block[None, :] < block[:, None]
    mask = (~nq & ~nk & causal) | (nq & nk & causal & same_block) | (nq & ~nk & earlier_block)
    return mask[None]


def mars_inputs(input_ids: jax.Array, labels: jax.Array, mask_id: int, positions=None):
    """``[noisy | clean]`` ids and position ids, both int32 [R, 2L], from ids/labels [R, L] and
    the position ids of one half (default 0..L-1; a packed batch's restart in every row)."""
    noisy = jnp.where(labels != IGNORE_INDEX, mask_id, input_ids)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    return (
        jnp.concatenate([noisy, input_ids], axis=1),
        jnp.concatenate([positions, positions], axis=1),
    )


def _next(x: jax.Array, fill: int) -> jax.Array:
    """``x`` [R, L] shifted left by one position, ``fill`` at the end."""
    return jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], fill)], axis=1)


def target_positions(labels: jax.Array, max_label_tokens: int | None, segment_ids=None):
    """Where the loss is: output positions whose next token is labelled (and, in a packed batch
    with ``segment_ids`` [R, L], of the same row).

    Returns (positions int32 [R, M], targets int32 [R, M], valid bool [R, M]) with
    M = ``max_label_tokens`` or L, in sequence order. The caller guarantees that no row has more
    than M labelled tokens (`mars_jax.batches.build_examples` checks this; `packing` for packed
    sequences).
    """
    shifted = _next(labels, IGNORE_INDEX)
    valid = shifted != IGNORE_INDEX
    if segment_ids is not None:
        valid &= _next(segment_ids, -1) == segment_ids
    k = labels.shape[1] if max_label_tokens is None else min(max_label_tokens, labels.shape[1])
    order = jnp.argsort(~valid, axis=1, stable=True)[:, :k]
    take = lambda x: jnp.take_along_axis(x, order, axis=1)
    return order, jnp.where(take(valid), take(shifted), 0), take(valid)


def loss_denominator(batch: dict[str, jax.Array], normalization: str) -> jax.Array:
    """What `cross_entropy` divides by for ``batch``'s labels [R, L]: the number of labelled
    targets ("token") or of rows with any ("sequence"; the packed rows of a packed batch);
    int32 scalar. Weighting micro-batch losses by their denominators reproduces the loss of the
    whole batch."""
    labels, segment_ids = batch["labels"], batch.get("segment_ids")
    if segment_ids is None:
        per_row = (labels[:, 1:] != IGNORE_INDEX).sum(axis=1)
        return per_row.sum() if normalization == "token" else (per_row > 0).sum()
    valid = (_next(labels, IGNORE_INDEX) != IGNORE_INDEX) & (_next(segment_ids, -1) == segment_ids)
    if normalization == "token":
        return valid.sum()
    counts = _segment_sums(valid.astype(jnp.int32), segment_ids)
    return (counts > 0).sum()


def _segment_sums(values: jax.Array, segments: jax.Array) -> jax.Array:
    """Sums of ``values`` [R, M] per (row, segment id) of ``segments`` [R, M] (ids ascending
    along each row, as packed rows lie in order): [R * M], one entry per segment (renumbered
    0, 1, ... within each row), zeros past them."""
    rows, m = segments.shape
    starts = jnp.concatenate(
        [jnp.zeros_like(segments[:, :1]), (segments[:, 1:] != segments[:, :-1]).astype(jnp.int32)],
        axis=1,
    )
    index = jnp.arange(rows)[:, None] * m + jnp.cumsum(starts, axis=1)
    return jax.ops.segment_sum(values.ravel(), index.ravel(), num_segments=rows * m)


def noisy_row_weights(seed: int, batch_index: int, batch_size: int) -> np.ndarray:
    """The "inverse_t" weights of the rows of training batch ``batch_index``: 1 / (t + 1e-6)
    with t ~ U(1e-3, 1) drawn independently per row (the weighting of the reference's no-SFT
    trainer). Drawn on the host from (``seed``, ``batch_index``) alone, so a resumed run and any
    split of the rows over processes see the same weights. fp32 [batch_size], in (0.99, 1000).
    """
    t = np.random.default_rng([seed, batch_index]).uniform(1e-3, 1.0, batch_size)
    return (1.0 / (t + 1e-6)).astype(np.float32)


def token_nll(model: CausalLM, h: jax.Array, targets: jax.Array, chunk_size: int = 0) -> jax.Array:
    """-log p(target) under ``model.logits(h)``: fp32 [R, M] for hidden states h [R, M, D] and
    targets int32 [R, M].

    With ``chunk_size`` > 0 the M positions are processed ``chunk_size`` at a time (``lax.map``)
    and each chunk's logits are recomputed in the backward pass (``jax.checkpoint``), so at most
    [R, chunk_size, V] logits exist at once instead of [R, M, V].
    """

    def nll(h, targets):
        logits = model.logits(h)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    rows, m = targets.shape
    if not chunk_size or chunk_size >= m:
        return nll(h, targets)
    n = -(-m // chunk_size)
    pad = n * chunk_size - m
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    chunks = lambda x: x.reshape(rows, n, chunk_size, *x.shape[2:]).swapaxes(0, 1)
    out = jax.lax.map(jax.checkpoint(lambda args: nll(*args)), (chunks(h), chunks(targets)))
    return out.swapaxes(0, 1).reshape(rows, n * chunk_size)[:, :m]


def cross_entropy(
    model: CausalLM,
    hidden: jax.Array,
    positions,
    targets,
    valid,
    normalization: str,
    chunk_size: int = 0,
    row_weights: jax.Array | None = None,
    segments: jax.Array | None = None,
):
    """Mean CE of ``targets`` given hidden states [R, T, D] gathered at ``positions`` [R, M].

    ``normalization``: "sequence" (mean over each row's tokens, then over rows that have any) or
    "token" (mean over all valid tokens). ``chunk_size``: see `token_nll`. ``row_weights``
    (fp32 [R], optional) multiply each row's token losses; the denominators stay unweighted.
    ``segments`` (int32 [R, M], packed batches): the segment of each target; "sequence" then
    means over each packed row's tokens. Returns an fp32 scalar.
    """
    h = jnp.take_along_axis(hidden, positions[..., None], axis=1)
    nll = jnp.where(valid, token_nll(model, h, targets, chunk_size), 0.0)
    if row_weights is not None:
        nll = nll * row_weights[:, None]
    counts = valid.sum(axis=1)
    if normalization == "token":
        return nll.sum() / jnp.maximum(counts.sum(), 1)
    if normalization == "sequence" and segments is not None:
        sums = _segment_sums(nll, segments)
        counts = _segment_sums(valid.astype(jnp.int32), segments)
        has = counts > 0
        per_row = sums / jnp.maximum(counts, 1)
        return jnp.where(has, per_row, 0.0).sum() / jnp.maximum(has.sum(), 1)
    if normalization == "sequence":
        has = counts > 0
        per_row = nll.sum(axis=1) / jnp.maximum(counts, 1)
        return jnp.where(has, per_row, 0.0).sum() / jnp.maximum(has.sum(), 1)
    raise ValueError(f"normalization must be one of {config.NORMALIZATIONS}, got {normalization!r}")


def ar_loss(model: CausalLM, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """Next-token SFT loss on the labelled tokens of ``batch`` ({input_ids, labels} int32 [R, L]).

    Reads ``obj``'s normalization, max_label_tokens and ce_chunk_size (`token_nll`). Returns
    (loss, metrics) with metrics {loss, clean_loss, label_tokens}.
    """
    ids, labels, segment_ids = batch["input_ids"], batch["labels"], batch.get("segment_ids")
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden, _ = model(ids, positions, _mask(causal_mask(ids.shape[1]), segment_ids))
    pos, tgt, valid = target_positions(labels, obj.max_label_tokens, segment_ids)
    loss = cross_entropy(
        model,
        hidden,
        pos,
        tgt,
        valid,
        obj.normalization,
        obj.ce_chunk_size,
        segments=_at(segment_ids, pos),
    )
    return loss, {"loss": loss, "clean_loss": loss, "label_tokens": valid.sum()}


def _mask(pattern: np.ndarray, segment_ids):
    """``pattern`` (an unpacked row's mask), within each row of a packed batch."""
    return pattern if segment_ids is None else Segmented(pattern, segment_ids)


def _at(segment_ids, positions):
    """The segment of each target position [R, M] (None when the batch is not packed)."""
    return None if segment_ids is None else jnp.take_along_axis(segment_ids, positions, axis=1)


def mars_loss(model: CausalLM, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """MARS loss CE(noisy) + ar_weight * CE(clean) (Sec. 3); reads ``obj``'s block_size,
    ar_weight, normalization, max_label_tokens, ce_chunk_size, mask_id and noisy_weighting.
    L must be a multiple of block_size.

    With ``noisy_weighting="inverse_t"`` the batch also holds ``batch[NOISY_WEIGHT]`` (fp32 [R],
    from `noisy_row_weights`) and each row's noisy CE is multiplied by its weight.

    Returns (loss, metrics) with metrics {loss, noisy_loss, clean_loss, label_tokens}.
    Raises ValueError when L is not a multiple of block_size or the weights are missing.
    """
    ids, labels, segment_ids = batch["input_ids"], batch["labels"], batch.get("segment_ids")
    length = ids.shape[1]
    if length % obj.block_size:
        raise ValueError(
            f"sequence length {length} is not a multiple of block_size {obj.block_size}"
        )
    ids2, positions2 = mars_inputs(ids, labels, obj.mask_id, batch.get("positions"))
    pattern = mars_attention_mask(length, obj.block_size)
    both = None if segment_ids is None else jnp.concatenate([segment_ids, segment_ids], axis=1)
    hidden, _ = model(ids2, positions2, _mask(pattern, both))
    pos, tgt, valid = target_positions(labels, obj.max_label_tokens, segment_ids)
    weights = None
    if obj.noisy_weighting == "inverse_t":
        if NOISY_WEIGHT not in batch:
            raise ValueError(f'noisy_weighting "inverse_t" needs batch["{NOISY_WEIGHT}"]')
        weights = batch[NOISY_WEIGHT]
    segments = _at(segment_ids, pos)
    ce = lambda h, w=None: cross_entropy(
        model, h, pos, tgt, valid, obj.normalization, obj.ce_chunk_size, w, segments
    )
    noisy, clean = ce(hidden[:, :length], weights), ce(hidden[:, length:])
    loss = noisy + obj.ar_weight * clean
    return loss, {
        "loss": loss,
        "noisy_loss": noisy,
        "clean_loss": clean,
        "label_tokens": valid.sum(),
    }


OBJECTIVES = {"ar": ar_loss, "mars": mars_loss}


def loss_fn(model: CausalLM, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """Dispatches on ``obj.name`` ("ar" or "mars"; `config.ObjectiveConfig` checks its values
    when it is built); returns (scalar loss, metrics dict)."""
    return OBJECTIVES[obj.name](model, batch, obj)
