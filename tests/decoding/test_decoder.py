"""The decoder (`decoder.Decoder`): each cache mode (sliding, block, none) and acceptance rule
(prob, entropy, margin, verify), per-row thresholds, the acceptance cap and streaming against the
uncached references of `decode_oracles`; then its structure: its pieces (prefill, one step, a few
steps, one branch, the result) driven from the host give exactly `decode.generate`'s output, each
piece lowers and compiles alone, per-row settings (`RowSettings`) travel in the state, and the
engine verbs (insert, free, new_tokens) do what a host loop leaves to them. The rules alone:
test_acceptance.py; the host API: test_decode.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.decode_state import RowSettings
from mars_jax.decoder import Decoder
from tests.decode_oracles import (
    MAX_NEW,
    Uncached,
    assert_matches_references,
    make_batch,
    make_model,
    qwen_generate,
    qwen_settings,
    reference_ar,
    reference_block,
    reference_mars,
)

# ----------------------------------------------------------------------------------------------
# Cache modes and rules against the uncached references.


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


# ----------------------------------------------------------------------------------------------
# The decoder's pieces, driven from the host.


def host_loop(model, ids, lengths, st, *, threshold, temperature=0.0, seeds=None, chunk=0):
    """Decodes by hand: prefill, then `step` (or `steps` of ``chunk``) until finished."""
    graphdef, params = nnx.split(model)
    dec = Decoder(graphdef, st)
    rows = len(lengths)
    seeds = np.zeros(rows, np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    row_settings = RowSettings.build(
        rows,
        threshold=threshold,
        max_accept=st.block_size,
        max_new_tokens=st.max_new_tokens,
        temperature=temperature,
        seed=seeds,
    )
    state = dec.prefill(params, jnp.asarray(ids), jnp.asarray(lengths), row_settings)
    calls = 0
    while not bool(dec.finished(state)):
        state = dec.steps(params, state, chunk) if chunk else dec.step(params, state)
        calls += 1
    return dec.result(state), calls


CASES = {
    "sliding": dict(),
    "block": dict(cache_mode="block"),
    "none": dict(cache_mode="none"),
    "verify": dict(rule="verify"),
    "ar": dict(block_size=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_host_driven_steps_equal_generate(mid, case):
    ids, lengths, _ = make_batch([5, 2, 11, 7], seed=2)
    kw = CASES[case]
    st = qwen_settings(**kw)
    threshold = 0.5 if kw.get("rule") == "verify" else 0.9
    out = qwen_generate(
        mid,
        ids,
        lengths,
        block_size=st.block_size,
        threshold=threshold,
        max_new_tokens=MAX_NEW,
        cache_mode=st.cache_mode,
        rule=st.rule,
        adaptive_window=st.adaptive_window,
    )
    result, calls = host_loop(mid, ids, lengths, st, threshold=threshold)
    np.testing.assert_array_equal(np.asarray(result.tokens), out.tokens)
    np.testing.assert_array_equal(np.asarray(result.lengths), out.lengths)
    np.testing.assert_array_equal(np.asarray(result.accepted), out.accepted)
    np.testing.assert_array_equal(np.asarray(result.row_forwards), out.row_forwards)
    assert int(result.forwards) == out.forwards == calls  # one forward per step call
    if case in ("sliding", "block"):  # a few steps per call (a server's unit of work)
        chunked, chunk_calls = host_loop(mid, ids, lengths, st, threshold=threshold, chunk=3)
        np.testing.assert_array_equal(np.asarray(chunked.tokens), out.tokens)
        assert chunk_calls == -(-calls // 3)


def test_sampled_steps_equal_generate(mid):
    ids, lengths, _ = make_batch([6, 3, 9], seed=4)
    seeds = [3, 11, 7]
    out = qwen_generate(
        mid,
        ids,
        lengths,
        block_size=4,
        threshold=0.8,
        max_new_tokens=MAX_NEW,
        temperature=0.7,
        seed=seeds,
    )
    result, _ = host_loop(
        mid, ids, lengths, qwen_settings(sampling=True), threshold=0.8, temperature=0.7, seeds=seeds
    )
    np.testing.assert_array_equal(np.asarray(result.tokens), out.tokens)


def decoded_alone(model, ids, lengths, r, thresholds, temps, seeds, **fields):
    """Row ``r`` of a batch decoded alone by `decode.generate` with its own settings."""
    return qwen_generate(
        model,
        ids[r : r + 1],
        lengths[r : r + 1],
        block_size=4,
        threshold=thresholds[r],
        max_new_tokens=MAX_NEW,
        temperature=temps[r],
        seed=seeds[r],
        **fields,
    )


def test_per_row_settings_travel_in_the_state(mid):
    """Rows of one batch with their own threshold and temperature each decode as alone."""
    ids, lengths, _ = make_batch([5, 8, 4], seed=6)
    graphdef, params = nnx.split(mid)
    dec = Decoder(graphdef, qwen_settings(sampling=True))
    thresholds, temps, seeds = [1.0, 0.6, 0.9], [0.0, 0.8, 0.5], [1, 2, 3]
    row_settings = RowSettings.build(
        3,
        threshold=thresholds,
        max_accept=[4, 2, 4],
        max_new_tokens=MAX_NEW,
        temperature=temps,
        seed=seeds,
    )
    state = dec.prefill(params, jnp.asarray(ids), jnp.asarray(lengths), row_settings)
    while not bool(dec.finished(state)):
        state = dec.step(params, state)
    batch = dec.result(state)
    for r in range(3):
        alone = decoded_alone(
            mid, ids, lengths, r, thresholds, temps, seeds, max_accept_per_step=[4, 2, 4][r]
        )
        np.testing.assert_array_equal(np.asarray(batch.tokens)[r], alone.tokens[0])
        assert int(batch.accepted[r]) == int(alone.accepted[0])
    # max_accept 2 caps row 1 at two tokens per forward; row 0 (threshold 1.0) is one-token.
    assert int(batch.accepted[0]) == int(batch.row_forwards[0])
    assert int(batch.accepted[1]) <= 2 * int(batch.row_forwards[1])


@pytest.mark.parametrize("cache_mode", ["sliding", "block"])
def test_each_piece_lowers_and_compiles_alone(mid, cache_mode):
    ids, lengths, _ = make_batch([5, 3], seed=1)
    graphdef, params = nnx.split(mid)
    dec = Decoder(graphdef, qwen_settings(cache_mode=cache_mode))
    args = (
        params,
        jnp.asarray(ids),
        jnp.asarray(lengths),
        RowSettings.build(2, threshold=0.9, max_accept=4, max_new_tokens=MAX_NEW),
    )
    prefill = Decoder.prefill.lower(dec, *args).compile()
    state = dec.prefill(*args)
    step = Decoder.step.lower(dec, params, state).compile()
    # One forward: each branch's layer scan and, inside it, its attention's loop over cache
    # chunks are the program's only loops (no decode loop).
    assert step.as_text().count(" while(") == 2 * len(dec.branches) == 4
    assert prefill.as_text().count(" while(") == 1  # the prompt's forward scans the layers
    for name in dec.branches:
        assert (
            Decoder.branch.lower(dec, params, state, name).compile().as_text().count(" while(") == 2
        )
    other = "fill" if cache_mode == "sliding" else "narrow"
    with pytest.raises(ValueError, match=f"branch '{other}'"):
        dec.branch(params, state, other)


def test_branch_is_the_forward_that_step_takes(mid):
    """After the prefill every row has one uncached token: the adaptive step runs ``narrow``."""
    ids, lengths, _ = make_batch([5, 3], seed=1)
    graphdef, params = nnx.split(mid)
    dec = Decoder(graphdef, qwen_settings())
    assert dec.branches == ("narrow", "wide")
    row_settings = RowSettings.build(2, threshold=0.9, max_accept=4, max_new_tokens=MAX_NEW)
    state = dec.prefill(params, jnp.asarray(ids), jnp.asarray(lengths), row_settings)
    stepped = dec.step(params, state)
    narrow = dec.branch(params, state, "narrow")
    keys = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    plain = lambda s: jax.tree.leaves(jax.tree.map(keys, s))
    for a, b in zip(plain(stepped), plain(narrow)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(narrow.forwards) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"block_size": 4, "cache_mode": "sliding", "rule": "prob"},
        {"block_size": 4, "cache_mode": "sliding", "rule": "verify"},
        {"block_size": 1, "cache_mode": "sliding", "rule": "prob"},
        {"block_size": 4, "cache_mode": "block", "rule": "prob"},
    ],
    ids=["sliding", "verify", "ar", "block"],
)
def test_steps_over_the_first_rows_equal_steps_over_all(fields, mid):
    """`Decoder.steps` with ``rows``: rows 0..rows-1 decoded, the rest carried. Its state after
    a few calls equals, field for field and in those rows' KV cache, the state that `steps` over
    every row reaches from the same start (ids exactly, floats to rounding: XLA's products sum
    differently at another number of rows), where the rows past ``rows`` are done (a server's
    free slots), with per-row thresholds, sampling and logprobs."""
    ids, lengths, _ = make_batch([5, 8, 4, 7], width=10, seed=3)
    graphdef, params = nnx.split(mid)
    settings = qwen_settings(sampling=True, **fields)
    if fields["cache_mode"] == "sliding":
        settings = dataclasses.replace(settings, logprobs=2)
    dec = Decoder(graphdef, settings)
    row_settings = RowSettings.build(
        4,
        threshold=[0.9, 0.6, 1.0, 0.7],
        max_accept=fields["block_size"],
        max_new_tokens=MAX_NEW,
        temperature=[0.0, 0.8, 0.0, 0.5] if fields["rule"] != "verify" else 0.0,
        seed=[5, 2, 9, 4],
        want_logprobs=settings.logprobs is not None,
    )

    def start():
        state = dec.prefill(params, ids, lengths, row_settings)
        return dec.free(state, np.asarray([False, False, True, True]))

    keys = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    plain = lambda s: [np.asarray(a) for a in jax.tree.leaves(jax.tree.map(keys, s))]
    whole, first, fresh = start(), start(), plain(start())
    for _ in range(3):
        whole, first = dec.steps(params, whole, 2), dec.steps(params, first, 2, 2)
    assert int(first.new_tokens[0]) > 0 and int(first.new_tokens[1]) > 0
    assert int(first.forwards) == int(whole.forwards) > 0
    # Rows 0-1 as `steps` over every row leaves them (the cache's rows on axis 1); rows 2-3 as
    # they were (`steps` over every row writes a done row's window and log-probabilities too:
    # stale entries, rewritten when a request takes the row).
    for a, b, c in zip(plain(whole), plain(first), fresh, strict=True):
        if a.ndim == 0:
            continue
        rows = (slice(None), slice(None, 2)) if a.ndim == 5 else (slice(None, 2),)
        rest = (slice(None), slice(2, None)) if a.ndim == 5 else (slice(2, None),)
        if np.issubdtype(a.dtype, np.floating):  # a product's sums depend on its rows
            np.testing.assert_allclose(a[rows], b[rows], rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_array_equal(a[rows], b[rows])
        np.testing.assert_array_equal(b[rest], c[rest])


def test_engine_api_insert_free_and_new_tokens(mid):
    """The slot surgery a host loop leaves to the decoder: `read_new_tokens` is the slice of the
    token buffer it replaces (re-reading past its width); `free` marks exactly the given rows
    done and `steps` then carries them; a one-row state inserted into a batch mid-decode decodes
    as its prompt alone, and the other rows as before."""
    ids, lengths, _ = make_batch([5, 8, 4, 7], width=10, seed=8)
    graphdef, params = nnx.split(mid)
    dec = Decoder(graphdef, qwen_settings(sampling=True))
    thresholds, temps, seeds = [0.9, 0.6, 1.0, 0.7], [0.0, 0.8, 0.0, 0.5], [5, 2**32 - 1, 9, 4]

    def prefill(rows):
        row_settings = RowSettings.build(
            len(rows),
            threshold=np.float32(thresholds)[rows],
            max_accept=4,
            max_new_tokens=MAX_NEW,
            temperature=np.float32(temps)[rows],
            seed=np.asarray(seeds)[rows],
        )
        return dec.prefill(params, ids[rows], lengths[rows], row_settings)

    def host(state):
        arrays = {
            k: np.asarray(v) for k, v in vars(state).items() if k not in ("cache", "row_settings")
        }
        settings = vars(state.row_settings).items()
        return arrays | {f"row_settings.{k}": np.asarray(v) for k, v in settings if k != "keys"}

    def check_read(state, sent, width):
        full = host(state)
        new = dec.read_new_tokens(state, sent, width)
        for r, (p, n, s) in enumerate(zip(full["prompt_lengths"], full["new_tokens"], sent)):
            np.testing.assert_array_equal(new.tokens[r, : n - s], full["tokens"][r, p + s : p + n])
        assert new.tokens.shape[1] % width == 0
        np.testing.assert_array_equal(new.new_tokens, full["new_tokens"])
        np.testing.assert_array_equal(new.row_forwards, full["row_forwards"])
        assert int(new.forwards) == int(full["forwards"])
        one = dec.new_tokens(state, np.asarray(sent, np.int32), width)  # one fixed-width read
        assert one.tokens.shape == (len(sent), width)
        np.testing.assert_array_equal(np.asarray(one.tokens), new.tokens[:, :width])

    # free: exactly the given rows are done, nothing else changes; steps carry them.
    fresh = host(prefill([0, 1, 2]))
    freed = dec.free(prefill([0, 1, 2]), np.asarray([True, False, True]))
    got = host(freed)
    np.testing.assert_array_equal(got.pop("done"), [True, False, True])
    assert all(np.array_equal(got[k], fresh[k]) for k in got if k != "forwards")
    stepped = host(dec.steps(params, freed, 2))
    assert list(stepped["new_tokens"] > 0) == [False, True, False]
    np.testing.assert_array_equal(stepped["tokens"][[0, 2]], fresh["tokens"][[0, 2]])

    # new tokens mid-decode, from what the host has seen, with a width smaller than a call's.
    batch = dec.steps(params, prefill([0, 1, 2]), 2)
    sent = np.minimum([1, 0, 2], np.asarray(batch.new_tokens))
    check_read(batch, sent, 2)

    # insert row 3 into slot 1, reset the batch's forward count, decode to the end.
    batch = dec.insert(batch, prefill([3]), np.int32(1))
    batch = dec.free(batch, np.zeros(3, bool))
    assert int(batch.forwards) == 0 and int(batch.new_tokens[1]) == 0
    while not bool(dec.finished(batch)):
        batch = dec.steps(params, batch, 3)
    check_read(batch, [0, 0, 0], 3)  # every completion, in several reads of 3
    result = dec.result(batch)
    for slot, r in enumerate([0, 3, 2]):
        alone = decoded_alone(mid, ids, lengths, r, thresholds, temps, seeds)
        np.testing.assert_array_equal(np.asarray(result.tokens)[slot], alone.tokens[0])
