"""Tests of mars_jax.decode's cache modes (sliding, block, none), acceptance rules (prob, entropy,
margin, verify), per-row thresholds, the acceptance cap and streaming, against the uncached
references of `decode_oracles`."""

import numpy as np
import pytest

from tests.decode_oracles import (
    MAX_NEW,
    Uncached,
    assert_matches_references,
    make_batch,
    make_model,
    qwen_generate,
    reference_ar,
    reference_block,
    reference_mars,
)


@pytest.fixture(scope="module")
def drafty():
    """A model whose predictions depend little on the current input token (token embeddings
    shrunk towards their mean), so a prediction made at a mask often equals the AR one: MARS
    drafts are often right, and often wrong."""
    model = make_model(300.0)
    e = model.embed_tokens.embedding[...]
    mean = e.mean(axis=0, keepdims=True)
    model.embed_tokens.embedding[...] = mean + 0.05 * (e - mean)
    return model


def _decode(model, ids, lengths, **kw):
    kw = {"block_size": 4, "max_new_tokens": MAX_NEW, **kw}
    return qwen_generate(model, ids, lengths, **kw)


def _assert_same_rows(a, b, rows_a=slice(None), rows_b=slice(None), forwards=True):
    fields = ("tokens", "lengths", "accepted") + (("row_forwards",) if forwards else ())
    for f in fields:
        np.testing.assert_array_equal(getattr(a, f)[rows_a], getattr(b, f)[rows_b], err_msg=f)


@pytest.mark.parametrize(
    "cache_mode,rule,block_size",
    [
        ("sliding", "prob", 4),
        ("block", "prob", 4),
        ("none", "prob", 4),
        ("sliding", "verify", 4),
        ("none", "verify", 4),
        ("sliding", "entropy", 4),
        ("sliding", "margin", 4),
        ("sliding", "prob", 1),
        ("block", "prob", 1),
        ("none", "prob", 1),
    ],
)
def test_threshold_one_is_greedy_ar_in_every_mode(cache_mode, rule, block_size, mid):
    ids, lengths, prompts = make_batch([3, 9, 6, 1], seed=1)
    out = _decode(
        mid, ids, lengths, block_size=block_size, threshold=1.0, cache_mode=cache_mode, rule=rule
    )
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    for r, p in enumerate(prompts):
        completion, generated, _ = reference_ar(fwd, p, MAX_NEW)
        assert out.completions()[r] == completion, f"row {r}"
        assert out.accepted[r] == generated
    if cache_mode == "block":
        # One token per forward that fills a block (none with B = 1: the token comes from the
        # forward that wrote the previous block, or the prefill), plus one forward writing each
        # block but the last to the cache.
        fills = out.accepted if block_size > 1 else 0
        writes = -(-out.accepted // block_size) - 1
        np.testing.assert_array_equal(out.row_forwards, fills + writes)
    else:
        np.testing.assert_array_equal(out.row_forwards, out.accepted)


@pytest.mark.parametrize("threshold", [0.9, 0.5])
def test_sliding_and_none_agree(threshold, mid):
    """The cached window and the full recompute give the same tokens and forward counts (and
    the reference's), with and without the adaptive window, on prompts of different lengths."""
    ids, lengths, prompts = make_batch([5, 2, 11, 7, 4], seed=2)
    sliding = _decode(mid, ids, lengths, threshold=threshold)
    none = _decode(mid, ids, lengths, threshold=threshold, cache_mode="none")
    _assert_same_rows(sliding, none)
    assert sliding.forwards == none.forwards
    assert sliding.tokens_per_forward > 1.2
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=threshold, max_new=MAX_NEW)[:3]
        for p in prompts
    ]
    assert_matches_references(none, refs)
    if threshold == 0.9:
        full = _decode(mid, ids, lengths, threshold=threshold, adaptive_window=False)
        _assert_same_rows(sliding, full)


@pytest.mark.parametrize("block_size,threshold", [(4, 0.9), (2, 0.5)])
def test_block_mode_matches_the_block_scheme(block_size, threshold, mid):
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=2)
    out = _decode(mid, ids, lengths, block_size=block_size, threshold=threshold, cache_mode="block")
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_block(fwd, p, block_size=block_size, threshold=threshold, max_new=MAX_NEW)
        for p in prompts
    ]
    for r, (completion, accepted, alone_forwards) in enumerate(refs):
        assert out.completions()[r] == completion, f"row {r}"
        assert out.accepted[r] == accepted
        # In a batch a row also waits at block ends for the others.
        assert out.row_forwards[r] >= alone_forwards
    # Several tokens per filling forward: fewer forwards than one token per fill would take.
    one_per_fill = out.accepted + -(-out.accepted // block_size) - 1
    assert np.all(out.row_forwards <= one_per_fill) and np.any(out.row_forwards < one_per_fill)
    # Alone, a row spends exactly the reference's forwards.
    alone = _decode(
        mid, ids[2:3], lengths[2:3], block_size=block_size, threshold=threshold, cache_mode="block"
    )
    assert alone.row_forwards[0] == refs[2][2]
    # The sliding window never waits: the same rows at the same threshold cost fewer forwards.
    sliding = _decode(mid, ids, lengths, block_size=block_size, threshold=threshold)
    assert sliding.forwards < out.forwards


@pytest.mark.parametrize("threshold", [0.9, 0.5, 0.1])
def test_verify_is_greedy_ar_with_several_tokens_per_forward(threshold, drafty):
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=2)
    out = _decode(drafty, ids, lengths, threshold=threshold, rule="verify")
    fwd = Uncached(drafty, ids.shape[1] + MAX_NEW + 4)
    for r, p in enumerate(prompts):
        completion, generated, _ = reference_ar(fwd, p, MAX_NEW)
        assert out.completions()[r] == completion, f"row {r}"
        assert out.accepted[r] == generated
    assert out.tokens_per_forward > 1.2
    assert len(set(out.tokens.ravel().tolist())) > 10  # not a constant stream
    # The drafts are not always right: lossy threshold decoding departs from AR here.
    lossy = _decode(drafty, ids, lengths, threshold=threshold)
    assert not np.array_equal(lossy.tokens, out.tokens)
    none = _decode(drafty, ids, lengths, threshold=threshold, rule="verify", cache_mode="none")
    _assert_same_rows(out, none)


@pytest.mark.parametrize("rule,threshold", [("entropy", 0.5), ("margin", 0.6)])
def test_entropy_and_margin_rules_match_reference(rule, threshold, mid):
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=3)
    out = _decode(mid, ids, lengths, threshold=threshold, rule=rule)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=threshold, max_new=MAX_NEW, rule=rule)[:3]
        for p in prompts
    ]
    assert_matches_references(out, refs)
    assert out.tokens_per_forward > 1.0
    prob = _decode(mid, ids, lengths, threshold=threshold)
    assert not np.array_equal(prob.row_forwards, out.row_forwards)  # the rule matters


@pytest.mark.parametrize(
    "cache_mode,rule", [("sliding", "prob"), ("block", "prob"), ("sliding", "verify")]
)
def test_per_row_threshold_and_batch_order(cache_mode, rule, mid, drafty):
    """Each row of a batch with per-row thresholds decodes as it does alone at its threshold,
    and reversing the batch changes no row."""
    model = drafty if rule == "verify" else mid
    ids, lengths, _ = make_batch([5, 9, 3, 7], seed=4)
    thresholds = np.array([1.0, 0.9, 0.5, 0.7], np.float32)
    kw = dict(cache_mode=cache_mode, rule=rule)
    out = _decode(model, ids, lengths, threshold=thresholds, **kw)
    for r, t in enumerate(thresholds):
        alone = _decode(model, ids[r : r + 1, : lengths[r]], lengths[r : r + 1], threshold=t, **kw)
        # Block mode syncs rows at block ends: a row's forwards depend on the batch.
        _assert_same_rows(out, alone, r, 0, forwards=cache_mode != "block")
    assert out.row_forwards[0] == out.accepted[0] or cache_mode == "block"
    flipped = _decode(model, ids[::-1], lengths[::-1], threshold=thresholds[::-1], **kw)
    _assert_same_rows(out, flipped, slice(None), slice(None, None, -1))


def test_max_accept_per_step_and_streaming(mid):
    """Streamed chunks add up to the output, and no forward accepts more than the cap."""
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=2)
    chunks = []
    out = _decode(
        mid,
        ids,
        lengths,
        threshold=0.5,
        max_accept_per_step=2,
        on_accept=lambda tokens, counts: chunks.append((np.array(tokens), np.array(counts))),
    )
    assert len(chunks) == out.forwards
    counts = np.stack([c for _, c in chunks])  # [forwards, R]
    assert counts.max() == 2 and counts.min() == 0
    np.testing.assert_array_equal(counts.sum(axis=0), out.accepted)
    for r in range(len(prompts)):
        streamed = [t for tokens, c in chunks for t in tokens[r, : c[r]].tolist()]
        assert streamed[: out.lengths[r]] == out.completions()[r]
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=0.5, max_new=MAX_NEW, max_accept=2)[:3]
        for p in prompts
    ]
    assert_matches_references(out, refs)


def test_invalid_modes(mid):
    ids, lengths, _ = make_batch([3, 5])
    for kw, match in [
        (dict(cache_mode="paged"), "cache_mode"),
        (dict(rule="topk"), "rule"),
        (dict(rule="verify", temperature=0.7), "verify"),
        (dict(rule="verify", cache_mode="block"), "verify"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=[0.9, 1.5]), "threshold"),
        (dict(max_accept_per_step=0), "max_accept_per_step"),
    ]:
        with pytest.raises(ValueError, match=match):
            _decode(mid, ids, lengths, **{"threshold": 0.9, **kw})
