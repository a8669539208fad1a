"""Acceptance rules of MARS threshold decoding (arXiv 2604.07023, Sec. 3.3): pure functions of
a forward's logits and its candidates that decide how many candidates after the first a row
accepts (`mars_jax.decode` describes the rules), and the reductions they share.

A rule is one `AcceptanceRule` subclass registered in `ACCEPTANCE_RULES`; `accept_count` turns
its per-candidate decisions into each row's count (left to right, stopping after an EOS and at
the row's budget); `confident` compares confidences with the rows' thresholds (never at 1.0);
`top_p_filter` is the sampling nucleus. Everything here is traced inside the decoder's programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mars_jax import decode_options
from mars_jax.decode_options import RULES


class AcceptanceRule:
    """How a step decides which candidates after the first to accept (module docstring).

    A rule gives each candidate a confidence on a [0, 1] scale; a candidate is accepted while
    its confidence (and every earlier one's) is >= the row's threshold. ``drafts`` rules
    (``verify``) instead propose the confident candidates as drafts that the next forward checks
    against its own AR predictions. A new rule is one subclass registered in `ACCEPTANCE_RULES`
    under a name of `decode_options.Rule` (where the settings it cannot run with are refused).
    """

    name: str = ""
    drafts: bool = False  # candidates become drafts verified by the next forward

    def confidence(self, logits: jax.Array, token: jax.Array) -> jax.Array:
        """float32 [...]: the confidence of choosing ``token`` int32 [...] from ``logits``
        [..., V]."""
        raise NotImplementedError


def log_probs(logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def pick(x: jax.Array, token: jax.Array) -> jax.Array:
    """x[..., token[...]] for x [..., V]: a one-hot select-and-sum (exact: one term is not
    zero), a reduction that fuses with the others over V where a gather would not (libtpu
    leaves a gather unestimated and unfused)."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.sum(jnp.where(index == token[..., None], x, jnp.zeros((), x.dtype)), axis=-1)


def _token_prob(logp: jax.Array, token: jax.Array) -> jax.Array:
    return jnp.exp(pick(logp, token))


def argmax(logits: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the largest of ``logits`` [..., V] (a NaN counts as the
    largest), as ``jnp.argmax``. Two plain reductions (the max, then the least index holding
    it) instead of argmax's paired (value, index) reduction, which XLA:CPU runs about 3x slower
    over a 152k vocabulary."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


class Prob(AcceptanceRule):
    """The chosen token's probability (the paper's rule)."""

    name = "prob"

    def confidence(self, logits, token):
        # log_softmax at the token alone, as jax.nn.log_softmax computes it (so bitwise equal),
        # without writing the [..., V] log-probabilities.
        logits = logits.astype(jnp.float32)
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        lse = jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
        return jnp.exp((pick(logits, token) - top) - lse)


class Entropy(AcceptanceRule):
    """exp(-entropy) of the distribution: 1 for a one-hot, 1/k for a uniform choice among k."""

    name = "entropy"

    def confidence(self, logits, token):
        logp = log_probs(logits)
        p = jnp.exp(logp)
        return jnp.exp(jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1))


class Margin(AcceptanceRule):
    """The chosen token's probability minus the largest other one."""

    name = "margin"

    def confidence(self, logits, token):
        logp = log_probs(logits)
        top2, idx = jax.lax.top_k(logp, 2)
        other = jnp.where(idx[..., 0] == token, top2[..., 1], top2[..., 0])
        return _token_prob(logp, token) - jnp.exp(other)


class Verify(Prob):
    """Lossless: confident candidates become drafts, kept only where the next forward's AR
    predictions agree (greedy AR output, token for token)."""

    name = "verify"
    drafts = True


# The registry (one dict, `decode_options.ACCEPTANCE_RULES`, so that DecodeOptions accepts the
# name of a rule registered here).
ACCEPTANCE_RULES: dict[str, AcceptanceRule] = decode_options.ACCEPTANCE_RULES
ACCEPTANCE_RULES.update({r.name: r for r in (Prob(), Entropy(), Margin(), Verify())})
assert tuple(ACCEPTANCE_RULES) == RULES, "each decode_options.Rule has its AcceptanceRule"


def confidence(logits: jax.Array, token: jax.Array, rule: str) -> jax.Array:
    """float32 [...]: the confidence of choosing ``token`` [...] from ``logits`` [..., V] under
    acceptance ``rule`` (a name of `ACCEPTANCE_RULES`)."""
    return ACCEPTANCE_RULES[rule].confidence(logits, token)


def accept_count(token: jax.Array, ok: jax.Array, eos: jax.Array, budget: jax.Array):
    """How many of a step's candidates each row accepts.

    token int32 [R, C] candidates; ok bool [R, C]: whether candidate i may follow candidate i-1
    (the first is always accepted); budget int32 [R]: the most tokens the row may accept now.
    Acceptance runs left to right while ok, stops after an EOS and at the budget. Returns
    (count int32 [R] in 1..C where budget >= 1, hit_eos bool [R]: an accepted candidate is EOS).
    """
    ok = ok.at[:, 0].set(True)
    is_eos = jnp.isin(token, eos)
    after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0
    count = jnp.minimum(jnp.cumprod(ok & ~after_eos, axis=1).sum(axis=1), budget)
    hit_eos = jnp.any(is_eos & (jnp.arange(token.shape[1])[None] < count[:, None]), axis=1)
    return count.astype(jnp.int32), hit_eos


def confident(conf: jax.Array, threshold: jax.Array) -> jax.Array:
    """bool [R, C]: conf [R, C] >= the row's threshold [R]; never where threshold >= 1.0
    (one-token mode, even where a probability rounds to 1.0)."""
    return (conf >= threshold[:, None]) & (threshold[:, None] < 1.0)


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits`` [R, C, V] with every token outside each row's nucleus set to the float
    minimum: row r keeps the most likely tokens while the probability before them is below
    top_p [R] (so the kept set is the smallest whose probabilities sum to >= top_p; ties at its
    edge kept), all of them where top_p >= 1."""
    desc = -jnp.sort(-logits, axis=-1)
    p = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p
    kept = (before < top_p[:, None, None]) | (top_p[:, None, None] >= 1.0)
    cutoff = jnp.min(jnp.where(kept, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= cutoff, logits, jnp.finfo(logits.dtype).min)
