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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax import config
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.model import Qwen2, causal_mask

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


def mars_inputs(input_ids: jax.Array, labels: jax.Array, mask_id: int):
    """``[noisy | clean]`` ids and position ids, both int32 [R, 2L], from ids/labels [R, L]."""
    noisy = jnp.where(labels != IGNORE_INDEX, mask_id, input_ids)
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    return (
        jnp.concatenate([noisy, input_ids], axis=1),
        jnp.concatenate([positions, positions], axis=1),
    )


def target_positions(labels: jax.Array, max_label_tokens: int | None):
    """Where the loss is: output positions whose next token is labelled.

    Returns (positions int32 [R, M], targets int32 [R, M], valid bool [R, M]) with
    M = ``max_label_tokens`` or L, in sequence order. The caller guarantees that no row has more
    than M labelled tokens (`mars_jax.batches.build_examples` checks this).
    """
    shifted = jnp.concatenate([labels[:, 1:], jnp.full_like(labels[:, :1], IGNORE_INDEX)], axis=1)
    valid = shifted != IGNORE_INDEX
    k = labels.shape[1] if max_label_tokens is None else min(max_label_tokens, labels.shape[1])
    order = jnp.argsort(~valid, axis=1, stable=True)[:, :k]
    take = lambda x: jnp.take_along_axis(x, order, axis=1)
    return order, jnp.where(take(valid), take(shifted), 0), take(valid)


def loss_denominator(labels: jax.Array, normalization: str) -> jax.Array:
    """What `cross_entropy` divides by for ``labels`` [R, L]: the number of labelled targets
    ("token") or of rows with any ("sequence"); int32 scalar. Weighting micro-batch losses by
    their denominators reproduces the loss of the whole batch."""
    per_row = (labels[:, 1:] != IGNORE_INDEX).sum(axis=1)
    return per_row.sum() if normalization == "token" else (per_row > 0).sum()


def noisy_row_weights(seed: int, batch_index: int, batch_size: int) -> np.ndarray:
    """The "inverse_t" weights of the rows of training batch ``batch_index``: 1 / (t + 1e-6)
    with t ~ U(1e-3, 1) drawn independently per row (the weighting of the reference's no-SFT
    trainer). Drawn on the host from (``seed``, ``batch_index``) alone, so a resumed run and any
    split of the rows over processes see the same weights. fp32 [batch_size], in (0.99, 1000).
    """
    t = np.random.default_rng([seed, batch_index]).uniform(1e-3, 1.0, batch_size)
    return (1.0 / (t + 1e-6)).astype(np.float32)


def token_nll(model: Qwen2, h: jax.Array, targets: jax.Array, chunk_size: int = 0) -> jax.Array:
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
    model: Qwen2,
    hidden: jax.Array,
    positions,
    targets,
    valid,
    normalization: str,
    chunk_size: int = 0,
    row_weights: jax.Array | None = None,
):
    """Mean CE of ``targets`` given hidden states [R, T, D] gathered at ``positions`` [R, M].

    ``normalization``: "sequence" (mean over each row's tokens, then over rows that have any) or
    "token" (mean over all valid tokens). ``chunk_size``: see `token_nll`. ``row_weights``
    (fp32 [R], optional) multiply each row's token losses; the denominators stay unweighted.
    Returns an fp32 scalar.
    """
    h = jnp.take_along_axis(hidden, positions[..., None], axis=1)
    nll = jnp.where(valid, token_nll(model, h, targets, chunk_size), 0.0)
    if row_weights is not None:
        nll = nll * row_weights[:, None]
    counts = valid.sum(axis=1)
    if normalization == "token":
        return nll.sum() / jnp.maximum(counts.sum(), 1)
    if normalization == "sequence":
        has = counts > 0
        per_row = nll.sum(axis=1) / jnp.maximum(counts, 1)
        return jnp.where(has, per_row, 0.0).sum() / jnp.maximum(has.sum(), 1)
    raise ValueError(f"normalization must be one of {config.NORMALIZATIONS}, got {normalization!r}")


def ar_loss(model: Qwen2, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """Next-token SFT loss on the labelled tokens of ``batch`` ({input_ids, labels} int32 [R, L]).

    Reads ``obj``'s normalization, max_label_tokens and ce_chunk_size (`token_nll`). Returns
    (loss, metrics) with metrics {loss, clean_loss, label_tokens}.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden, _ = model(ids, positions, causal_mask(ids.shape[1]))
    pos, tgt, valid = target_positions(labels, obj.max_label_tokens)
    loss = cross_entropy(model, hidden, pos, tgt, valid, obj.normalization, obj.ce_chunk_size)
    return loss, {"loss": loss, "clean_loss": loss, "label_tokens": valid.sum()}


def mars_loss(model: Qwen2, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """MARS loss CE(noisy) + ar_weight * CE(clean) (Sec. 3); reads ``obj``'s block_size,
    ar_weight, normalization, max_label_tokens, ce_chunk_size, mask_id and noisy_weighting.
    L must be a multiple of block_size.

    With ``noisy_weighting="inverse_t"`` the batch also holds ``batch[NOISY_WEIGHT]`` (fp32 [R],
    from `noisy_row_weights`) and each row's noisy CE is multiplied by its weight.

    Returns (loss, metrics) with metrics {loss, noisy_loss, clean_loss, label_tokens}.
    Raises ValueError when L is not a multiple of block_size or the weights are missing.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    length = ids.shape[1]
    if length % obj.block_size:
        raise ValueError(
            f"sequence length {length} is not a multiple of block_size {obj.block_size}"
        )
    ids2, positions2 = mars_inputs(ids, labels, obj.mask_id)
    hidden, _ = model(ids2, positions2, mars_attention_mask(length, obj.block_size))
    pos, tgt, valid = target_positions(labels, obj.max_label_tokens)
    weights = None
    if obj.noisy_weighting == "inverse_t":
        if NOISY_WEIGHT not in batch:
            raise ValueError(f'noisy_weighting "inverse_t" needs batch["{NOISY_WEIGHT}"]')
        weights = batch[NOISY_WEIGHT]
    ce = lambda h, w=None: cross_entropy(
        model, h, pos, tgt, valid, obj.normalization, obj.ce_chunk_size, w
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


def loss_fn(model: Qwen2, batch: dict[str, jax.Array], obj: config.ObjectiveConfig):
    """Dispatches on ``obj.name`` ("ar" or "mars"; `config.ObjectiveConfig` checks its values
    when it is built); returns (scalar loss, metrics dict)."""
    return OBJECTIVES[obj.name](model, batch, obj)
