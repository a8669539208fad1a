r"""Launches mars-jax training with XManager, or prints the job spec (``--dry_run``).

  python launch/xm_launch.py --config=configs/qwen0_5b.py --workdir=RUN_DIR \
      --gpu=a100 --gpus_per_host=8 [--stage=both] [--dry_run] \
      -- --config.init_from=/models/Qwen2.5-0.5B-Instruct --config.data.train_path=/data/sft.jsonl

Everything after ``--`` must be ``--config.KEY=VALUE`` overrides; they reach every training
command verbatim, in order. ``--stage=both`` (the default) trains stage 1 (``ar``) in
``RUN_DIR/ar``, then stage 2 (``mars``) in ``RUN_DIR/mars`` with
``--config.init_from=RUN_DIR/ar`` after the user's overrides, as ``launch/two_stage.sh`` does;
``--stage=ar`` or ``--stage=mars`` trains that stage alone in ``RUN_DIR``. Stage 2 alone needs
``--config.init_from`` among the overrides.

The job spec, printed as JSON by ``--dry_run`` (xmanager is not needed for it):

  name         experiment title
  accelerator  {"tpu": "v5e", "topology": "4x4"} or {"gpu": "h100", "count": 8} (per host)
  num_hosts    processes/hosts that run the same command (``jax.distributed`` wires them up)
  image        {"base_image": ..., "pip_install": [...]}: how the container is built from
               ``git archive HEAD`` of this repository (uncommitted changes are not shipped)
  env          environment variables of every job
  jobs         in launch order, each {"stage", "workdir", "argv"}; a job starts after the
               previous one completed successfully

Without ``--dry_run`` the spec is launched with the open-source XManager (``pip install
xmanager``, plus Docker or Cloud Build and ``gcloud auth`` for Vertex AI): the accelerator
becomes ``xm.JobRequirements`` (``tpu_v5e="4x4"`` or ``h100=8``, ``replicas=num_hosts``), the
code an ``xm.python_container`` and each job an ``xm.Job`` on the ``xm_local.Vertex`` executor.
Its Vertex backend (xmanager 0.8.5) picks a machine type only for A100 (a2), L4 (g2) and the
n1-attached GPUs (T4, V100), maps TPU v2/v3 only, and needs a replica count of 1 for the first
job of a work unit. So real launches here are single-host jobs on those GPUs; other specs are
refused before anything is built, TPU pods with a pointer to ``launch/tpu_vm.sh`` (see
docs/training-at-scale.md, "Running on a TPU pod / GPU cluster").
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

# The jax release the launchers install next to requirements.txt (as in launch/tpu_vm.sh).
JAX_VERSION = "0.10.2"
# TPU generations and GPU types with an xm.ResourceType (names as xm.JobRequirements takes
# them: tpu_<generation>, <gpu>).
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")
GPU_TYPES = ("t4", "l4_24th", "v100", "a100", "a100_80gib", "h100", "h200", "b200")
# GPUs for which xmanager's Vertex backend chooses a machine type that carries them (others get
# an n1 machine, which Vertex AI does not pair with H100/H200/B200 or A100 80GB).
VERTEX_GPUS = ("t4", "v100", "a100", "l4_24th")
DEFAULT_BASE_IMAGE = "python:3.11-slim"
STAGES = ("ar", "mars", "both")
TRAIN = ["python", "-m", "mars_jax.train"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accelerator(tpu: str | None, topology: str | None, gpu: str | None, gpus_per_host: int):
    """The spec's accelerator entry: ``{"tpu", "topology"}`` or ``{"gpu", "count"}``.

    Raises ValueError unless exactly one of ``tpu`` and ``gpu`` is set with a known name (and a
    ``topology`` such as ``4x4`` for a TPU)."""
    if (tpu is None) == (gpu is None):
        raise ValueError("set exactly one of --tpu and --gpu")
    if tpu is not None:
        if tpu not in TPU_GENERATIONS:
            raise ValueError(f"--tpu={tpu!r}: expected one of {', '.join(TPU_GENERATIONS)}")
        if not topology or not all(d.isdigit() for d in topology.split("x")):
            raise ValueError(f"--tpu needs --topology like 4x4 or 2x2x2, got {topology!r}")
        return {"tpu": tpu, "topology": topology}
    if gpu not in GPU_TYPES:
        raise ValueError(f"--gpu={gpu!r}: expected one of {', '.join(GPU_TYPES)}")
    if gpus_per_host < 1:
        raise ValueError(f"--gpus_per_host must be positive, got {gpus_per_host}")
    return {"gpu": gpu, "count": gpus_per_host}


def training_jobs(config: str, workdir: str, stage: str, overrides: list[str]) -> list[dict]:
    """The training commands of ``stage`` (``ar``, ``mars`` or ``both``), in launch order.

    ``config`` is a config file path without a ``:stage`` suffix; ``overrides`` are
    ``--config.KEY=VALUE`` flags passed verbatim. With ``both``, stage 2 runs in
    ``workdir/mars`` from ``workdir/ar``. Raises ValueError for another stage, a suffixed config
    or a flag that is not a config override."""
    if stage not in STAGES:
        raise ValueError(f"--stage={stage!r}: expected one of {', '.join(STAGES)}")
    if ":" in config:
        raise ValueError(f"--config={config!r}: give the file only; --stage picks the stage")
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise ValueError(f"only --config.KEY=VALUE overrides may follow '--', got {bad}")

    def job(stage_name: str, run_dir: str, extra: list[str]) -> dict:
        argv = [*TRAIN, f"--config={config}:{stage_name}", f"--workdir={run_dir}", *overrides]
        return {"stage": stage_name, "workdir": run_dir, "argv": argv + extra}

    if stage != "both":
        return [job(stage, workdir, [])]
    ar_dir, mars_dir = f"{workdir}/ar", f"{workdir}/mars"
    return [job("ar", ar_dir, []), job("mars", mars_dir, [f"--config.init_from={ar_dir}"])]


def job_spec(
    *,
    name: str,
    config: str,
    workdir: str,
    stage: str,
    overrides: list[str],
    accel: dict,
    num_hosts: int,
    base_image: str,
) -> dict:
    """The job spec printed by ``--dry_run`` and launched otherwise (see the module docstring).

    Raises ValueError for ``num_hosts < 1`` and as `training_jobs`."""
    if num_hosts < 1:
        raise ValueError(f"--num_hosts must be positive, got {num_hosts}")
    jax_extra = "tpu" if "tpu" in accel else "cuda12"
    return {
        "name": name,
        "accelerator": accel,
        "num_hosts": num_hosts,
        "image": {
            "base_image": base_image,
            "pip_install": ["-r", "requirements.txt", f"jax[{jax_extra}]=={JAX_VERSION}"],
        },
        "env": {"PYTHONUNBUFFERED": "1"},
        "jobs": training_jobs(config, workdir, stage, overrides),
    }


def xm_requirements(xm, spec: dict):
    """``xm.JobRequirements`` of one job of ``spec``: the accelerator per host (a TPU topology
    such as ``tpu_v5e="4x4"``, or a GPU count such as ``h100=8``) and ``replicas=num_hosts``."""
    accel = spec["accelerator"]
    if "tpu" in accel:
        resources = {f"tpu_{accel['tpu']}": accel["topology"]}
    else:
        resources = {accel["gpu"]: accel["count"]}
    return xm.JobRequirements(resources, replicas=spec["num_hosts"])


def check_vertex(spec: dict) -> None:
    """Raises ValueError for a spec that xmanager's Vertex backend cannot run: a TPU (it maps
    only the TPU v2/v3 ``cloud-tpu`` machine; JAX runs on TPU VMs: use launch/tpu_vm.sh), a GPU
    outside `VERTEX_GPUS`, or ``num_hosts > 1`` (the first job of a work unit must have one
    replica, and JAX reads no Vertex cluster spec)."""
    accel = spec["accelerator"]
    if "tpu" in accel:
        raise ValueError(
            "xmanager's Vertex executor has no TPU VM machine types; launch TPU pods with "
            "launch/tpu_vm.sh (the job spec above still shows the requirements)"
        )
    if accel["gpu"] not in VERTEX_GPUS:
        raise ValueError(
            f"xmanager's Vertex executor has no machine type for {accel['gpu']} (it has for "
            f"{', '.join(VERTEX_GPUS)}); use a SLURM cluster"
        )
    if spec["num_hosts"] != 1:
        raise ValueError(
            "multi-host jobs are not wired for Vertex: use a SLURM cluster or launch/tpu_vm.sh"
        )


def docker_instructions(spec: dict, project_dir: str) -> list[str]:
    """Dockerfile steps after ``FROM base_image``: install requirements, the pinned jax build and
    the package; the entrypoint runs from the project directory."""
    pip = " ".join(json.dumps(p) if "[" in p else p for p in spec["image"]["pip_install"])
    return [
        "ENV LANG=C.UTF-8",
        "WORKDIR /mars-jax",
        f"COPY {project_dir}/requirements.txt requirements.txt",
        f"RUN python -m pip install --no-cache-dir {pip}",
        f"COPY {project_dir}/ .",
        "RUN python -m pip install --no-cache-dir --no-deps -e .",
    ]


def source_tree(destination: str) -> str:
    """Extracts ``git archive HEAD`` of this repository into ``destination/mars-jax`` and
    returns that path (what the container is built from)."""
    project = os.path.join(destination, "mars-jax")
    os.makedirs(project)
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", "--format=tar", "HEAD"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", project], input=archive, check=True)
    return project


async def launch(spec: dict) -> None:
    """Packages this repository and runs ``spec``'s jobs one after another on Vertex AI,
    each after the previous one completed (``spec`` passed `check_vertex`). Needs xmanager,
    imported here rather than at module import."""
    from xmanager import xm, xm_local

    requirements = xm_requirements(xm, spec)
    with tempfile.TemporaryDirectory() as tmp:
        project = source_tree(tmp)
        async with xm_local.create_experiment(experiment_title=spec["name"]) as experiment:
            [executable] = experiment.package(
                [
                    xm.python_container(
                        executor_spec=xm_local.Vertex.Spec(),
                        path=project,
                        base_image=spec["image"]["base_image"],
                        docker_instructions=docker_instructions(spec, os.path.basename(project)),
                        entrypoint=xm.ModuleName("mars_jax.train"),
                        env_vars=spec["env"],
                    )
                ]
            )
            for job in spec["jobs"]:
                # argv[:3] is `python -m mars_jax.train`, the container's entrypoint.
                args = job["argv"][len(TRAIN) :]
                executor = xm_local.Vertex(requirements=requirements)
                work_unit = await experiment.add(xm.Job(executable, executor, args=args))
                await work_unit.wait_until_complete()


def main() -> None:
    """Defines the flags, then prints (``--dry_run``) or launches the job spec."""
    try:  # XManager's own flags (image building, Vertex) must be parsed with ours.
        import xmanager.xm_flags  # noqa: F401
    except ImportError:
        pass
    config = flags.DEFINE_string(
        "config", None, "Config file, e.g. configs/qwen7b.py.", required=True
    )
    workdir = flags.DEFINE_string(
        "workdir",
        None,
        "Run directory on storage every host sees (RUN_DIR/{ar,mars} with --stage=both).",
        required=True,
    )
    stage = flags.DEFINE_enum("stage", "both", STAGES, "Stage(s) to train.")
    tpu = flags.DEFINE_string("tpu", None, f"TPU generation: {', '.join(TPU_GENERATIONS)}.")
    topology = flags.DEFINE_string("topology", None, "TPU slice topology, e.g. 4x4.")
    gpu = flags.DEFINE_string("gpu", None, f"GPU type: {', '.join(GPU_TYPES)}.")
    gpus_per_host = flags.DEFINE_integer("gpus_per_host", 8, "GPUs per host (with --gpu).")
    num_hosts = flags.DEFINE_integer("num_hosts", 1, "Hosts running the same command.")
    name = flags.DEFINE_string("name", None, "Experiment title (default: mars-<config name>).")
    base_image = flags.DEFINE_string("base_image", DEFAULT_BASE_IMAGE, "Container base image.")
    dry_run = flags.DEFINE_bool("dry_run", False, "Print the job spec as JSON; launch nothing.")

    def run(argv: list[str]) -> None:
        try:
            spec = job_spec(
                name=name.value or f"mars-{os.path.splitext(os.path.basename(config.value))[0]}",
                config=config.value,
                workdir=workdir.value,
                stage=stage.value,
                overrides=argv[1:],
                num_hosts=num_hosts.value,
                base_image=base_image.value,
                accel=accelerator(tpu.value, topology.value, gpu.value, gpus_per_host.value),
            )
        except ValueError as e:
            raise app.UsageError(str(e)) from e
        print(json.dumps(spec, indent=2))
        if dry_run.value:
            return
        try:
            check_vertex(spec)
        except ValueError as e:
            sys.exit(f"not launched: {e}")
        asyncio.run(launch(spec))

    app.run(run)


if __name__ == "__main__":
    main()
