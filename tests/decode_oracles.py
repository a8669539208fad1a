"""Independent oracles for the decoder tests: tiny random fp32 models with the real Qwen2.5
special-token ids, and uncached references of each decoding scheme written in plain Python over
a full causal forward per step (greedy AR, the MARS acceptance rules, the block-cached scheme).

Random models are unconfident; multiplying the final RMSNorm weight by ``scale`` multiplies every
logit, which makes the output distribution as peaked as needed (scale 300: a mix of confident and
unconfident candidates; scale 1000: many probabilities that are exactly 1.0 in fp32).
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax import decode, engine
from mars_jax.decode_options import DecodeOptions
from mars_jax.decode_state import DecoderSettings
from mars_jax.model import CausalLM, ModelConfig, causal_mask
from mars_jax.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_ID

VOCAB = 151680  # covers 151643..151665 (<|endoftext|> .. <|mask|>)
EOS = (IM_END_ID, ENDOFTEXT_ID)
MAX_NEW = 16
CFG = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    tie_word_embeddings=False,  # a tied head would mostly predict the input token back
)


def make_model(scale: float, seed: int = 0) -> CausalLM:
    model = CausalLM(CFG, rngs=nnx.Rngs(seed))
    model.norm.weight[...] = model.norm.weight[...] * scale
    return model


def make_batch(lengths, width=None, pad=ENDOFTEXT_ID, seed=0):
    """Prompts of the given lengths (random ordinary ids, some with special ids inside, among
    them <|endoftext|> and <|im_end|>), right-padded to ``width`` with ``pad``."""
    rng = np.random.default_rng(seed)
    width = width or max(lengths)
    ids = np.full((len(lengths), width), pad, np.int32)
    prompts = []
    for r, n in enumerate(lengths):
        p = rng.integers(0, ENDOFTEXT_ID, size=n).astype(np.int32)
        if n >= 3 and r % 2 == 0:
            p[1] = ENDOFTEXT_ID
            p[n // 2] = IM_START_ID
        if n >= 4 and r % 3 == 1:
            p[2] = IM_END_ID
            p[0] = ENDOFTEXT_ID
        ids[r, :n] = p
        prompts.append(p.tolist())
    return ids, np.asarray(lengths, np.int32), prompts


@functools.partial(jax.jit, static_argnums=(0, 4))
def _logits_at(graphdef, state, ids, start, size):
    """Full causal forward over ids [1, T] (no cache); fp32 logits of positions
    start .. start + size - 1. Ids after the last position read cannot affect it (causal)."""
    model = nnx.merge(graphdef, state)
    t = ids.shape[1]
    hidden, _ = model(ids, jnp.arange(t)[None], causal_mask(t))
    return model.logits(jax.lax.dynamic_slice_in_dim(hidden[0], start, size, axis=0))


class Uncached:
    """Full-recompute forward of ``model`` on a fixed-width buffer (one compilation)."""

    def __init__(self, model, width):
        self.graphdef, self.state = nnx.split(model)
        self.width = width

    def logits(self, seq, start, size):
        buf = np.zeros((1, self.width), np.int32)
        buf[0, : len(seq)] = seq
        return np.asarray(_logits_at(self.graphdef, self.state, jnp.asarray(buf), start, size))


def reference_ar(fwd: Uncached, prompt, max_new, eos=EOS):
    """Greedy AR: argmax of the last position of a full forward, until EOS or the budget.
    Returns (completion without EOS, tokens generated incl. EOS, max probabilities seen)."""
    seq, out, probs = list(prompt), [], []
    while len(out) < max_new:
        logits = fwd.logits(seq, len(seq) - 1, 1)[0]
        token = int(np.argmax(logits))
        probs.append(float(np.max(jax.nn.softmax(jnp.asarray(logits)))))
        seq.append(token)
        out.append(token)
        if token in eos:
            break
    cut = next((i for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut], len(out), probs


def reference_mars(
    fwd: Uncached,
    prompt,
    *,
    block_size,
    threshold,
    max_new,
    eos=EOS,
    mask_id=MASK_ID,
    rule="prob",
    max_accept=None,
    temperature=0.0,
    top_p=1.0,
    seed=0,
):
    """The MARS acceptance rule, uncached: each step forwards committed tokens + B-1 masks
    (positions n .. n+B-2) and reads the outputs at n-1 .. n+B-2 as candidates for n .. n+B-1;
    the first is accepted, then left to right while confidence (`rule_confidence`) >= threshold
    (exactly one when threshold >= 1) and at most ``max_accept`` per step; accepting stops
    after an EOS and at the budget. With ``temperature`` > 0 the candidates are drawn as
    `sample` draws them and the confidence is the model's own probability of each (``prob``).

    Returns (completion cut before the first EOS, accepted incl. EOS, forwards, per-step lists).
    """
    threshold = np.float32(threshold)
    seq, out, steps = list(prompt), [], []
    while True:
        n = len(seq)
        logits = fwd.logits(seq + [mask_id] * (block_size - 1), n - 1, block_size)
        if temperature > 0:
            assert rule == "prob"
            tokens = [sample(logits[i], temperature, top_p, seed, n + i) for i in range(block_size)]
            conf = [model_probability(logits[i], t) for i, t in enumerate(tokens)]
        else:
            tokens = np.argmax(logits, axis=-1)
            conf = rule_confidence(logits, rule)
        step, finished = [], False
        for i in range(min(block_size, max_accept or block_size)):
            if i > 0 and (threshold >= 1.0 or not conf[i] >= threshold):
                break
            step.append(int(tokens[i]))
            if tokens[i] in eos or len(out) + len(step) == max_new:
                finished = True
                break
        seq += step
        out += step
        steps.append(step)
        if finished:
            break
    cut = next((i for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut], len(out), len(steps), steps


def sample(logits, temperature, top_p, seed, position) -> int:
    """The token drawn from logits [V] at ``position`` by a row of seed ``seed``, in numpy:
    argmax of logits / temperature, outside the top_p nucleus (the fewest most likely tokens
    whose probabilities sum to >= top_p) at -inf, plus the Gumbel noise of
    fold_in(key(seed), position) (the decoder's keying, `mars_jax.decode`)."""
    z = np.asarray(logits, np.float64) / temperature
    if top_p < 1.0:
        order = np.argsort(-z)
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        before = np.cumsum(p) - p
        z = np.where(np.isin(np.arange(z.size), order[before < top_p]), z, -np.inf)
    key = jax.random.fold_in(jax.random.key(np.uint32(seed)), position)
    noise = np.asarray(jax.random.gumbel(key, z.shape, jnp.float32), np.float64)
    return int(np.argmax(z + noise))


def model_probability(logits, token) -> np.float32:
    """The model's own probability of ``token`` under logits [V] (softmax at temperature 1)."""
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max())
    return np.float32(p[token] / p.sum())


def rule_confidence(logits, rule):
    """float32 [C]: the confidence of each greedy candidate (logits [C, V]) under an acceptance
    rule, in numpy: top probability (prob), exp(-entropy) (entropy), or top minus second
    probability (margin)."""
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top2 = -np.sort(-p, axis=-1)[:, :2]
    if rule == "entropy":
        return np.exp(np.sum(p * np.log(np.maximum(p, 1e-300)), axis=-1)).astype(np.float32)
    if rule == "margin":
        return (top2[:, 0] - top2[:, 1]).astype(np.float32)
    return top2[:, 0].astype(np.float32)


def reference_block(
    fwd: Uncached, prompt, *, block_size, threshold, max_new, eos=EOS, mask_id=MASK_ID
):
    """The reference's block-cached scheme, uncached and for one row alone: blocks of B positions
    from the end of the prompt; each forward feeds the committed text, the block's accepted
    tokens and masks for the rest of the block, reads candidates for the unfilled positions (the
    first from the output before it, i.e. the prefix's last output for a fresh block) and
    accepts as `reference_mars`; a full block costs one more forward (writing it to the cache)
    unless the row is done. With B = 1 the candidate needs no forward (it is the last output).

    Returns (completion cut before the first EOS, accepted incl. EOS, forwards).
    """
    threshold = np.float32(threshold)
    seq, out, forwards, done = list(prompt), [], 0, False
    while not done:
        p0, block = len(seq), []
        while len(block) < block_size and not done:
            filled = len(block)
            ids = seq + block + [mask_id] * (block_size - filled)
            logits = fwd.logits(ids, p0 - 1 + filled, block_size - filled)
            forwards += block_size > 1
            tokens = np.argmax(logits, axis=-1)
            conf = rule_confidence(logits, "prob")
            for i in range(block_size - filled):
                if i > 0 and (threshold >= 1.0 or not conf[i] >= threshold):
                    break
                block.append(int(tokens[i]))
                out.append(int(tokens[i]))
                if tokens[i] in eos or len(out) == max_new:
                    done = True
                    break
        seq += block
        forwards += not done  # the forward that writes the full block to the cache
    cut = next((i for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut], len(out), forwards


def assert_matches_references(out, refs):
    for r, (completion, accepted, forwards) in enumerate(refs):
        n = len(completion)
        assert out.lengths[r] == n, f"row {r}"
        np.testing.assert_array_equal(out.tokens[r, :n], completion, err_msg=f"row {r}")
        assert np.all(out.tokens[r, n:] == ENDOFTEXT_ID), f"row {r}: padding after the cut"
        assert out.accepted[r] == accepted, f"row {r}"
        assert out.row_forwards[r] == forwards, f"row {r}"
    assert out.forwards == max(f for _, _, f in refs)


def swap_head_columns(model, a, b):
    """A copy of ``model`` whose LM head predicts ``b`` wherever it predicted ``a`` (and back)."""
    graphdef, state = nnx.split(model)
    swapped = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    w = swapped.lm_head.kernel[...]
    swapped.lm_head.kernel[...] = w.at[:, [a, b]].set(w[:, [b, a]])
    return swapped


# The decoder and the engine take every id from the loaded model's tokenizer; these tests'
# models have rows for Qwen2.5's ids, so they pass those (any argument given wins).
QWEN_IDS = dict(eos_ids=EOS, mask_id=MASK_ID)
qwen_generate = functools.partial(decode.generate, **QWEN_IDS)
qwen_generate_batched = functools.partial(decode.generate_batched, pad_id=ENDOFTEXT_ID, **QWEN_IDS)


def qwen_settings(*, sampling=False, mesh=None, axis_rules=None, **fields) -> DecoderSettings:
    """The `DecoderSettings` of the `DecodeOptions` of ``fields`` (block size 4 and
    MAX_NEW unless given) with Qwen2.5's ids, as `decode.generate` builds them."""
    options = DecodeOptions(**{"block_size": 4, "max_new_tokens": MAX_NEW, **fields})
    return DecoderSettings.of(
        options, **QWEN_IDS, sampling=sampling, mesh=mesh, axis_rules=axis_rules
    )


_ENGINE_ARGS = set(inspect.signature(engine.Engine).parameters) - {"model", "options"}


def qwen_engine(model, **kwargs) -> engine.Engine:
    """An `engine.Engine` of ``model`` with Qwen2.5's ids; the keyword arguments that are not the
    engine's are the fields of its `DecodeOptions`."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in _ENGINE_ARGS}
    return engine.Engine(
        model, DecodeOptions(**fields), **{"pad_id": ENDOFTEXT_ID, **QWEN_IDS, **kwargs}
    )
