r"""What one decode step costs on TPU, by mode, as libtpu's compiler estimates it (no TPU needed).

  PYTHONPATH=. python benchmarks/decode_tpu_estimate.py --shape=qwen7b --topology=v5e:2x2 \
      --tensor=4 --batch_sizes=1,4,16,64 --block_sizes=4,8 [--output_dir=DIR] [--json]

Each forward a decode step can run (`mars_jax.decoder.Decoder.branch`) is lowered and compiled
ahead of time for the TPU topology with libtpu on this CPU, as launch/memory_plan.py does for
the train step: inputs are ``jax.ShapeDtypeStruct``s with shardings (parameters by the training
rules, ``tensor`` chips over heads; the KV cache by `mars_jax.kv_cache.CACHE_AXES`), so nothing is
allocated. The programs, per batch R and block size B:

  ar      block_size 1: one query slot per row (the baseline);
  narrow  sliding window of B slots (one uncached token, B-1 masks: a step after K = 1);
  wide    sliding window of 2B-1 slots (after K >= 2 accepted tokens);
  fill    block cache: the block's B slots against the prefix;
  commit  block cache: the filled block written to the cache (one projection).

From ``compiled.cost_analysis()``: flops, bytes accessed and libtpu's ``optimal_seconds`` (the
compiler's estimate of the step's time on the chip), per device; from ``memory_analysis()`` the
argument and temporary bytes. The model is unrolled (``scan_layers=False``): XLA's cost analysis
counts a ``while`` body once, so a scanned model would count one layer. Beside each, the
roofline of `benchmarks/roofline.py` (weights and KV cache read once, FLOPs at peak; divided
over the chips, no communication) and their ratio.

From these the fixed-acceptance table: a row accepting K tokens per forward runs ``narrow``
(K = 1) or ``wide`` (K >= 2) in ``sliding`` mode, and ceil(B / K) fills then a commit per block
in ``block`` mode; conversion = AR step / mode step (per forward) and speedup =
tokens_per_forward * conversion, as `benchmarks/decode_step.py` measures on a real device.

Needs libtpu (``jax[tpu]`` at the installed jax); the script sets ``JAX_PLATFORMS=cpu``,
``TPU_SKIP_MDS_QUERY=1`` and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (a value already set wins).
"""

from __future__ import annotations

import os

# Before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from benchmarks import decode_hlo, decode_step, roofline  # noqa: E402
from launch import memory_plan  # noqa: E402
from mars_jax import cli, sharding  # noqa: E402
from mars_jax.decode_state import RowSettings  # noqa: E402
from mars_jax.decoder import Decoder  # noqa: E402
from mars_jax.kv_cache import CACHE_AXES  # noqa: E402
from mars_jax.model import abstract_params  # noqa: E402

# Program -> (decode_step mode, Decoder.branch name, roofline mode).
PROGRAMS = {
    "ar": ("ar", "wide", "ar"),
    "narrow": ("sliding", "narrow", "adaptive"),
    "wide": ("sliding", "wide", "sliding"),
    "fill": ("block", "fill", "block"),
    "commit": ("block", "commit", "commit"),
}
# The roofline's hardware of each TPU generation (benchmarks/roofline.py's spec-sheet figures).
HARDWARE = {"v5e": "TPU v5e"}


def compile_program(
    graphdef,
    params,
    *,
    program: str,
    block_size: int,
    rows: int,
    prompt_len: int,
    max_new_tokens: int,
    mesh,
    rules,
) -> dict:
    """Lowers and compiles ``program`` (`PROGRAMS`) for the mesh's devices; returns its cost
    (microseconds, flops and bytes per device) and memory."""
    mode, branch, _ = PROGRAMS[program]
    decoder = decode_step.make_decoder(
        graphdef,
        block_size=block_size,
        mode=mode,
        max_new_tokens=max_new_tokens,
        mesh=mesh,
        axis_rules=rules,
    )
    replicated = NamedSharding(mesh, P())
    cache_sharding = NamedSharding(mesh, sharding.logical_spec(CACHE_AXES, rules))

    def prefilled(params):
        with decoder._on_mesh():
            return decoder._prefill(
                nnx.merge(graphdef, params),
                jnp.zeros((rows, prompt_len), jnp.int32),
                jnp.full((rows,), prompt_len, jnp.int32),
                RowSettings.build(rows, threshold=1.0, max_accept=1, max_new_tokens=max_new_tokens),
            )

    shapes = jax.eval_shape(prefilled, params)
    state = shapes.replace(cache=None)
    state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state
    )
    if shapes.cache is not None:
        state = state.replace(
            cache=jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cache_sharding),
                shapes.cache,
            )
        )
    start = time.perf_counter()
    compiled = Decoder.branch.lower(decoder, params, state, branch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    return {
        **decode_hlo.optimal(cost.get("optimal_seconds")),
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "slots": state.tokens.shape[1],
        "compile_s": time.perf_counter() - start,
    }


def estimate(
    *,
    shape: str,
    topology: str,
    tensor: int,
    batch_sizes: Sequence[int],
    block_sizes: Sequence[int],
    prompt_len: int = 512,
    max_new_tokens: int = 64,
    dtype: str = "bfloat16",
    emit=print,
) -> list[dict]:
    """One row per (batch, program, B) with the compiler's and the roofline's step time."""
    devices = memory_plan.topology_devices(topology)
    mesh = sharding.make_mesh(data=-1, tensor=tensor, devices=devices)
    rules = sharding.logical_rules()
    cfg = decode_step.model_config(shape, dtype, scan_layers=False)
    graphdef, params = abstract_params(cfg, mesh, rules)
    hw = next(h for h in roofline.ACCELERATORS if h.name == HARDWARE[topology.partition(":")[0]])
    rows = []
    for batch in batch_sizes:
        for b in block_sizes:
            for program in PROGRAMS:
                if program == "ar" and b != block_sizes[0]:
                    continue  # one AR program per batch
                block = 1 if program == "ar" else b
                r = compile_program(
                    graphdef,
                    params,
                    program=program,
                    block_size=block,
                    rows=batch,
                    prompt_len=prompt_len,
                    max_new_tokens=max_new_tokens,
                    mesh=mesh,
                    rules=rules,
                )
                line = roofline.step(cfg, hw, PROGRAMS[program][2], batch, block, r["slots"])
                roof_us = line.seconds / len(devices) * 1e6
                row = dict(
                    shape=shape,
                    dtype=dtype,
                    topology=topology,
                    tensor=tensor,
                    batch=batch,
                    block_size=block,
                    program=program,
                    roofline_us=roof_us,
                    **r,
                )
                row["compiler_over_roofline"] = (
                    None if r["optimal_us"] is None else r["optimal_us"] / roof_us
                )
                rows.append(row)
                emit(json.dumps(row))
    return rows


def fixed_acceptance(rows: Sequence[dict]) -> list[dict]:
    """The (batch, B, mode, K) table derived from `estimate`'s rows (module docstring), from the
    compiler's estimate and, beside it, the roofline's."""
    out = []
    by = {(r["batch"], r["block_size"], r["program"]): r for r in rows}
    for (batch, b, program), r in by.items():
        if program != "narrow":
            continue
        ar = by[(batch, 1, "ar")]
        for k in range(1, b + 1):
            fills = math.ceil(b / k)
            for mode in ("sliding", "block"):

                def per_forward(key):
                    if mode == "sliding":
                        return by[(batch, b, "narrow" if k == 1 else "wide")][key]
                    fill, commit = by[(batch, b, "fill")][key], by[(batch, b, "commit")][key]
                    return None if None in (fill, commit) else (fills * fill + commit) / (fills + 1)

                tpf = k if mode == "sliding" else b / (fills + 1)
                step_us, roof_us = per_forward("optimal_us"), per_forward("roofline_us")
                conv = (
                    None
                    if step_us is None or ar["optimal_us"] is None
                    else (ar["optimal_us"] / step_us)
                )
                out.append(
                    dict(
                        shape=r["shape"],
                        topology=r["topology"],
                        batch=batch,
                        block_size=b,
                        mode=mode,
                        accept=k,
                        step_us=step_us,
                        ar_step_us=ar["optimal_us"],
                        step_over_ar=None if conv is None else 1 / conv,
                        conversion=conv,
                        tokens_per_forward=tpf,
                        speedup=None if conv is None else tpf * conv,
                        roofline_step_over_ar=roof_us / ar["roofline_us"],
                    )
                )
    return out


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(rows: Sequence[dict], table: Sequence[dict]) -> str:
    """The programs' table, then the fixed-acceptance table."""
    lines = [
        "| shape | topology | batch | B | program | compiler us | roofline us | "
        "compiler / roofline | GFLOP | GB accessed |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['topology']} (tensor {r['tensor']}) | {r['batch']} | "
            f"{r['block_size']} | {r['program']} | {_f(r['optimal_us'], '.1f')} | "
            f"{r['roofline_us']:.1f} | {_f(r['compiler_over_roofline'], '.2f')} | "
            f"{_f(r['flops'] and r['flops'] / 1e9, '.1f')} | "
            f"{_f(r['bytes_accessed'] and r['bytes_accessed'] / 1e9, '.2f')} |"
        )
    lines += [
        "",
        "| shape | batch | B | mode | K | step / AR (compiler) | step / AR (roofline) "
        "| conversion | tokens/forward | speedup |",
        "|---" * 10 + "|",
    ]
    for t in table:
        lines.append(
            f"| {t['shape']} | {t['batch']} | {t['block_size']} | {t['mode']} | {t['accept']} | "
            f"{_f(t['step_over_ar'], '.3f')} | {t['roofline_step_over_ar']:.3f} | "
            f"{_f(t['conversion'], '.2f')} | {t['tokens_per_forward']:.2f} | "
            f"{_f(t['speedup'], '.2f')}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    shape = flags.DEFINE_enum("shape", "qwen7b", decode_step.SHAPES, "Architecture.")
    topology = flags.DEFINE_string("topology", "v5e:2x2", "TPU topology (GENERATION:AxB).")
    tensor = flags.DEFINE_integer("tensor", 4, "Chips on the tensor axis (the rest: data).")
    batch_sizes = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "Batch sizes.")
    block_sizes = flags.DEFINE_list("block_sizes", ["4", "8"], "Block sizes B.")
    prompt_len = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens (cache context).")
    max_new = flags.DEFINE_integer("max_new_tokens", 64, "Completion budget (cache slots).")
    dtype = flags.DEFINE_string("dtype", "bfloat16", "Parameters, compute and cache dtype.")
    output_dir = flags.DEFINE_string("output_dir", "", "Write decode_tpu_estimate.{md,jsonl}.")

    def run():
        rows = estimate(
            shape=shape.value,
            topology=topology.value,
            tensor=tensor.value,
            batch_sizes=[int(b) for b in batch_sizes.value],
            block_sizes=[int(b) for b in block_sizes.value],
            prompt_len=prompt_len.value,
            max_new_tokens=max_new.value,
            dtype=dtype.value,
        )
        text = markdown(rows, fixed_acceptance(rows))
        print(text)
        if output_dir.value:
            decode_step.write_results(
                output_dir.value,
                "decode_tpu_estimate",
                rows,
                f"libtpu's estimate (jax {jax.__version__}), prompts of {prompt_len.value} "
                f"tokens, {max_new.value} new.\n\n" + text,
            )

    cli.run(run)


if __name__ == "__main__":
    main()
