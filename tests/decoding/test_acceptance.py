"""The acceptance rules (`mars_jax.acceptance`): a new rule is one class, and the reductions
that replace argmax and log_softmax agree with jax's own bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax import acceptance
from tests.decode_oracles import make_batch, qwen_generate


class AcceptAll(acceptance.AcceptanceRule):
    """A rule that accepts every candidate: the test of 'a new rule is one class'."""

    name = "accept_all"

    def confidence(self, logits, token):
        return jnp.ones(token.shape, jnp.float32)


def test_a_new_rule_is_one_class(mid, monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCE_RULES, "accept_all", AcceptAll())
    ids, lengths, _ = make_batch([5, 9], seed=3)
    out = qwen_generate(
        mid,
        ids,
        lengths,
        block_size=4,
        threshold=0.99,
        max_new_tokens=12,
        rule="accept_all",
        eos_ids=(),
    )
    # Every forward accepts all B = 4 candidates: 12 tokens in 3 forwards per row.
    np.testing.assert_array_equal(out.accepted, 12)
    np.testing.assert_array_equal(out.row_forwards, 3)


def test_argmax_and_prob_confidence_equal_jax_bit_for_bit():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 1000)) * 4
    logits = logits.at[0, 1, 7].set(logits[0, 1].max()).at[0, 1, 3].set(logits[0, 1].max())
    logits = logits.at[1, 2, 9].set(jnp.nan).at[1, 2, 20].set(jnp.nan)
    np.testing.assert_array_equal(
        np.asarray(acceptance.argmax(logits)), np.asarray(jnp.argmax(logits, axis=-1))
    )
    assert int(acceptance.argmax(logits)[0, 1]) == 3 and int(acceptance.argmax(logits)[1, 2]) == 9
    finite = logits.at[1, 2].set(0.0)
    for token in (jnp.argmax(finite, -1), jax.random.randint(jax.random.key(1), (3, 5), 0, 1000)):
        expect = jnp.exp(
            jnp.take_along_axis(jax.nn.log_softmax(finite), token[..., None], axis=-1)[..., 0]
        )
        got = jax.jit(acceptance.ACCEPTANCE_RULES["prob"].confidence)(finite, token)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expect))
