"""What several benchmarks share: random parameters that compile in seconds, and progress lines.

A benchmark on a lent accelerator runs under a time limit, so what it spends before its first
measurement has to be small and visible: `random_params` and `progress` are for that.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from mars_jax.model import CausalLM, ModelConfig, abstract_model

_START = time.perf_counter()


def progress(message: str) -> None:
    """Prints ``message`` to stderr with the seconds since the process imported this module,
    so that a part cut short by its time limit still shows where its time went."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


def random_params(cfg: ModelConfig, seed: int = 0, shardings=None) -> tuple[object, nnx.State]:
    """(graphdef, parameters) of a random `CausalLM` of ``cfg``, placed by ``shardings`` if given.

    One decoder layer is initialised (the model's own init, in one jitted program) and its
    values repeated across the ``layers`` axis: every layer holds the same random values, which
    changes nothing a speed benchmark measures. Initialising every layer in one program instead
    compiles for minutes on a GPU (a 7B model hit XLA's slow-compile alarm there) and in 19 s
    against 1 s on a CPU for the 0.5B shape, time taken from a benchmark's limit before it
    measures anything."""
    graphdef, abstract = nnx.split(abstract_model(cfg))
    one = dataclasses.replace(cfg, num_layers=1)
    single = jax.jit(lambda: nnx.split(CausalLM(one, rngs=nnx.Rngs(seed)))[1])()

    def widen(target, value):
        if target.shape == value.shape:
            return value
        if value.shape[0] == 1 and target.shape == (cfg.num_layers, *value.shape[1:]):
            return jnp.repeat(value, cfg.num_layers, axis=0)
        raise ValueError(f"no layer axis to widen: {value.shape} -> {target.shape}")

    params = jax.jit(lambda s: jax.tree.map(widen, abstract, s), out_shardings=shardings)(single)
    return graphdef, params
