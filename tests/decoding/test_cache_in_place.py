"""The decode programs write the KV cache in place and read only slices of it: in the optimized
XLA:CPU HLO of every decoder (`mars_jax.decode._generate`: prefill, step loop, output) and of the
engine's `Decoder.steps`, no instruction inside a loop copies, broadcasts, transposes or
rewrites a buffer shaped like the cache or one of its layers (benchmarks/decode_hlo.py's
`cache_rewrites`, which names the instruction). The libtpu programs are checked in
test_decode_hlo.py. Two programs written the ways that did copy the cache (a layer scan with the
cache as its scanned input and stacked output; a branch that updates it) show that the check
sees those copies."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import decode_hlo
from configs import tiny
from mars_jax import kv_cache
from mars_jax.model import ModelConfig

ROWS, PROMPT = 3, 150  # S > CACHE_CHUNK: a chunk read is not cache-shaped
SHAPE = (2, ROWS, 57, 2, 16)  # [L, R, S, K, H] of the toy programs


@pytest.mark.parametrize(
    "name, block_size",
    [
        ("ar", 1),
        ("sliding", 4),
        ("verify", 4),
        ("block", 4),
        ("block", 1),
        ("steps", 4),
        ("steps_first_rows", 4),
    ],
)
def test_decode_programs_write_the_cache_in_place(name, block_size):
    cfg = ModelConfig(**tiny.get_config("mars").model)
    (row,) = decode_hlo.compile_decoders(
        cfg,
        jax.devices("cpu")[:1],
        rows=ROWS,
        prompt_len=PROMPT,
        max_new_tokens=8,
        block_size=block_size,
        decoders=[name],
        emit=lambda row: None,
    )
    assert row["cache_rewrites"] == [], "\n".join(row["cache_rewrites"])
    assert row["while_loops"] >= 2  # the step loop (or `steps`' loop) and the layer scans


def _rewrites(fn) -> list[str]:
    args = (jnp.zeros(SHAPE), jnp.array([1, 5, 9], jnp.int32))
    text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    return decode_hlo.cache_rewrites(text, [SHAPE, SHAPE[1:]])


def _layer_writes(cache, new, start):
    """The model's old layer loop: each layer's cache [R, S, K, H] scanned in, a window written
    into it per row (a vmapped dynamic_update_slice), the layers stacked out."""
    write = lambda x, layer: (x, kv_cache._write_dynamic(layer, new, start))
    return jax.lax.scan(write, 0.0, cache)[1]


def test_the_check_sees_a_layer_scan_that_stacks_the_cache():
    def step(i, cache, start):
        return _layer_writes(cache, jnp.ones((ROWS, 1, *SHAPE[3:])) * i, start + i)

    found = _rewrites(lambda c, s: jax.lax.fori_loop(0, 4, lambda i, c: step(i, c, s), c))
    assert any(f.endswith((" broadcast", " copy")) for f in found), found


def test_the_check_sees_branches_that_update_the_cache():
    def step(i, cache, start):  # a narrow and a wide window, each written in its own branch
        write = lambda t: lambda c: _layer_writes(c, jnp.ones((ROWS, t, *SHAPE[3:])) * i, start)
        return jax.lax.cond(i % 2 == 0, write(1), write(3), cache)

    found = _rewrites(lambda c, s: jax.lax.fori_loop(0, 4, lambda i, c: step(i, c, s), c))
    assert any(f.endswith(" copy") for f in found), found
