"""Tests of mars_jax.decode's default scheme (per-row cursors, ``prob`` rule) against the uncached
references of `decode_oracles`: one-token mode is greedy AR, threshold decoding follows the
acceptance rule, batch invariance, EOS, budget, sampling and argument checks.
Last, inputs at the edges: empty prompts, a zero budget, a batch of 64 with rows that end at very
different times, and prompts holding <|mask|> and <|endoftext|>."""

import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax import acceptance, decode
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_ID
from tests.decode_oracles import (
    MAX_NEW,
    Uncached,
    assert_matches_references,
    make_batch,
    make_model,
    qwen_generate,
    qwen_generate_batched,
    reference_ar,
    reference_mars,
    swap_head_columns,
)


@pytest.fixture(scope="module")
def flat():
    return make_model(1.0)


@pytest.fixture(scope="module")
def peaked():
    return make_model(1000.0)


# ----------------------------------------------------------------------------------------------
# (a) one-token mode is greedy AR.


@pytest.mark.parametrize("which", ["flat", "mid", "peaked"])
def test_threshold_one_is_greedy_ar(which, request):
    model = request.getfixturevalue(which)
    ids, lengths, prompts = make_batch([3, 9, 6, 1], seed=1)
    out = qwen_generate(model, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW)
    fwd = Uncached(model, ids.shape[1] + MAX_NEW + 4)
    max_probs = []
    for r, p in enumerate(prompts):
        completion, generated, probs = reference_ar(fwd, p, MAX_NEW)
        max_probs += probs
        n = len(completion)
        assert out.lengths[r] == n
        np.testing.assert_array_equal(out.tokens[r, :n], completion)
        assert out.accepted[r] == generated
    # One token per forward, whatever the confidence.
    np.testing.assert_array_equal(out.row_forwards, out.accepted)
    assert out.tokens_per_forward == 1.0
    # Non-trivial completions: not a constant token stream.
    assert len(set(out.tokens[:, :8].ravel().tolist())) > 8
    if which == "peaked":
        # fp32 probabilities of exactly 1.0 occurred, and the same model accepts several tokens
        # per forward below threshold 1: threshold 1.0 itself must not accept them.
        assert max(max_probs) == 1.0
        multi = qwen_generate(
            model, ids, lengths, block_size=4, threshold=0.999, max_new_tokens=MAX_NEW
        )
        assert multi.tokens_per_forward > 1.5


# ----------------------------------------------------------------------------------------------
# (b) threshold decoding equals the uncached acceptance rule.


@pytest.mark.parametrize(
    "block_size,threshold,which",
    [(2, 0.9, "mid"), (4, 0.9, "mid"), (4, 0.9, "peaked"), (4, 0.5, "mid")],
)
def test_threshold_decoding_matches_uncached_reference(block_size, threshold, which, request):
    model = request.getfixturevalue(which)
    ids, lengths, prompts = make_batch([5, 2, 11, 7, 4], seed=2)
    out = qwen_generate(
        model, ids, lengths, block_size=block_size, threshold=threshold, max_new_tokens=MAX_NEW
    )
    fwd = Uncached(model, ids.shape[1] + MAX_NEW + block_size)
    refs, multi = [], 0
    for p in prompts:
        completion, accepted, forwards, steps = reference_mars(
            fwd, p, block_size=block_size, threshold=threshold, max_new=MAX_NEW
        )
        refs.append((completion, accepted, forwards))
        multi += sum(len(s) > 1 for s in steps)
    assert_matches_references(out, refs)
    # The runs really accepted several tokens per forward (and not always the whole block).
    assert multi > 0
    assert out.tokens_per_forward > 1.0
    assert out.row_forwards.sum() > out.accepted.sum() / block_size


def test_mask_id_is_used(mid):
    """Another mask id changes the mask inputs: the decoder must feed the one it is given."""
    ids, lengths, prompts = make_batch([5, 8], seed=3)
    other = IM_START_ID
    out = qwen_generate(
        mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW, mask_id=other
    )
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=0.9, max_new=MAX_NEW, mask_id=other)[:3]
        for p in prompts
    ]
    assert_matches_references(out, refs)
    default = qwen_generate(mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert (
        not np.array_equal(default.tokens, out.tokens)
        or not np.array_equal(default.accepted, out.accepted)
        or not np.array_equal(default.row_forwards, out.row_forwards)
    )


# ----------------------------------------------------------------------------------------------
# (c) batch invariance.


def test_prompt_alone_equals_prompt_in_batch(mid):
    ids, lengths, prompts = make_batch([4, 10, 7], seed=4)
    target = 0  # the shortest row: the most padding in the batch
    alone = qwen_generate(
        mid,
        ids[target : target + 1, : lengths[target]],
        lengths[target : target + 1],
        block_size=4,
        threshold=0.9,
        max_new_tokens=MAX_NEW,
    )
    assert alone.tokens_per_forward > 1.0
    # The same prompt inside batches of different widths and padding ids.
    for width, pad, order in [(10, ENDOFTEXT_ID, [1, 0, 2]), (17, 12345, [2, 1, 0])]:
        batch = np.full((3, width), pad, np.int32)
        for row, r in enumerate(order):
            batch[row, : lengths[r]] = prompts[r]
        out = qwen_generate(
            mid, batch, lengths[order], block_size=4, threshold=0.9, max_new_tokens=MAX_NEW
        )
        row = order.index(target)
        np.testing.assert_array_equal(out.tokens[row], alone.tokens[0])
        assert out.lengths[row] == alone.lengths[0]
        assert out.accepted[row] == alone.accepted[0]
        assert out.row_forwards[row] == alone.row_forwards[0]


SAMPLE = dict(block_size=4, threshold=0.7, max_new_tokens=MAX_NEW, temperature=2.0)


@pytest.mark.parametrize("cache_mode", ["sliding", "block"])
def test_sampled_prompt_alone_equals_prompt_in_batch(mid, cache_mode):
    """With temperature > 0 a row's sample depends only on its prompt and seed: the same alone,
    in batches of other orders, other rows, other padding widths and pad ids, whatever seeds
    the other rows have."""
    kw = dict(SAMPLE, cache_mode=cache_mode)
    ids, lengths, prompts = make_batch([4, 10, 7], seed=4)
    _, _, strangers = make_batch([12, 2, 6], seed=9)
    target, seed, others = prompts[1], 5, [prompts[0], prompts[2]]
    alone = qwen_generate(mid, np.asarray([target]), [len(target)], seed=seed, **kw)
    greedy = qwen_generate(mid, np.asarray([target]), [len(target)], **{**kw, "temperature": 0.0})
    # The sample is not the greedy output; some forwards accept several tokens, some reject
    # candidates (whose positions are drawn again by later forwards).
    assert np.mean(alone.tokens != greedy.tokens) > 0.3
    accepted, blocks = alone.accepted[0], -(-alone.accepted[0] // 4)
    drawing = alone.row_forwards[0] - (blocks - 1 if cache_mode == "block" else 0)
    assert blocks < drawing < accepted
    for batch_mates, width, pad, where, other_seeds in [
        (others, 10, ENDOFTEXT_ID, 1, None),  # the scalar seed, every row's
        (others, 17, 12345, 2, [3, 4]),
        (strangers, 12, ENDOFTEXT_ID, 3, [0, 0, 1]),
        (strangers[:1], 30, 7, 0, [seed]),  # another row with the same seed
    ]:
        rows = list(batch_mates)
        rows.insert(where, target)
        batch = np.full((len(rows), width), pad, np.int32)
        for r, p in enumerate(rows):
            batch[r, : len(p)] = p
        seeds = seed
        if other_seeds is not None:
            seeds = other_seeds[:where] + [seed] + other_seeds[where:]
        out = qwen_generate(mid, batch, [len(p) for p in rows], seed=seeds, **kw)
        np.testing.assert_array_equal(out.tokens[where], alone.tokens[0])
        assert out.lengths[where] == alone.lengths[0]
        assert out.accepted[where] == alone.accepted[0]
        if cache_mode == "sliding":  # block mode: rows wait for each other at block ends
            assert out.row_forwards[where] == alone.row_forwards[0]


def test_per_row_seeds(mid):
    """Each row samples with its own seed: a batch with seeds [R] decodes every row as it does
    alone with its seed, different seeds give different samples, the scalar seed is every
    row's, and ``none`` (no cache) draws the same tokens as ``sliding``. Greedy ignores seeds."""
    ids, lengths, _ = make_batch([5, 9, 3], seed=10)
    seeds = [11, 0, 2**32 - 1]
    out = qwen_generate(mid, ids, lengths, seed=seeds, **SAMPLE)
    for r, s in enumerate(seeds):
        alone = qwen_generate(
            mid, ids[r : r + 1, : lengths[r]], lengths[r : r + 1], seed=s, **SAMPLE
        )
        for f in ("tokens", "lengths", "accepted", "row_forwards"):
            assert getattr(out, f)[r].tolist() == getattr(alone, f)[0].tolist(), (r, f)
    flipped = qwen_generate(mid, ids[::-1], lengths[::-1], seed=seeds[::-1], **SAMPLE)
    np.testing.assert_array_equal(flipped.tokens[::-1], out.tokens)
    same = qwen_generate(mid, ids, lengths, seed=np.array([11, 11, 11], np.uint32), **SAMPLE)
    scalar = qwen_generate(mid, ids, lengths, seed=11, **SAMPLE)
    np.testing.assert_array_equal(same.tokens, scalar.tokens)
    np.testing.assert_array_equal(same.tokens[0], out.tokens[0])
    for r in (1, 2):  # another seed, another sample (where the model is sure, the same token)
        assert np.mean(same.tokens[r] != out.tokens[r]) > 0.2
    none = qwen_generate(mid, ids, lengths, seed=seeds, cache_mode="none", **SAMPLE)
    for f in ("tokens", "lengths", "accepted", "row_forwards"):
        np.testing.assert_array_equal(getattr(none, f), getattr(out, f), err_msg=f)
    greedy = {**SAMPLE, "temperature": 0.0}
    np.testing.assert_array_equal(
        qwen_generate(mid, ids, lengths, seed=seeds, **greedy).tokens,
        qwen_generate(mid, ids, lengths, **greedy).tokens,
    )


# ----------------------------------------------------------------------------------------------
# EOS, budget, sampling, argument checks.


def test_eos_cuts_the_output_inside_a_multi_token_step(mid):
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=2)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    # Find an accepted token that was followed by more accepted tokens in the same forward,
    # and that neither occurred before it in the completion nor in a candidate role for EOS.
    pick = None
    for r, p in enumerate(prompts):
        completion, _, _, steps = reference_mars(
            fwd, p, block_size=4, threshold=0.9, max_new=MAX_NEW
        )
        assert IM_END_ID not in completion
        pos = 0
        for s in steps:
            for j, tok in enumerate(s[:-1]):
                if tok not in completion[: pos + j] and pick is None:
                    pick = (r, tok, pos + j, completion)
            pos += len(s)
    assert pick is not None, "no multi-token step found"
    row, token, cut, original = pick

    # The model now emits <|im_end|> exactly where it emitted `token`.
    model = swap_head_columns(mid, token, IM_END_ID)
    out = qwen_generate(model, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert out.lengths[row] == cut
    np.testing.assert_array_equal(out.tokens[row, :cut], original[:cut])
    assert np.all(out.tokens[row, cut:] == ENDOFTEXT_ID)  # filled with the last stop id
    assert out.accepted[row] == cut + 1  # the EOS is counted, nothing after it
    assert IM_END_ID not in out.tokens.ravel().tolist()
    fwd2 = Uncached(model, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd2, p, block_size=4, threshold=0.9, max_new=MAX_NEW)[:3] for p in prompts
    ]
    assert_matches_references(out, refs)

    # Without <|im_end|> among the EOS ids the row runs on past it.
    out = qwen_generate(
        model,
        ids,
        lengths,
        block_size=4,
        threshold=0.9,
        max_new_tokens=MAX_NEW,
        eos_ids=(ENDOFTEXT_ID,),
    )
    assert out.tokens[row, cut] == IM_END_ID
    assert out.lengths[row] > cut


@pytest.mark.parametrize("budget", [1, 5, 7])
def test_max_new_tokens_is_respected(peaked, budget):
    ids, lengths, prompts = make_batch([3, 9, 6], seed=5)
    full = qwen_generate(peaked, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert full.tokens_per_forward > 1.5 and np.all(full.lengths == MAX_NEW)
    out = qwen_generate(peaked, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=budget)
    assert out.tokens.shape == (3, budget)
    np.testing.assert_array_equal(out.lengths, budget)
    np.testing.assert_array_equal(out.accepted, budget)
    np.testing.assert_array_equal(out.tokens, full.tokens[:, :budget])
    fwd = Uncached(peaked, ids.shape[1] + budget + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=0.9, max_new=budget)[:3] for p in prompts
    ]
    assert_matches_references(out, refs)


def test_sampling_is_seeded(flat, mid):
    ids, lengths, _ = make_batch([3, 9, 6], seed=6)
    kw = dict(block_size=4, threshold=0.9, max_new_tokens=MAX_NEW, temperature=1.0)
    a = qwen_generate(flat, ids, lengths, seed=0, **kw)
    b = qwen_generate(flat, ids, lengths, seed=0, **kw)
    c = qwen_generate(flat, ids, lengths, seed=1, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.accepted, b.accepted)
    assert np.mean(a.tokens != c.tokens) > 0.5  # a near-uniform model: almost every token differs
    greedy = qwen_generate(flat, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert np.mean(a.tokens != greedy.tokens) > 0.5
    # Confidence is the model's probability of the sampled token, tiny on a flat model: one
    # token per forward.
    assert a.tokens_per_forward == 1.0
    # A uniform model (all logits 0): every draw is fresh, across steps and positions.
    uniform = qwen_generate(make_model(0.0), ids, lengths, seed=0, **kw)
    for row in uniform.tokens:
        assert len(set(row.tolist())) >= MAX_NEW - 2
    assert uniform.tokens_per_forward == 1.0
    # The noise is keyed by (row seed, position): rows with one seed draw the same token at the
    # same position where their logits agree (here everywhere), and other seeds do not.
    by_position = lambda out, r: dict(zip(range(lengths[r], lengths[r] + MAX_NEW), out.tokens[r]))
    rows = [by_position(uniform, r) for r in range(3)]
    shared = sorted(set(rows[0]) & set(rows[1]) & set(rows[2]))
    assert len(shared) == MAX_NEW - 6  # positions 9 .. 18
    assert all(rows[0][p] == rows[1][p] == rows[2][p] for p in shared)
    apart = qwen_generate(make_model(0.0), ids, lengths, seed=[0, 1, 2], **kw)
    assert all(by_position(apart, 0)[p] != by_position(apart, 1)[p] for p in shared)
    np.testing.assert_array_equal(apart.tokens[0], uniform.tokens[0])
    # Near-zero temperature samples the argmax: one-token mode then equals greedy decoding.
    cold = qwen_generate(
        mid, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW, temperature=1e-4
    )
    hot = qwen_generate(mid, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(cold.tokens, hot.tokens)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.5, 0.9)])
def test_sampled_decoding_matches_uncached_reference(temperature, top_p, mid):
    """A sampled candidate is drawn from the tempered nucleus and accepted while the model's own
    probability of it (temperature 1, before top_p) reaches the threshold."""
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=4)
    seeds = [3, 4, 5, 6]
    kw = dict(block_size=4, threshold=0.8, max_new_tokens=MAX_NEW)
    out = qwen_generate(mid, ids, lengths, seed=seeds, temperature=temperature, top_p=top_p, **kw)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(
            fwd,
            p,
            **{k: v for k, v in kw.items() if k != "max_new_tokens"},
            max_new=MAX_NEW,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )[:3]
        for p, seed in zip(prompts, seeds)
    ]
    assert_matches_references(out, refs)
    assert out.tokens_per_forward > 1.0
    greedy = qwen_generate(mid, ids, lengths, **kw)
    assert not np.array_equal(out.tokens, greedy.tokens)  # really sampled


def test_a_colder_draw_never_loosens_acceptance(mid):
    """Temperature -> 0, or a nucleus of one token, decodes as greedy at the same threshold:
    the same tokens in the same forwards (a confidence taken after temperature or top_p would
    call every such draw certain and accept whole blocks)."""
    ids, lengths, _ = make_batch([5, 9, 3, 7], seed=7)
    kw = dict(block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    greedy = qwen_generate(mid, ids, lengths, **kw)
    assert 1.0 < greedy.tokens_per_forward < 3.0
    for cold in (dict(temperature=1e-4), dict(temperature=1.0, top_p=1e-6)):
        out = qwen_generate(mid, ids, lengths, seed=[1, 2, 3, 4], **cold, **kw)
        np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=str(cold))
        np.testing.assert_array_equal(out.row_forwards, greedy.row_forwards, err_msg=str(cold))


def test_invalid_arguments(flat):
    ids, lengths, _ = make_batch([3, 5])
    kw = dict(block_size=4, threshold=0.9, max_new_tokens=4)
    for bad_ids, bad_lengths in [
        (ids, np.array([0, 5])),  # empty prompt
        (ids, np.array([3, 6])),  # longer than the array
        (ids, np.array([3])),  # one length for two rows
        (ids[0], np.array([3])),  # not [R, P]
    ]:
        with pytest.raises(ValueError):
            qwen_generate(flat, bad_ids, bad_lengths, **kw)
    with pytest.raises(ValueError):
        qwen_generate(flat, ids, lengths, block_size=0, threshold=0.9, max_new_tokens=4)
    with pytest.raises(ValueError):
        qwen_generate(flat, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=-1)
    for seed in (-1, 2**32, [1, 2, 3], [1], [[1], [2]], 1.5, [0.0, 1.0], True, "0"):
        with pytest.raises(ValueError, match="seed"):
            qwen_generate(flat, ids, lengths, seed=seed, **kw)


def test_pad_prompts():
    ids, lengths = decode.pad_prompts([[5, 6, 7], [8]], pad_id=ENDOFTEXT_ID, rows=3)
    np.testing.assert_array_equal(
        ids, [[5, 6, 7], [8, ENDOFTEXT_ID, ENDOFTEXT_ID], [ENDOFTEXT_ID] * 3]
    )
    np.testing.assert_array_equal(lengths, [3, 1, 1])
    assert ids.dtype == lengths.dtype == np.int32
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decode.pad_prompts([[1], []], pad_id=0)


def test_generate_batched_equals_each_batch(mid):
    """Batches of 2 (the last one filled with a filler row) give each prompt the tokens and
    counts of decoding its own batch, in order; the summary counts are computed once."""
    _, _, prompts = make_batch([3, 9, 6, 4, 7], seed=7)
    kw = dict(block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    out = qwen_generate_batched(mid, prompts, batch_size=2, pad_id=ENDOFTEXT_ID, **kw)
    assert out.tokens.shape == (5, MAX_NEW)
    width = max(map(len, prompts))
    parts = []
    for i in range(0, 5, 2):
        ids, lengths = decode.pad_prompts(prompts[i : i + 2], ENDOFTEXT_ID, rows=2)
        ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=ENDOFTEXT_ID)
        parts.append(qwen_generate(mid, ids, lengths, **kw))
    expected = decode.DecodeOutput.concatenate(parts, rows=5)
    for field in ("tokens", "lengths", "accepted", "row_forwards"):
        np.testing.assert_array_equal(getattr(out, field), getattr(expected, field), err_msg=field)
    assert out.forwards == sum(p.forwards for p in parts)
    assert out.completions() == [
        expected.tokens[i, : expected.lengths[i]].tolist() for i in range(5)
    ]
    assert out.tokens_per_forward == pytest.approx(out.accepted.sum() / out.row_forwards.sum())
    assert out.tokens_per_forward > 1.0  # the confident model accepts several tokens per step
    np.testing.assert_allclose(out.row_tokens_per_forward, out.accepted / out.row_forwards)


def test_generate_batched_gives_each_prompt_its_seed(mid):
    """A scalar seed gives prompt i the seed seed + i; a list gives each prompt its own. Either
    way a prompt's sample is the same whatever the batch size and the prompt order."""
    _, _, prompts = make_batch([3, 9, 6, 4, 7], seed=7)
    by_two = qwen_generate_batched(mid, prompts, batch_size=2, seed=7, **SAMPLE)
    by_three = qwen_generate_batched(mid, prompts, batch_size=3, seed=7, **SAMPLE)
    backwards = qwen_generate_batched(
        mid, prompts[::-1], batch_size=5, seed=[11, 10, 9, 8, 7], **SAMPLE
    )
    for other, rows in [(by_three, slice(None)), (backwards, slice(None, None, -1))]:
        for f in ("tokens", "lengths", "accepted", "row_forwards"):
            np.testing.assert_array_equal(getattr(other, f)[rows], getattr(by_two, f), err_msg=f)
    for i in (0, 3):
        alone = qwen_generate(
            mid, np.asarray([prompts[i]]), [len(prompts[i])], seed=7 + i, **SAMPLE
        )
        np.testing.assert_array_equal(alone.tokens[0], by_two.tokens[i])
    greedy = qwen_generate_batched(mid, prompts, batch_size=2, **{**SAMPLE, "temperature": 0.0})
    assert np.mean(greedy.tokens != by_two.tokens) > 0.3
    with pytest.raises(ValueError, match="seed"):
        qwen_generate_batched(mid, prompts, batch_size=2, seed=[1, 2], **SAMPLE)


def test_loop_ends_even_if_a_step_accepts_nothing(mid, monkeypatch):
    """The loop condition bounds the forwards at max_new_tokens: a step that accepts no token
    (a bug) ends the decode instead of spinning forever."""
    ids, lengths, _ = make_batch([3, 9], seed=8)
    real = acceptance.accept_count

    def accept_nothing(token, ok, eos, budget):
        count, hit_eos = real(token, ok, eos, budget)
        return jnp.zeros_like(count), jnp.zeros_like(hit_eos)

    decode._generate.clear_cache()
    monkeypatch.setattr(acceptance, "accept_count", accept_nothing)
    try:
        out = qwen_generate(mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=5)
    finally:
        monkeypatch.undo()
        decode._generate.clear_cache()  # no later test may reuse the patched trace
    assert out.forwards == 5
    np.testing.assert_array_equal(out.accepted, 0)
    np.testing.assert_array_equal(out.row_forwards, 5)


# ----------------------------------------------------------------------------------------------
# Inputs at the edges of `decode.generate`.


KW = dict(block_size=4, threshold=0.9)


def test_an_empty_prompt_is_refused_naming_its_row(mid):
    ids, _, _ = make_batch([3, 5, 4])
    with pytest.raises(ValueError, match=r"row 1 has 0 \(an empty prompt\)"):
        qwen_generate(mid, ids, np.array([3, 0, 4]), max_new_tokens=4, **KW)
    with pytest.raises(ValueError, match=r"row 2 has 6"):
        qwen_generate(mid, ids, np.array([3, 5, 6]), max_new_tokens=4, **KW)
    with pytest.raises(ValueError, match="no prompts"):
        qwen_generate(mid, ids[:0], np.zeros((0,), np.int32), max_new_tokens=4, **KW)


def test_a_zero_budget_gives_empty_completions_without_compiling(mid, monkeypatch):
    ids, lengths, _ = make_batch([3, 5])

    def never(*args, **kwargs):
        raise AssertionError("the decoder was compiled or run for max_new_tokens=0")

    monkeypatch.setattr(decode, "_generate", never)
    calls = []
    out = qwen_generate(mid, ids, lengths, max_new_tokens=0, on_accept=calls.append, **KW)
    assert out.tokens.shape == (2, 0) and out.tokens.dtype == np.int32
    assert out.completions() == [[], []]
    np.testing.assert_array_equal(out.lengths, 0)
    np.testing.assert_array_equal(out.accepted, 0)
    assert out.forwards == 0 and out.tokens_per_forward == 0.0 and calls == []
    # The other arguments are still checked.
    with pytest.raises(ValueError, match="threshold"):
        qwen_generate(mid, ids, lengths, block_size=4, threshold=1.5, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        qwen_generate(mid, ids, lengths, max_new_tokens=-1, **KW)


def test_batch_of_64_early_eos_and_special_tokens_in_prompts(mid):
    ids, lengths, prompts = make_batch([6, 9] + [5, 8, 3, 7] * 15 + [4, 6], seed=11)
    # Row 1's prompt holds <|mask|> and <|endoftext|> as ordinary tokens.
    ids[1, 2], ids[1, 5], ids[1, 7] = MASK_ID, ENDOFTEXT_ID, MASK_ID
    prompts[1] = ids[1, : lengths[1]].tolist()
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    ref = [reference_mars(fwd, p, max_new=MAX_NEW, **KW)[0] for p in prompts[:2]]
    # The model now emits <|im_end|> where it emitted row 0's first token: row 0 ends at once.
    first = ref[0][0]
    assert first not in ref[1] and IM_END_ID not in ref[1] and ENDOFTEXT_ID not in ref[1]
    model = swap_head_columns(mid, first, IM_END_ID)
    assert len(ref[1]) == MAX_NEW  # row 1 runs to the budget

    out = qwen_generate(model, ids, lengths, max_new_tokens=MAX_NEW, **KW)
    assert out.tokens.shape == (64, MAX_NEW)
    assert out.lengths[0] == 0 and out.accepted[0] == 1 and out.row_forwards[0] <= 1
    np.testing.assert_array_equal(out.tokens[0], ENDOFTEXT_ID)  # cut, the last stop id after
    # The late row: its uncached reference (the prompt's <|mask|> read as a token) and itself
    # decoded alone, whatever the other 63 rows do.
    assert out.completions()[1] == ref[1]
    alone = qwen_generate(model, ids[1:2, : lengths[1]], lengths[1:2], max_new_tokens=MAX_NEW, **KW)
    np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])
    assert (out.accepted[1], out.row_forwards[1]) == (alone.accepted[0], alone.row_forwards[0])
    assert out.forwards >= alone.forwards


def test_a_prompt_longer_than_any_training_context_decodes(mid):
    # ModelConfig records no context limit and RoPE has none: a 700-token prompt (the tiny
    # model was never trained at all, let alone on 700 positions) decodes as the uncached
    # reference does, past the 512 positions of a small HF config.
    ids, lengths, prompts = make_batch([700, 3], seed=12)
    out = qwen_generate(mid, ids, lengths, max_new_tokens=MAX_NEW, **KW)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    assert out.completions()[0] == reference_mars(fwd, prompts[0], max_new=MAX_NEW, **KW)[0]
