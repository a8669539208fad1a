r"""Ahead-of-time memory plan of the train step on TPU topologies, from the real compiler.

  PYTHONPATH=. python launch/memory_plan.py --config=configs/qwen0_5b.py:mars --topology=v5e:4x4 \
      --grad_accum_steps=1,24 --remat=none,full [--json] [--config.key=value ...]

Lowers and compiles the actual jitted train step (`train_step.build_train_step`) for an abstract
TPU topology with libtpu, on a machine without TPUs: inputs are ``jax.ShapeDtypeStruct``s with
shardings, so nothing is allocated. Prints one row per (topology, objective, micro batch, remat
policy, attention implementation) with XLA's per-device memory analysis against the chip's HBM.

Needs libtpu (``pip install "jax[tpu]==<the installed jax version>"``). The script sets these
environment defaults before jax loads (a value already set wins):

- ``JAX_PLATFORMS=cpu``: nothing runs on a device, and a TPU VM's chips stay free;
- ``TPU_SKIP_MDS_QUERY=1``: libtpu does not wait for a GCE metadata server;
- ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (only when JAX_PLATFORMS is cpu): libtpu's lock file
  (/tmp/libtpu_lockfile) guards the chips of a TPU VM against two processes; a compile-only
  process opens no chip, so plans may run next to each other and next to a process holding the
  lock. Without it a second process fails with "ABORTED: Internal error when accessing libtpu
  multi-process lockfile";
- ``TPU_ACCELERATOR_TYPE=v5litepod-4`` and ``TPU_WORKER_HOSTNAMES=localhost`` (only when
  JAX_PLATFORMS is cpu): libtpu's start-up asks for the host's chips even when it only
  compiles, and without them prints "Failed to find host bounds" and an INVALID_ARGUMENT
  error beside a correct table. The compile targets ``--topology`` either way (the tables of
  v4, v5e, v5p and v6e topologies are identical with and without these).

Shapes come from ``config.model`` (the paper configs carry the real Qwen2.5 architectures);
``init_from`` and the data paths are never read. ``objective.max_label_tokens`` must be set
(> 0): the step's logits buffer has that many positions per row, and without data there are no
examples to take it from (the paper configs set 512; for tiny pass e.g.
``--config.objective.max_label_tokens=64``). The mesh is the config's ``mesh`` section over the
topology's devices (-1 takes the rest).

Per device (bytes, from ``compiled.memory_analysis()``): ``argument_bytes`` (parameters,
optimizer state, batch), ``output_bytes``, ``alias_bytes`` (outputs that reuse a donated
argument buffer: parameters and optimizer state are donated), ``temp_bytes`` (activations and
other scratch at the peak of XLA's buffer assignment) and ``code_bytes`` (the program). Then

    peak_bytes = argument_bytes + output_bytes - alias_bytes + temp_bytes + code_bytes
    fits       = peak_bytes <= hbm_bytes

``hbm_bytes`` is the chip's nominal HBM (`TPUS`); the runtime keeps a little of it (libtpu's
compiler counts 15.75 GiB of a v5e's 16 as available), so a row within a few percent of it is
marginal. A row whose compile fails (e.g. the compiler runs out
of HBM, or the mesh does not divide the model) is printed with its error and ``fits`` false;
the sweep goes on.
"""

from __future__ import annotations

import os

# Before anything imports jax (see the module docstring).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from mars_jax import cli, model, sharding, train_step  # noqa: E402
from mars_jax import config as config_lib  # noqa: E402
from mars_jax.tokenizer import MASK_ID  # noqa: E402

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TPU:
    """A TPU generation (the prefix of a topology name): the device kind libtpu reports for it,
    the chip configuration a real VM of it shows (v4 and v5p: "megacore", one device per chip)
    and the HBM per chip in bytes."""

    device_kind: str
    chip_config: str
    hbm_bytes: int


# HBM per chip from Google Cloud's TPU system architecture pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e): v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e (Trillium) 32 GiB.
TPUS = {
    "v4": TPU("TPU v4", "megacore", 32 * GiB),
    "v5e": TPU("TPU v5 lite", "default", 16 * GiB),
    "v5p": TPU("TPU v5", "megacore", 95 * GiB),
    "v6e": TPU("TPU v6 lite", "default", 32 * GiB),
}


def libtpu_installed() -> bool:
    """Whether the libtpu package (``jax[tpu]``) is importable in this environment."""
    return importlib.util.find_spec("libtpu") is not None


def topology_devices(name: str) -> list[jax.Device]:
    """Compile-only devices of TPU topology ``name`` ("GENERATION:AxB[xC]", e.g. "v5e:4x4",
    "v5p:2x2x2"), one per chip, hosts of at most 2x2x1 chips.

    Raises ValueError for an unknown generation or a malformed shape, RuntimeError when libtpu
    is not installed or reports another device kind than `TPUS` (whose HBM would not apply).
    """
    generation, _, shape = name.partition(":")
    if generation not in TPUS:
        raise ValueError(f"topology {name!r}: generation must be one of {sorted(TPUS)}")
    try:
        dims = [int(d) for d in shape.split("x")]
    except ValueError:
        raise ValueError(f"topology {name!r}: expected a shape like 4x4 or 2x2x2") from None
    if not 2 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"topology {name!r}: expected a shape like 4x4 or 2x2x2")
    if not libtpu_installed():
        raise RuntimeError('libtpu is not installed: pip install "jax[tpu]==<jax version>"')
    tpu = TPUS[generation]
    devices = topologies.get_topology_desc(
        name,
        "tpu",
        chip_config_name=tpu.chip_config,
        chips_per_host_bounds=(min(2, dims[0]), min(2, dims[1]), 1),
        num_slices=1,
    ).devices
    if devices[0].device_kind != tpu.device_kind:
        raise RuntimeError(
            f"topology {name!r}: libtpu reports {devices[0].device_kind!r}, expected "
            f"{tpu.device_kind!r}"
        )
    return devices


def plan_row(cfg, topology: str, devices: list[jax.Device]) -> dict:
    """Compiles the train step of run config ``cfg`` on ``devices`` (of ``topology``) and
    returns its row (module docstring); a ValueError of the config (mesh, shapes) or a compile
    error is returned in ``error`` with ``fits`` false.

    Raises ValueError when ``cfg.objective.max_label_tokens`` is not positive.
    """
    if cfg.objective.max_label_tokens <= 0:
        raise ValueError(
            "objective.max_label_tokens must be > 0 for a memory plan (no data to take it from)"
        )
    t, m = cfg.train, cfg.mesh
    row = {
        "topology": topology,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "objective": cfg.objective.name,
        "global_batch": t.batch_size,
        "grad_accum_steps": t.grad_accum_steps,
        "micro_batch": (
            None if t.batch_size % t.grad_accum_steps else t.batch_size // t.grad_accum_steps
        ),
        "max_length": cfg.data.max_length,
        "remat": cfg.model.remat,
        "attention": cfg.model.attention,
        "hbm_bytes": TPUS[topology.partition(":")[0]].hbm_bytes,
    }
    start = time.perf_counter()
    try:
        config_lib.validate(cfg, training=True, paths=False)  # this row's settings; no data read
        mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
        row["mesh"] = dict(mesh.shape)
        rules = sharding.logical_rules(m.rules)
        graphdef, abstract = model.abstract_params(model.ModelConfig(**cfg.model), mesh, rules)
        obj = train_step.objective_settings(cfg, MASK_ID, examples=())
        tx, _ = train_step.optimizer(cfg, num_steps=1)
        step = train_step.build_train_step(cfg, graphdef, abstract, obj, tx, mesh, rules)
        mem = step.fn.lower(*step.abstract_inputs).compile().memory_analysis()
    except (ValueError, jax.errors.JaxRuntimeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {**row, "error": f"{type(e).__name__}: {first_line}", "fits": False}
    row.update(
        argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        code_bytes=mem.generated_code_size_in_bytes,
    )
    row["peak_bytes"] = (
        row["argument_bytes"]
        + row["output_bytes"]
        - row["alias_bytes"]
        + row["temp_bytes"]
        + row["code_bytes"]
    )
    row["fits"] = row["peak_bytes"] <= row["hbm_bytes"]
    row["compile_s"] = round(time.perf_counter() - start, 1)
    return row


def sweep(
    cfg,
    *,
    topologies_: list[str],
    objectives: list[str],
    grad_accum_steps: list[int],
    remats: list[str],
    attentions: list[str],
    emit,
) -> list[dict]:
    """Calls ``emit(row)`` for every combination, compiled one after another in this process,
    and returns the rows. ``cfg`` is not modified. Raises ValueError and RuntimeError as
    `topology_devices`, ValueError as `plan_row`."""
    rows = []
    devices_of = {t: topology_devices(t) for t in topologies_}  # bad names fail before compiling
    for topology, devices in devices_of.items():
        for objective in objectives:
            for accum in grad_accum_steps:
                for remat in remats:
                    for attention in attentions:
                        c = cfg.copy_and_resolve_references()
                        c.objective.name = objective
                        c.train.grad_accum_steps = accum
                        c.model.remat, c.model.attention = remat, attention
                        rows.append(plan_row(c, topology, devices))
                        emit(rows[-1])
    return rows


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_row(row: dict) -> str:
    """One markdown table row (see `HEADER`) of a plan row, sizes in GiB."""
    mesh = "x".join(map(str, row["mesh"].values())) if "mesh" in row else "-"
    head = (
        f"| {row['topology']} | {mesh} | {row['objective']} | "
        f"{row['global_batch']} | {row['micro_batch'] or '-'} | {row['remat']} | "
        f"{row['attention']} | "
    )
    if "error" in row:
        return head + f"failed: {row['error']} | | | | | | {_gib(row['hbm_bytes'])} | no |"
    return head + (
        f"{_gib(row['argument_bytes'])} | {_gib(row['output_bytes'])} | "
        f"{_gib(row['alias_bytes'])} | {_gib(row['temp_bytes'])} | {_gib(row['code_bytes'])} | "
        f"{_gib(row['peak_bytes'])} | {_gib(row['hbm_bytes'])} | "
        f"{'yes' if row['fits'] else 'no'} |"
    )


HEADER = (
    "| topology | mesh (data x fsdp x tensor) | objective | global batch | micro batch | remat | "
    "attention | argument GiB | output GiB | alias GiB | temp GiB | code GiB | peak GiB | "
    "HBM GiB | fits |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    config = cli.config_flag(help="Run config (model, batch, length, objective, mesh).")
    topology = flags.DEFINE_multi_string(
        "topology", ["v5e:4x4"], f"TPU topology GENERATION:SHAPE ({sorted(TPUS)}); repeatable."
    )
    objective = flags.DEFINE_list("objective", None, "Objectives (default: the config's).")
    accum = flags.DEFINE_list(
        "grad_accum_steps",
        None,
        "Gradient accumulation steps (micro batch = train.batch_size / steps; default: the "
        "config's).",
    )
    remat = flags.DEFINE_list("remat", None, f"Remat policies {model.REMAT} (default: config's).")
    attention = flags.DEFINE_list(
        "attention", None, f"Attention implementations {model.ATTENTION} (default: config's)."
    )
    as_json = flags.DEFINE_bool("json", False, "Print rows as JSON lines instead of a table.")

    def run():
        cfg = config.value
        config_lib.validate(cfg, training=True, paths=False)  # a plan reads no file of it
        remats = remat.value or [cfg.model.remat]
        attentions = attention.value or [cfg.model.attention]
        bad = [r for r in remats if r not in model.REMAT] + [
            a for a in attentions if a not in model.ATTENTION
        ]
        if bad:
            raise app.UsageError(
                f"unknown remat/attention {bad}: remat in {model.REMAT}, attention in "
                f"{model.ATTENTION}"
            )
        if cfg.objective.max_label_tokens <= 0:
            raise app.UsageError(
                "set --config.objective.max_label_tokens > 0: a plan has no data to take it from"
            )
        if not libtpu_installed():
            raise app.UsageError(
                'libtpu is not installed: pip install "jax[tpu]==<the installed jax version>"'
            )
        if not as_json.value:
            print(HEADER, flush=True)
        sweep(
            cfg,
            topologies_=topology.value,
            objectives=objective.value or [cfg.objective.name],
            grad_accum_steps=[int(a) for a in accum.value or [cfg.train.grad_accum_steps]],
            remats=remats,
            attentions=attentions,
            emit=lambda r: print(json.dumps(r) if as_json.value else format_row(r), flush=True),
        )

    cli.run(run)


if __name__ == "__main__":
    main()
