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

Structure (after gemma's sampler loop and tunix's sampler), bottom-up:
`mars_jax.acceptance` holds the acceptance rules (`AcceptanceRule` classes, pure functions of a
forward's logits); `mars_jax.decode_state` the values (the static `DecoderSettings` of a
program, each row's `RowSettings`, the `DecodeState` that carries them from forward to forward);
`mars_jax.decoder` the `Decoder`, whose jitted methods ``prefill``, ``step`` (one forward),
``steps`` and ``result`` are pure functions over the parameters and a state, so that each piece
compiles alone and a host loop (the serving engine) can drive them with ``insert``, ``free``
and ``new_tokens``; and this module the host API: `generate` (checked arguments, one jitted
program: ``Decoder.decode``, a ``lax.while_loop``) and `generate_batched`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mars_jax.decode_options import CACHE_MODES, RULES, DecodeOptions
from mars_jax.decode_state import DecodeResult, DecoderSettings, RowSettings, mask_id_for
from mars_jax.decoder import Decoder
from mars_jax.errors import InputError
from mars_jax.model import CausalLM

__all__ = ["CACHE_MODES", "RULES", "DecodeOptions"]  # re-exported with the host API


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


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _generate(
    params, prompt_ids, prompt_lengths, row_settings: RowSettings, *, graphdef, settings
) -> DecodeResult:
    """The whole decode as one jitted program: `Decoder.decode` of the `Decoder` (graphdef,
    settings), arguments as its."""
    return Decoder(graphdef, settings).decode(params, prompt_ids, prompt_lengths, row_settings)


def generate(
    model: CausalLM,
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
      model: a `CausalLM` (MARS-trained, or any AR model with threshold 1.0).
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
        params,
        jnp.asarray(prompt_ids),
        jnp.asarray(prompt_lengths),
        RowSettings.of(options, rows, seed=seeds),
        graphdef=graphdef,
        settings=settings,
    )
    out = jax.device_get(out)
    return DecodeOutput(out.tokens, out.lengths, out.accepted, out.row_forwards, int(out.forwards))


def generate_batched(
    model: CausalLM,
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
