"""The decoder's structure: `decoder.Decoder`'s pieces (prefill, one step, a few steps, one branch,
the result) driven from the host give exactly `decode.generate`'s output; each piece lowers and
compiles alone; per-row settings (`RowSettings`) travel in the state; the engine verbs (insert,
free, new_tokens) do what a host loop leaves to them. The rules: test_acceptance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.decode_state import RowSettings
from mars_jax.decoder import Decoder
from tests.decode_oracles import MAX_NEW, make_batch, qwen_generate, qwen_settings


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
    # One forward: each branch's layer scan is the program's only loop (no decode loop).
    assert step.as_text().count(" while(") == len(dec.branches) == 2
    assert prefill.as_text().count(" while(") == 1  # the prompt's forward scans the layers
    for name in dec.branches:
        assert (
            Decoder.branch.lower(dec, params, state, name).compile().as_text().count(" while(") == 1
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
