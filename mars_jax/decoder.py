"""The MARS decoder (arXiv 2604.07023, Sec. 3.3): one frozen `Decoder` per program (the model's graphdef and the static
`DecoderSettings`), whose jitted methods are pure functions over the parameters and a
`DecodeState` (which carries each row's `RowSettings`): ``prefill``, ``step`` (one forward),
``steps``, ``result``, and the engine verbs ``begin`` / ``prefill_chunk`` / ``insert`` /
``free`` / ``new_tokens`` a host loop drives; ``decode`` traces them as one ``lax.while_loop``
program. The method, the cache modes and sampling are described in `mars_jax.decode`, the
acceptance rules in `mars_jax.acceptance`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax import acceptance
from mars_jax.decode_state import DecodeResult, DecoderSettings, DecodeState, NewTokens, RowSettings
from mars_jax.errors import InputError
from mars_jax.kv_cache import KVCache, init_cache, read_window, write_cache, write_window
from mars_jax.model import CausalLM, causal_mask
from mars_jax.sharding import with_logical_constraint


def _rowwise(x: jax.Array) -> jax.Array:
    """``x`` [R, ...] constrained to rows over the batch axes (where a mesh is active)."""
    return with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1))


class Write(NamedTuple):
    """A forward's cache write, made after its branch is chosen: ``new`` {"k","v"} [L, R, T, K,
    H] at slots start[r] + 0..T-1 of each row (`mars_jax.kv_cache.write_cache`); ``new`` None
    where there is no cache (cache mode ``none``)."""

    new: KVCache | None
    start: jax.Array


def _written(s: DecodeState, write: Write) -> DecodeState:
    """``s`` with ``write`` made into its cache."""
    if write.new is None:
        return s
    return s.replace(cache=write_cache(s.cache, write.new, write.start))


def _padded(write: Write, width: int) -> Write:
    """``write`` with its new keys/values zero-padded to ``width`` slots (within the cache:
    `DecoderSettings.slots` leaves two windows past the budget)."""
    if write.new is None:
        return write
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[2]), (0, 0), (0, 0)))
    return write._replace(new=jax.tree.map(pad, write.new))


def _first_rows(s: DecodeState, rows: int) -> DecodeState:
    """Rows 0..rows-1 of ``s``: every per-row field sliced, the cache kept whole (a forward over
    those rows reads and writes its first ``rows`` rows: `attend_cache`, `write_new`)."""
    fields = {
        f.name: jax.tree.map(lambda a: a[:rows], getattr(s, f.name))
        for f in dataclasses.fields(s)
        if f.name not in ("cache", "forwards") and getattr(s, f.name) is not None
    }
    return s.replace(**fields)


def _put_first_rows(s: DecodeState, part: DecodeState) -> DecodeState:
    """``s`` with `_first_rows`' ``part`` written back over its first rows (in place where ``s``
    is donated); the cache and the batch's ``forwards`` are ``part``'s."""
    fields = {
        f.name: jax.tree.map(lambda a, b: a.at[: b.shape[0]].set(b), getattr(s, f.name), new)
        for f in dataclasses.fields(s)
        if f.name not in ("cache", "forwards") and (new := getattr(part, f.name)) is not None
    }
    return s.replace(cache=part.cache, forwards=part.forwards, **fields)


_static_self = functools.partial(jax.jit, static_argnums=0)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One decoder program: ``graphdef`` (the model's structure) and its static ``settings``.

    Its pure functions over (parameters, `DecodeState`) are jitted methods, each of which can be
    lowered and compiled alone (``Decoder.step.lower(decoder, params, state)``):

      state = decoder.prefill(params, prompt_ids, prompt_lengths, row_settings)
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

    with `RowSettings.build` (or `RowSettings.of` a `DecodeOptions`) making the rows' settings.

    `decode` runs the same as one program (a ``lax.while_loop``); `mars_jax.decode.generate` is
    its checked, host-side entry. Under ``settings.mesh`` every method runs sharded by ``settings.axis_rules``.
    """

    graphdef: Any
    settings: DecoderSettings

    @property
    def rule(self) -> acceptance.AcceptanceRule:
        """The `AcceptanceRule` named by ``settings.rule``."""
        return acceptance.ACCEPTANCE_RULES[self.settings.rule]

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
    def prefill(self, params, prompt_ids, prompt_lengths, row_settings: RowSettings) -> DecodeState:
        """The state after the prompts' forward (no token decoded yet).

        prompt_ids int32 [R, P] (right-padded), prompt_lengths int32 [R] in 1..P, row_settings
        the rows' `RowSettings`. Unchecked: `decode.generate` checks its arguments.
        """
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            return self._prefill(model, prompt_ids, prompt_lengths, row_settings)

    @_static_self
    def begin(self, params, prompt_ids, prompt_lengths, row_settings: RowSettings) -> DecodeState:
        """A chunked prefill's first state (``sliding`` or ``none`` mode; arguments as
        `prefill`): the prompts' tokens and settings with an empty cache, which
        `prefill_chunk` then fills one chunk at a time (``none``: no cache, nothing to fill).
        Once every prompt slot is written, decode from it as from `prefill`'s state."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            s = self._initial(prompt_ids, prompt_lengths, row_settings)
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
            _, new = self._forward(model, ids, start, state.cache)
            return state.replace(cache=write_cache(state.cache, new, start))

    @_static_self
    def step(self, params, state: DecodeState) -> DecodeState:
        """One decoding forward of the whole batch (finished rows are carried unchanged)."""
        with self._on_mesh():
            return self._step(nnx.merge(self.graphdef, params), state)

    @functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=2)
    def steps(
        self, params, state: DecodeState, num_steps: int, rows: int | None = None
    ) -> DecodeState:
        """Up to ``num_steps`` forwards in one program (fewer once `finished`): a host loop's
        unit of work. ``state`` is donated (its KV cache is updated in place).

        ``rows`` (static; None: all R): only rows 0..rows-1 are decoded, the others carried
        unchanged (the caller's promise: they are done, e.g. a server's free slots). The
        forwards then compute ``rows`` rows, reading and writing those rows of the cache in
        place, so a step costs what the live rows hold, not the number of slots."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            whole = state.tokens.shape[0]
            part = state if rows is None or rows >= whole else _first_rows(state, rows)
            part = jax.lax.while_loop(
                lambda c: (c[0] < num_steps) & ~self.finished(c[1]),
                lambda c: (c[0] + 1, self._step(model, c[1])),
                (jnp.int32(0), part),
            )[1]
            return part if part.tokens.shape[0] == whole else _put_first_rows(state, part)

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def branch(self, params, state: DecodeState, name: str) -> DecodeState:
        """One forward of the program `step` runs as ``name`` (one of `branches`), alone: what a
        step costs in each of its cases."""
        with self._on_mesh():
            return _written(*self._branch(nnx.merge(self.graphdef, params), state, name))

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
            f.name: jax.tree.map(put, getattr(state, f.name), getattr(group, f.name))
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

    def decode(self, params, prompt_ids, prompt_lengths, row_settings: RowSettings) -> DecodeResult:
        """prefill, the steps in a ``lax.while_loop`` and the result, traced as one program
        (call it inside ``jit``, as `_generate` does). Arguments as `prefill`."""
        with self._on_mesh():
            model = nnx.merge(self.graphdef, params)
            s = self._prefill(model, prompt_ids, prompt_lengths, row_settings)
            s = jax.lax.while_loop(lambda s: ~self.finished(s), lambda s: self._step(model, s), s)
            return self._result(s)

    # -- the traced pieces ------------------------------------------------------------------------
    def _sampled(self, s: DecodeState, logits: jax.Array) -> jax.Array:
        """The model's logits [R, C, V] as each sampling row draws from them: divided by its
        temperature, those outside its top_p nucleus at the float minimum. Only the draw reads
        them (confidences and log-probabilities are the model's own). Greedy rows' logits are
        left as they are."""
        t = s.row_settings.temperature[:, None, None]
        logits = logits / jnp.where(t > 0, t, 1.0)
        nucleus = (s.row_settings.temperature > 0) & (s.row_settings.top_p < 1.0)
        top_p = jnp.where(nucleus, s.row_settings.top_p, 1.0)
        return jax.lax.cond(
            jnp.any(nucleus), lambda x: acceptance.top_p_filter(x, top_p), lambda x: x, logits
        )

    def _record(self, s: DecodeState, logits: jax.Array, token: jax.Array) -> DecodeState:
        """``s`` with the log-probabilities of ``token`` int32 [R, C] (the candidates at
        positions committed + 0..C-1) under the model's logits [R, C, V], and the K most likely
        tokens there, written at those positions (where any active row wants them)."""
        k = self.settings.logprobs
        if k is None:
            return s

        def write(s):
            logp = acceptance.log_probs(logits)
            s = s.replace(
                logprobs=write_window(s.logprobs, acceptance.pick(logp, token), s.committed)
            )
            if k == 0:
                return s
            top, ids = jax.lax.top_k(logp, k)
            return s.replace(
                top_logprobs=write_window(s.top_logprobs, top, s.committed),
                top_ids=write_window(s.top_ids, ids.astype(jnp.int32), s.committed),
            )

        return jax.lax.cond(jnp.any(s.row_settings.want_logprobs & ~s.done), write, lambda s: s, s)

    def _choose(self, s: DecodeState, logits: jax.Array, positions: jax.Array) -> jax.Array:
        """int32 [R, C]: greedy or sampled candidates from the model's fp32 logits [R, C, V],
        where candidate [r, c] is the token at position positions[r, c] (int32 [R, C]). A
        sampling row draws from `_sampled`'s logits with Gumbel noise keyed by
        fold_in(keys[r], position) (`RowSettings.keys`; module docstring)."""
        if self.settings.sampling:
            logits = self._sampled(s, logits)

            def noise(key, position):
                key = jax.random.fold_in(key, position)
                return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

            by_row = jax.vmap(jax.vmap(noise, in_axes=(None, 0)))(s.row_settings.keys, positions)
            logits = logits + jnp.where(s.row_settings.temperature[:, None, None] > 0, by_row, 0.0)
        return acceptance.argmax(logits)

    def _forward(self, model: CausalLM, ids, start, cache):
        """ids [R, W] at positions (and slots) start[r] + 0..W-1 against the cache, which is only
        read, or a full causal forward from position 0 without a cache. Returns (hidden
        [R, W, D], the window's new keys and values {"k","v"} [L, R, W, K, H], or None without
        a cache) for `write_cache` at ``start``."""
        pos = start[:, None] + jnp.arange(ids.shape[1])
        if cache is None:
            return model(ids, pos, causal_mask(ids.shape[1]))[0], None
        return model.extend(ids, pos, cache, start)

    def _budget(self, s: DecodeState) -> jax.Array:
        return jnp.minimum(s.row_settings.max_new_tokens - s.new_tokens, s.row_settings.max_accept)

    def _advance(
        self,
        s: DecodeState,
        *,
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
            tokens=_rowwise(keep(tokens, s.tokens)),
            committed=s.committed + count,
            cache_cursor=keep(cache_cursor, s.cache_cursor),
            num_drafts=s.num_drafts if num_drafts is None else keep(num_drafts, s.num_drafts),
            new_tokens=new_tokens,
            done=s.done | hit_eos | (new_tokens >= s.row_settings.max_new_tokens),
            row_forwards=row_forwards,
            token_forwards=_rowwise(token_forwards),
            forwards=s.forwards + forward,
        )

    def _initial(self, prompt_ids, prompt_lengths, row_settings: RowSettings) -> DecodeState:
        """The state before any forward: the prompts in their token slots, no cache."""
        rows, prompt_len = prompt_ids.shape
        slots = self.settings.slots(prompt_len)
        return DecodeState(
            row_settings=row_settings,
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

    def _prefill(self, model, prompt_ids, prompt_lengths, row_settings) -> DecodeState:
        st = self.settings
        s = self._initial(prompt_ids, prompt_lengths, row_settings)
        if st.cache_mode == "none":
            return s
        rows, prompt_len = prompt_ids.shape
        slots = s.tokens.shape[1]
        # Every prompt token's key/value; slots past a row's prompt hold stale values.
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (rows, prompt_len))
        cache = init_cache(model.cfg, rows, slots)
        hidden, cache = model(prompt_ids, positions, None, cache)
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

    def _branch(self, model, s: DecodeState, name: str) -> tuple[DecodeState, Write]:
        """The state after branch ``name``'s forward, its cache not yet written, and the
        `Write` that writes it."""
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
        if st.cache_mode == "block":
            if B == 1:
                return _written(*self._branch(model, s, "commit"))
            full = jnp.all(s.done | (s.committed - s.cache_cursor == B))
            return self._either(model, s, full, "commit", "fill")
        if len(self.branches) == 1:
            return _written(*self._branch(model, s, self.branches[0]))
        # The widest window an active row needs: its uncached tokens and drafts, then B-1 masks.
        need = jnp.max(jnp.where(s.done, 0, s.committed + s.num_drafts - s.cache_cursor)) + B - 1
        return self._either(model, s, need <= B, "narrow", "wide")

    def _either(self, model, s: DecodeState, pred, if_true: str, if_false: str) -> DecodeState:
        """Branch ``if_true`` where ``pred`` (bool []) holds, else ``if_false``, in a
        ``lax.cond`` that only reads the cache: each branch returns its state without the cache
        and its window's new keys/values (the narrower padded to the wider: slots past a window
        are stale, rewritten before they are read), written once after it, in place (a cache
        updated inside a branch is copied whole by XLA, on CPU and TPU alike)."""
        cache = s.cache
        width = max(self._window_width(if_true), self._window_width(if_false))

        def run(name):
            def branch(bare):
                out, write = self._branch(model, bare.replace(cache=cache), name)
                return out.replace(cache=None), _padded(write, width)

            return branch

        out, write = jax.lax.cond(pred, run(if_true), run(if_false), s.replace(cache=None))
        return _written(out.replace(cache=cache), write)

    def _window_width(self, name: str) -> int:
        st = self.settings
        return {"narrow": st.block_size, "wide": st.window}.get(name, st.block_size)

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
        hidden, new = self._forward(model, ids, start, s.cache)
        write = Write(new, start)
        # Output at position committed-1+i predicts token committed+i (i < B).
        first = s.committed - 1 - start
        logits = model.logits(read_window(hidden, first, B))  # [R, B, V]
        token = self._choose(s, logits, s.committed[:, None] + jnp.arange(B))
        s = self._record(s, logits, token)
        r = s.row_settings
        if not self.rule.drafts:
            ok = acceptance.confident(self.rule.confidence(logits, token), r.threshold)
            count, hit_eos = acceptance.accept_count(token, ok, eos, self._budget(s))
            return self._advance(
                s,
                tokens=write_window(s.tokens, token, s.committed),
                count=count,
                hit_eos=hit_eos,
                cache_cursor=s.committed,
                accepted=token,
            ), write
        # verify: candidate i (i >= 1) is the AR prediction after draft i-1; it is exact while
        # every draft before it equals the AR prediction at its position.
        drafts = read_window(s.tokens, s.committed, B)
        i = jnp.arange(1, B)[None]
        ok = (i <= s.num_drafts[:, None]) & (drafts[:, :-1] == token[:, :-1])
        count, hit_eos = acceptance.accept_count(
            token, jnp.pad(ok, ((0, 0), (1, 0))), eos, self._budget(s)
        )
        tokens = write_window(s.tokens, token, s.committed)
        # New drafts: the masks after the last draft predict the tokens after the AR token that
        # follows it; they are valid only where every draft was accepted.
        if B > 1:
            after = read_window(hidden, first + s.num_drafts + 1, B - 1)
            draft_logits = model.logits(after)
            new_drafts = self._choose(s, draft_logits, (s.committed + s.num_drafts)[:, None] + i)
            sure = acceptance.confident(
                self.rule.confidence(draft_logits, new_drafts), s.row_settings.threshold
            )
            # The next step accepts at most its drafts + 1 tokens: no more drafts than that uses.
            room = (
                jnp.minimum(
                    s.row_settings.max_new_tokens - s.new_tokens - count, s.row_settings.max_accept
                )
                - 1
            )
            num = jnp.minimum(jnp.cumprod(sure, axis=1).sum(axis=1), jnp.maximum(room, 0))
            all_ok = (count == s.num_drafts + 1) & ~hit_eos
            num_drafts = jnp.where(all_ok, num, 0).astype(jnp.int32)
            tokens = write_window(tokens, new_drafts, s.committed + count)
        else:
            num_drafts = jnp.zeros_like(s.num_drafts)
        return self._advance(
            s,
            tokens=tokens,
            count=count,
            hit_eos=hit_eos,
            cache_cursor=s.committed + count - 1,
            num_drafts=num_drafts,
            accepted=token,
        ), write

    # -- block: the reference's block cache -------------------------------------------------------
    def _block_fill(self, model, s: DecodeState) -> DecodeState:
        st, B = self.settings, self.settings.block_size
        eos = jnp.asarray(st.eos_ids, jnp.int32)
        block_pos = jnp.arange(B)
        start = s.cache_cursor
        filled = s.committed - start
        block = read_window(s.tokens, start, B)
        ids = jnp.where(block_pos[None] < filled[:, None], block, st.mask_id)
        hidden, new = self._forward(model, ids, start, s.cache)  # block keys rewritten later
        # Candidate for block position i: the prefix's prediction (i = 0) or slot i-1's output.
        logits = model.logits(hidden[:, : B - 1])
        token = self._choose(s, logits, start[:, None] + block_pos[None, 1:])
        conf = self.rule.confidence(logits, token)
        cand = jnp.concatenate([block[:, :1], token], axis=1)  # [R, B]
        conf = jnp.concatenate([jnp.ones_like(conf[:, :1]), conf], axis=1)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, B)))
        cand = read_window(pad(cand), filled, B)
        ok = acceptance.confident(read_window(pad(conf), filled, B), s.row_settings.threshold)
        count, hit_eos = acceptance.accept_count(
            cand, ok, eos, jnp.minimum(self._budget(s), B - filled)
        )
        return self._advance(
            s,
            tokens=write_window(s.tokens, cand, s.committed),
            count=count,
            hit_eos=hit_eos,
            cache_cursor=start,
            accepted=cand,
        ), Write(new, start)

    def _block_commit(self, model, s: DecodeState) -> tuple[DecodeState, Write]:
        B = self.settings.block_size
        if B == 1:  # the block's one token is the prefix's prediction: accept it, then commit
            eos = jnp.asarray(self.settings.eos_ids, jnp.int32)
            pending = read_window(s.tokens, s.committed, 1)
            count, hit_eos = acceptance.accept_count(
                pending, jnp.ones_like(pending, bool), eos, self._budget(s)
            )
            s = self._advance(
                s,
                tokens=s.tokens,
                count=count,
                hit_eos=hit_eos,
                cache_cursor=s.cache_cursor,
                accepted=pending,
                forward=False,
            )
            cache = s.cache

            def write(bare):
                out, write = self._write_block(model, bare.replace(cache=cache))
                return out.replace(cache=None), write

            def skip(bare):  # every row done: no forward (its write lands on stale slots)
                new = jax.tree.map(lambda x: jnp.zeros_like(x[:, :, :1]), cache)
                return bare, Write(new, bare.cache_cursor)

            out, w = jax.lax.cond(jnp.all(s.done), skip, write, s.replace(cache=None))
            return out.replace(cache=cache), w
        return self._write_block(model, s)

    def _write_block(self, model, s: DecodeState) -> tuple[DecodeState, Write]:
        B = self.settings.block_size
        start = s.cache_cursor
        hidden, new = self._forward(model, read_window(s.tokens, start, B), start, s.cache)
        # The next block's first token.
        token = self._choose(s, model.logits(hidden[:, B - 1 :]), (start + B)[:, None])
        zero = jnp.zeros_like(start)
        return self._advance(
            s,
            tokens=write_window(s.tokens, token, start + B),
            count=zero,
            hit_eos=zero.astype(bool),
            cache_cursor=start + B,
        ), Write(new, start)

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
