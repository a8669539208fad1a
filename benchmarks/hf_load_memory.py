r"""Peak host memory of loading a Hugging Face checkpoint onto a sharded mesh.

  python benchmarks/hf_load_memory.py --checkpoint=/tmp/qwen0_5b_bf16

Writes (once) a synthetic bf16 checkpoint with the shapes of Qwen2.5-0.5B (configs/qwen0_5b.py:
tied embeddings, 151,936 x 896; about 1 GB in safetensors files of at most 400 MB each;
``--shape=tiny``, configs/tiny.py's architecture, makes a smoke run of seconds), then
loads it into fp32 parameters on 8 simulated CPU devices (mesh fsdp=8) in fresh processes and
reports each process's peak resident memory (``ru_maxrss``):

  host:     ``jax.device_put(huggingface.load_hf_state(...), shardings)``, the whole model read
            into host memory by one process, then placed;
  sharded:  ``huggingface.load_hf_sharded``, one process with all 8 devices;
  sharded2: ``huggingface.load_hf_sharded`` in 2 processes with 4 devices each (the same
            fsdp=8 mesh over both): each reads the half of every parameter its devices hold.

On CPU the devices' buffers are host memory too, so every peak includes the loaded parameters
the process holds (fp32: all of them with one process, half with two), reported as "held".
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time

from absl import app, flags

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint",
    None,
    "Directory of the synthetic checkpoint (written if it has no config.json).",
    required=True,
)
_MEASURE = flags.DEFINE_enum(
    "measure",
    None,
    ["build", "host", "sharded", "sharded2"],
    "Internal: build the checkpoint or run one measurement in this process.",
)
_PROCESS = flags.DEFINE_integer("process", 0, "Internal: process id for sharded2.")
_PORT = flags.DEFINE_integer("port", 0, "Internal: coordinator port for sharded2.")
_SHAPE = flags.DEFINE_enum(
    "shape",
    "qwen0_5b",
    ["qwen0_5b", "tiny"],
    "Architecture: that of configs/<shape>.py (tiny: a smoke run).",
)

_SHARD_BYTES = 400 << 20


def _model_config(param_dtype: str):
    import importlib

    from mars_jax.model import ModelConfig

    config = importlib.import_module(f"configs.{_SHAPE.value}").get_config()
    return ModelConfig(**{**config.model, "param_dtype": param_dtype})


def build(path: str) -> None:
    """Writes a random bf16 checkpoint with ``--shape``'s shapes into ``path``."""
    import jax
    from flax import nnx

    from mars_jax import huggingface
    from mars_jax.model import CausalLM

    model = nnx.jit(lambda: CausalLM(_model_config("bfloat16"), rngs=nnx.Rngs(0)))()
    jax.block_until_ready(nnx.state(model))
    huggingface.export_hf(model, path, max_shard_bytes=_SHARD_BYTES)


def measure(path: str, mode: str, process: int, port: int) -> dict:
    """Loads ``path`` as ``mode`` says. This process's peak RSS, its RSS before loading (jax
    and the devices started) and the bytes of the parameters its devices hold."""
    import jax

    from mars_jax import huggingface, sharding
    from mars_jax.model import abstract_params

    if mode == "sharded2":
        jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    cfg = _model_config("float32")
    mesh = sharding.make_mesh(data=1, fsdp=8, tensor=1)
    _, abstract = abstract_params(cfg, mesh, sharding.logical_rules())
    before, start = _status("VmRSS"), time.time()
    if mode == "host":
        shardings = jax.tree.map(lambda x: x.sharding, abstract)
        params = jax.device_put(huggingface.load_hf_state(path, cfg), shardings)
    else:
        params = huggingface.load_hf_sharded(path, cfg, abstract)
    jax.block_until_ready(params)
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    return {
        "mode": mode,
        "process": process,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vm_hwm": _status("VmHWM"),
        "before": before,
        "held": held,
        "seconds": round(time.time() - start, 1),
    }


def _status(field: str) -> int:
    """A memory field of /proc/self/status (VmHWM: peak resident, VmRSS: resident), bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _child(mode: str, process: int = 0, port: int = 0) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    devices = 4 if mode == "sharded2" else 8
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    args = [
        sys.executable,
        __file__,
        f"--checkpoint={_CHECKPOINT.value}",
        f"--measure={mode}",
        f"--process={process}",
        f"--port={port}",
        f"--shape={_SHAPE.value}",
    ]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"measurement failed ({proc.returncode}): {proc.args}")
    return json.loads(out.strip().splitlines()[-1])


def main(_) -> None:
    path = _CHECKPOINT.value
    if _MEASURE.value == "build":
        build(path)
    elif _MEASURE.value:
        print(json.dumps(measure(path, _MEASURE.value, _PROCESS.value, _PORT.value)))
    else:
        report(path)


def report(path: str) -> None:
    """Builds the checkpoint if needed and prints each measurement (in fresh processes: Linux
    carries a parent's peak RSS into a forked child's ``ru_maxrss``, so this one stays small)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        if _child("build").wait():
            raise RuntimeError(f"building {path} failed")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    print(f"checkpoint {path}: {len(files)} files, {size / 2**30:.2f} GiB (bf16)")
    results = [_result(_child("host")), _result(_child("sharded"))]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    results += [_result(p) for p in [_child("sharded2", i, port) for i in range(2)]]
    for r in results:
        print(
            f"{r['mode']:9s} process {r['process']}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB "
            f"(VmHWM {r['vm_hwm'] / 2**30:.2f}, {r['before'] / 2**30:.2f} before loading), held {r['held'] / 2**30:.2f} GiB, "
            f"{r['seconds']} s"
        )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
