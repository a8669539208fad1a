r"""Host memory across repeated `train` calls in one process, with and without
``jax.clear_caches()`` between them: tells memory that JAX's caches of compiled programs hold
(each `train` call builds and compiles its own step function) from memory that steps leak.

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/train_call_memory.py --calls=8
  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/train_call_memory.py --calls=8 --clear_caches
  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/train_call_memory.py --calls=8 --malloc_arenas=0

glibc's malloc arenas are capped at ``--malloc_arenas`` (2, as the entry points cap them:
`mars_jax.platforms.limit_malloc_arenas`); 0 keeps glibc's default, under which the RSS grows
with no live object behind it (docs/training-at-scale.md).

Each call trains `configs/tiny.py` for ``--steps`` steps (batch 4, 32 synthetic rows) in a fresh
temporary workdir; after it (and ``jax.clear_caches()`` with the flag) the script collects
garbage and prints the process RSS (psutil), then the growth from the first call to the last
(with two calls or more).
"""

import gc
import tempfile

import jax
import psutil
from absl import app, flags, logging

from configs import tiny
from mars_jax import platforms, train

_CALLS = flags.DEFINE_integer("calls", 8, "train calls")
_STEPS = flags.DEFINE_integer("steps", 5, "steps per call")
_CLEAR = flags.DEFINE_bool("clear_caches", False, "jax.clear_caches() after each call")
_ARENAS = flags.DEFINE_integer(
    "malloc_arenas", 2, "glibc malloc arenas (platforms.limit_malloc_arenas; 0: glibc's default)"
)


def main(argv) -> None:
    del argv
    if _ARENAS.value:
        platforms.limit_malloc_arenas(_ARENAS.value)
    logging.set_verbosity(logging.WARNING)
    process, rss = psutil.Process(), []
    for call in range(_CALLS.value):
        cfg = tiny.get_config("ar")
        cfg.train.update(num_steps=_STEPS.value, save_every=_STEPS.value, batch_size=4)
        cfg.data.num_synthetic_train = 32
        with tempfile.TemporaryDirectory() as workdir:
            train.train(cfg, workdir)
        if _CLEAR.value:
            jax.clear_caches()
        gc.collect()
        rss.append(process.memory_info().rss / 2**20)
        print(f"call {call + 1}: RSS {rss[-1]:.0f} MiB", flush=True)
    if len(rss) > 1:  # --calls=1: no growth to report (rss[1] does not exist)
        print(
            f"growth from call 1 to call {len(rss)}: {100 * (rss[-1] / rss[0] - 1):.1f}%; "
            f"from call 2: {100 * (rss[-1] / rss[1] - 1):.1f}%"
        )


if __name__ == "__main__":
    app.run(main)
