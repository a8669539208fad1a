r"""Roofline of one decode step: bytes, FLOPs and the time bound of each decoding mode.

  PYTHONPATH=. python benchmarks/roofline.py --markdown           # the tables of docs/decoding.md
  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/roofline.py --measure_cpu --markdown

For each model (the architectures of configs/qwen0_5b.py and configs/qwen7b.py), hardware and
batch of R rows, one decode step (one forward of the batch) of each mode costs at least

  time = max(bytes / bandwidth, FLOPs / peak)

  bytes = value_bytes * (non-embedding params + V * D)          weights, read once per step
        + value_bytes * 2 * L * K * H * context * R              KV cache of the R rows
  FLOPs = 2 * non-embedding params * slots * R                   layers
        + 2 * D * V * projections * R                            vocabulary projection
        + 4 * L * N * H * keys * slots * R                       attention (q.k and p.v)

where slots is the window fed per row, projections the slots projected onto the vocabulary, and
keys the key slots each query attends (``context`` with a cache; the whole sequence without).
``value_bytes`` is 2 (bf16 weights and cache) on accelerators, 4 (fp32) on the CPU. Left out:
activations, the embedding gather, and the fp32 logits and attention scores (reported apart).

The CPU figures are measured with ``--measure_cpu`` (`measure_cpu`: the FLOP/s of a JAX fp32
matmul; as bandwidth, the faster of a matrix-vector product and a row sum over 1 GiB) or given
with ``--cpu_gflops`` and ``--cpu_gbps``; without either the CPU is left out.
"""

from __future__ import annotations

import dataclasses
import time

from absl import flags

from configs import qwen0_5b, qwen7b
from mars_jax import cli
from mars_jax.model import ModelConfig

GB = 1e9
MODELS = {"Qwen2.5-0.5B": qwen0_5b, "Qwen2.5-7B": qwen7b}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip: ``flops`` peak FLOP/s, ``bandwidth`` memory bytes/s, ``memory`` bytes (None:
    not considered), ``value_bytes`` bytes per weight and cache value (2 bf16, 4 fp32)."""

    name: str
    flops: float
    bandwidth: float
    memory: float | None
    value_bytes: int

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a step is compute-bound."""
        return self.flops / self.bandwidth


# Vendor spec sheets (docs/decoding.md cites them); dense bf16 (NVIDIA quotes twice these with
# 2:4 sparsity).
ACCELERATORS = (
    Hardware("TPU v5e", 197e12, 819e9, 16e9, 2),
    Hardware("H100 SXM", 989e12, 3.35e12, 80e9, 2),
    Hardware("H200", 989e12, 4.8e12, 141e9, 2),
)


def model_config(name: str) -> ModelConfig:
    """The `ModelConfig` of the config file of model ``name`` (a key of `MODELS`)."""
    return ModelConfig(**MODELS[name].get_config().model)


def layer_params(m: ModelConfig) -> int:
    """Parameters of one decoder layer: q/k/v with biases, o without, SwiGLU MLP, two norms."""
    d, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = (d * q + q) + 2 * (d * kv + kv) + q * d
    return attention + 3 * d * m.intermediate_size + 2 * d


def non_embedding_params(m: ModelConfig) -> int:
    """Every parameter but the embedding and the LM head: the layers and the final norm."""
    return m.num_layers * layer_params(m) + m.hidden_size


def total_params(m: ModelConfig) -> int:
    """All parameters; the LM head is a second V x D matrix unless tied to the embedding."""
    embedding = m.vocab_size * m.hidden_size
    return non_embedding_params(m) + embedding * (1 if m.tie_word_embeddings else 2)


def read_params(m: ModelConfig) -> int:
    """Parameters a decode step reads: the non-embedding ones and the V x D projection (the
    embedding itself is only gathered, a few rows)."""
    return non_embedding_params(m) + m.vocab_size * m.hidden_size


def kv_bytes_per_token(m: ModelConfig, value_bytes: int) -> int:
    """Bytes of keys and values of one token over all layers (one [L, ., 1, K, H] slot each)."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * value_bytes


# Decoding modes: label, and what one row feeds per step as a function of the block size B and
# the context (slots fed, slots projected onto the vocabulary, whether the KV cache is read).
MODES = {
    "ar": "AR (KV cache)",
    "sliding": "sliding / verify (2B-1)",
    "adaptive": "sliding, adaptive (B)",
    "block": "block (B)",
    "commit": "block commit (B, 1 projection)",
    "none": "none (no cache)",
}


def window(mode: str, block: int, context: int) -> tuple[int, int, bool]:
    """(slots, projections, cached) of one row's step in ``mode`` (a key of `MODES`)."""
    return {
        "ar": (1, 1, True),
        "sliding": (2 * block - 1, block, True),
        "adaptive": (block, block, True),
        "block": (block, block, True),
        "commit": (block, 1, True),
        "none": (context + block - 1, block, False),
    }[mode]


@dataclasses.dataclass(frozen=True)
class Step:
    """Cost of one decode step of the batch: ``bytes`` read, ``flops``, and the roofline
    ``seconds`` = max(bytes / bandwidth, flops / peak)."""

    bytes: float
    flops: float
    seconds: float
    compute_bound: bool


def step(m: ModelConfig, hw: Hardware, mode: str, rows: int, block: int, context: int) -> Step:
    """The roofline cost of one step of ``rows`` rows in ``mode`` (module docstring)."""
    slots, projections, cached = window(mode, block, context)
    projection = m.vocab_size * m.hidden_size
    weights = hw.value_bytes * read_params(m)
    cache = kv_bytes_per_token(m, hw.value_bytes) * context * rows if cached else 0
    keys = context if cached else slots
    flops = rows * (
        2 * non_embedding_params(m) * slots
        + 2 * projection * projections
        + 4 * m.num_layers * m.num_heads * m.head_dim * keys * slots
    )
    memory_s, compute_s = (weights + cache) / hw.bandwidth, flops / hw.flops
    return Step(weights + cache, flops, max(memory_s, compute_s), compute_s > memory_s)


def relative(m, hw, mode, rows, block, context) -> float:
    """Step time of ``mode`` over that of an AR step at the same batch and context."""
    return (
        step(m, hw, mode, rows, block, context).seconds
        / step(m, hw, "ar", rows, block, context).seconds
    )


RIDGE_LIMIT = 4096  # the largest batch `ridge_batch` tries


def ridge_batch(m, hw, block: int, context: int, tolerance: float, limit: int = RIDGE_LIMIT) -> int:
    """The largest batch R (<= ``limit``) up to which a 2B-1 window step costs at most
    (1 + ``tolerance``) AR steps; 0 if even R = 1 costs more."""
    rows = 0
    while rows < limit and relative(m, hw, "sliding", rows + 1, block, context) <= 1 + tolerance:
        rows += 1
    return rows


def speedups(m, hw, rows: int, block: int, context: int, tokens_per_forward: float):
    """Ideal speedups over AR (tokens per unit time) for ``tokens_per_forward`` t per row:

    sliding: t * AR step / (2B-1 window step). block: a block of B tokens takes the forwards
    of its slowest row, then one commit forward; with no waiting that is B/t forwards (best),
    at worst B (the slowest row accepts one token per forward). Returns (sliding, block best,
    block worst).
    """
    at = lambda mode: step(m, hw, mode, rows, block, context).seconds
    ar, commit, blk = at("ar"), at("commit"), at("block")
    sliding = tokens_per_forward * ar / at("sliding")
    best = block * ar / (block / tokens_per_forward * blk + commit)
    worst = block * ar / (block * blk + commit)
    return sliding, best, worst


def measure_cpu(repeats: int = 5) -> dict:
    """Achieved figures of the JAX CPU device (best of ``repeats`` timed runs after a compiling
    one): ``matmul_gflops`` of a 2048^3 fp32 matmul (GFLOP/s); ``gemv_gbps`` and ``sum_gbps``,
    bytes/s (GB/s) reading a 1 GiB fp32 matrix in a matrix-vector product and in a row sum."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]

    def best(fn, *args) -> float:
        fn = jax.jit(fn)
        args = [jax.device_put(a, cpu) for a in args]
        fn(*args).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - start)
        return min(times)

    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    w = jnp.ones((8192, 32768), jnp.float32)  # 1 GiB: past the caches
    v = jnp.ones((32768,), jnp.float32)
    return {
        "matmul_gflops": 2 * n**3 / best(jnp.dot, a, a) / GB,
        "gemv_gbps": w.nbytes / best(jnp.dot, w, v) / GB,
        "sum_gbps": w.nbytes / best(lambda x: x.sum(axis=1), w) / GB,
    }


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _table(title: str, header: list[str], rows: list[list], markdown: bool) -> None:
    print(f"\n{'### ' if markdown else ''}{title}\n")
    rows = [[str(c) for c in row] for row in rows]
    if markdown:
        for row in [header, ["---"] * len(header), *rows]:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(map(len, col)) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def report(
    hardware,
    *,
    batches,
    block: int,
    context: int,
    ridge_blocks,
    tolerance: float,
    tokens_per_forward: float,
    markdown: bool,
) -> None:
    """Prints every table of docs/decoding.md."""
    models = {name: model_config(name) for name in MODELS}
    table = lambda title, header, rows: _table(title, header, rows, markdown)
    bf16 = ACCELERATORS[0]  # any bf16 chip: bytes and FLOPs do not depend on its speed

    table(
        "Hardware: peak FLOP/s, memory bandwidth and capacity per chip",
        ["hardware", "peak TFLOP/s", "bandwidth GB/s", "memory GB", "ridge FLOP/byte", "values"],
        [
            [
                hw.name,
                _num(hw.flops / 1e12),
                _num(hw.bandwidth / GB),
                "-" if hw.memory is None else _num(hw.memory / GB),
                _num(hw.ridge),
                {2: "bf16", 4: "fp32"}[hw.value_bytes],
            ]
            for hw in hardware
        ],
    )
    table(
        "Models: parameter counts from the config shapes; GB in bf16",
        [
            "model",
            "L",
            "D",
            "I",
            "N",
            "K",
            "H",
            "V",
            "tied",
            "non-embedding",
            "V x D",
            "total",
            "weights read/step GB",
            "resident GB bf16 (fp32)",
            "KV KiB/token",
        ],
        [
            [
                name,
                m.num_layers,
                m.hidden_size,
                m.intermediate_size,
                m.num_heads,
                m.num_kv_heads,
                m.head_dim,
                m.vocab_size,
                m.tie_word_embeddings,
                f"{non_embedding_params(m):,}",
                f"{m.vocab_size * m.hidden_size:,}",
                f"{total_params(m):,}",
                _num(2 * read_params(m) / GB),
                f"{_num(2 * total_params(m) / GB)} ({_num(4 * total_params(m) / GB)})",
                _num(kv_bytes_per_token(m, 2) / 1024),
            ]
            for name, m in models.items()
        ],
    )
    rows = []
    for name, m in models.items():
        for hw in (h for h in hardware if h.memory is not None):
            free = hw.memory - hw.value_bytes * total_params(m)
            tokens = max(free, 0) // kv_bytes_per_token(m, hw.value_bytes)
            rows.append(
                [
                    name,
                    hw.name,
                    _num(hw.value_bytes * total_params(m) / GB),
                    _num(free / GB),
                    f"{tokens:,.0f}",
                    f"{tokens // context:,.0f}",
                ]
            )
    table(
        "Memory: what is left for the KV cache (no activations, logits or runtime reserve)",
        ["model", "hardware", "weights GB", "left GB", "KV tokens", f"rows at context {context}"],
        rows,
    )
    for name, m in models.items():
        table(
            f"{name}: GB read / GFLOP per step (bf16; fp32 doubles the GB), B={block}, "
            f"context {context}",
            ["mode", "slots", "projections", *[f"R={r}" for r in batches]],
            [
                [
                    MODES[mode],
                    *window(mode, block, context)[:2],
                    *[
                        f"{step(m, bf16, mode, r, block, context).bytes / GB:.3g} / "
                        f"{_num(step(m, bf16, mode, r, block, context).flops / GB)}"
                        for r in batches
                    ],
                ]
                for mode in MODES
            ],
        )
    for name, m in models.items():
        for hw in hardware:
            rows = []
            for mode in MODES:
                cells = []
                for r in batches:
                    s = step(m, hw, mode, r, block, context)
                    kind = "C" if s.compute_bound else "M"
                    cells.append(
                        f"{_num(s.seconds * 1e3)} {kind} "
                        f"x{relative(m, hw, mode, r, block, context):.2f}"
                    )
                rows.append([MODES[mode], *cells])
            table(
                f"{name} on {hw.name}: step ms, M(emory)/C(ompute)-bound, x AR step "
                f"(B={block}, context {context})",
                ["mode", *[f"R={r}" for r in batches]],
                rows,
            )

    def ridge(m, hw, b) -> str:
        rows = ridge_batch(m, hw, b, context, tolerance)
        return f">={rows}" if rows == RIDGE_LIMIT else str(rows)

    table(
        f"Ridge: the largest batch R at which a 2B-1 window costs <= {1 + tolerance:g} AR steps "
        f"(context {context})",
        ["model", "hardware", *[f"B={b} ({2 * b - 1} slots)" for b in ridge_blocks]],
        [
            [name, hw.name, *[ridge(m, hw, b) for b in ridge_blocks]]
            for name, m in models.items()
            for hw in hardware
        ],
    )
    rows = [
        [
            name,
            hw.name,
            *[
                f"{s:.2f} / {best:.2f}-{worst:.2f}"
                for s, best, worst in (
                    speedups(m, hw, r, block, context, tokens_per_forward) for r in batches
                )
            ],
        ]
        for name, m in models.items()
        for hw in hardware
    ]
    table(
        f"Ideal speedup over AR at t = {tokens_per_forward} tokens/forward, B={block}: "
        f"sliding / block (no wait - worst wait)",
        ["model", "hardware", *[f"R={r}" for r in batches]],
        rows,
    )

    def left_out(m, mode, rows) -> str:
        slots, projections, cached = window(mode, block, context)
        keys = context if cached else slots
        logits = rows * projections * m.vocab_size * 4
        scores = m.num_layers * rows * m.num_heads * slots * keys * 4
        return f"{_num(logits / 1e6)} + {_num(scores / 1e6)}"

    table(
        f"Left out of the bound: fp32 logits (R x projections x V) + attention scores "
        f"(L x R x N x slots x keys) written per step, MB; B={block}, context {context}",
        ["model", "mode", "weights read MB (bf16)", *[f"R={r}" for r in batches]],
        [
            [
                name,
                MODES[mode],
                _num(2 * read_params(m) / 1e6),
                *[left_out(m, mode, r) for r in batches],
            ]
            for name, m in models.items()
            for mode in ("ar", "sliding")
        ],
    )


def main() -> None:
    batches = flags.DEFINE_list("batches", ["1", "4", "16", "64"], "Batch sizes R (rows).")
    block = flags.DEFINE_integer("block", 8, "Block size B of the mode tables.")
    ridge_blocks = flags.DEFINE_list("ridge_blocks", ["4", "8", "16"], "Block sizes of the ridge.")
    context = flags.DEFINE_integer("context", 512, "Cache slots attended per row (tokens).")
    tolerance = flags.DEFINE_float("tolerance", 0.1, "Ridge: allowed excess over an AR step.")
    tokens = flags.DEFINE_float("tokens_per_forward", 1.68, "MARS tokens per forward per row.")
    measure = flags.DEFINE_bool("measure_cpu", False, "Measure this CPU's FLOP/s and GB/s.")
    cpu_gflops = flags.DEFINE_float("cpu_gflops", None, "CPU fp32 matmul GFLOP/s (achieved).")
    cpu_gbps = flags.DEFINE_float("cpu_gbps", None, "CPU memory bandwidth, GB/s (achieved).")
    markdown = flags.DEFINE_bool("markdown", False, "Print markdown tables.")

    def run():
        hardware = list(ACCELERATORS)
        gflops, gbps = cpu_gflops.value, cpu_gbps.value
        if measure.value:
            figures = measure_cpu()
            print(
                "Measured on this CPU (best of 5; a shared machine, so noisy): "
                + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
            )
            gflops = gflops or round(figures["matmul_gflops"])
            gbps = gbps or round(max(figures["gemv_gbps"], figures["sum_gbps"]), 1)
            print(f"Reproduce the tables below with --cpu_gflops={gflops:g} --cpu_gbps={gbps:g}")
        if gflops and gbps:
            hardware.append(Hardware("CPU (measured)", gflops * 1e9, gbps * GB, None, 4))
        report(
            hardware,
            batches=[int(b) for b in batches.value],
            block=block.value,
            context=context.value,
            ridge_blocks=[int(b) for b in ridge_blocks.value],
            tolerance=tolerance.value,
            tokens_per_forward=tokens.value,
            markdown=markdown.value,
        )

    cli.run(run)


if __name__ == "__main__":
    main()
