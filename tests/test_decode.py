"""Tests of mars_jax.decode's default scheme (per-row cursors, ``prob`` rule) against the uncached
references of `decode_oracles`: one-token mode is greedy AR, threshold decoding follows the
acceptance rule, batch invariance, EOS, budget, sampling and argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode_oracles import (
    MAX_NEW,
    Uncached,
    assert_matches_references,
    make_batch,
    make_model,
    reference_ar,
    reference_mars,
)
from flax import nnx
from mars_jax import decode
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID


@pytest.fixture(scope="module")
def flat():
    return make_model(1.0)


@pytest.fixture(scope="module")
def mid():
    return make_model(300.0)


@pytest.fixture(scope="module")
def peaked():
    return make_model(1000.0)


# ----------------------------------------------------------------------------------------------
# (a) one-token mode is greedy AR.


@pytest.mark.parametrize("which", ["flat", "mid", "peaked"])
def test_threshold_one_is_greedy_ar(which, request):
    model = request.getfixturevalue(which)
    ids, lengths, prompts = make_batch([3, 9, 6, 1], seed=1)
    out = decode.generate(
        model, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW
    )
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
        multi = decode.generate(
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
    out = decode.generate(
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
    out = decode.generate(
        mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW, mask_id=other
    )
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd, p, block_size=4, threshold=0.9, max_new=MAX_NEW, mask_id=other)[:3]
        for p in prompts
    ]
    assert_matches_references(out, refs)
    default = decode.generate(mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert not np.array_equal(default.tokens, out.tokens) or not np.array_equal(
        default.accepted, out.accepted
    ) or not np.array_equal(default.row_forwards, out.row_forwards)


# ----------------------------------------------------------------------------------------------
# (c) batch invariance.


def test_prompt_alone_equals_prompt_in_batch(mid):
    ids, lengths, prompts = make_batch([4, 10, 7], seed=4)
    target = 0  # the shortest row: the most padding in the batch
    alone = decode.generate(
        mid, ids[target:target + 1, : lengths[target]], lengths[target:target + 1],
        block_size=4, threshold=0.9, max_new_tokens=MAX_NEW,
    )
    assert alone.tokens_per_forward > 1.0
    # The same prompt inside batches of different widths and padding ids.
    for width, pad, order in [(10, ENDOFTEXT_ID, [1, 0, 2]), (17, 12345, [2, 1, 0])]:
        batch = np.full((3, width), pad, np.int32)
        for row, r in enumerate(order):
            batch[row, : lengths[r]] = prompts[r]
        out = decode.generate(
            mid, batch, lengths[order], block_size=4, threshold=0.9, max_new_tokens=MAX_NEW
        )
        row = order.index(target)
        np.testing.assert_array_equal(out.tokens[row], alone.tokens[0])
        assert out.lengths[row] == alone.lengths[0]
        assert out.accepted[row] == alone.accepted[0]
        assert out.row_forwards[row] == alone.row_forwards[0]


# ----------------------------------------------------------------------------------------------
# EOS, budget, sampling, argument checks.


def _swap_head_columns(model, a, b):
    """A copy of ``model`` whose LM head predicts ``b`` wherever it predicted ``a`` (and back)."""
    graphdef, state = nnx.split(model)
    swapped = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    w = swapped.lm_head.kernel[...]
    swapped.lm_head.kernel[...] = w.at[:, [a, b]].set(w[:, [b, a]])
    return swapped


def test_eos_cuts_the_output_inside_a_multi_token_step(mid):
    ids, lengths, prompts = make_batch([5, 2, 11, 7], seed=2)
    fwd = Uncached(mid, ids.shape[1] + MAX_NEW + 4)
    # Find an accepted token that was followed by more accepted tokens in the same forward,
    # and that neither occurred before it in the completion nor in a candidate role for EOS.
    pick = None
    for r, p in enumerate(prompts):
        completion, _, _, steps = reference_mars(fwd, p, block_size=4, threshold=0.9, max_new=MAX_NEW)
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
    model = _swap_head_columns(mid, token, IM_END_ID)
    out = decode.generate(model, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert out.lengths[row] == cut
    np.testing.assert_array_equal(out.tokens[row, :cut], original[:cut])
    assert np.all(out.tokens[row, cut:] == ENDOFTEXT_ID)
    assert out.accepted[row] == cut + 1  # the EOS is counted, nothing after it
    assert IM_END_ID not in out.tokens.ravel().tolist()
    fwd2 = Uncached(model, ids.shape[1] + MAX_NEW + 4)
    refs = [
        reference_mars(fwd2, p, block_size=4, threshold=0.9, max_new=MAX_NEW)[:3] for p in prompts
    ]
    assert_matches_references(out, refs)

    # Without <|im_end|> among the EOS ids the row runs on past it.
    out = decode.generate(
        model, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW,
        eos_ids=(ENDOFTEXT_ID,),
    )
    assert out.tokens[row, cut] == IM_END_ID
    assert out.lengths[row] > cut


@pytest.mark.parametrize("budget", [1, 5, 7])
def test_max_new_tokens_is_respected(peaked, budget):
    ids, lengths, prompts = make_batch([3, 9, 6], seed=5)
    full = decode.generate(peaked, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert full.tokens_per_forward > 1.5 and np.all(full.lengths == MAX_NEW)
    out = decode.generate(peaked, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=budget)
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
    a = decode.generate(flat, ids, lengths, seed=0, **kw)
    b = decode.generate(flat, ids, lengths, seed=0, **kw)
    c = decode.generate(flat, ids, lengths, seed=1, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.accepted, b.accepted)
    assert np.mean(a.tokens != c.tokens) > 0.5  # a near-uniform model: almost every token differs
    greedy = decode.generate(flat, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    assert np.mean(a.tokens != greedy.tokens) > 0.5
    # Confidence is the sampled token's probability, tiny on a flat model: one token per forward.
    assert a.tokens_per_forward == 1.0
    # A uniform model (all logits 0): every draw is fresh, across steps, rows and positions.
    uniform = decode.generate(make_model(0.0), ids, lengths, seed=0, **kw)
    for row in uniform.tokens:
        assert len(set(row.tolist())) >= MAX_NEW - 2
    assert uniform.tokens_per_forward == 1.0
    # Near-zero temperature samples the argmax: one-token mode then equals greedy decoding.
    cold = decode.generate(
        mid, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW, temperature=1e-4
    )
    hot = decode.generate(mid, ids, lengths, block_size=4, threshold=1.0, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(cold.tokens, hot.tokens)


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
            decode.generate(flat, bad_ids, bad_lengths, **kw)
    with pytest.raises(ValueError):
        decode.generate(flat, ids, lengths, block_size=0, threshold=0.9, max_new_tokens=4)
    with pytest.raises(ValueError):
        decode.generate(flat, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=0)


def test_pad_prompts():
    ids, lengths = decode.pad_prompts([[5, 6, 7], [8]], pad_id=ENDOFTEXT_ID, rows=3)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, ENDOFTEXT_ID, ENDOFTEXT_ID],
                                        [ENDOFTEXT_ID] * 3])
    np.testing.assert_array_equal(lengths, [3, 1, 1])
    assert ids.dtype == lengths.dtype == np.int32
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decode.pad_prompts([[1], []], pad_id=0)


def test_generate_batched_equals_each_batch(mid):
    """Batches of 2 (the last one filled with a filler row) give each prompt the tokens and
    counts of decoding its own batch, in order; the summary counts are computed once."""
    _, _, prompts = make_batch([3, 9, 6, 4, 7], seed=7)
    kw = dict(block_size=4, threshold=0.9, max_new_tokens=MAX_NEW)
    out = decode.generate_batched(mid, prompts, batch_size=2, pad_id=ENDOFTEXT_ID, **kw)
    assert out.tokens.shape == (5, MAX_NEW)
    width = max(map(len, prompts))
    parts = []
    for i in range(0, 5, 2):
        ids, lengths = decode.pad_prompts(prompts[i : i + 2], ENDOFTEXT_ID, rows=2)
        ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=ENDOFTEXT_ID)
        parts.append(decode.generate(mid, ids, lengths, **kw))
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


def test_loop_ends_even_if_a_step_accepts_nothing(mid, monkeypatch):
    """The loop condition bounds the forwards at max_new_tokens: a step that accepts no token
    (a bug) ends the decode instead of spinning forever."""
    ids, lengths, _ = make_batch([3, 9], seed=8)
    real = decode._count

    def accept_nothing(token, ok, eos, budget):
        count, hit_eos = real(token, ok, eos, budget)
        return jnp.zeros_like(count), jnp.zeros_like(hit_eos)

    decode._generate.clear_cache()
    monkeypatch.setattr(decode, "_count", accept_nothing)
    try:
        out = decode.generate(mid, ids, lengths, block_size=4, threshold=0.9, max_new_tokens=5)
    finally:
        monkeypatch.undo()
        decode._generate.clear_cache()  # no later test may reuse the patched trace
    assert out.forwards == 5
    np.testing.assert_array_equal(out.accepted, 0)
    np.testing.assert_array_equal(out.row_forwards, 5)
