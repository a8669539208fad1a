"""MARS threshold decoding with a functional KV cache (arXiv 2604.07023, Sec. 3.3).

Each forward scores the next ``block_size`` (B) positions of every row at once: the committed
text followed by ``<|mask|>`` tokens. With the right-shifted logits, the output at the last
committed position n-1 is the ordinary AR prediction of token n, and the output at the mask
standing for position n+i-1 predicts token n+i (i = 1..B-1). The first candidate is always
accepted, so one-token mode (threshold 1.0) reproduces greedy AR decoding exactly; later ones
are accepted left to right as the acceptance ``rule`` says:

- ``prob`` (the paper's default), ``entropy``, ``margin``: while the candidate's confidence is
  >= threshold. Confidence is the chosen token's probability; exp(-entropy) of the distribution
  (1 for a one-hot, 1/k for a uniform choice among k); or the chosen token's probability minus
  the largest other one. These are the reference's acceptance metrics, put on one [0, 1] scale.
- ``verify`` (lossless): the candidates after the first become *drafts*; the next forward feeds
  them as ordinary tokens, and keeps the longest run of drafts equal to the AR predictions made
  in that same forward, plus the AR token after it. The output is greedy AR decoding token for
  token; the threshold only chooses how many drafts are proposed.

Cache modes (``cache_mode``):

- ``sliding`` (default): every row keeps its own cursor and never waits for the others. Per
  step and row, the window starts at the first position whose key/value is not cached yet (the
  tokens accepted by the previous step), followed by the drafts (``verify``) and B-1 masks: at
  most 2B-1 slots. With ``adaptive_window`` a step whose rows all need at most B slots (one
  uncached token, no drafts) runs a B-slot window instead.
- ``block``: the reference's block cache (its block-cached sampler; the scheme of the paper's
  Table 5). Blocks of B positions are aligned to the start of generation. Each forward feeds
  the current block (accepted tokens, masks elsewhere) against the cache of the prefix; the
  block's first token comes from the prefix's last output. Once every row has filled its block,
  one more forward writes the block to the cache, so rows wait for each other at block ends.
- ``none``: no cache; every step recomputes the whole sequence (the plain semantics, for tests).

Sampling (``temperature`` > 0) draws each candidate from softmax(logits / temperature), within
the row's top_p nucleus, by Gumbel-max. Temperature and top_p only choose the candidate: the
confidence a threshold compares is the model's own probability of it (softmax at temperature 1,
before top_p), so a lower temperature or top_p makes the draw greedier, never the acceptance
looser, and temperature -> 0 decodes as greedy. The noise is keyed by the row's seed and the
*position* it is drawn for: ``fold_in(key(seed_r), p)``. A token's draw thus depends only on
its row's seed, the position and the logits there, never on the row's place in the batch, the
other rows, the padding width or how many forwards (or waits at block ends) the row needed. A request decodes the same alone and
in any batch, in every cache mode (``sliding`` and ``none`` also agree with each other; ``block``
is another scheme). A position drawn again after its candidate was rejected reuses its noise:
where the mask's distribution equals the AR one, the token kept is exactly an AR sample. Rows
with the same seed share noise position by position; give rows distinct seeds for independent
draws (`generate_batched` gives each prompt its own).

AR decoding is ``block_size=1`` in every mode. Cache slots at or past a row's cursor may hold
stale values; they are always rewritten before being attended.

Under a ``mesh`` the decoder runs sharded by the training rules: parameters as placed (see
`mars_jax.workdir.load_model`), rows over the batch axes, the KV cache's KV heads over
``tensor`` (`mars_jax.kv_cache.CACHE_AXES`).

Structure (after gemma's sampler loop and tunix's sampler): a frozen `Decoder` (the model's
graphdef and the static `DecoderSettings`) whose jitted methods ``prefill``, ``step`` (one
forward) and ``result`` are pure functions over the parameters and a `DecodeState`, which also
carries the per-row settings (threshold, max_accept, temperature, PRNG keys), so that each
piece compiles alone and a host loop (a server) can drive them, with ``insert``, ``free`` and
``new_tokens`` for its slots; ``Decoder.decode`` runs them as one ``lax.while_loop`` program.
The acceptance rules are `AcceptanceRule` classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mars_jax import decode_options
from mars_jax.decode_options import CACHE_MODES, RULES, DecodeOptions
from mars_jax.errors import InputError
from mars_jax.kv_cache import KVCache, init_cache, read_window, write_window
from mars_jax.model import Qwen2, causal_mask
from mars_jax.sharding import with_logical_constraint

__all__ = ["CACHE_MODES", "RULES", "DecodeOptions"]  # re-exported with the decoder


@dataclasses.dataclass
class DecodeOutput:
    """Result of `generate` for a batch of R prompts.

    tokens: int32 [R, max_new_tokens], the completion cut before the first EOS, then padded with
      the last of ``eos_ids`` (id 0 without any). lengths: int32 [R], completion lengths (EOS excluded).
    accepted: int32 [R], tokens accepted per row, the EOS included (what the forwards produced).
    row_forwards: int32 [R], decoding forwards in which each row was still active (in ``block``
      mode this includes forwards spent waiting for other rows and writing blocks to the cache).
    forwards: int, decoding forwards of the whole batch (the prefill is not counted); summed
      over batches by `concatenate`.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    accepted: np.ndarray
    row_forwards: np.ndarray
    forwards: int

    @property
    def tokens_per_forward(self) -> float:
        """Accepted tokens per decoding forward, summed over rows (1.0 in one-token mode)."""
        return float(self.accepted.sum() / max(self.row_forwards.sum(), 1))

    @property
    def row_tokens_per_forward(self) -> np.ndarray:
        """float64 [R]: each row's accepted tokens per forward in which it was active."""
        return self.accepted / np.maximum(self.row_forwards, 1)

    def completions(self) -> list[list[int]]:
        """Each row's completion as a list of token ids (EOS excluded)."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]

    @classmethod
    def concatenate(cls, outputs: Sequence["DecodeOutput"], rows: int | None = None):
        """The outputs of several batches as one, row after row, keeping the first ``rows``
        rows (default: all; drops filler rows)."""
        cat = lambda f: np.concatenate([getattr(o, f) for o in outputs])[:rows]
        fields = ("tokens", "lengths", "accepted", "row_forwards")
        return cls(*map(cat, fields), forwards=sum(o.forwards for o in outputs))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, rows: int | None = None):
    """Right-pads token-id lists into the inputs of `generate`.

    Returns (prompt_ids int32 [rows, P], prompt_lengths int32 [rows]) with P the longest prompt;
    ``rows`` (default: len(prompts)) may add filler rows (one pad token each) so that every
    batch has the same shape and compiles once. Raises ValueError for an empty prompt.
    """
    rows = len(prompts) if rows is None else rows
    ids = np.full((rows, max(map(len, prompts))), pad_id, np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
        if not len(p):
            raise InputError(f"prompt {i} is empty")
        ids[i, : len(p)], lengths[i] = p, len(p)
    return ids, lengths


# -- acceptance rules -----------------------------------------------------------------------------
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


def _log_probs(logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _at(x: jax.Array, token: jax.Array) -> jax.Array:
    """x[..., token[...]] for x [..., V]: a one-hot select-and-sum (exact: one term is not
    zero), a reduction that fuses with the others over V where a gather would not (libtpu
    leaves a gather unestimated and unfused)."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.sum(jnp.where(index == token[..., None], x, jnp.zeros((), x.dtype)), axis=-1)


def _token_prob(logp: jax.Array, token: jax.Array) -> jax.Array:
    return jnp.exp(_at(logp, token))


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
        return jnp.exp((_at(logits, token) - top) - lse)


class Entropy(AcceptanceRule):
    """exp(-entropy) of the distribution: 1 for a one-hot, 1/k for a uniform choice among k."""

    name = "entropy"

    def confidence(self, logits, token):
        logp = _log_probs(logits)
        p = jnp.exp(logp)
        return jnp.exp(jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1))


class Margin(AcceptanceRule):
    """The chosen token's probability minus the largest other one."""

    name = "margin"

    def confidence(self, logits, token):
        logp = _log_probs(logits)
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


def _count(token: jax.Array, ok: jax.Array, eos: jax.Array, budget: jax.Array):
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


def _confident(conf: jax.Array, threshold: jax.Array) -> jax.Array:
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


# -- state and result -----------------------------------------------------------------------------
@flax.struct.dataclass
class DecodeState:
    """Everything a decoding step reads and writes, for R rows and S slots (positions: prompt +
    budget + room for one window). The model's parameters travel beside it.

    Per-call settings (one value per row, so rows of one batch may differ):
    threshold: float32 [R], confidence needed after the first candidate (1.0: one token).
    max_accept: int32 [R], most tokens accepted per forward.
    temperature: float32 [R], 0 greedy, else sampled (only where the decoder samples).
    row_keys: PRNG keys [R], each row's sampling key (noise is keyed by key and position).
    top_p: float32 [R], nucleus sampling: a sampling row draws from the smallest set of tokens
      whose probabilities (after its temperature) sum to >= top_p (1.0: all).
    want_logprobs: bool [R], record the row's log-probabilities (where the decoder records).
    max_new_tokens: int32 [R], the row's budget (at most `DecoderSettings.max_new_tokens`, which
      sizes the slots): the row is done at it, inside a `steps` call too.
    prompt_lengths: int32 [R], where each completion starts.

    Decoding progress:
    cache: `KVCache`, per layer {"k", "v"} [R, S, K, H] (None in ``none`` mode); row r's slots
      below ``cache_cursor[r]`` hold the keys/values of its committed tokens.
    tokens: int32 [R, S], each row's prompt then its accepted tokens; past ``committed`` it holds
      the row's pending drafts (``verify``), or the prefix's prediction of the block's first
      token (``block``), then stale entries.
    committed: int32 [R], tokens committed so far (prompt + accepted): the position of the next
      token to decode.
    cache_cursor: int32 [R], first position whose key/value is not cached yet (``block``: the
      start of the row's current block); the tokens from it up to ``committed`` start the next
      window.
    num_drafts: int32 [R], drafts waiting at tokens[committed : committed + num_drafts], fed as
      ordinary tokens by the next forward (``verify`` only; 0 otherwise).
    new_tokens: int32 [R], tokens accepted so far (an EOS included).
    done: bool [R], the row accepted an EOS or reached ``max_new_tokens``.
    row_forwards: int32 [R], forwards in which the row was active.
    token_forwards: int32 [R, S], at each committed position of a completion, the row's forwards
      up to the one that accepted the token (a server counts an answer's forwards up to the
      token that ends it, not those a device call ran after).
    forwards: int32 [], forwards of the batch.

    Log-probabilities (None unless `DecoderSettings.logprobs` is set; K its value):
    logprobs: float32 [R, S], at each committed position the token's log-probability under the
      model's distribution in the forward that chose it (before temperature and top_p).
    top_ids, top_logprobs: int32 / float32 [R, S, K], the K most likely tokens there.
    """

    threshold: jax.Array
    max_accept: jax.Array
    temperature: jax.Array
    row_keys: jax.Array
    top_p: jax.Array
    want_logprobs: jax.Array
    max_new_tokens: jax.Array
    prompt_lengths: jax.Array
    cache: KVCache | None
    tokens: jax.Array
    committed: jax.Array
    cache_cursor: jax.Array
    num_drafts: jax.Array
    new_tokens: jax.Array
    done: jax.Array
    row_forwards: jax.Array
    token_forwards: jax.Array
    forwards: jax.Array
    logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


@flax.struct.dataclass
class DecodeResult:
    """The device-side result of a decode (`DecodeOutput` is its host copy; fields as there):
    tokens int32 [R, max_new_tokens], lengths, accepted, row_forwards int32 [R], forwards
    int32 []."""

    tokens: jax.Array
    lengths: jax.Array
    accepted: jax.Array
    row_forwards: jax.Array
    forwards: jax.Array


@flax.struct.dataclass
class NewTokens:
    """What a host loop reads back after some steps (`Decoder.new_tokens`, on the device, or
    `Decoder.read_new_tokens`, its host copy), for R rows, ``sent`` int32 [R] tokens of each
    already seen:
    tokens: int32 [R, W], row r's tokens from position prompt_lengths[r] + sent[r]; only the first
      new_tokens[r] - sent[r] are committed (the rest are drafts or stale).
    new_tokens, row_forwards: int32 [R], as in `DecodeState`. forwards: int32 [], the batch's.
    token_forwards: int32 [R, W], those of ``tokens`` (`DecodeState`).
    logprobs [R, W], top_ids and top_logprobs [R, W, K]: those of ``tokens`` (`DecodeState`),
      None where the decoder records none."""

    tokens: Any
    new_tokens: Any
    row_forwards: Any
    forwards: Any
    token_forwards: Any = None
    logprobs: Any = None
    top_ids: Any = None
    top_logprobs: Any = None


# -- the decoder ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecoderSettings:
    """The static settings of one decoder program (hashable: part of the jit cache key).
    ``rule`` is a name of `ACCEPTANCE_RULES`; ``sampling`` whether any row samples;
    ``logprobs`` (None: none) records each committed token's log-probability and the
    ``logprobs`` most likely alternatives for the rows that ask (``sliding`` and ``none``)."""

    block_size: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    mask_id: int
    sampling: bool
    cache_mode: str
    rule: str
    adaptive_window: bool
    mesh: Mesh | None
    axis_rules: Any  # flax logical-axis rules ((name, mesh axes), ...) or None
    on_accept: Callable | None
    logprobs: int | None = None

    @classmethod
    def of(
        cls,
        options: DecodeOptions,
        *,
        eos_ids: Sequence[int],
        mask_id: int | None,
        sampling: bool | None = None,
        mesh: Mesh | None = None,
        axis_rules: Any = None,
        on_accept: Callable | None = None,
        logprobs: int | None = None,
    ) -> DecoderSettings:
        """The program's settings of (already checked) ``options``: the one place they turn
        into static settings. ``sampling`` defaults to whether the options sample; the mask id
        as `mask_id_for` (None only at block size 1)."""
        if logprobs is not None and (logprobs < 0 or options.cache_mode.value == "block"):
            raise InputError(f"logprobs: {logprobs}; needs >= 0 and cache_mode sliding or none")
        return cls(
            block_size=options.block_size,
            max_new_tokens=options.max_new_tokens,
            eos_ids=tuple(int(e) for e in eos_ids),
            mask_id=mask_id_for(mask_id, options.block_size),
            sampling=options.sampling if sampling is None else sampling,
            cache_mode=options.cache_mode.value,
            rule=options.rule_name,
            adaptive_window=options.adaptive_window,
            mesh=mesh,
            axis_rules=None if axis_rules is None else tuple(axis_rules),
            on_accept=on_accept,
            logprobs=logprobs,
        )

    @property
    def max_forwards(self) -> int:
        """Forwards that finish every row: each active row accepts >= 1 token per forward,
        except in ``block`` mode, which adds one cache-writing forward per block."""
        b, n = self.block_size, self.max_new_tokens
        return n + (-(-n // b) if self.cache_mode == "block" and b > 1 else 0)

    @property
    def window(self) -> int:
        """Query slots of a full sliding window: at most B uncached tokens (or 1 token and B-1
        drafts), then B-1 masks."""
        return 2 * self.block_size - 1

    def slots(self, prompt_len: int) -> int:
        """Cache and token slots per row for prompts of ``prompt_len``: the prompt, the budget
        and room for two windows past it."""
        return prompt_len + self.max_new_tokens + 2 * self.window


_static_self = functools.partial(jax.jit, static_argnums=0)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One decoder program: ``graphdef`` (the model's structure) and its static ``settings``.

    Its pure functions over (parameters, `DecodeState`) are jitted methods, each of which can be
    lowered and compiled alone (``Decoder.step.lower(decoder, params, state)``):

      state = decoder.prefill(params, prompt_ids, prompt_lengths, threshold, max_accept,
                              temperature, row_keys)
      while not decoder.finished(state): state = decoder.step(params, state)   # one forward
      result = decoder.result(state)

    A prompt can also be prefilled in chunks (the serving engine's long prompts):
    ``state = decoder.begin(...)`` with the same arguments as ``prefill``, then
    ``state = decoder.prefill_chunk(params, state, chunk_ids, chunk_start)`` per chunk.

    A continuous-batching host loop (`mars_jax.engine`, after JetStream's prefill / insert /
    generate / free) keeps only slot ids and host counts, and leaves every device update here:

      batch = decoder.insert(batch, group_state, slots)      # prefilled requests into slots
      batch = decoder.steps(params, batch, num_steps)        # a few forwards of every row
      new = decoder.read_new_tokens(batch, sent, width)      # host numpy: tokens since ``sent``
      batch = decoder.free(batch, rows)                      # rows bool [R] marked done

    with `seed_keys` making the rows' PRNG keys of integer seeds.

    `decode` runs the same as one program (a ``lax.while_loop``); `generate` is its checked,
    host-side entry. Under ``settings.mesh`` every method runs sharded by ``settings.axis_rules``.
    """

    graphdef: Any
    settings: DecoderSettings

    @property
    def acceptance(self) -> AcceptanceRule:
        """The `AcceptanceRule` named by ``settings.rule``."""
        return ACCEPTANCE_RULES[self.settings.rule]

    @contextlib.contextmanager
    def _on_mesh(self):
        st = self.settings
        with contextlib.ExitStack() as stack:
            if st.mesh is not None:
                stack.enter_context(jax.sharding.use_abstract_mesh(st.mesh.abstract_mesh))
                stack.enter_context(nnx.logical_axis_rules(st.axis_rules))
            yield

    # The jitted entry points: each enters the mesh and traces the `_`-method of its name.
    @_static_self
    def prefill(
        self,
        params,
        prompt_ids,
        prompt_lengths,
        threshold,
        max_accept,
        temperature,
        row_keys,
        top_p=1.0,
        want_logprobs=False,
        max_new_tokens=None,
    ) -> DecodeState:
        """The state after the prompts' forward (no token decoded yet).

        prompt_ids int32 [R, P] (right-padded), prompt_lengths int32 [R] in 1..P; threshold
        float32 [R]; max_accept int32 [] or [R]; temperature float32 [] or [R]; row_keys: one
        PRNG key or one per row [R]; top_p float32 [] or [R]; want_logprobs bool [] or [R];
        max_new_tokens int32 [] or [R], each row's budget (None: the decoder's).
        Unchecked: `generate` checks its arguments.
        """
        with self._on_mesh():
            return self._prefill(
                nnx.merge(self.graphdef, params),
                prompt_ids,
                prompt_lengths,
                threshold,
                max_accept,
                temperature,
                row_keys,
                top_p,
                want_logprobs,
                max_new_tokens,
            )

    @_static_self
    def begin(
        self,
        params,
        prompt_ids,
        prompt_lengths,
        threshold,
        max_accept,
        temperature,
        row_keys,
        top_p=1.0,
        want_logprobs=False,
        max_new_tokens=None,
    ) -> DecodeState:
        """A chunked prefill's first state (``sliding`` or ``none`` mode; arguments as
        `prefill`): the prompts' tokens and settings with an empty cache, which
        `prefill_chunk` then fills one chunk at a time (``none``: no cache, nothing to fill).
        Once every prompt slot is written, decode from it as from `prefill`'s state."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            s = self._initial(
                prompt_ids,
                prompt_lengths,
                threshold,
                max_accept,
                temperature,
                row_keys,
                top_p,
                want_logprobs,
                max_new_tokens,
            )
            if self.settings.cache_mode == "none":
                return s
            cache = init_cache(model.cfg, *s.tokens.shape)
            return s.replace(cache=cache, cache_cursor=prompt_lengths - 1)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def prefill_chunk(self, params, state: DecodeState, ids, start) -> DecodeState:
        """``state`` with the keys/values of ids int32 [R, C] at positions start int32 [R] +
        0..C-1 written into its cache (donated): one chunk of a prompt (see `begin`). The
        chunk's queries attend to every slot up to their own position, the earlier chunks'."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            _, cache = self._forward(model, ids, start, state.cache)
            return state.replace(cache=cache)

    @_static_self
    def step(self, params, state: DecodeState) -> DecodeState:
        """One decoding forward of the whole batch (finished rows are carried unchanged)."""
        with self._on_mesh():
            return self._step(nnx.merge(self.graphdef, params), state)

    @functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=2)
    def steps(self, params, state: DecodeState, num_steps: int) -> DecodeState:
        """Up to ``num_steps`` forwards in one program (fewer once `finished`): a host loop's
        unit of work. ``state`` is donated (its KV cache is updated in place)."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            return jax.lax.while_loop(
                lambda c: (c[0] < num_steps) & ~self.finished(c[1]),
                lambda c: (c[0] + 1, self._step(model, c[1])),
                (jnp.int32(0), state),
            )[1]

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def branch(self, params, state: DecodeState, name: str) -> DecodeState:
        """One forward of the program `step` runs as ``name`` (one of `branches`), alone: what a
        step costs in each of its cases."""
        with self._on_mesh():
            return self._branch(nnx.merge(self.graphdef, params), state, name)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def insert(self, state: DecodeState, group: DecodeState, slots) -> DecodeState:
        """``state`` (R rows, donated) with row g of ``group`` (G rows, same S) written into row
        slots[g] (int32 [G], or [] for a one-row group): its KV cache row, tokens, cursors and
        settings; a slot outside 0..R-1 drops its row (a padding row). The batch's
        ``forwards`` kept."""
        slots = jnp.atleast_1d(slots)

        def put(big, small):
            return big.at[slots].set(small, mode="drop")

        fields = {
            f.name: put(getattr(state, f.name), getattr(group, f.name))
            for f in dataclasses.fields(state)
            if f.name not in ("cache", "forwards") and getattr(state, f.name) is not None
        }
        cache = None
        if state.cache is not None:
            cache = {
                n: state.cache[n].at[:, slots].set(group.cache[n], mode="drop") for n in state.cache
            }
        return state.replace(cache=cache, **fields)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def free(self, state: DecodeState, rows) -> DecodeState:
        """``state`` (donated) with the rows of bool [R] ``rows`` marked done (`steps` carries
        them unchanged) and the batch's ``forwards`` reset to 0 (a host loop that runs for ever
        counts its own; `finished` compares it with `DecoderSettings.max_forwards`)."""
        return state.replace(done=state.done | rows, forwards=jnp.zeros_like(state.forwards))

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def new_tokens(self, state: DecodeState, sent, width: int) -> NewTokens:
        """`NewTokens` of ``width`` (W) tokens per row from prompt_lengths + sent (int32 [R]):
        one gather, not the whole [R, S] buffer. W = num_steps * block_size covers a `steps`
        call (a forward accepts at most block_size tokens per row); `read_new_tokens` reads
        again past W."""
        slots = state.tokens.shape[1]
        at = state.prompt_lengths[:, None] + sent[:, None] + jnp.arange(width)
        at = jnp.minimum(at, slots - 1)
        tokens = jnp.take_along_axis(state.tokens, at, axis=1)
        new = NewTokens(
            tokens,
            state.new_tokens,
            state.row_forwards,
            state.forwards,
            token_forwards=jnp.take_along_axis(state.token_forwards, at, axis=1),
        )
        if state.logprobs is None:
            return new
        return new.replace(
            logprobs=jnp.take_along_axis(state.logprobs, at, axis=1),
            top_ids=jnp.take_along_axis(state.top_ids, at[:, :, None], axis=1),
            top_logprobs=jnp.take_along_axis(state.top_logprobs, at[:, :, None], axis=1),
        )

    def read_new_tokens(self, state: DecodeState, sent, width: int) -> NewTokens:
        """Host side of `new_tokens`: numpy arrays, with every row's committed tokens past
        ``sent`` (int [R]) in ``tokens`` [R, W'] (W' = ``width``, or a multiple of it where some
        row has more unseen tokens: one more read per ``width``)."""
        sent = np.asarray(sent, np.int32)
        new = jax.device_get(self.new_tokens(state, sent, width))
        pieces = [new]
        while (new.new_tokens - sent > width * len(pieces)).any():
            more = self.new_tokens(state, sent + width * len(pieces), width)
            pieces.append(jax.device_get(more))
        names = ("tokens", "token_forwards")
        if new.logprobs is not None:
            names += ("logprobs", "top_ids", "top_logprobs")
        return new.replace(
            **{n: np.concatenate([getattr(p, n) for p in pieces], axis=1) for n in names}
        )

    @_static_self
    def result(self, state: DecodeState) -> DecodeResult:
        """Each row's completion, cut before its first EOS."""
        with self._on_mesh():
            return self._result(state)

    def finished(self, state: DecodeState) -> jax.Array:
        """bool []: every row is done, or the forwards reached `DecoderSettings.max_forwards`
        (which also ends a decode should a step ever accept nothing)."""
        return jnp.all(state.done) | (state.forwards >= self.settings.max_forwards)

    def decode(
        self,
        params,
        prompt_ids,
        prompt_lengths,
        threshold,
        max_accept,
        temperature,
        row_keys,
        top_p=1.0,
    ) -> DecodeResult:
        """prefill, the steps in a ``lax.while_loop`` and the result, traced as one program
        (call it inside ``jit``, as `_generate` does). Arguments as `prefill`."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            s = self._prefill(
                model,
                prompt_ids,
                prompt_lengths,
                threshold,
                max_accept,
                temperature,
                row_keys,
                top_p,
            )
            s = jax.lax.while_loop(lambda s: ~self.finished(s), lambda s: self._step(model, s), s)
            return self._result(s)

    # -- the traced pieces ------------------------------------------------------------------------
    def _sampled(self, s: DecodeState, logits: jax.Array) -> jax.Array:
        """The model's logits [R, C, V] as each sampling row draws from them: divided by its
        temperature, those outside its top_p nucleus at the float minimum. Only the draw reads
        them (confidences and log-probabilities are the model's own). Greedy rows' logits are
        left as they are."""
        t = s.temperature[:, None, None]
        logits = logits / jnp.where(t > 0, t, 1.0)
        nucleus = (s.temperature > 0) & (s.top_p < 1.0)
        top_p = jnp.where(nucleus, s.top_p, 1.0)
        return jax.lax.cond(jnp.any(nucleus), lambda x: top_p_filter(x, top_p), lambda x: x, logits)

    def _record(self, s: DecodeState, logits: jax.Array, token: jax.Array) -> DecodeState:
        """``s`` with the log-probabilities of ``token`` int32 [R, C] (the candidates at
        positions committed + 0..C-1) under the model's logits [R, C, V], and the K most likely
        tokens there, written at those positions (where any active row wants them)."""
        k = self.settings.logprobs
        if k is None:
            return s

        def write(s):
            logp = _log_probs(logits)
            s = s.replace(logprobs=write_window(s.logprobs, _at(logp, token), s.committed))
            if k == 0:
                return s
            top, ids = jax.lax.top_k(logp, k)
            return s.replace(
                top_logprobs=write_window(s.top_logprobs, top, s.committed),
                top_ids=write_window(s.top_ids, ids.astype(jnp.int32), s.committed),
            )

        return jax.lax.cond(jnp.any(s.want_logprobs & ~s.done), write, lambda s: s, s)

    def _choose(self, s: DecodeState, logits: jax.Array, positions: jax.Array) -> jax.Array:
        """int32 [R, C]: greedy or sampled candidates from the model's fp32 logits [R, C, V],
        where candidate [r, c] is the token at position positions[r, c] (int32 [R, C]). A
        sampling row draws from `_sampled`'s logits with Gumbel noise keyed by
        fold_in(row_keys[r], position) (module docstring)."""
        if self.settings.sampling:
            logits = self._sampled(s, logits)

            def noise(key, position):
                key = jax.random.fold_in(key, position)
                return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

            by_row = jax.vmap(jax.vmap(noise, in_axes=(None, 0)))(s.row_keys, positions)
            logits = logits + jnp.where(s.temperature[:, None, None] > 0, by_row, 0.0)
        return argmax(logits)

    def _forward(self, model: Qwen2, ids, start, cache):
        """ids [R, W] at positions start[r] + 0..W-1 against the cache (written first), or a
        full causal forward from position 0 without a cache. Returns (hidden [R, W, D], cache)."""
        pos = start[:, None] + jnp.arange(ids.shape[1])
        if cache is None:
            return model(ids, pos, causal_mask(ids.shape[1]))
        slot_ids = jnp.arange(cache["k"].shape[2])
        return model(ids, pos, slot_ids[None, None, :] <= pos[:, :, None], cache, start)

    def _budget(self, s: DecodeState) -> jax.Array:
        return jnp.minimum(s.max_new_tokens - s.new_tokens, s.max_accept)

    def _advance(
        self,
        s: DecodeState,
        *,
        cache,
        tokens,
        count,
        hit_eos,
        cache_cursor,
        num_drafts=None,
        accepted=None,
        forward=True,
    ) -> DecodeState:
        """The next state after a forward (``forward``: counted as one) in which each active row
        accepted ``count`` tokens, the first ``count`` of ``accepted`` [R, C]."""
        st = self.settings
        active = ~s.done
        count = jnp.where(active, count, 0)
        if st.on_accept is not None and accepted is not None:
            jax.debug.callback(st.on_accept, accepted, count, ordered=True)
        new_tokens = s.new_tokens + count
        keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
        row_forwards = s.row_forwards + (active & forward)
        token_forwards = s.token_forwards
        if accepted is not None:  # the accepted tokens' forward (stale past count: rewritten)
            at = jnp.broadcast_to(row_forwards[:, None], accepted.shape)
            token_forwards = keep(write_window(s.token_forwards, at, s.committed), s.token_forwards)
        return s.replace(
            cache=cache,
            tokens=_rowwise(keep(tokens, s.tokens)),
            committed=s.committed + count,
            cache_cursor=keep(cache_cursor, s.cache_cursor),
            num_drafts=s.num_drafts if num_drafts is None else keep(num_drafts, s.num_drafts),
            new_tokens=new_tokens,
            done=s.done | hit_eos | (new_tokens >= s.max_new_tokens),
            row_forwards=row_forwards,
            token_forwards=_rowwise(token_forwards),
            forwards=s.forwards + forward,
        )

    def _initial(
        self,
        prompt_ids,
        prompt_lengths,
        threshold,
        max_accept,
        temperature,
        row_keys,
        top_p=1.0,
        want_logprobs=False,
        max_new_tokens=None,
    ) -> DecodeState:
        """The state before any forward: the prompts in their token slots, no cache."""
        st = self.settings
        rows, prompt_len = prompt_ids.shape
        slots = st.slots(prompt_len)
        per_row = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (rows,))
        row_keys = row_keys if row_keys.ndim == 1 else jnp.broadcast_to(row_keys, (rows,))
        return DecodeState(
            threshold=per_row(threshold, jnp.float32),
            max_accept=per_row(max_accept, jnp.int32),
            temperature=per_row(temperature, jnp.float32),
            row_keys=row_keys,
            top_p=per_row(top_p, jnp.float32),
            want_logprobs=per_row(want_logprobs, bool),
            max_new_tokens=per_row(
                st.max_new_tokens if max_new_tokens is None else max_new_tokens, jnp.int32
            ),
            prompt_lengths=prompt_lengths,
            cache=None,
            tokens=_rowwise(jnp.zeros((rows, slots), jnp.int32).at[:, :prompt_len].set(prompt_ids)),
            committed=prompt_lengths,
            cache_cursor=jnp.zeros_like(prompt_lengths),
            num_drafts=jnp.zeros((rows,), jnp.int32),
            new_tokens=jnp.zeros((rows,), jnp.int32),
            done=jnp.zeros((rows,), bool),
            row_forwards=jnp.zeros((rows,), jnp.int32),
            token_forwards=_rowwise(jnp.zeros((rows, slots), jnp.int32)),
            forwards=jnp.int32(0),
            **self._logprob_slots(rows, slots),
        )

    def _logprob_slots(self, rows: int, slots: int) -> dict[str, jax.Array]:
        k = self.settings.logprobs
        if k is None:
            return {}
        return dict(
            logprobs=jnp.zeros((rows, slots), jnp.float32),
            top_ids=jnp.zeros((rows, slots, k), jnp.int32),
            top_logprobs=jnp.zeros((rows, slots, k), jnp.float32),
        )

    def _prefill(
        self,
        model,
        prompt_ids,
        prompt_lengths,
        threshold,
        max_accept,
        temperature,
        row_keys,
        top_p=1.0,
        want_logprobs=False,
        max_new_tokens=None,
    ) -> DecodeState:
        st = self.settings
        s = self._initial(
            prompt_ids,
            prompt_lengths,
            threshold,
            max_accept,
            temperature,
            row_keys,
            top_p,
            want_logprobs,
            max_new_tokens,
        )
        if st.cache_mode == "none":
            return s
        rows, prompt_len = prompt_ids.shape
        slots = s.tokens.shape[1]
        # Every prompt token's key/value; slots past a row's prompt hold stale values.
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (rows, prompt_len))
        cache = init_cache(model.cfg, rows, slots)
        hidden, cache = model(
            prompt_ids, positions, jnp.arange(slots)[None, None, :] <= positions[:, :, None], cache
        )
        # sliding: the last prompt token starts the first window; block: the first block starts
        # after the prompt, and its first token is predicted from the prompt's last output.
        if st.cache_mode == "sliding":
            return s.replace(cache=cache, cache_cursor=prompt_lengths - 1)
        last = read_window(hidden, prompt_lengths - 1, 1)
        first = self._choose(s, model.logits(last), prompt_lengths[:, None])
        return s.replace(
            cache=cache,
            cache_cursor=prompt_lengths,
            tokens=write_window(s.tokens, first, prompt_lengths),
        )

    @property
    def branches(self) -> tuple[str, ...]:
        """The forwards a step chooses between: ``narrow`` (a B-slot window) and ``wide``
        (2B-1 slots) for ``sliding`` (``wide`` only without the adaptive window or at B = 1),
        ``full`` (the whole sequence) for ``none``, ``fill`` and ``commit`` for ``block``."""
        st = self.settings
        if st.cache_mode == "block":
            return ("commit",) if st.block_size == 1 else ("fill", "commit")
        if st.cache_mode == "none":
            return ("full",)
        return ("narrow", "wide") if st.adaptive_window and st.block_size > 1 else ("wide",)

    def _branch(self, model, s: DecodeState, name: str) -> DecodeState:
        if name not in self.branches:
            raise InputError(f"branch {name!r}: this decoder's are {self.branches}")
        if name == "fill":
            return self._block_fill(model, s)
        if name == "commit":
            return self._block_commit(model, s)
        width = {"full": s.tokens.shape[1], "narrow": self.settings.block_size}
        return self._window_step(model, s, width.get(name, self.settings.window))

    def _step(self, model, s: DecodeState) -> DecodeState:
        st, B = self.settings, self.settings.block_size
        run = lambda name: lambda s: self._branch(model, s, name)
        if st.cache_mode == "block":
            if B == 1:
                return run("commit")(s)
            full = jnp.all(s.done | (s.committed - s.cache_cursor == B))
            return jax.lax.cond(full, run("commit"), run("fill"), s)
        if len(self.branches) == 1:
            return run(self.branches[0])(s)
        # The widest window an active row needs: its uncached tokens and drafts, then B-1 masks.
        need = jnp.max(jnp.where(s.done, 0, s.committed + s.num_drafts - s.cache_cursor)) + B - 1
        return jax.lax.cond(need <= B, run("narrow"), run("wide"), s)

    # -- sliding / none: a window from the first uncached position ------------------------------
    def _window_step(self, model, s: DecodeState, width: int) -> DecodeState:
        st, B = self.settings, self.settings.block_size
        eos = jnp.asarray(st.eos_ids, jnp.int32)
        if s.cache is None:  # the whole sequence from position 0
            start, window_ids = jnp.zeros_like(s.cache_cursor), s.tokens
        else:
            start, window_ids = s.cache_cursor, read_window(s.tokens, s.cache_cursor, width)
        fed = s.committed + s.num_drafts  # committed tokens and drafts; masks after them
        pos = start[:, None] + jnp.arange(width)
        ids = jnp.where(pos < fed[:, None], window_ids, st.mask_id)
        hidden, cache = self._forward(model, ids, start, s.cache)
        # Output at position committed-1+i predicts token committed+i (i < B).
        first = s.committed - 1 - start
        logits = model.logits(read_window(hidden, first, B))  # [R, B, V]
        token = self._choose(s, logits, s.committed[:, None] + jnp.arange(B))
        s = self._record(s, logits, token)
        if not self.acceptance.drafts:
            ok = _confident(self.acceptance.confidence(logits, token), s.threshold)
            count, hit_eos = _count(token, ok, eos, self._budget(s))
            return self._advance(
                s,
                cache=cache,
                tokens=write_window(s.tokens, token, s.committed),
                count=count,
                hit_eos=hit_eos,
                cache_cursor=s.committed,
                accepted=token,
            )
        # verify: candidate i (i >= 1) is the AR prediction after draft i-1; it is exact while
        # every draft before it equals the AR prediction at its position.
        drafts = read_window(s.tokens, s.committed, B)
        i = jnp.arange(1, B)[None]
        ok = (i <= s.num_drafts[:, None]) & (drafts[:, :-1] == token[:, :-1])
        count, hit_eos = _count(token, jnp.pad(ok, ((0, 0), (1, 0))), eos, self._budget(s))
        tokens = write_window(s.tokens, token, s.committed)
        # New drafts: the masks after the last draft predict the tokens after the AR token that
        # follows it; they are valid only where every draft was accepted.
        if B > 1:
            after = read_window(hidden, first + s.num_drafts + 1, B - 1)
            draft_logits = model.logits(after)
            new_drafts = self._choose(s, draft_logits, (s.committed + s.num_drafts)[:, None] + i)
            sure = _confident(self.acceptance.confidence(draft_logits, new_drafts), s.threshold)
            # The next step accepts at most its drafts + 1 tokens: no more drafts than that uses.
            room = jnp.minimum(s.max_new_tokens - s.new_tokens - count, s.max_accept) - 1
            num = jnp.minimum(jnp.cumprod(sure, axis=1).sum(axis=1), jnp.maximum(room, 0))
            all_ok = (count == s.num_drafts + 1) & ~hit_eos
            num_drafts = jnp.where(all_ok, num, 0).astype(jnp.int32)
            tokens = write_window(tokens, new_drafts, s.committed + count)
        else:
            num_drafts = jnp.zeros_like(s.num_drafts)
        return self._advance(
            s,
            cache=cache,
            tokens=tokens,
            count=count,
            hit_eos=hit_eos,
            cache_cursor=s.committed + count - 1,
            num_drafts=num_drafts,
            accepted=token,
        )

    # -- block: the reference's block cache -------------------------------------------------------
    def _block_fill(self, model, s: DecodeState) -> DecodeState:
        st, B = self.settings, self.settings.block_size
        eos = jnp.asarray(st.eos_ids, jnp.int32)
        block_pos = jnp.arange(B)
        start = s.cache_cursor
        filled = s.committed - start
        block = read_window(s.tokens, start, B)
        ids = jnp.where(block_pos[None] < filled[:, None], block, st.mask_id)
        hidden, cache = self._forward(model, ids, start, s.cache)  # block keys rewritten later
        # Candidate for block position i: the prefix's prediction (i = 0) or slot i-1's output.
        logits = model.logits(hidden[:, : B - 1])
        token = self._choose(s, logits, start[:, None] + block_pos[None, 1:])
        conf = self.acceptance.confidence(logits, token)
        cand = jnp.concatenate([block[:, :1], token], axis=1)  # [R, B]
        conf = jnp.concatenate([jnp.ones_like(conf[:, :1]), conf], axis=1)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, B)))
        cand = read_window(pad(cand), filled, B)
        ok = _confident(read_window(pad(conf), filled, B), s.threshold)
        count, hit_eos = _count(cand, ok, eos, jnp.minimum(self._budget(s), B - filled))
        return self._advance(
            s,
            cache=cache,
            tokens=write_window(s.tokens, cand, s.committed),
            count=count,
            hit_eos=hit_eos,
            cache_cursor=start,
            accepted=cand,
        )

    def _block_commit(self, model, s: DecodeState) -> DecodeState:
        B = self.settings.block_size
        if B == 1:  # the block's one token is the prefix's prediction: accept it, then commit
            eos = jnp.asarray(self.settings.eos_ids, jnp.int32)
            pending = read_window(s.tokens, s.committed, 1)
            count, hit_eos = _count(pending, jnp.ones_like(pending, bool), eos, self._budget(s))
            s = self._advance(
                s,
                cache=s.cache,
                tokens=s.tokens,
                count=count,
                hit_eos=hit_eos,
                cache_cursor=s.cache_cursor,
                accepted=pending,
                forward=False,
            )
            write = functools.partial(self._write_block, model)
            return jax.lax.cond(jnp.all(s.done), lambda s: s, write, s)
        return self._write_block(model, s)

    def _write_block(self, model, s: DecodeState) -> DecodeState:
        B = self.settings.block_size
        start = s.cache_cursor
        hidden, cache = self._forward(model, read_window(s.tokens, start, B), start, s.cache)
        # The next block's first token.
        token = self._choose(s, model.logits(hidden[:, B - 1 :]), (start + B)[:, None])
        zero = jnp.zeros_like(start)
        return self._advance(
            s,
            cache=cache,
            tokens=write_window(s.tokens, token, start + B),
            count=zero,
            hit_eos=zero.astype(bool),
            cache_cursor=start + B,
        )

    def _result(self, s: DecodeState) -> DecodeResult:
        n = self.settings.max_new_tokens
        eos = jnp.asarray(self.settings.eos_ids, jnp.int32)
        new = s.prompt_lengths[:, None] + jnp.arange(n)
        out = jnp.take_along_axis(s.tokens, new, axis=1)  # a gather, once: no loop over rows
        within = jnp.arange(n)[None] < s.new_tokens[:, None]
        is_eos = jnp.isin(out, eos) & within
        lengths = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), s.new_tokens)
        filler = self.settings.eos_ids[-1] if self.settings.eos_ids else 0  # a real token
        out = jnp.where(jnp.arange(n)[None] < lengths[:, None], out, filler)
        return DecodeResult(
            out, lengths.astype(jnp.int32), s.new_tokens, s.row_forwards, s.forwards
        )


def _rowwise(x: jax.Array) -> jax.Array:
    """``x`` [R, ...] constrained to rows over the batch axes (where a mesh is active)."""
    return with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _generate(
    graphdef,
    params,
    prompt_ids,
    prompt_lengths,
    threshold,
    max_accept,
    temperature,
    rng,
    top_p=1.0,
    *,
    settings: DecoderSettings,
) -> DecodeResult:
    """The whole decode as one jitted program: `Decoder.decode` (arguments as its)."""
    return Decoder(graphdef, settings).decode(
        params, prompt_ids, prompt_lengths, threshold, max_accept, temperature, rng, top_p
    )


def seed_keys(seeds) -> jax.Array:
    """PRNG keys [R], ``jax.random.key`` of each of the integer ``seeds`` [R] (0..2**32-1): the
    rows' sampling keys (``row_keys`` of `Decoder.prefill` and `Decoder.begin`)."""
    return jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seeds).astype(np.uint32)))


def mask_id_for(mask_id: int | None, block_size: int) -> int:
    """``mask_id`` as the decoder's setting: None (a model without ``<|mask|>``) is refused
    for block_size > 1, and is never fed at block size 1 (no masks after the one token)."""
    if mask_id is None:
        if block_size > 1:
            raise InputError(
                f"mask_id: None; block size {block_size} feeds <|mask|> tokens, and this model "
                "has none (decode with block size 1)"
            )
        return -1
    return int(mask_id)


def generate(
    model: Qwen2,
    prompt_ids: np.ndarray,
    prompt_lengths: np.ndarray,
    options: DecodeOptions | None = None,
    *,
    eos_ids: Sequence[int],
    mask_id: int | None,
    seed: int | Sequence[int] | np.ndarray = 0,
    mesh: Mesh | None = None,
    axis_rules: Any = None,
    on_accept: Callable[[np.ndarray, np.ndarray], None] | None = None,
    **fields,
) -> DecodeOutput:
    """Decodes a batch of prompts with MARS threshold decoding (one jitted program).

    What it does is ``options``, a `DecodeOptions` (checked when it was built), or, without
    one, the DecodeOptions of ``fields`` (block_size, threshold, max_new_tokens, cache_mode,
    rule, temperature, max_accept, adaptive_window); the fields are explained there and below.

    Args:
      model: a `Qwen2` (MARS-trained, or any AR model with threshold 1.0).
      prompt_ids: int [R, P] prompts, right-padded with any id; which tokens are valid comes only
        from ``prompt_lengths`` (a prompt may itself contain <|endoftext|>).
      prompt_lengths: int [R], each in 1..P. There is no context limit here: RoPE positions
        run on past any length the model was trained on (the prompt plus ``max_new_tokens``
        needs only cache memory); staying within the model's trained context (an HF config's
        ``max_position_embeddings``, which `ModelConfig` does not record) is the caller's
        choice.
      options.threshold: one value, or one per row (R values). 1.0 accepts exactly one token
        per forward (AR decoding), even where a probability rounds to 1.0. With
        ``rule="verify"`` it chooses how many drafts to propose.
      options.max_new_tokens: 0 returns empty completions (tokens [R, 0], zero counts) after
        the argument checks, without compiling or running the model.
      options.cache_mode, options.rule: module docstring.
      options.temperature, options.top_p: choose the candidates (> 0: sampled); the threshold
        compares the model's own probability of each (module docstring).
      eos_ids: tokens that end a row; the output is cut before the first one, even where a
        forward accepted tokens past it.
      mask_id: id of <|mask|>.
      seed: PRNG seed for sampling, in 0..2**32-1: one for every row, or one per row [R]. Row r's
        sample depends only on its prompt, its seed and the settings, not on the batch (module
        docstring); rows with equal seeds share noise position by position.
      mesh, axis_rules: decode sharded on ``mesh`` by the flax logical-axis rules
        ``axis_rules`` (`mars_jax.sharding.logical_rules`; not the acceptance ``rule``); the
        parameters should already be placed by the same rules (`mars_jax.workdir.load_model`
        does).
      on_accept: called on the host after every forward that may accept tokens, with
        (candidates int32 [R, C], counts int32 [R]): row r accepted candidates[r, :counts[r]]
        (0 for finished rows). For streaming; ordered; the EOS, if any, is included.

    Returns:
      A `DecodeOutput`. Raises ValueError for inconsistent shapes or lengths (naming the rows
      whose length is outside 1..P, e.g. an empty prompt), no rows, per-row thresholds that are
      not one per row, a seed that is not an integer in 0..2**32-1 or not one for every row, a
      mesh without axis_rules, and (`decode_options.OptionError`) bad ``fields``.
    """
    if options is None:
        options = DecodeOptions(**fields)
    elif fields:
        raise InputError(f"pass options or their fields, not both (got {sorted(fields)})")
    prompt_ids = np.asarray(prompt_ids, np.int32)
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    if prompt_ids.ndim != 2 or prompt_lengths.shape != prompt_ids.shape[:1]:
        raise InputError(
            f"prompt_ids must be [R, P] and prompt_lengths [R]; got "
            f"{prompt_ids.shape} and {prompt_lengths.shape}"
        )
    rows = prompt_ids.shape[0]
    if rows == 0:
        raise InputError("no prompts: prompt_ids has no rows")
    bad = np.flatnonzero((prompt_lengths < 1) | (prompt_lengths > prompt_ids.shape[1]))
    if bad.size:
        raise InputError(
            f"prompt_lengths must lie in 1..{prompt_ids.shape[1]}; "
            + ", ".join(
                f"row {r} has {prompt_lengths[r]}"
                + (" (an empty prompt)" if prompt_lengths[r] < 1 else "")
                for r in bad[:8]
            )
            + (f" and {bad.size - 8} more" if bad.size > 8 else "")
        )
    threshold = np.asarray(options.threshold, np.float32)
    if threshold.ndim and threshold.shape != (rows,):
        raise InputError(f"threshold: {threshold.size} values for {rows} rows; give one per row")
    threshold = np.broadcast_to(threshold, (rows,))
    block_size, max_new_tokens = options.block_size, options.max_new_tokens
    seeds = np.asarray(seed)
    if seeds.dtype.kind not in "iu" or seeds.shape not in ((), (rows,)):
        raise InputError(f"seed must be one integer or one per row ({rows}); got {seed!r}")
    if seeds.min() < 0 or seeds.max() >= 2**32:
        raise InputError(f"seeds must lie in 0..2**32-1; got {seed!r}")
    seeds = np.broadcast_to(seeds, (rows,)).astype(np.uint32)
    if (mesh is None) != (axis_rules is None):
        raise InputError("mesh and axis_rules go together: pass both or neither")
    mask_id = mask_id_for(mask_id, block_size)
    if max_new_tokens == 0:  # nothing to decode: empty completions, nothing compiled or run
        zeros = np.zeros((rows,), np.int32)
        return DecodeOutput(np.zeros((rows, 0), np.int32), zeros, zeros.copy(), zeros.copy(), 0)
    settings = DecoderSettings.of(
        options,
        eos_ids=eos_ids,
        mask_id=mask_id,
        mesh=mesh,
        axis_rules=axis_rules,
        on_accept=on_accept,
    )
    graphdef, params = nnx.split(model)
    out = _generate(
        graphdef,
        params,
        jnp.asarray(prompt_ids),
        jnp.asarray(prompt_lengths),
        jnp.asarray(threshold),
        jnp.int32(options.accept_limit),
        jnp.float32(options.temperature),
        seed_keys(seeds),
        jnp.float32(options.top_p),
        settings=settings,
    )
    out = jax.device_get(out)
    return DecodeOutput(out.tokens, out.lengths, out.accepted, out.row_forwards, int(out.forwards))


def generate_batched(
    model: Qwen2,
    prompts: Sequence[Sequence[int]],
    options: DecodeOptions | None = None,
    *,
    batch_size: int,
    pad_id: int,
    seed: int | Sequence[int] | np.ndarray = 0,
    **kwargs,
) -> DecodeOutput:
    """Decodes any number of prompts (lists of token ids) in batches of ``batch_size`` rows.

    Every batch has the same shape [batch_size, longest prompt] (the last one is filled with
    one-token filler rows), so the decoder compiles once. ``seed`` is one integer, giving prompt
    i the seed ``seed + i`` (independent draws per prompt), or one seed per prompt [N]; either
    way a prompt's sample does not depend on ``batch_size`` or on the other prompts (`generate`).
    Seeds must lie in 0..2**32-1. ``options`` and ``kwargs`` go to `generate` (the ids, or the
    fields of the options; a per-row threshold is not supported here). Returns one `DecodeOutput` with a row per prompt, in order. Raises ValueError as
    `pad_prompts` and `generate`, and for a seed list whose length is not the number of prompts.
    """
    num_batches = -(-len(prompts) // batch_size)
    ids, lengths = pad_prompts(prompts, pad_id, rows=num_batches * batch_size)
    seeds = np.asarray(seed)
    if seeds.ndim == 0 and seeds.dtype.kind in "iu":
        seeds = int(seeds) + np.arange(len(prompts), dtype=np.int64)
    if seeds.shape != (len(prompts),):
        raise InputError(
            f"seed must be one integer or one per prompt ({len(prompts)}); got {seed!r}"
        )
    seeds = np.pad(seeds, (0, len(ids) - len(prompts)))  # filler rows: seed 0
    outputs = [
        generate(
            model,
            ids[i : i + batch_size],
            lengths[i : i + batch_size],
            options,
            seed=seeds[i : i + batch_size],
            **kwargs,
        )
        for i in range(0, len(ids), batch_size)
    ]
    return DecodeOutput.concatenate(outputs, rows=len(prompts))
