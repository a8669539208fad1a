r"""What one train step costs on TPU, as libtpu's compiler estimates it, with its MFU (no TPU needed).

  PYTHONPATH=. python benchmarks/train_tpu_estimate.py --config=configs/qwen0_5b.py \
      --topology=v5e:2x2 --micro_batch=4 --objective=ar,mars --attention=xla,splash \
      --remat=none,full --packing=false,true [--rows=../shared/data/gsm8k/train.jsonl] \
      [--output_dir=DIR]

The real jitted train step (`train_step.build_train_step`: objective, AdamW update, the
config's mesh over the topology's chips) is lowered and compiled ahead of time for the TPU
topology with libtpu on this CPU, as launch/memory_plan.py does; inputs are
``jax.ShapeDtypeStruct``s with shardings, so nothing is allocated. One program per (topology,
objective, attention, remat, packing), of ``--micro_batch`` rows of ``data.max_length`` and
``grad_accum_steps`` 1. XLA's cost analysis counts a ``while`` body once, so nothing runs in a
loop: the layers are unrolled (``scan_layers=False``), the cross-entropy is taken in one piece
(``ce_chunk_size=0``; its chunks are a ``lax.map``) and the accumulation loop is left out. The
AdamW update (and the clipping before it) is compiled alone too, so a step of the recipe's
batch, A = ``train.batch_size / micro_batch`` micro-batches, is estimated as

    step = A x (program - update) + update

From ``compiled.cost_analysis()`` (per chip): libtpu's ``optimal_seconds`` (its estimate of
the program's time; `decode_hlo.optimal` separates the ops it could not estimate), FLOPs and
bytes accessed. Then, with the chip's dense bf16 peak (`PEAK_BF16`):

    model FLOPs = benchmarks/train_step.py's step_flops of the step's rows (matmuls, backward =
                  2 x forward, the dense attention scores of the 2L-token [noisy | clean] input
                  for MARS)
    MFU         = model FLOPs / (estimated step seconds x peak x chips)
    row MFU     = MFU x (1 - padding): the FLOPs spent on tokens of rows, not padding

``padding`` is the fraction of token slots that hold no row's token when the ``--rows`` file
(GSM8K train by default: rows of a realistic length distribution) is tokenized with the
config's tokenizer (``init_from``'s where it is a directory, else the offline Qwen2.5 one) at ``data.max_length``,
unpacked (one row a sequence) or packed (`mars_jax.packing`). Packing changes the mask (segment
ids) but not the shapes, so a packed and an unpacked program cost about the same and the
difference is in how many of their tokens are real. MaxText's published MFU for comparison:
45-71% on v5e / v5p / v6e for models of 2-405B (its README's table).

Needs libtpu (``jax[tpu]`` at the installed jax); sets ``JAX_PLATFORMS=cpu`` and the other
compile-only defaults of launch/memory_plan.py.
"""

from __future__ import annotations

# First: its import sets libtpu's compile-only environment before jax loads.
from launch import memory_plan  # isort: skip

import json
import os
import time

import jax
import optax
from absl import flags

from benchmarks import decode_hlo
from benchmarks.train_step import step_flops
from mars_jax import cli, model, packing, sharding, train_inputs, train_step
from mars_jax import config as config_lib
from mars_jax.tokenizer import MASK_ID, load_tokenizer

# Dense bf16 peak FLOP/s per chip, from Google Cloud's TPU system architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e).
PEAK_BF16 = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}


def padding_of(cfg, rows_path: str, rows_format: str) -> dict[bool, float]:
    """{packed: padding fraction} of ``rows_path`` tokenized as ``cfg`` trains (its tokenizer,
    ``data.max_length``, block size), unpacked and packed."""
    c = cfg.copy_and_resolve_references()
    c.data.train_path, c.data.source = rows_path, rows_format
    c.objective.max_label_tokens = 0
    if not os.path.isdir(c.init_from):  # the paper configs' placeholder: Qwen2.5's tokenizer
        c.init_from = ""
    examples = train_inputs.load_train_examples(c, load_tokenizer(train_inputs.tokenizer_source(c)))
    packed = train_inputs.pack_examples(c, examples)
    length = c.data.max_length
    return {
        False: packing.padding_fraction(examples, length),
        True: packing.padding_fraction(packed, length),
    }


def update_seconds(tx, step: train_step.TrainStep) -> float | None:
    """libtpu's estimate of the AdamW update alone (clipping, moments, new parameters) on the
    step's shardings: gradients placed as the parameters."""
    params, opt_state, _ = step.abstract_inputs

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    shardings = sharding.shardings_of(params)
    compiled = (
        jax.jit(update, out_shardings=(shardings, step.opt_state_shardings), donate_argnums=(0, 1))
        .lower(params, opt_state, params)
        .compile()
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    optimal = decode_hlo.optimal(cost.get("optimal_seconds"))["optimal_us"]
    return None if optimal is None else optimal / 1e6


def compile_row(cfg, topology: str, devices, accumulation: int) -> dict:
    """Compiles the train step of ``cfg`` (grad_accum_steps 1, layers unrolled) for ``devices``
    and returns its cost (per chip) and memory; a compile error is returned in ``error``."""
    row = {
        "topology": topology,
        "devices": len(devices),
        "objective": cfg.objective.name,
        "attention": cfg.model.attention,
        "remat": cfg.model.remat,
        "packing": cfg.data.packing,
        "micro_batch": cfg.train.batch_size,
        "max_length": cfg.data.max_length,
    }
    start = time.perf_counter()
    try:
        config_lib.validate(cfg, training=True, paths=False)
        m = cfg.mesh
        mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
        rules = sharding.logical_rules(m.rules)
        model_cfg = model.ModelConfig(**cfg.model)
        graphdef, abstract = model.abstract_params(model_cfg, mesh, rules)
        obj = train_step.objective_settings(cfg, MASK_ID, examples=())
        tx, _ = train_step.optimizer(cfg, num_steps=1)
        step = train_step.build_train_step(cfg, graphdef, abstract, obj, tx, mesh, rules)
        compiled = step.fn.lower(*step.abstract_inputs).compile()
        row["update_s"] = update_seconds(tx, step)
    except (ValueError, jax.errors.JaxRuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {**row, "error": f"{type(e).__name__}: {first}"}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    row.update(
        **decode_hlo.optimal(cost.get("optimal_seconds")),
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        peak_gib=(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
            + mem.generated_code_size_in_bytes
        )
        / 2**30,
        compile_s=round(time.perf_counter() - start, 1),
    )
    row["accumulation"] = accumulation
    row["model_flops"] = accumulation * step_flops(
        model_cfg,
        rows=cfg.train.batch_size,
        length=cfg.data.max_length,
        objective=cfg.objective.name,
        max_label_tokens=obj.max_label_tokens,
    )
    return row


def add_mfu(row: dict, padding: dict[bool, float] | None) -> dict:
    """``row`` with its estimated step seconds, MFU and (given ``padding``) row MFU."""
    if row.get("optimal_us") is None or row.get("update_s") is None:
        return row
    program, update, a = row["optimal_us"] / 1e6, row["update_s"], row["accumulation"]
    seconds = a * (program - update) + update
    peak = PEAK_BF16[row["topology"].partition(":")[0]] * row["devices"]
    row["step_s"] = seconds
    row["mfu"] = row["model_flops"] / seconds / peak
    row["compiler_over_model_flops"] = a * row["flops"] * row["devices"] / row["model_flops"]
    if padding is not None:
        tokens = a * row["micro_batch"] * row["max_length"]
        row["padding"] = padding[row["packing"]]
        row["row_mfu"] = row["mfu"] * (1 - row["padding"])
        row["row_tokens_per_s_per_chip"] = tokens * (1 - row["padding"]) / seconds / row["devices"]
    return row


def sweep(cfg, *, topologies, micro_batch, objectives, attentions, remats, packings, padding, emit):
    """Every combination, compiled one after another; ``emit(row)`` for each; returns the rows."""
    rows = []
    for topology in topologies:
        devices = memory_plan.topology_devices(topology)
        for objective in objectives:
            for attention in attentions:
                for remat in remats:
                    for packed in packings:
                        c = cfg.copy_and_resolve_references()
                        c.objective.name = objective
                        c.model.update(attention=attention, remat=remat, scan_layers=False)
                        c.data.packing = packed
                        c.objective.ce_chunk_size = 0
                        c.train.update(batch_size=micro_batch, grad_accum_steps=1)
                        row = compile_row(c, topology, devices, cfg.train.batch_size // micro_batch)
                        rows.append(add_mfu(row, padding))
                        emit(rows[-1])
    return rows


def _f(x, spec):
    return "-" if x is None else format(x, spec)


HEADER = (
    "| topology | objective | attention | remat | packing | micro batch x A | micro-batch ms "
    "(update ms) | unestimated ops | TFLOP (compiler / model) | GB accessed | peak GiB | step s "
    "| MFU | padding | row MFU | row tokens/s/chip |\n" + "|---" * 16 + "|"
)


def format_row(r: dict) -> str:
    head = (
        f"| {r['topology']} | {r['objective']} | {r['attention']} | {r['remat']} | "
        f"{'yes' if r['packing'] else 'no'} | {r['micro_batch']} x {r.get('accumulation', '-')} | "
    )
    if "error" in r:
        return head + f"failed: {r['error']} |" + " |" * 10
    model_tflop = r["model_flops"] / r["accumulation"] / 1e12
    tflop = f"{r['flops'] * r['devices'] / 1e12:.2f} / {model_tflop:.2f}"
    update = r.get("update_s")
    return head + (
        f"{_f(r['optimal_us'] and r['optimal_us'] / 1e3, '.1f')} "
        f"({_f(update and update * 1e3, '.1f')}) | {r['unestimated']} | {tflop} | "
        f"{r['bytes_accessed'] / 1e9:.1f} | {r['peak_gib']:.2f} | {_f(r.get('step_s'), '.2f')} | "
        f"{_f(r.get('mfu'), '.1%')} | "
        f"{_f(r.get('padding'), '.1%')} | {_f(r.get('row_mfu'), '.1%')} | "
        f"{_f(r.get('row_tokens_per_s_per_chip'), '.0f')} |"
    )


def main() -> None:
    config = cli.config_flag(help="Run config (model, length, objective, mesh).")
    topology = flags.DEFINE_multi_string("topology", ["v5e:2x2"], "TPU topology; repeatable.")
    micro_batch = flags.DEFINE_integer("micro_batch", 4, "Rows (or packed sequences) compiled.")
    objective = flags.DEFINE_list("objective", ["ar", "mars"], "Objectives.")
    attention = flags.DEFINE_list("attention", ["xla", "splash"], "Attention implementations.")
    remat = flags.DEFINE_list("remat", ["none", "full"], "Remat policies.")
    packings = flags.DEFINE_list("packing", ["false", "true"], "data.packing off / on.")
    rows = flags.DEFINE_string(
        "rows", "../shared/data/gsm8k/train.jsonl", "Rows whose lengths give the padding ('' none)."
    )
    rows_format = flags.DEFINE_string("rows_format", "gsm8k", "Format of --rows.")
    output_dir = flags.DEFINE_string("output_dir", "", "Write train_tpu_estimate.{md,jsonl} here.")

    def run():
        cfg = config.value
        config_lib.validate(cfg, training=True, paths=False)
        if not memory_plan.libtpu_installed():
            raise RuntimeError('libtpu is not installed: pip install "jax[tpu]==<jax version>"')
        padding = padding_of(cfg, rows.value, rows_format.value) if rows.value else None
        if padding:
            print(
                f"padding of {rows.value} at max_length {cfg.data.max_length}: "
                f"{padding[False]:.1%} unpacked, {padding[True]:.1%} packed"
            )
        print(HEADER, flush=True)
        out = sweep(
            cfg,
            topologies=topology.value,
            micro_batch=micro_batch.value,
            objectives=objective.value,
            attentions=attention.value,
            remats=remat.value,
            packings=[p.lower() in ("true", "1", "yes") for p in packings.value],
            padding=padding,
            emit=lambda r: print(format_row(r), flush=True),
        )
        if output_dir.value:
            os.makedirs(output_dir.value, exist_ok=True)
            with open(os.path.join(output_dir.value, "train_tpu_estimate.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in out)
            with open(os.path.join(output_dir.value, "train_tpu_estimate.md"), "w") as f:
                f.write(HEADER + "\n" + "\n".join(map(format_row, out)) + "\n")

    cli.run(run)


if __name__ == "__main__":
    main()
