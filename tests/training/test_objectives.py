"""MARS / AR objectives, checked against what they mean rather than how they are written.

The MARS forward over ``[noisy | clean]`` must give, at noisy position j, exactly what a plain
causal model computes when it reads the clean tokens of all blocks before j's block followed by
the noisy (masked) tokens of j's block up to j; the clean half must be a plain causal forward.
Losses are checked against straightforward references on full-vocabulary logits (and against
transformers' own loss for the AR objective).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from mars_jax import huggingface
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.config import ObjectiveConfig
from mars_jax.model import causal_mask
from mars_jax.objectives import (
    NOISY_WEIGHT,
    ar_loss,
    cross_entropy,
    loss_fn,
    mars_attention_mask,
    mars_inputs,
    mars_loss,
    noisy_row_weights,
    target_positions,
)
from tests.helpers import TINY, save_hf

V = TINY["vocab_size"]
MASK_ID, EOS_ID, PAD_ID = V - 1, V - 2, V - 3


def obj_cfg(
    name="mars",
    block_size=4,
    ar_weight=1.0,
    normalization="sequence",
    max_label_tokens=None,
    ce_chunk_size=0,
    noisy_weighting="none",
):
    return ObjectiveConfig(
        name=name,
        block_size=block_size,
        ar_weight=ar_weight,
        normalization=normalization,
        max_label_tokens=max_label_tokens,
        mask_id=MASK_ID,
        ce_chunk_size=ce_chunk_size,
        noisy_weighting=noisy_weighting,
    )


def make_batch(seed, block, shapes, length=None):
    """Rows like `mars_jax.batches` builds them: prompt (IGNORE) + labelled answer + labelled EOS up
    to a multiple of ``block``; then batch padding (PAD, IGNORE) to a common length L.

    ``shapes``: (prompt length, answer length) per row; answer length 0 gives an unlabelled row.
    ``length`` defaults to one block more than the longest row.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for p, a in shapes:
        ids = rng.integers(0, V - 3, p + a)
        labels = np.concatenate([np.full(p, IGNORE_INDEX), ids[p:]])
        pad = -(p + a) % block if a else 0
        rows.append(
            (
                np.concatenate([ids, np.full(pad, EOS_ID)]),
                np.concatenate([labels, np.full(pad, EOS_ID)]),
            )
        )
    longest = max(len(i) for i, _ in rows)
    length = length or (-(-longest // block) + 1) * block
    assert length >= longest and length % block == 0
    input_ids = np.full((len(rows), length), PAD_ID)
    labels = np.full((len(rows), length), IGNORE_INDEX)
    for r, (i, l) in enumerate(rows):
        input_ids[r, : len(i)], labels[r, : len(l)] = i, l
    return {
        "input_ids": jnp.asarray(input_ids, jnp.int32),
        "labels": jnp.asarray(labels, jnp.int32),
    }


def forward(model, ids, pos, mask):
    return model(ids, pos, mask)[0]


forward_jit = nnx.jit(forward)  # a handful of shapes only: compiled once each


def causal_forward(model, ids, fwd=forward_jit):
    ids = jnp.asarray(ids, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return fwd(model, ids, pos, causal_mask(ids.shape[1]))


REF_ROWS = 64  # reference batches are padded to this many rows (one compiled shape)


def reference_noisy_hidden(model, batch, block, fwd=forward_jit):
    """Noisy-stream hidden states from plain causal forwards: for block b, the sequence
    clean[:bB] + noisy[bB:] (causal, so outputs at bB..(b+1)B-1 see only noisy tokens up to
    themselves and clean tokens of earlier blocks)."""
    ids, labels = batch["input_ids"], batch["labels"]
    noisy = jnp.where(labels != IGNORE_INDEX, MASK_ID, ids)
    rows, length = ids.shape
    nb = length // block
    col = jnp.arange(length)
    seqs = jnp.concatenate(
        [jnp.where(col[None] < b * block, ids, noisy) for b in range(nb)], axis=0
    )  # [nb * rows, L]
    assert nb * rows <= REF_ROWS
    seqs = jnp.pad(seqs, ((0, REF_ROWS - nb * rows), (0, 0)))
    out = causal_forward(model, seqs, fwd)[: nb * rows].reshape(nb, rows, length, -1)
    return jnp.concatenate([out[b, :, b * block : (b + 1) * block] for b in range(nb)], axis=1)


def mars_hidden(model, batch, block):
    length = batch["input_ids"].shape[1]
    ids2, pos2 = mars_inputs(batch["input_ids"], batch["labels"], MASK_ID)
    hidden = forward_jit(model, ids2, pos2, mars_attention_mask(length, block))
    return hidden[:, :length], hidden[:, length:]


def reference_ce(model, hidden, labels, normalization, xp=np, row_weights=None):
    """Right-shifted CE over labelled tokens from full logits: output t predicts labels[t+1];
    ``row_weights`` [R] scale each row's token losses (not the counts)."""
    logits = model.logits(hidden)[:, :-1]
    targets = labels[:, 1:]
    if xp is np:
        logits, targets = np.asarray(logits, np.float64), np.asarray(targets)
    valid = targets != IGNORE_INDEX
    top = logits.max(-1, keepdims=True)
    logp = logits - top - xp.log(xp.exp(logits - top).sum(-1, keepdims=True))
    nll = -xp.take_along_axis(logp, xp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    nll = xp.where(valid, nll, 0.0)
    if row_weights is not None:
        nll = nll * xp.asarray(row_weights)[:, None]
    if normalization == "token":
        return nll.sum() / valid.sum()
    counts = valid.sum(1)
    has = counts > 0
    per_row = nll.sum(1) / xp.maximum(counts, 1)
    return xp.where(has, per_row, 0.0).sum() / has.sum()


@pytest.fixture(scope="module")
def hf_models(tied_ckpt, tmp_path_factory):
    """transformers models: tied Qwen2, Qwen3 and Llama 3 (tests.helpers.FAMILY_CONFIGS)."""
    out = {"tied": tied_ckpt}
    for family in ("qwen3", "llama"):
        path = tmp_path_factory.mktemp(f"objectives_{family}")
        out[family] = (path, save_hf(path, seed=21, family=family))
    return out


@pytest.fixture(scope="module")
def models(hf_models, untied_ckpt):
    return {
        **{name: huggingface.load_hf(str(path)) for name, (path, _) in hf_models.items()},
        "untied": huggingface.load_hf(str(untied_ckpt[0])),
    }


# Prompt + answer lengths: a multiple of every block size (16), of 2 and 4 only (12), of none.
SHAPES = [(3, 4), (5, 8), (2, 7), (6, 10), (1, 11)]


@pytest.mark.parametrize("block", [2, 4, 8])
@pytest.mark.parametrize("which", ["tied", "untied", "qwen3", "llama"])
def test_mars_attention_means_blockwise_denoising(models, which, block):
    model = models[which]
    batch = make_batch(block, block, SHAPES, length=24)
    noisy_h, clean_h = mars_hidden(model, batch, block)
    ref_noisy = reference_noisy_hidden(model, batch, block)
    labelled = np.asarray(batch["labels"] != IGNORE_INDEX)
    assert labelled.sum() > 20
    # Every labelled position (and, by the same definition, every other one).
    np.testing.assert_allclose(
        np.asarray(noisy_h)[labelled], np.asarray(ref_noisy)[labelled], rtol=0, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(noisy_h), np.asarray(ref_noisy), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(clean_h),
        np.asarray(causal_forward(model, batch["input_ids"])),
        rtol=0,
        atol=1e-5,
    )
    # Non-trivial: masks really change the labelled positions, and the clean context of earlier
    # blocks is really used (a causal pass over the all-noisy sequence differs).
    assert np.abs(np.asarray(noisy_h - clean_h))[labelled].max() > 0.1
    all_noisy = causal_forward(
        model, jnp.where(batch["labels"] != IGNORE_INDEX, MASK_ID, batch["input_ids"])
    )
    late = labelled & (np.arange(labelled.shape[1]) >= block)[None]
    assert np.abs(np.asarray(noisy_h - all_noisy))[late].max() > 0.1


def test_mars_inputs_layout():
    batch = make_batch(0, 4, [(3, 5), (6, 2)])
    ids2, pos2 = mars_inputs(batch["input_ids"], batch["labels"], MASK_ID)
    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
    length = ids.shape[1]
    np.testing.assert_array_equal(np.asarray(ids2[:, length:]), ids)
    noisy = np.asarray(ids2[:, :length])
    np.testing.assert_array_equal(noisy[labels != IGNORE_INDEX], MASK_ID)
    np.testing.assert_array_equal(noisy[labels == IGNORE_INDEX], ids[labels == IGNORE_INDEX])
    np.testing.assert_array_equal(np.asarray(pos2), np.tile(np.arange(length), (2, 2)))


@pytest.fixture(scope="module")
def loss_setup(models):
    """A block-4 batch whose rows have different label counts (one has none), with reference
    hidden states computed independently of the MARS mask."""
    model, block = models["tied"], 4
    batch = make_batch(11, block, [(2, 3), (4, 13), (3, 0), (1, 6), (6, 2)], length=24)
    counts = (np.asarray(batch["labels"])[:, 1:] != IGNORE_INDEX).sum(1)
    assert len(set(counts.tolist())) == 5 and 0 in counts
    noisy_h = reference_noisy_hidden(model, batch, block)
    clean_h = causal_forward(model, batch["input_ids"])
    return model, batch, block, noisy_h, clean_h


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("ar_weight", [1.0, 0.5, 0.0])
def test_mars_loss_decomposition(loss_setup, ar_weight, normalization):
    model, batch, block, noisy_h, clean_h = loss_setup
    labels = batch["labels"]
    noisy = reference_ce(model, noisy_h, labels, normalization)
    clean = reference_ce(model, clean_h, labels, normalization)
    loss, metrics = mars_loss(
        model, batch, obj_cfg(block_size=block, ar_weight=ar_weight, normalization=normalization)
    )
    np.testing.assert_allclose(float(metrics["noisy_loss"]), noisy, rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(metrics["clean_loss"]), clean, rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(loss), noisy + ar_weight * clean, rtol=0, atol=1e-5)
    assert float(metrics["loss"]) == float(loss)
    assert int(metrics["label_tokens"]) == int((np.asarray(labels)[:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_inverse_t_weighting_scales_each_rows_noisy_ce(loss_setup, normalization):
    """The no-SFT trainer's weighting: row r's noisy CE times 1 / (t_r + 1e-6); the clean CE
    is untouched; t ~ U(1e-3, 1) per row."""
    model, batch, block, noisy_h, clean_h = loss_setup
    labels = batch["labels"]
    rows = labels.shape[0]
    weights = noisy_row_weights(3, 7, rows)
    assert not np.array_equal(weights, noisy_row_weights(3, 8, rows))  # fresh t every batch
    t = 1.0 / np.asarray(weights, np.float64) - 1e-6
    assert np.all((t >= 1e-3 - 1e-6) & (t <= 1.0 + 1e-6)) and len(set(t.round(6))) == rows
    cfg = obj_cfg(
        block_size=block, ar_weight=0.0, normalization=normalization, noisy_weighting="inverse_t"
    )
    loss, metrics = mars_loss(model, {**batch, NOISY_WEIGHT: weights}, cfg)
    expected = reference_ce(model, noisy_h, labels, normalization, row_weights=weights)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    unweighted = reference_ce(model, noisy_h, labels, normalization)
    assert abs(expected - unweighted) > 1e-2  # the weights matter on this batch
    np.testing.assert_allclose(
        float(metrics["clean_loss"]), reference_ce(model, clean_h, labels, normalization), atol=1e-5
    )
    with pytest.raises(ValueError, match=NOISY_WEIGHT):
        mars_loss(model, batch, cfg)


def test_normalizations_differ_as_documented(loss_setup):
    """Hand computation on per-token NLLs: "sequence" averages per row then over rows that have
    labels (the unlabelled row does not count); "token" averages over all labelled tokens."""
    model, batch, block, _, clean_h = loss_setup
    labels = np.asarray(batch["labels"])
    logits = np.asarray(model.logits(clean_h), np.float64)
    per_row = []
    for r in range(labels.shape[0]):
        nlls = []
        for t in range(labels.shape[1] - 1):
            if labels[r, t + 1] != IGNORE_INDEX:
                z = logits[r, t]
                nlls.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[labels[r, t + 1]])
        per_row.append(nlls)
    assert sorted(len(n) for n in per_row)[0] == 0
    seq = np.mean([np.mean(n) for n in per_row if n])
    tok = np.sum([np.sum(n) for n in per_row]) / sum(len(n) for n in per_row)
    assert abs(seq - tok) > 1e-3
    for norm, expected in [("sequence", seq), ("token", tok)]:
        for fn in (ar_loss, mars_loss):
            _, m = fn(model, batch, obj_cfg(block_size=block, normalization=norm))
            np.testing.assert_allclose(float(m["clean_loss"]), expected, rtol=0, atol=1e-5)


def test_ar_weight_zero_gradient_is_noisy_ce_gradient(loss_setup):
    model, batch, block, _, _ = loss_setup
    graphdef, params = nnx.split(model, nnx.Param)

    def ours(p, w):
        return mars_loss(nnx.merge(graphdef, p), batch, obj_cfg(block_size=block, ar_weight=w))[0]

    def ref_noisy(p):
        m = nnx.merge(graphdef, p)
        h = reference_noisy_hidden(m, batch, block, fwd=forward)
        return reference_ce(m, h, batch["labels"], "sequence", xp=jnp)

    grad_ours = jax.jit(jax.grad(ours))
    g0, g1 = grad_ours(params, 0.0), grad_ours(params, 1.0)
    gref = jax.jit(jax.grad(ref_noisy))(params)
    l0, lr = jax.tree.leaves(g0), jax.tree.leaves(gref)
    scale = max(float(jnp.abs(x).max()) for x in lr)
    assert scale > 1e-3
    for a, b in zip(l0, lr):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * max(1.0, scale)
        )
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1), lr))
    assert diff > 1e-3  # with ar_weight 1 the clean CE contributes


def test_max_label_tokens_covering_all_labels_changes_nothing(loss_setup):
    model, batch, block, _, _ = loss_setup
    labels = np.asarray(batch["labels"])
    most = int((labels[:, 1:] != IGNORE_INDEX).sum(1).max())
    assert most < labels.shape[1]
    for norm in ("sequence", "token"):
        full, m_full = mars_loss(model, batch, obj_cfg(block_size=block, normalization=norm))
        for k in (most, most + 3):
            cut, m_cut = mars_loss(
                model, batch, obj_cfg(block_size=block, normalization=norm, max_label_tokens=k)
            )
            np.testing.assert_allclose(float(cut), float(full), rtol=0, atol=1e-6)
            assert int(m_cut["label_tokens"]) == int(m_full["label_tokens"])
        ar_full, _ = ar_loss(model, batch, obj_cfg(name="ar", normalization=norm))
        ar_cut, _ = ar_loss(
            model, batch, obj_cfg(name="ar", normalization=norm, max_label_tokens=most)
        )
        np.testing.assert_allclose(float(ar_cut), float(ar_full), rtol=0, atol=1e-6)


def test_target_positions():
    labels = jnp.array(
        [
            [IGNORE_INDEX, IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7],
            [IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
        ]
    )
    pos, tgt, valid = target_positions(labels, 4)
    assert pos.shape == tgt.shape == valid.shape == (2, 4)
    # Output t predicts labels[t + 1]: row 0 positions 1, 2, 4 -> 5, 6, 7; row 1 position 0 -> 9.
    np.testing.assert_array_equal(np.asarray(valid), [[1, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(pos)[np.asarray(valid)], [1, 2, 4, 0])
    np.testing.assert_array_equal(np.asarray(tgt)[np.asarray(valid)], [5, 6, 7, 9])


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("which", ["tied", "qwen3", "llama"])
def test_ar_loss_equals_transformers_shifted_ce(hf_models, models, normalization, which):
    _, hf = hf_models[which]
    model = models[which]
    batch = make_batch(5, 4, [(3, 6), (2, 12), (5, 2), (1, 9), (4, 4)], length=24)
    ids = torch.tensor(np.asarray(batch["input_ids"]), dtype=torch.long)
    labels = torch.tensor(np.asarray(batch["labels"]), dtype=torch.long)
    with torch.no_grad():
        if normalization == "token":  # transformers' loss: mean over all labelled tokens
            expected = float(hf(input_ids=ids, labels=labels).loss)
        else:
            expected = float(
                np.mean(
                    [
                        float(hf(input_ids=ids[r : r + 1], labels=labels[r : r + 1]).loss)
                        for r in range(ids.shape[0])
                    ]
                )
            )
    loss, metrics = ar_loss(model, batch, obj_cfg(name="ar", normalization=normalization))
    np.testing.assert_allclose(float(loss), expected, rtol=0, atol=2e-5)
    assert float(metrics["clean_loss"]) == float(loss)
    via_dispatch, _ = loss_fn(model, batch, obj_cfg(name="ar", normalization=normalization))
    assert float(via_dispatch) == pytest.approx(float(loss), abs=1e-6)


def test_objective_errors(models):
    model = models["tied"]
    batch = make_batch(0, 4, [(3, 5)] * 5, length=20)
    with pytest.raises(ValueError, match="not a multiple of block_size 8"):
        mars_loss(model, batch, obj_cfg(block_size=8))
    batch = make_batch(0, 4, [(3, 5)] * 5, length=24)
    # A typed ObjectiveConfig refuses a bad value when it is built, before any loss is traced.
    with pytest.raises(ValueError, match="objective.name"):
        obj_cfg(name="diffusion")
    with pytest.raises(ValueError, match="normalization"):
        obj_cfg(name="ar", normalization="batch")
    with pytest.raises(ValueError, match="noisy_weighting must be one of"):
        obj_cfg(noisy_weighting="inverse")
    with pytest.raises(ValueError, match="needs objective.name='mars'"):
        obj_cfg(name="ar", noisy_weighting="inverse_t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj_cfg().block_size = 8
    # cross_entropy, which takes the normalization as a string, keeps its own guard.
    positions, targets, valid = target_positions(batch["labels"], None)
    hidden = jnp.zeros((*batch["labels"].shape, TINY["hidden_size"]))
    with pytest.raises(ValueError, match="normalization must be one of"):
        cross_entropy(model, hidden, positions, targets, valid, "batch")


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_cross_entropy_equals_full(loss_setup, chunk):
    """Chunks of 1, 3 (not dividing the positions) and 8 give the loss and the gradients of the
    unchunked cross-entropy."""
    model, batch, block, _, _ = loss_setup
    graphdef, params = nnx.split(model, nnx.Param)
    most = int((np.asarray(batch["labels"])[:, 1:] != IGNORE_INDEX).sum(1).max())
    assert most > chunk and most % 3

    def loss(p, chunk_size):
        cfg = obj_cfg(
            block_size=block, ar_weight=0.5, ce_chunk_size=chunk_size, max_label_tokens=most
        )
        return mars_loss(nnx.merge(graphdef, p), batch, cfg)[0]

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (full, g_full), (chunked, g_chunked) = grad(params, 0), grad(params, chunk)
    np.testing.assert_allclose(float(chunked), float(full), rtol=1e-6)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_full))
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6 * scale)


def _shapes(jaxpr):
    """Shapes of every value a jaxpr (and the jaxprs nested in its equations) computes."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _shapes(inner)


def test_chunked_cross_entropy_never_builds_all_logits(loss_setup):
    """No value in the forward or backward pass has the vocabulary as its last axis for more
    than ``ce_chunk_size`` positions of a row; without chunking, [rows, positions, V] exists."""
    model, batch, block, _, _ = loss_setup
    graphdef, params = nnx.split(model, nnx.Param)
    most = int((np.asarray(batch["labels"])[:, 1:] != IGNORE_INDEX).sum(1).max())
    rows = batch["labels"].shape[0]

    def widest_logits(chunk_size):
        cfg = obj_cfg(block_size=block, ce_chunk_size=chunk_size, max_label_tokens=most)
        loss = lambda p: mars_loss(nnx.merge(graphdef, p), batch, cfg)[0]
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        return max(int(np.prod(s[:-1])) for s in _shapes(jaxpr) if len(s) >= 2 and s[-1] == V)

    assert widest_logits(0) >= rows * most
    assert widest_logits(2) <= rows * 2
