r"""What a decoding step costs against the width of its prompt buffer: the same rows padded to
the width that fits them and to wider buffers (1,024 is `mars_jax.serve`'s and `mars_jax.chat`'s
default prompt width).

  PYTHONPATH=. python benchmarks/decode_width.py [--shape=smollm2] [--batch_sizes=1,16] \
      [--live=140] [--widths=fit,1024] [--block_size=1] [--steps=16] [--repeats=5]

Random weights of SmolLM2-135M-Instruct's architecture (``--shape=smollm2``: 30 layers, hidden
576, 9 / 3 heads, 49,152-row vocabulary; ``tiny`` for smoke runs), fp32. Each row holds a random
prompt of ``--live`` - 40 to ``--live`` tokens (``--live`` at batch 1); ``fit`` pads the batch to
its longest prompt. Per (batch, width) the prompts are prefilled, then `Decoder.steps` runs
``--steps`` greedy forwards in one program (its state donated, as the serving engine runs it), no
EOS; the widths are interleaved over ``--repeats`` rounds after an untimed one and the best kept.
Columns: slots (the cache's), step ms, x fit (step ms over the fitting width's).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import common
from mars_jax.decode_state import DecoderSettings, RowSettings
from mars_jax.decoder import Decoder
from mars_jax.model import ModelConfig

SHAPES = {
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        family="llama",
        attention_bias=False,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        family="llama",
        attention_bias=False,
    ),
}

_SHAPE = flags.DEFINE_enum("shape", "smollm2", list(SHAPES), "Model architecture.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "16"], "Batch sizes.")
_LIVE = flags.DEFINE_integer("live", 140, "Longest prompt (tokens); rows hold live-40..live.")
_WIDTHS = flags.DEFINE_list("widths", ["fit", "1024"], "Prompt buffer widths (fit: the longest).")
_BLOCK = flags.DEFINE_integer("block_size", 1, "Block size (1: AR; B > 1 accepts B a forward).")
_STEPS = flags.DEFINE_integer("steps", 16, "Forwards per timed program.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (the best is kept).")


def step_ms(widths: list[int], *, batch: int, live: int, block_size: int, steps: int, repeats: int):
    """{width: best ms per forward} for the rows of one batch padded to each width."""
    cfg = ModelConfig(**SHAPES[_SHAPE.value])
    graphdef, params = common.random_params(cfg)
    settings = DecoderSettings(
        block_size=block_size,
        max_new_tokens=steps * block_size,
        eos_ids=(),
        mask_id=cfg.vocab_size - 1,
        sampling=False,
        cache_mode="sliding",
        rule="prob",
        adaptive_window=True,
        mesh=None,
        axis_rules=None,
        on_accept=None,
    )
    decoder = Decoder(graphdef, settings)
    rng = np.random.default_rng(0)
    lengths = np.full((batch,), live) if batch == 1 else rng.integers(live - 40, live + 1, batch)
    ids = rng.integers(3, cfg.vocab_size - 1, (batch, max(widths)))
    rows = RowSettings.build(
        batch,
        threshold=1e-30 if block_size > 1 else 1.0,  # every row accepts B tokens a forward
        max_accept=block_size,
        max_new_tokens=steps * block_size,
    )
    best = {w: float("inf") for w in widths}
    for round_ in range(repeats + 1):
        for w in widths:
            state = decoder.prefill(
                params, jnp.asarray(ids[:, :w], jnp.int32), jnp.asarray(lengths, jnp.int32), rows
            )
            jax.block_until_ready(state)
            t = time.perf_counter()
            jax.block_until_ready(decoder.steps(params, state, steps))
            if round_:
                best[w] = min(best[w], (time.perf_counter() - t) / steps * 1e3)
        common.progress(f"batch {batch}: round {round_} of {repeats}")
    return best, {w: settings.slots(w) for w in widths}


def main(argv) -> None:
    del argv
    live = _LIVE.value
    print(
        f"{_SHAPE.value}, fp32, block size {_BLOCK.value}, {_STEPS.value} forwards a program, "
        f"best of {_REPEATS.value}; JAX {jax.__version__} on {jax.devices()[0].platform}\n"
    )
    print("| batch | width | slots | step ms | x fit |\n|---|---|---|---|---|")
    for batch in map(int, _BATCHES.value):
        widths = [live if w == "fit" else int(w) for w in _WIDTHS.value]
        ms, slots = step_ms(
            widths,
            batch=batch,
            live=live,
            block_size=_BLOCK.value,
            steps=_STEPS.value,
            repeats=_REPEATS.value,
        )
        for w in widths:
            print(f"| {batch} | {w:,} | {slots[w]:,} | {ms[w]:.1f} | {ms[w] / ms[widths[0]]:.2f} |")


if __name__ == "__main__":
    app.run(main)
