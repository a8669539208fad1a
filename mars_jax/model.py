"""Qwen2 / Qwen2.5 decoder in Flax NNX, with the Qwen3 and Llama 3 families as variants.

One model serves every use in MARS (arXiv 2604.07023, Sec. 3): causal AR training, the
``[noisy | clean]`` MARS layout (explicit position ids and an explicit boolean attention mask)
and cached decoding (a functional KV cache, `mars_jax.kv_cache`: arrays in, arrays out).

Architecture as in transformers' ``Qwen2ForCausalLM``: token embedding; per layer
RMSNorm -> grouped-query attention (q/k/v with bias, o without; rotary embeddings with
``rope_theta`` in the rotate-half layout) -> residual -> RMSNorm -> SwiGLU MLP -> residual;
final RMSNorm; LM head tied to the embedding or separate. The families (``ModelConfig.family``)
differ only where transformers' classes do: Qwen3 has no q/k/v biases and an RMSNorm over each
query and key head before RoPE (``qk_norm``); Llama 3 has no biases and the "llama3" RoPE
frequency scaling (``rope_type``).

Precision: parameters are stored in ``param_dtype`` and matmuls run in ``dtype``; attention
scores and softmax (`mars_jax.attention`), RMSNorm and the rotary tables are fp32.

Sharding: every parameter carries the logical names of its axes as flax partitioning metadata
(``nnx.with_partitioning``; vocab, embed, heads, kv_heads, mlp, norm), which `mars_jax.sharding`
maps to mesh axes. `abstract_model` is the shape-only model that all loading and placement
starts from; `abstract_params` gives its parameters their shardings on a mesh.

Shape notation: R rows (batch), T query length, S key length (cache slots), D hidden size,
N query heads, K kv heads, H head dim, V embedding rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mars_jax.attention import IMPLEMENTATIONS, Segmented, attend, attend_cache
from mars_jax.errors import InputError
from mars_jax.kv_cache import KVCache, write_cache
from mars_jax.sharding import Rules, check_heads, param_shardings, with_logical_constraint

# Rematerialisation policies of a decoder layer's backward pass: keep every activation ("none"),
# recompute all of them ("full"), or keep only matmul outputs ("dots").
REMAT = ("none", "full", "dots")
# Attention implementations (see `mars_jax.attention`).
ATTENTION = IMPLEMENTATIONS


# Model families and what each fixes: (q/k/v biases by default, RMSNorm on query and key heads).
FAMILIES = {"qwen2": (True, False), "qwen3": (False, True), "llama": (False, False)}
ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Qwen2-architecture decoder (names follow transformers' Qwen2Config).

    ``family`` (`FAMILIES`) names the transformers class it converts to and from; within it,
    ``attention_bias`` (q/k/v biases; Qwen2 always has them) and ``qk_norm`` (Qwen3's per-head
    RMSNorm of queries and keys). ``rope_type`` "llama3" scales the RoPE frequencies as
    transformers' llama3 rope does, with ``rope_factor``, ``rope_low_freq_factor``,
    ``rope_high_freq_factor`` and ``rope_original_max_position_embeddings``.

    ``vocab_size`` is the number of embedding rows (151,936 for Qwen2.5-0.5B, 152,064 for 7B),
    which is larger than the tokenizer's 151,666 ids. ``dtype`` is the compute dtype and
    ``param_dtype`` the storage dtype, both as numpy dtype names.

    Execution settings, not architecture (they change memory and speed, never the function):
    ``remat`` is the rematerialisation policy of each decoder layer in training (`REMAT`),
    ``attention`` the attention implementation (`ATTENTION`), ``scan_layers`` whether the layers
    run in a ``lax.scan`` (else unrolled; the parameters are stacked either way).
    """

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    family: str = "qwen2"
    attention_bias: bool = True
    qk_norm: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "xla"
    scan_layers: bool = True

    def __post_init__(self):
        if self.remat not in REMAT:
            raise ValueError(f"model.remat must be one of {REMAT}, got {self.remat!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"model.attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"model.family must be one of {tuple(FAMILIES)}, got {self.family!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"model.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


def _partitioned(init, names: tuple[str | None, ...]):
    """``init`` with flax partitioning metadata: the logical axis names of the parameter
    (``out_sharding``, read by ``nnx.get_partition_spec``; `mars_jax.sharding` maps them to mesh
    axes). Parameters are created unsharded; placement is left to the caller's ``jit``."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm, computed in fp32 (transformers' Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.eps = eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.weight = nnx.Param(
            jnp.ones((dim,), cfg.param_dtype), out_sharding=("norm",), eager_sharding=False
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(self.dtype)


def inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    """fp32 [H/2]: RoPE's inverse frequencies, scaled for ``rope_type`` "llama3" (low frequencies
    divided by ``rope_factor``, high ones kept, the band between blended), as transformers'
    llama3 rope computes them."""
    h = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    if cfg.rope_type == "default":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_position_embeddings
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return jnp.where(medium, blended, scaled)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, inv_freq: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables, fp32 [R, T, H], for integer ``positions`` [R, T] (rotate-half layout);
    ``inv_freq`` [H/2] (`inverse_frequencies`) replaces plain RoPE's from ``theta``."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [R, T, heads, H] by the tables [R, T, H]; fp32 inside, ``x.dtype`` out."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, names, bias: bool, rngs: nnx.Rngs):
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=cfg.param_dtype,
        kernel_init=_partitioned(nnx.initializers.normal(0.02), names),
        bias_init=_partitioned(nnx.initializers.zeros_init(), names[1:]),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings and an optional functional KV cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = _linear(cfg, d, n * h, ("embed", "heads"), bias, rngs)
        self.k_proj = _linear(cfg, d, k * h, ("embed", "kv_heads"), bias, rngs)
        self.v_proj = _linear(cfg, d, k * h, ("embed", "kv_heads"), bias, rngs)
        self.o_proj = _linear(cfg, n * h, d, ("heads", "embed"), False, rngs)
        if cfg.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by every head
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, cfg)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, cfg)

    def __call__(self, x, cos, sin, mask, cache=None, layer=None, cached=None):
        """x [R, T, D]; mask bool broadcastable to [R, T, T] (a numpy array where the attention
        implementation needs a static pattern, see `mars_jax.attention`), or None with a cache.

        With a cache (the whole stacked {"k","v"} [L, R, S, K, H], only read; this is layer
        ``layer``), the T inputs of row r follow its ``cached[r]`` cached slots (int32 [R], or
        None: none) and attend to those and causally to each other
        (`mars_jax.attention.attend_cache`). Returns (output [R, T, D], this window's new
        {"k","v"} [R, T, K, H] with a cache, else None).
        """
        r, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(r, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(r, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).reshape(r, t, cfg.num_kv_heads, cfg.head_dim)
        if cache is None:
            return self.o_proj(attend(q, k, v, mask, cfg.attention).reshape(r, t, -1)), None
        dtype = cache["k"].dtype  # the window attends to its keys as the cache will hold them
        new = {"k": k.astype(dtype), "v": v.astype(dtype)}
        out = attend_cache(q, new["k"], new["v"], cache["k"], cache["v"], layer, cached)
        return self.o_proj(out.reshape(r, t, -1)), new


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, d, m, ("embed", "mlp"), False, rngs)
        self.up_proj = _linear(cfg, d, m, ("embed", "mlp"), False, rngs)
        self.down_proj = _linear(cfg, m, d, ("mlp", "embed"), False, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, cache=None, layer=None, cached=None):
        h, new = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, cached)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new


class CausalLM(nnx.Module):
    """The decoder-only causal LM of every family here (Qwen2/Qwen2.5, Qwen3, Llama 3:
    ``cfg.family``): transformers' ``*ForCausalLM`` without its generation utilities.

    Call ``model(input_ids, positions, mask)`` for final hidden states and ``model.logits(h)`` for
    fp32 logits, so callers can project only the positions they need onto the vocabulary.

    The decoder layers are one `DecoderLayer` whose parameters are stacked on a leading
    ``layers`` axis [num_layers, ...]; the forward runs them with ``lax.scan`` (compile time and
    program size independent of depth; ``scan_layers=False`` unrolls the same computation), each
    layer rematerialised in the backward pass as ``cfg.remat`` says.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=cfg.param_dtype,
            embedding_init=_partitioned(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        self.layers = _stacked([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _linear(cfg, cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), False, rngs)
        )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        mask: jax.Array | None,
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Runs the decoder.

        Args:
          input_ids: int32 [R, T] token ids (< vocab_size).
          positions: int32 [R, T] rotary position ids (any values; the MARS layout repeats 0..L-1).
          mask: bool, broadcastable to [R, T, T]; True where query t may attend to key s (the
            inputs); or an `attention.Segmented` mask (packed rows). None with a cache.
          cache: optional KV cache from `mars_jax.kv_cache.init_cache`: the inputs of row r are
            its slots cache_index[r] .. cache_index[r] + T - 1, attend to the cached slots
            before them and causally to each other (`extend`), and their keys/values are then
            written there in place (`mars_jax.kv_cache.write_cache`).
          cache_index: int32 [R], each row's first slot; None: slot 0 of every row (a prefill:
            no per-row offsets, nothing cached before).

        Returns:
          (hidden states [R, T, D] after the final norm, in ``dtype``; updated cache or None).
        """
        if cache is not None:
            if mask is not None:
                raise InputError("a cached forward is causal by slot: pass mask=None with a cache")
            hidden, new = self.extend(input_ids, positions, cache, cache_index)
            return hidden, write_cache(cache, new, cache_index)
        return self._layers(input_ids, positions, mask, None, None)

    def extend(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        cache_index: jax.Array | None,
    ) -> tuple[jax.Array, KVCache]:
        """The cached forward without its write: ids [R, T] at slots cache_index[r] + 0..T-1
        (None: from slot 0, nothing cached before), attending to the cache's slots before them
        (only read) and causally to each other. Returns (hidden [R, T, D], their keys and values
        {"k","v"} [L, R, T, K, H]) for `mars_jax.kv_cache.write_cache`: the decoder writes once
        per step, after choosing its branch, so that no branch rewrites the cache."""
        return self._layers(input_ids, positions, None, cache, cache_index)

    def _layers(self, input_ids, positions, mask, cache, cached):
        cfg = self.cfg
        if isinstance(mask, Segmented) and cfg.attention != "splash":
            mask = mask.dense()  # once, not in every layer (splash takes the segment ids)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, inverse_frequencies(cfg))
        x = with_logical_constraint(self.embed_tokens(input_ids), ACTIVATION_AXES)
        graphdef, stacked = nnx.split(self.layers)

        # The cache is a loop constant (each layer reads its own slices); the layers' new keys
        # and values are the loop's stacked output, [L, R, T, K, H].
        def layer(x, params, index):
            x, new = nnx.merge(graphdef, params)(x, cos, sin, mask, cache, index, cached)
            return with_logical_constraint(x, ACTIVATION_AXES), new

        if self.cfg.remat != "none":
            # Inside a scan XLA cannot merge the recomputed forward with the first one; unrolled,
            # its common-subexpression pass would, undoing the remat, unless prevented.
            layer = jax.checkpoint(
                layer,
                policy=_REMAT_POLICIES[self.cfg.remat],
                prevent_cse=not self.cfg.scan_layers,
            )
        indices = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if self.cfg.scan_layers:
            x, new = jax.lax.scan(lambda x, xs: layer(x, *xs), x, (stacked, indices))
        else:
            news = []
            for i in range(self.cfg.num_layers):
                x, layer_new = layer(x, jax.tree.map(lambda a: a[i], stacked), i)
                news.append(layer_new)
            new = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *news)
        return self.norm(x), new

    def logits(self, h: jax.Array) -> jax.Array:
        """Projects hidden states [..., D] onto the vocabulary: fp32 logits [..., V]."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...].astype(h.dtype)
            return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
        w = self.lm_head.kernel[...].astype(h.dtype)
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


# Logical axes of the residual stream [R, T, D], constrained at every layer boundary.
ACTIVATION_AXES = ("batch", "length", "activation_embed")

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


def _stacked(layers: list[DecoderLayer]) -> DecoderLayer:
    """One `DecoderLayer` whose parameters are those of ``layers`` stacked on a new leading axis
    (logical name "layers"), so each layer keeps the values it was initialised with."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        first = variables[0]
        names = first.get_metadata().get("out_sharding") or (None,) * first.ndim
        return first.replace(
            jnp.stack([v.get_value() for v in variables]), out_sharding=("layers", *names)
        )

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """The shape-only `CausalLM` of ``cfg``: every parameter a ``jax.ShapeDtypeStruct`` carrying its
    partitioning metadata; nothing is allocated. Split it with ``nnx.split`` for the graphdef
    and the abstract parameter State."""
    return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))


def abstract_params(cfg: ModelConfig, mesh: Mesh, rules: Rules):
    """(graphdef, abstract parameter State) of the `CausalLM` of ``cfg`` placed on ``mesh``: each
    leaf a ``jax.ShapeDtypeStruct`` with its NamedSharding under ``rules``; nothing allocated.

    Raises ValueError as `mars_jax.sharding.check_heads` and
    `mars_jax.sharding.param_shardings`.
    """
    check_heads(cfg.num_heads, cfg.num_kv_heads, mesh, rules)
    graphdef, state = nnx.split(abstract_model(cfg))
    shardings = param_shardings(state, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return graphdef, abstract


def causal_mask(t: int) -> np.ndarray:
    """bool [1, T, T]: query t attends to keys s <= t (numpy: a static pattern)."""
    return np.tril(np.ones((t, t), bool))[None]


# A vocabulary grown for an added token keeps this many rows' multiple (the vocab axis then
# still splits over any power-of-two tensor axis up to it).
ROW_MULTIPLE = 128


def grown_vocab_size(rows: int, needed: int) -> int:
    """The embedding rows of a ``rows``-row model that must also hold id ``needed - 1``:
    ``needed`` rounded up to a multiple of `ROW_MULTIPLE` (``rows`` when it has them)."""
    return rows if needed <= rows else -(-needed // ROW_MULTIPLE) * ROW_MULTIPLE


def mean_rows(table: jax.Array, new_rows: int, key: jax.Array) -> jax.Array:
    """``new_rows`` rows to append to ``table`` [V, D], initialised as transformers'
    ``resize_token_embeddings`` does by default (``mean_resizing``): drawn from a normal with
    the rows' mean and 1e-9 times their covariance (the mean itself where that covariance is
    not positive definite), so an added token starts where the average token is and no logit
    of the old rows moves. float32 [new_rows, D]."""
    x = table.astype(jnp.float32)
    mean = x.mean(axis=0)
    centered = x - mean
    covariance = centered.T @ centered / x.shape[0]
    chol = jnp.linalg.cholesky(1e-9 * covariance)
    noise = jax.random.normal(key, (new_rows, x.shape[1]), jnp.float32) @ chol.T
    noise = jnp.where(jnp.all(jnp.isfinite(chol)), noise, 0.0)
    return mean[None] + noise


def add_vocab_rows(params: nnx.State, cfg: ModelConfig, rows: int, seed: int = 0) -> nnx.State:
    """``params`` of ``cfg`` with its embedding [V, D] (and an untied head's kernel [D, V])
    grown from ``cfg.vocab_size`` to ``rows`` rows (`mean_rows`), every other leaf unchanged.
    Pure: jit it with the grown model's shardings as ``out_shardings``."""
    new = rows - cfg.vocab_size
    embed_key, head_key = jax.random.split(jax.random.key(seed))

    def grow(path, x):
        names = tuple(getattr(k, "key", None) for k in path)
        if names[:2] == ("embed_tokens", "embedding"):
            return jnp.concatenate([x, mean_rows(x, new, embed_key).astype(x.dtype)])
        if names[:2] == ("lm_head", "kernel"):
            extra = mean_rows(x.T, new, head_key).T.astype(x.dtype)
            return jnp.concatenate([x, extra], axis=1)
        return x

    return jax.tree_util.tree_map_with_path(grow, params)
