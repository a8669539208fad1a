r"""How the per-row KV-cache write and the decoder's per-row reads compile for TPU, by scheme.

  PYTHONPATH=. python benchmarks/decode_hlo.py [--config=configs/tiny.py] [--topology=v5e:1x1] \
      [--rows=16] [--slots=1024] [--windows=1,7] [--writes=...] [--reads=...] [--cpu_repeats=5] \
      [--json] [--config.model.<key>=<value> ...]

Decoding writes each row's T new keys/values into its cache [R, S, K, H] at the row's own slot
offset (`mars_jax.kv_cache.write_new`, into the stacked cache), and `mars_jax.decode` reads and writes per-row windows of
its token ids [R, S] and reads its hidden states [R, T, D] the same way. A ``vmap`` of
``lax.dynamic_update_slice`` / ``dynamic_slice`` is a scatter / gather, which libtpu may expand
into a serial ``while`` loop over the rows (jax-ml/jax#21367, openxla/xla#12982).

Per window length T (``--windows``; 1: AR decoding, 2B - 1 = 7: MARS with B = 4) and scheme, the
script lowers and compiles ahead of time for an abstract TPU topology (libtpu, no chip needed):

- ``forward``: one cached decode forward of the model as `mars_jax.decode` runs it
  (``Qwen2.__call__`` on T query slots against S cache slots, each row at its own offset, the
  cache donated as in the decoder's loop), its cache write replaced by each of `WRITES`
  ("model": `mars_jax.kv_cache.write_new` as the model calls it);
- ``write``: the write alone, on one layer's keys [R, S, K, H] (T new per row) and on the token
  ids [R, S] (the B = (T + 1) // 2 candidates of a step, as `mars_jax.decode` writes them);
- ``read``: each of `READS` on the token ids [R, S] -> [R, T] (the step's window) and on the
  hidden states [R, T, D] -> [R, B] (the block's candidates), as `mars_jax.decode` reads them.

From the optimized HLO (``compiled.as_text()``) it reports every ``while`` loop, nested ones
included: its bound (the integer constant of its condition: the trip count of a counter from 0),
the op it was made from (HLO metadata: "while" for a lax loop such as the layer scan, "scatter" /
"gather" for one the compiler made) and the slicing ops in its body; a loop made from a scatter or
gather, or bounded by the rows per device, is a *row loop*. Then the slicing and collective ops of
the program, and from ``compiled.cost_analysis()`` flops, bytes accessed and libtpu's
``optimal_seconds`` estimate (see `optimal`; XLA's cost analysis counts a while body once, so a
loop is understated by its trip count), and ``memory_analysis()``'s temp bytes.

Then, on this machine's CPU, the forward per write scheme is timed: a jitted ``fori_loop`` of
``--cpu_forwards`` forwards carrying the cache (as the decoder's loop does), best of
``--cpu_repeats``, the schemes interleaved, in ms per forward (with the largest difference of the
resulting cache to the first scheme's); and each read scheme on the token window, in µs per read.
``--cpu_repeats=0`` skips this; ``--topology=`` (empty) skips the TPU compiles.

``--decoders=ar,sliding,block,verify,none`` also lowers each whole decoder
(`mars_jax.decode._generate`: prefill, the loop of steps, the output; prompts of 8 tokens, 8 new
tokens, ``--block_size``) and reports its loops the same way: the step loop and the layer scans
should be the only ones.

Topology: one v5e chip by default: `mars_jax.decode.generate` without a mesh is a ``jit`` on one
device, and a row loop is a per-device matter anyway. A multi-chip topology (e.g. ``v5e:2x2``) splits the rows over all chips (a
data-parallel decode batch, parameters replicated) to check that a scheme keeps its rows local
(no collectives); rows per device is then R / chips.

The TPU part needs libtpu (``pip install "jax[tpu]==<the installed jax version>"``); as
launch/memory_plan.py, the script sets ``JAX_PLATFORMS=cpu``, ``TPU_SKIP_MDS_QUERY=1`` and
``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` before jax loads (a value already set wins).
"""

from __future__ import annotations

import os

# Before anything imports jax (see the module docstring).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Sequence  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from mars_jax import cli, decode, kv_cache, sharding  # noqa: E402
from mars_jax import config as config_lib  # noqa: E402
from mars_jax import model as model_lib
from mars_jax.decode_state import DecoderSettings, RowSettings  # noqa: E402
from mars_jax.decoder import Decoder  # noqa: E402
from mars_jax.tokenizer import DEFAULT_EOS_IDS, MASK_ID  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Per-row writes: x [R, N, ...] with new [R, T, ...] at positions start[r] .. start[r] + T - 1.


def write_vmap_dus(x, new, start):
    """vmapped ``dynamic_update_slice`` (a scatter with a [1, T, ...] window per row)."""
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=0))(
        x, new, start
    )


def _scatter(x, new, start, mode):
    r, t = new.shape[:2]
    slots = start[:, None] + jnp.arange(t)
    return x.at[jnp.arange(r)[:, None], slots].set(new, mode=mode)


def write_scatter_drop(x, new, start):
    """Scatter with explicit (row, slot) indices, one [...] window per new entry; out-of-range
    slots dropped."""
    return _scatter(x, new, start, "drop")


def write_scatter_inbounds(x, new, start):
    """As `write_scatter_drop`, with indices promised in bounds (no bounds checks)."""
    return _scatter(x, new, start, "promise_in_bounds")


def _offsets(x, new, start):
    """int [R, N, 1, ...]: position n's offset into row r's window (n - start[r])."""
    off = jnp.arange(x.shape[1])[None, :] - start[:, None]
    return off.reshape(off.shape + (1,) * (x.ndim - 2))


def write_select(x, new, start):
    """T elementwise selects over all N positions: ``where(n == start + t, new[:, t], x)``."""
    off = _offsets(x, new, start)
    for t in range(new.shape[1]):
        x = jnp.where(off == t, new[:, t : t + 1], x)
    return x


def write_select_gather(x, new, start):
    """One select over all N positions of ``new`` gathered to [R, N, ...] (take_along_axis)."""
    off = _offsets(x, new, start)
    t = new.shape[1]
    spread = jnp.take_along_axis(new, jnp.clip(off, 0, t - 1), axis=1, mode="promise_in_bounds")
    return jnp.where((off >= 0) & (off < t), spread, x)


def write_onehot_einsum(x, new, start):
    """``new`` spread to [R, N, ...] by a one-hot [R, N, T] matmul (exact: HIGHEST precision),
    then one select."""
    off = jnp.arange(x.shape[1])[None, :] - start[:, None]
    t = new.shape[1]
    onehot = (off[:, :, None] == jnp.arange(t)).astype(new.dtype)
    spread = jnp.einsum(
        "rnt,rt...->rn...",
        onehot,
        new,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=new.dtype,
    )
    inside = ((off >= 0) & (off < t)).reshape(off.shape + (1,) * (x.ndim - 2))
    return jnp.where(inside, spread, x)


def write_unrolled_dus(x, new, start):
    """R dynamic_update_slices, one per row (a constant row index), unrolled in the program (as
    MaxText's ragged AR cache update, there a fori_loop unrolled 8 times)."""
    zeros = (0,) * (x.ndim - 2)
    for r in range(x.shape[0]):
        x = jax.lax.dynamic_update_slice(x, new[r : r + 1], (r, start[r], *zeros))
    return x


def _model_layer_write(x, new, start):
    """The model's write (`mars_jax.kv_cache.write_new`) on one layer's keys [R, S, K, H]."""
    return kv_cache.write_new(x[None], new[None], start)[0]


# "model" is the model's own write (`mars_jax.kv_cache.write_new`, into the stacked cache).
WRITES = {
    "model": None,
    "vmap_dus": write_vmap_dus,
    "scatter_drop": write_scatter_drop,
    "scatter_inbounds": write_scatter_inbounds,
    "select": write_select,
    "select_gather": write_select_gather,
    "onehot_einsum": write_onehot_einsum,
    "unrolled_dus": write_unrolled_dus,
}

# ----------------------------------------------------------------------------------------------
# Per-row reads: x [R, N, ...] -> [R, size, ...], row r from position start[r].


def read_vmap_ds(x, start, size):
    """vmapped ``dynamic_slice`` (`mars_jax.kv_cache.read_window` off TPU; a gather)."""
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, size, axis=0))(x, start)


def read_take_along_axis(x, start, size):
    """``take_along_axis`` with explicit positions (a gather of single elements)."""
    idx = start[:, None] + jnp.arange(size)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1, mode="clip")


def read_onehot(x, start, size):
    """A one-hot select-and-sum over all N positions: [R, size, N, ...] elementwise, reduced."""
    hit = jnp.arange(x.shape[1])[None, None, :] == (start[:, None] + jnp.arange(size))[:, :, None]
    hit = hit.reshape(hit.shape + (1,) * (x.ndim - 2))
    return jnp.sum(jnp.where(hit, x[:, None], jnp.zeros((), x.dtype)), axis=2)


def read_unrolled_ds(x, start, size):
    """R dynamic_slices, one per row, stacked."""
    return jnp.concatenate(
        [
            jax.lax.dynamic_slice_in_dim(x[r : r + 1], start[r], size, axis=1)
            for r in range(x.shape[0])
        ]
    )


# "model" is mars_jax.kv_cache.read_window.
READS = {
    "model": None,
    "vmap_ds": read_vmap_ds,
    "take_along_axis": read_take_along_axis,
    "onehot": read_onehot,
    "unrolled_ds": read_unrolled_ds,
}


@contextlib.contextmanager
def model_write(name: str):
    """Within the block, the model writes a forward's new keys/values with `WRITES[name]`,
    applied to each layer of the stacked cache (``vmap`` over the layers; "model": unchanged,
    `mars_jax.kv_cache.write_cache`)."""
    if WRITES[name] is None:
        yield
        return
    original = model_lib.write_cache
    per_layer = jax.vmap(WRITES[name], in_axes=(0, 0, None))

    def write_cache(cache, new, start):
        if start is None:
            return original(cache, new, start)
        return {n: per_layer(cache[n], new[n].astype(cache[n].dtype), start) for n in cache}

    with mock.patch.object(model_lib, "write_cache", write_cache):
        yield


# ----------------------------------------------------------------------------------------------
# Optimized-HLO analysis.

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ", re.M)
_OPCODE = re.compile(r" = .*? ([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s,]+(?:, ?%[\w.\-]+)*)"
)
_SLICING = ("dynamic-update-slice", "dynamic-slice", "scatter", "gather")


def _computations(text: str) -> dict[str, list[str]]:
    """HLO module text -> {computation name: its instruction lines}."""
    comps, name = {}, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
    return comps


def _opcode(line: str) -> str | None:
    m = _OPCODE.search(line.split(", metadata=")[0])
    return m.group(1) if m else None


def _called(line: str) -> list[str]:
    out = []
    for m in _CALLED.finditer(line):
        out += [c.strip().lstrip("%") for c in m.group(1).split(",")]
    return out


def while_loops(text: str, rows: int) -> list[dict]:
    """The ``while`` loops of optimized HLO module ``text`` (nested ones included), each as
    {"bound": the integer constant(s) of its condition computation (one: the trip count of a
    counter from 0), "source": the op it was made from (the last part of its metadata op_name:
    "while" for a lax loop, "scatter"/"gather" for one the compiler made), "body_ops": the slicing
    ops (`_SLICING`) found in its body and everything the body calls, "row_loop": made from a
    scatter/gather or bounded by ``rows``}."""
    comps = _computations(text)

    def reachable_ops(root: str) -> set[str]:
        seen, todo, ops = set(), [root], set()
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                op = _opcode(line)
                if op in _SLICING:
                    ops.add(op)
                todo += _called(line)
        return ops

    loops = []
    for lines in comps.values():
        for line in lines:
            if _opcode(line) != "while":
                continue
            cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            bounds = sorted(
                {
                    int(v)
                    for cl in comps.get(cond, [])
                    for v in re.findall(r"s32\[\]\S* constant\((-?\d+)\)", cl)
                }
            )
            op_name = re.search(r'op_name="([^"]*)"', line)
            source = op_name.group(1).rsplit("/", 1)[-1] if op_name else "?"
            loops.append(
                {
                    "bound": bounds[0] if len(bounds) == 1 else bounds,
                    "source": source,
                    "body_ops": sorted(reachable_ops(body)),
                    "row_loop": source in ("scatter", "gather") or rows in bounds,
                }
            )
    return loops


# Opcodes that carry a cache-shaped buffer without touching its elements, and the in-place writes.
_CARRIERS = ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call")
_IN_PLACE = ("dynamic-update-slice", "scatter")
_SHAPE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \(?([a-z0-9]+)\[([\d,]*)\]")


def loop_computations(text: str) -> set[str]:
    """The computations that run inside a ``while`` loop of HLO module ``text``: its bodies and
    conditions and everything they call, nested loops included."""
    comps = _computations(text)
    todo = [
        m.group(1)
        for lines in comps.values()
        for line in lines
        if _opcode(line) == "while"
        for m in re.finditer(r"(?:body|condition)=%?([\w.\-]+)", line)
    ]
    seen = set()
    while todo:
        c = todo.pop()
        if c not in seen and c in comps:
            seen.add(c)
            todo += [x for line in comps[c] for x in _called(line)]
    return seen


def cache_rewrites(text: str, cache_shapes: Sequence[Sequence[int]]) -> list[str]:
    """Instructions inside a loop of HLO module ``text`` that make a buffer shaped like the KV
    cache (any of ``cache_shapes``, in any order of its dimensions: the stacked cache [L, R, S,
    K, H] or one layer [R, S, K, H]) other than by an in-place write: a copy, broadcast,
    transpose, select or any other op or fusion whose result is cache-shaped, but for a
    dynamic-update-slice or scatter (a fusion whose root is one), and the carriers (parameters,
    tuples, loops, branches). Each as "computation: instruction", the instruction cut at its
    operands. Empty for a loop that writes its cache in place and reads only slices of it."""
    comps = _computations(text)
    wanted = {tuple(sorted(shape)) for shape in cache_shapes}
    found = []
    for name in sorted(loop_computations(text)):
        for line in comps[name]:
            m = _SHAPE.match(line)
            op = _opcode(line)
            if not m or op in _CARRIERS or op in _IN_PLACE:
                continue
            dims = tuple(sorted(int(d) for d in m.group(2).split(",") if d))
            if dims not in wanted:
                continue
            if op == "fusion":
                (callee,) = _called(line)[:1] or [None]
                roots = [x for x in comps.get(callee, []) if x.lstrip().startswith("ROOT")]
                if roots and _opcode(roots[0]) in _IN_PLACE:
                    continue
            lhs = line.strip().removeprefix("ROOT ").split(" = ")[0]
            found.append(f"{name}: {lhs} = {m.group(1)}[{m.group(2)}] {op}")
    return found


def optimal(seconds: float | None) -> dict:
    """libtpu's ``optimal_seconds`` estimate split into {"optimal_us": the estimate of the ops it
    could estimate, "unestimated": how many it could not}. As read from its values (not from
    documentation): each op it cannot estimate (e.g. a while loop, some gathers) adds -1 s, so a
    program's value is (estimate - n) s; hence the split."""
    if seconds is None:
        return {"optimal_us": None, "unestimated": None}
    n = max(0, int(np.ceil(-seconds)))
    return {"optimal_us": round((seconds + n) * 1e6, 2), "unestimated": n}


def hlo_summary(compiled, rows_per_device: int, cache_shapes=()) -> dict:
    """While loops (`while_loops`), op counts, cost and memory analysis of a compiled program,
    and its `cache_rewrites` of ``cache_shapes``."""
    text = compiled.as_text()
    loops = while_loops(text, rows_per_device)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    counts = {
        op: 0 for op in _SLICING + ("all-gather", "all-reduce", "all-to-all", "collective-permute")
    }
    collectives = []
    for lines in _computations(text).values():
        for line in lines:
            op = _opcode(line)
            if op in counts:
                counts[op] += 1
            if op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"):
                m = _SHAPE.match(line)
                collectives.append(f"{op} {m.group(1)}[{m.group(2)}]" if m else op)
    return {
        "while_loops": len(loops),
        "row_loops": sum(lp["row_loop"] for lp in loops),
        "cache_rewrites": cache_rewrites(text, cache_shapes),
        "loops": loops,
        "ops": {k: v for k, v in counts.items() if v},
        "collectives": sorted(set(collectives)),
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        **optimal(cost.get("optimal_seconds")),
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
    }


# ----------------------------------------------------------------------------------------------
# The programs.


def decode_forward(graphdef, params, ids, cache, start):
    """One cached decode forward as `mars_jax.decode` runs it: window slot j of row r at
    position start[r] + j, attending to cache slots <= its position. Returns (hidden, cache)."""
    model = nnx.merge(graphdef, params)
    pos = start[:, None] + jnp.arange(ids.shape[1])
    return model(ids, pos, None, cache, start)


def abstract_inputs(cfg, rows, window, slots, param_sharding, row_sharding):
    """ShapeDtypeStructs (graphdef, params, ids, cache, start) of `decode_forward`."""
    graphdef, params = nnx.split(model_lib.abstract_model(cfg))
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=param_sharding), params
    )
    cache = jax.eval_shape(lambda: kv_cache.init_cache(cfg, rows, slots))
    cache = {
        k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=row_sharding(a.ndim, 1))
        for k, a in cache.items()
    }
    ids = jax.ShapeDtypeStruct((rows, window), jnp.int32, sharding=row_sharding(2, 0))
    start = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sharding(1, 0))
    return graphdef, params, ids, cache, start


def tpu_devices(topology: str):
    """Compile-only devices of ``topology`` (launch/memory_plan.py's `topology_devices`, which
    also takes single-chip shapes such as v5e:1x1)."""
    from launch import memory_plan  # sets nothing new: the environment is already set above

    return memory_plan.topology_devices(topology)


def shardings(devices):
    """(parameter sharding, row_sharding(ndim, row_axis)) on ``devices``: everything on the one
    device, or parameters replicated and rows split over all devices."""
    if len(devices) == 1:
        one = SingleDeviceSharding(devices[0])
        return one, lambda ndim, axis: one
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))

    def rows(ndim, axis):
        spec = [None] * ndim
        spec[axis] = "data"
        return NamedSharding(mesh, P(*spec))

    return NamedSharding(mesh, P()), rows


def compile_writes(cfg, devices, *, rows, slots, windows, writes, emit) -> list[dict]:
    param_sharding, row_sharding = shardings(devices)
    out = []
    for window in windows:
        graphdef, params, ids, cache, start = abstract_inputs(
            cfg, rows, window, slots, param_sharding, row_sharding
        )
        for name in writes:
            t0 = time.perf_counter()
            # A fresh jit per scheme: jit caches its trace, which would keep the first write.
            fwd = jax.jit(functools.partial(decode_forward, graphdef), donate_argnums=(2,))
            with model_write(name):
                compiled = fwd.lower(params, ids, cache, start).compile()
            row = {
                "kind": "forward",
                "scheme": name,
                "window": window,
                "rows": rows,
                "slots": slots,
                "devices": len(devices),
                **hlo_summary(compiled, rows // len(devices)),
                "compile_s": round(time.perf_counter() - t0, 1),
            }
            out.append(row)
            emit(row)
        # The write alone, its own cost without the model's (target donated): one layer's keys
        # [R, S, K, H] with T new entries per row, and the decoder's committed tokens [R, S]
        # with the B = (T + 1) // 2 candidates of a step (as `mars_jax.decode` writes them).
        k = cache["k"]
        targets = {
            "k": ((rows, *k.shape[2:]), (rows, window, *k.shape[3:]), k.dtype),
            "tokens": ((rows, slots), (rows, (window + 1) // 2), jnp.int32),
        }
        for what, (shape, new_shape, dtype) in targets.items():
            x = jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(len(shape), 0))
            new = jax.ShapeDtypeStruct(new_shape, dtype, sharding=row_sharding(len(shape), 0))
            for name in writes:
                write = WRITES[name] or (
                    _model_layer_write if what == "k" else kv_cache.write_window
                )
                row = {
                    "kind": "write",
                    "array": what,
                    "scheme": name,
                    "window": window,
                    "shape": list(shape),
                    "new": list(new_shape),
                    "devices": len(devices),
                }
                try:
                    compiled = jax.jit(write, donate_argnums=(0,)).lower(x, new, start).compile()
                except Exception as e:  # e.g. an integer matmul the backend does not support
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                else:
                    row.update(hlo_summary(compiled, rows // len(devices)))
                out.append(row)
                emit(row)
    return out


def compile_reads(cfg, devices, *, rows, slots, windows, reads, emit) -> list[dict]:
    _, row_sharding = shardings(devices)
    out = []
    for window in windows:
        size = (window + 1) // 2  # the block size B of a window of 2B - 1
        arrays = {
            # decode: the uncached committed tokens of each row's window
            "tokens": (
                jax.ShapeDtypeStruct((rows, slots), jnp.int32, sharding=row_sharding(2, 0)),
                window,
            ),
            # decode: the B hidden states whose logits give the block's candidates
            "hidden": (
                jax.ShapeDtypeStruct(
                    (rows, window, cfg.hidden_size),
                    jnp.dtype(cfg.dtype),
                    sharding=row_sharding(3, 0),
                ),
                size,
            ),
        }
        start = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sharding(1, 0))
        for what, (x, n) in arrays.items():
            for name in reads:
                fn = jax.jit(functools.partial(READS[name] or kv_cache.read_window, size=n))
                compiled = fn.lower(x, start).compile()
                row = {
                    "kind": "read",
                    "scheme": name,
                    "array": what,
                    "shape": list(x.shape),
                    "size": n,
                    "window": window,
                    "devices": len(devices),
                    **hlo_summary(compiled, rows // len(devices)),
                }
                out.append(row)
                emit(row)
    return out


def time_writes_cpu(cfg, *, rows, slots, window, writes, forwards, repeats, seed=0) -> dict:
    """ms per cached forward on the local CPU for each write scheme (module docstring)."""
    model = model_lib.CausalLM(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, window)), jnp.int32)
    start0 = jnp.asarray(rng.integers(0, slots - forwards * window, (rows,)), jnp.int32)
    fns = {}
    for name in writes:

        def loop(params, cache, start0):
            def body(i, cache):
                _, cache = decode_forward(graphdef, params, ids, cache, start0 + i * window)
                return cache

            return jax.lax.fori_loop(0, forwards, body, cache)

        with model_write(name):
            fns[name] = (
                jax.jit(loop, donate_argnums=(1,))
                .lower(params, kv_cache.init_cache(cfg, rows, slots), start0)
                .compile()
            )
    best = {name: float("inf") for name in writes}
    results = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            cache = kv_cache.init_cache(cfg, rows, slots)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            cache = jax.block_until_ready(fn(params, cache, start0))
            best[name] = min(best[name], time.perf_counter() - t0)
            results[name] = cache
    ref = results[writes[0]]
    diff = {
        name: max(float(jnp.max(jnp.abs(ref[k] - c[k]))) for k in ref)
        for name, c in results.items()
    }
    return {
        name: {
            "ms_per_forward": round(best[name] / forwards * 1e3, 3),
            "cache_max_abs_diff": diff[name],
        }
        for name in writes
    }


def time_reads_cpu(*, rows, slots, window, reads, iters, repeats, seed=0) -> dict:
    """µs per read of the decoder's token window ([R, S] -> [R, T]) on the local CPU, as a
    ``fori_loop`` of ``iters`` reads (each feeding the next start)."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 1000, (rows, slots)), jnp.int32)
    start = jnp.asarray(rng.integers(0, slots - window, (rows,)), jnp.int32)
    fns = {}
    for name in reads:

        def loop(tokens, start, read=READS[name] or kv_cache.read_window):
            def body(i, acc):
                got = read(tokens, (start + acc) % (slots - window), window)
                return acc + got[:, 0] % 2

            return jax.lax.fori_loop(0, iters, body, jnp.zeros_like(start))

        fns[name] = jax.jit(loop).lower(tokens, start).compile()
    best = {name: float("inf") for name in reads}
    outs = {}
    for _ in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(fn(tokens, start))
            best[name] = min(best[name], time.perf_counter() - t0)
    ref = outs[reads[0]]
    return {
        name: {
            "us_per_read": round(best[name] / iters * 1e6, 2),
            "equal_to_first": bool(np.array_equal(ref, outs[name])),
        }
        for name in reads
    }


# ----------------------------------------------------------------------------------------------


# Decoders lowered whole (``--decoders``): name -> (cache_mode, rule).
DECODERS = {
    "ar": ("sliding", "prob"),
    "sliding": ("sliding", "prob"),
    "block": ("block", "prob"),
    "verify": ("sliding", "verify"),
    "none": ("none", "prob"),
    # The serving engine's unit of work: `Decoder.steps` (4 forwards, its state donated) of the
    # sliding decoder, on one device.
    "steps": ("sliding", "prob"),
    # The same over its first rows only (one user of a many-slot server: `steps`' ``rows``).
    "steps_first_rows": ("sliding", "prob"),
}


def compile_decoders(
    cfg, devices, *, rows, prompt_len, max_new_tokens, block_size, decoders, emit
) -> list[dict]:
    """Lowers and compiles the whole decoder (`mars_jax.decode._generate`: prefill, the
    ``while_loop`` of steps, the output) for each of ``decoders`` (`DECODERS`; "ar" with block
    size 1) on ``devices``: one device, or a (data = all devices) mesh with the default rules,
    as ``decode.generate(..., mesh=, axis_rules=)`` runs it."""
    mesh = rules = None
    if len(devices) > 1:
        mesh = sharding.make_mesh(data=-1, devices=devices)
        rules = sharding.logical_rules()
        param_sharding = NamedSharding(mesh, P())
        row = lambda shape: NamedSharding(mesh, P(("data", "fsdp"), *[None] * (len(shape) - 1)))
    else:
        param_sharding = SingleDeviceSharding(devices[0])
        row = lambda shape: param_sharding
    graphdef, params = nnx.split(model_lib.abstract_model(cfg))
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=param_sharding), params
    )
    arg = lambda shape, dtype, sh=None: jax.ShapeDtypeStruct(
        shape, dtype, sharding=sh or row(shape)
    )
    out = []
    for name in decoders:
        cache_mode, rule = DECODERS[name]
        b = 1 if name == "ar" else block_size
        settings = DecoderSettings(
            block_size=b,
            max_new_tokens=max_new_tokens,
            eos_ids=DEFAULT_EOS_IDS,
            mask_id=MASK_ID,
            sampling=False,
            cache_mode=cache_mode,
            rule=rule,
            adaptive_window=True,
            mesh=mesh,
            axis_rules=rules,
            on_accept=None,
        )
        row_settings = jax.eval_shape(
            lambda: RowSettings.build(
                rows, threshold=0.9, max_accept=b, max_new_tokens=max_new_tokens
            )
        )
        t0 = time.perf_counter()
        inputs = (
            params,
            arg((rows, prompt_len), jnp.int32),
            arg((rows,), jnp.int32),
            jax.tree.map(lambda a: arg(a.shape, a.dtype), row_settings),
        )
        if name.startswith("steps"):
            decoder = Decoder(graphdef, settings)
            state = jax.eval_shape(lambda *a: decoder.prefill(*a), *inputs)
            first = max(rows // 2, 1) if name == "steps_first_rows" else None
            compiled = Decoder.steps.lower(decoder, params, state, 4, first).compile()
        else:
            compiled = decode._generate.lower(
                *inputs, graphdef=graphdef, settings=settings
            ).compile()
        per_device = rows // len(devices)
        layer = (per_device, settings.slots(prompt_len), cfg.num_kv_heads, cfg.head_dim)
        result = {
            "kind": "decoder",
            "scheme": name,
            "window": 2 * b - 1,
            "rows": rows,
            "devices": len(devices),
            "max_forwards": settings.max_forwards,
            # cache mode "none" has no cache (its full forwards have a cache's dimensions)
            **hlo_summary(
                compiled,
                per_device,
                [] if cache_mode == "none" else [layer, (cfg.num_layers, *layer)],
            ),
            "compile_s": round(time.perf_counter() - t0, 1),
        }
        out.append(result)
        emit(result)
    return out


def _loops_text(row: dict) -> str:
    if not row["loops"]:
        return "-"
    return "; ".join(
        f"bound {lp['bound']} from {lp['source']} [{','.join(lp['body_ops']) or 'no slicing'}]"
        f"{' ROW LOOP' if lp['row_loop'] else ''}"
        for lp in row["loops"]
    )


def format_row(row: dict) -> str:
    name = f"{row['array']}: {row['scheme']}" if "array" in row else row["scheme"]
    ops = ", ".join(f"{k} {v}" for k, v in row["ops"].items()) or "-"
    if "error" in row:
        return f"| {row['kind']} | T={row['window']} | {name} | failed: {row['error']} |"
    num = lambda v, f: "-" if v is None else format(v, f)
    mib = lambda b: num(None if b is None else b / 2**20, ".2f")
    optimal = num(row["optimal_us"], ".2f") + (
        f" (+{row['unestimated']} unestimated)" if row["unestimated"] else ""
    )
    return (
        f"| {row['kind']} | T={row['window']} | {name} | {row['while_loops']} | "
        f"{row['row_loops']} | {_loops_text(row)} | {ops} | {num(row['flops'], '.3g')} | "
        f"{mib(row['bytes_accessed'])} | {optimal} | {mib(row['temp_bytes'])} |"
    )


HEADER = (
    "| program | window | scheme | while loops | row loops | loops (bound, source, slicing ops "
    "in body) | slicing/collective ops | flops | MiB accessed | optimal µs | temp MiB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    config = cli.config_flag(help="Run config: only its model section is used.")
    topology = flags.DEFINE_string(
        "topology", "v5e:1x1", "TPU topology to compile for (empty: no TPU compiles)."
    )
    rows = flags.DEFINE_integer("rows", 16, "Rows R (decode batch).")
    slots = flags.DEFINE_integer("slots", 1024, "Cache slots S.")
    windows = flags.DEFINE_list("windows", ["1", "7"], "Window lengths T (1: AR; 2B - 1: MARS).")
    writes = flags.DEFINE_list("writes", list(WRITES), f"Write schemes, of {list(WRITES)}.")
    reads = flags.DEFINE_list("reads", list(READS), f"Read schemes, of {list(READS)}.")
    cpu_window = flags.DEFINE_integer("cpu_window", 7, "Window T of the CPU timing.")
    cpu_forwards = flags.DEFINE_integer("cpu_forwards", 8, "Forwards per timed CPU call.")
    cpu_repeats = flags.DEFINE_integer("cpu_repeats", 5, "Timed CPU calls (0: no CPU timing).")
    decoders = flags.DEFINE_list(
        "decoders", [], f"Whole decoders to lower, of {list(DECODERS)} (8 new tokens)."
    )
    block_size = flags.DEFINE_integer("block_size", 4, "Block size of the --decoders.")
    prompt_len = flags.DEFINE_integer("prompt_len", 8, "Prompt width of the --decoders.")
    as_json = flags.DEFINE_bool("json", False, "Print JSON lines instead of tables.")

    def run():
        bad = [w for w in writes.value if w not in WRITES] + [
            r for r in reads.value if r not in READS
        ]
        if bad:
            raise ValueError(f"unknown schemes {bad}: writes {list(WRITES)}, reads {list(READS)}")
        config_lib.validate(config.value, training=False, paths=False)  # its model section
        cfg = model_lib.ModelConfig(**config.value.model)
        ws = [int(w) for w in windows.value]
        emit = (
            (lambda r: print(json.dumps(r), flush=True))
            if as_json.value
            else (lambda r: print(format_row(r), flush=True))
        )
        if topology.value:
            devices = tpu_devices(topology.value)
            if not as_json.value:
                print(
                    f"{topology.value} ({devices[0].device_kind}, {len(devices)} devices), "
                    f"R={rows.value}, S={slots.value}, {cfg}\n\n{HEADER}",
                    flush=True,
                )
            kwargs = dict(rows=rows.value, slots=slots.value, windows=ws, emit=emit)
            compile_writes(cfg, devices, writes=writes.value, **kwargs)
            compile_reads(cfg, devices, reads=reads.value, **kwargs)
            compile_decoders(
                cfg,
                devices,
                rows=rows.value,
                prompt_len=prompt_len.value,
                max_new_tokens=8,
                block_size=block_size.value,
                decoders=decoders.value,
                emit=emit,
            )
        if cpu_repeats.value:
            t = time_writes_cpu(
                cfg,
                rows=rows.value,
                slots=slots.value,
                window=cpu_window.value,
                writes=writes.value,
                forwards=cpu_forwards.value,
                repeats=cpu_repeats.value,
            )
            r = time_reads_cpu(
                rows=rows.value,
                slots=slots.value,
                window=cpu_window.value,
                reads=reads.value,
                iters=200,
                repeats=cpu_repeats.value,
            )
            if as_json.value:
                print(json.dumps({"kind": "cpu_time", "writes": t, "reads": r}), flush=True)
            else:
                print(
                    f"\nCPU ({jax.devices('cpu')[0].device_kind}), R={rows.value}, "
                    f"S={slots.value}, T={cpu_window.value}, best of {cpu_repeats.value}:"
                )
                print(
                    f"| write scheme | ms / forward | cache max abs diff to {writes.value[0]} |"
                    "\n|---|---|---|"
                )
                for name, v in t.items():
                    print(f"| {name} | {v['ms_per_forward']} | {v['cache_max_abs_diff']:.2g} |")
                print("| read scheme (tokens window) | µs / read | equal |\n|---|---|---|")
                for name, v in r.items():
                    print(f"| {name} | {v['us_per_read']} | {v['equal_to_first']} |")

    cli.run(run)


if __name__ == "__main__":
    main()
