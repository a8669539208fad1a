r"""Train-step speed of the AR and MARS objectives at equal batch and length, side by side.

  PYTHONPATH=. python benchmarks/train_step.py --config=configs/tiny.py [--steps=10] \
      [--peak_flops=...]
  PYTHONPATH=. python benchmarks/train_step.py --config=configs/smollm2_gsm8k.py --data \
      --max_lengths=256,512 --packing=false,true [--steps=3] [--json_out=FILE]

With ``--data``, the batch is real: the config's training rows (``data.train_path`` in
``data.source``'s format, or its synthetic problems) tokenized by the run's tokenizer as
training does, at each of ``--max_lengths``, unpacked and packed (``--packing``,
`mars_jax.packing`); the model's shape is ``init_from``'s when set (its config.json only: the
weights stay random, `common.random_params`), else ``config.model``. One row per (max length,
packing, objective): padding (the fraction of the epoch's token slots that hold no row's
token), rows per step and steps per epoch at ``train.batch_size`` rows or packed sequences,
step time (median of ``--steps`` after a compiling one, the two packings of an objective and
length alternating), and labelled tokens per second: the epoch's labelled targets per step
over the step time, the measure that packing changes (an unpacked and a packed step of one
length have the same shape; the packed one holds more rows). The last column is that rate
against the same objective unpacked at the same length.

Builds the jitted train step of the config (`train_step.build_train_step`: its mesh, gradient
accumulation and AdamW update) once per objective, with random parameters of ``config.model``
(``init_from`` is not read; `common.random_params`, every layer the same values) and a
synthetic batch of the config's shape ``[train.batch_size, data.max_length]``: random token
ids, the first ``1 - label_fraction`` of every row an unlabelled prompt and the rest a labelled
answer, as in SFT data. The first step (compilation) is not
timed; then AR and MARS steps alternate, ``--steps`` of each, each ended by
``jax.block_until_ready``, and each objective's step time is the median of its steps
(alternating keeps a shared machine's load from favouring one of them). Both objectives' parameters
and optimizer states are live at once. Runs unchanged on CPU, GPU or TPU (the config's mesh over
all local devices).

Model FLOPs per step (matmuls only; the backward pass counted as twice the forward):

    3 * rows * [2 * W * T  +  4 * layers * T^2 * heads * head_dim  +  s * 2 * hidden * vocab * M]

with W the weights of the decoder layers' matmuls (q, k, v, o, gate, up, down), T the tokens one
row runs through the decoder (L for AR; 2L for MARS, whose input is ``[noisy | clean]``), the
attention term the dense score and value products (the "xla" attention computes every query-key
pair of the mask), and M = ``objective.max_label_tokens`` logits positions in each of s streams
(1 for AR, 2 for MARS). MFU = model FLOPs / step time / (peak FLOP/s per device * devices).
The peak is ``--peak_flops`` if given, else the FLOP/s of a square matmul in the compute dtype
measured here on one device (a rough peak: on CPU it is what the BLAS reaches; on a GPU or TPU
pass the datasheet's dense figure for the compute dtype instead).

tokens/s counts the L input tokens of every row for both objectives. The last line printed is
``mars/ar step time ratio: X.XX``. MARS runs the decoder over 2L tokens and computes logits in
two streams, so about 2.0 is the floor where those dominate the step; costs that do not grow
with the tokens (the AdamW update, the embedding gradient) can take a small model below it.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import common
from mars_jax import cli, packing, sharding, train_inputs, train_step
from mars_jax import config as config_lib
from mars_jax.batches import Example, batched_dataset
from mars_jax.common_types import IGNORE_INDEX
from mars_jax.model import ModelConfig, abstract_params
from mars_jax.tokenizer import MASK_ID, load_tokenizer


def step_flops(
    m: ModelConfig, *, rows: int, length: int, objective: str, max_label_tokens: int
) -> float:
    """Model FLOPs of one train step (forward and backward) of ``rows`` sequences of ``length``
    tokens under ``objective`` ("ar" or "mars"); the formula of the module docstring."""
    width = m.num_heads * m.head_dim
    kv_width = m.num_kv_heads * m.head_dim
    weights = m.num_layers * (
        m.hidden_size * width
        + 2 * m.hidden_size * kv_width
        + width * m.hidden_size
        + 3 * m.hidden_size * m.intermediate_size
    )
    tokens, streams = (2 * length, 2) if objective == "mars" else (length, 1)
    forward = (
        2 * weights * tokens
        + 4 * m.num_layers * tokens**2 * width
        + streams * 2 * m.hidden_size * m.vocab_size * max_label_tokens
    )
    return 3.0 * rows * forward


def matmul_peak(dtype: str, size: int, repeats: int = 5) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul in ``dtype`` on the default device (best of
    ``repeats`` after a compiling run)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def mask_id_for(vocab_size: int) -> int:
    """Qwen2.5's ``<|mask|>`` where the vocabulary holds it, else its last row (a mask added as
    a new row, as `add_mask_token` does)."""
    return MASK_ID if MASK_ID < vocab_size else vocab_size - 1


def synthetic_batch(
    rows: int, length: int, label_fraction: float, vocab_size: int, seed: int = 0
) -> dict:
    """{input_ids, labels} int32 [rows, length]: ids uniform over the model's ``vocab_size``
    rows but its last (`mask_id_for`'s mask), below Qwen2.5's special tokens (151643) where the
    vocabulary has them, labels = ids
    on the last ``round(label_fraction * length)`` positions of each row and
    `common_types.IGNORE_INDEX` before them (prompt, then answer)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(vocab_size - 1, 151643), size=(rows, length), dtype=np.int32)
    labels = np.full_like(ids, IGNORE_INDEX)
    answer = max(1, round(label_fraction * length))
    labels[:, length - answer :] = ids[:, length - answer :]
    return {"input_ids": ids, "labels": labels}


def prepare(
    cfg,
    objective: str,
    batch: dict,
    model_cfg: ModelConfig | None = None,
    units=None,
    mask_id: int | None = None,
) -> tuple[Callable[[], tuple[float, float]], int]:
    """The train step of ``objective`` for run config ``cfg`` on ``batch`` (host arrays), with
    fresh random parameters and optimizer state: (a function that runs one step, waits for it
    and returns (seconds, loss), the max_label_tokens the step was built with).

    ``model_cfg`` defaults to ``cfg.model``; ``units`` (the examples or packed sequences the
    batch was drawn from) to the batch's own rows, ``mask_id`` to `mask_id_for`."""
    c = cfg.copy_and_resolve_references()
    c.objective.name = objective
    c.init_from = ""
    c.data.packing = "segment_ids" in batch  # the step's inputs are the batch's
    model_cfg = model_cfg or ModelConfig(**c.model)
    if units is None:
        units = [
            Example(ids, labels, r)
            for r, (ids, labels) in enumerate(zip(batch["input_ids"], batch["labels"]))
        ]
    mask_id = mask_id_for(model_cfg.vocab_size) if mask_id is None else mask_id
    obj = train_step.objective_settings(c, mask_id, units)
    mesh, rules = sharding.mesh_from_config(c.mesh)
    graphdef, abstract = abstract_params(model_cfg, mesh, rules)
    tx, _ = train_step.optimizer(c, num_steps=1000)  # the schedule does not change the cost
    step = train_step.build_train_step(c, graphdef, abstract, obj, tx, mesh, rules)
    _, params = common.random_params(model_cfg, c.seed, shardings=sharding.shardings_of(abstract))
    state = [params, jax.jit(tx.init, out_shardings=step.opt_state_shardings)(params)]
    device_batch = jax.block_until_ready(jax.device_put(batch, step.batch_sharding))
    common.progress(f"{objective}: parameters and optimizer state ready")

    def run_once():
        start = time.perf_counter()
        state[0], state[1], metrics = step.fn(state[0], state[1], device_batch)
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - start, float(metrics["loss"])

    return run_once, obj.max_label_tokens


def benchmark(
    cfg, *, steps: int, label_fraction: float, peak_flops: float | None, matmul_size: int
) -> list[dict]:
    """Prints the side-by-side table (module docstring) ending with the ratio line, and returns
    the two rows (objective, step_s, tokens_per_s, tflop_per_step, mfu)."""
    rows, length = cfg.train.batch_size, cfg.data.max_length
    batch = synthetic_batch(rows, length, label_fraction, cfg.model.vocab_size, seed=cfg.seed)
    model_cfg = ModelConfig(**cfg.model)
    devices = len(jax.devices())
    peak = peak_flops or matmul_peak(model_cfg.dtype, matmul_size)
    print(
        f"{jax.devices()[0].device_kind} x {devices}: batch {rows}, length {length}, "
        f"{label_fraction:.0%} labelled, grad_accum_steps {cfg.train.grad_accum_steps}, "
        f"remat {model_cfg.remat}, attention {model_cfg.attention}, dtype {model_cfg.dtype}; "
        f"peak {peak / 1e12:.3f} TFLOP/s per device "
        f"({'given' if peak_flops else 'measured matmul'})"
    )
    objectives = ("ar", "mars")
    runners = {o: prepare(cfg, o, batch) for o in objectives}
    times = {o: [] for o in objectives}
    for o in objectives:
        runners[o][0]()  # compiles
        common.progress(f"{o}: compiled and ran a step")
    for _ in range(steps):  # alternating, so that a busy machine slows both alike
        for o in objectives:
            seconds, loss = runners[o][0]()
            if not np.isfinite(loss):
                raise FloatingPointError(f"{o}: non-finite loss {loss}")
            times[o].append(seconds)
    print("| objective | step time (ms) | tokens/s | model TFLOP/step | MFU |")
    print("|---|---|---|---|---|")
    out = []
    for objective in objectives:
        step_s = statistics.median(times[objective])
        flops = step_flops(
            model_cfg,
            rows=rows,
            length=length,
            objective=objective,
            max_label_tokens=runners[objective][1],
        )
        row = {
            "objective": objective,
            "step_s": step_s,
            "tokens_per_s": rows * length / step_s,
            "tflop_per_step": flops / 1e12,
            "mfu": flops / step_s / (peak * devices),
        }
        out.append(row)
        print(
            f"| {objective} | {1e3 * row['step_s']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['tflop_per_step']:.4f} | {row['mfu']:.1%} |",
            flush=True,
        )
    return out


def data_units(cfg, model_length: int, packed: bool, tok) -> tuple[list, list]:
    """(the training examples at max length ``model_length``, the units a batch is made of:
    those examples, or their packed sequences)."""
    c = cfg.copy_and_resolve_references()
    c.data.max_length = model_length
    examples = train_inputs.load_train_examples(c, tok)
    return examples, (train_inputs.pack_examples(c, examples) if packed else examples)


def targets(unit) -> int:
    """Labelled targets of an example or packed sequence: labelled tokens but a row's first
    (`objectives.target_positions`)."""
    labelled = np.asarray(unit.labels) != IGNORE_INDEX
    if isinstance(unit, packing.Packed):  # a packed row's first token is no target either
        starts = np.flatnonzero(np.diff(unit.segment_ids, prepend=-1))
        return int(labelled.sum() - labelled[starts].sum())
    return int(labelled[1:].sum())


def benchmark_data(cfg, *, steps: int, max_lengths: list[int], packings: list[bool]) -> list[dict]:
    """The real-data table (module docstring): prints it and returns its rows."""
    tok = load_tokenizer(train_inputs.tokenizer_source(cfg))
    model_cfg = train_inputs.with_mask_row(cfg, train_inputs.model_config(cfg), tok)
    rows = cfg.train.batch_size
    print(
        f"{jax.devices()[0].device_kind} x {len(jax.devices())}: {cfg.data.train_path or 'synthetic'}"
        f" rows, batch {rows}, model {model_cfg.num_layers} x {model_cfg.hidden_size} "
        f"({model_cfg.vocab_size} rows), block size {cfg.objective.block_size}, dtype "
        f"{model_cfg.dtype}, attention {model_cfg.attention}, remat {model_cfg.remat}"
    )
    out = []
    for length in max_lengths:
        units_of, stats_of = {}, {}
        for packed in packings:
            examples, units = data_units(cfg, length, packed, tok)
            units_of[packed] = units
            stats_of[packed] = {
                "max_length": length,
                "packing": packed,
                "padding": packing.padding_fraction(units, length),
                "rows_per_step": len(examples) / len(units) * rows,
                "steps_per_epoch": len(units) // rows,
                "label_tokens_per_step": sum(map(targets, units)) / len(units) * rows,
            }
        mine = []
        for objective in ("ar", "mars"):
            # One objective's packings at a time (their steps alternating): a MARS step of a
            # real model at length 512 holds gigabytes of activations.
            setups = {}
            for packed in packings:
                c = cfg.copy_and_resolve_references()
                c.data.max_length, c.data.packing = length, packed
                batch = batched_dataset(
                    units_of[packed],
                    batch_size=rows,
                    max_length=length,
                    seed=c.seed,
                    pad_id=tok.pad_id,
                )[0]
                batch.pop("row_ids")
                run, _ = prepare(c, objective, batch, model_cfg, units_of[packed], tok.mask_id)
                run()  # compiles
                common.progress(f"{length} packing={packed} {objective}: compiled and ran a step")
                setups[packed] = (run, [])
            for _ in range(steps):  # alternating, so that a busy machine slows both alike
                for run, times in setups.values():
                    seconds, loss = run()
                    if not np.isfinite(loss):
                        raise FloatingPointError(f"non-finite loss {loss}")
                    times.append(seconds)
            for packed, (_, times) in setups.items():
                step_s = statistics.median(times)
                mine.append(
                    {
                        **stats_of[packed],
                        "objective": objective,
                        "step_s": step_s,
                        "label_tokens_per_s": stats_of[packed]["label_tokens_per_step"] / step_s,
                    }
                )
            del setups
        mine.sort(key=lambda r: (r["packing"], r["objective"]))
        for row in mine:
            base = [r for r in mine if r["objective"] == row["objective"] and not r["packing"]]
            row["vs_unpacked"] = (
                row["label_tokens_per_s"] / (base or [row])[0]["label_tokens_per_s"]
            )
            if not out:
                print(DATA_HEADER)
            out.append(row)
            print(format_data_row(row), flush=True)
    return out


DATA_HEADER = (
    "| max_length | packing | objective | padding | rows/step | steps/epoch | step time (s) | "
    "labelled tokens/step | labelled tokens/s | vs unpacked |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_data_row(row: dict) -> str:
    return (
        f"| {row['max_length']} | {'yes' if row['packing'] else 'no'} | {row['objective']} | "
        f"{row['padding']:.1%} | {row['rows_per_step']:.2f} | {row['steps_per_epoch']} | "
        f"{row['step_s']:.2f} | {row['label_tokens_per_step']:.0f} | "
        f"{row['label_tokens_per_s']:.1f} | {row['vs_unpacked']:.2f}x |"
    )


def main() -> None:
    config = cli.config_flag(help="Run config (model, batch, length, objective, mesh).")
    steps = flags.DEFINE_integer("steps", 10, "Timed steps per objective (median reported).")
    label_fraction = flags.DEFINE_float(
        "label_fraction", 0.5, "Labelled (answer) fraction at the end of every row."
    )
    peak = flags.DEFINE_float(
        "peak_flops", 0.0, "Peak FLOP/s per device for MFU (0: measure a matmul)."
    )
    matmul_size = flags.DEFINE_integer(
        "matmul_size", 2048, "Side of the square matmul that measures the peak."
    )
    data = flags.DEFINE_bool(
        "data", False, "Batches of the config's training rows (real lengths; module docstring)."
    )
    max_lengths = flags.DEFINE_list(
        "max_lengths", None, "With --data: max lengths to measure (default: data.max_length)."
    )
    packings = flags.DEFINE_list("packing", ["false", "true"], "With --data: packing off / on.")
    json_out = flags.DEFINE_string("json_out", "", "With --data: also write the rows here.")

    def run():
        if data.value:
            config_lib.validate(config.value, training=True)  # reads its rows
            lengths = [int(x) for x in max_lengths.value or [config.value.data.max_length]]
            table = benchmark_data(
                config.value,
                steps=steps.value,
                max_lengths=lengths,
                packings=[p.lower() in ("true", "1", "yes") for p in packings.value],
            )
            if json_out.value:
                with open(json_out.value, "w") as f:
                    json.dump(table, f, indent=1)
            return
        config_lib.validate(config.value, training=True, paths=False)  # synthetic batches only
        rows = benchmark(
            config.value,
            steps=steps.value,
            label_fraction=label_fraction.value,
            peak_flops=peak.value or None,
            matmul_size=matmul_size.value,
        )
        print(json.dumps(rows))
        print(f"mars/ar step time ratio: {rows[1]['step_s'] / rows[0]['step_s']:.2f}")

    cli.run(run)


if __name__ == "__main__":
    main()
