"""Device mesh and logical-axis sharding rules (in the style of MaxText's logical_axis_rules).

Model parameters carry logical axis names in flax's own partitioning metadata
(``nnx.with_partitioning``: the ``out_sharding`` of each ``nnx.Param``), so
``nnx.get_partition_spec`` reads them like any flax model. A rules table maps each logical name
(layers, vocab, embed, heads, kv_heads, mlp, norm for parameters; batch, length,
activation_embed for activations) to axes of the
``(data, fsdp, tensor)`` mesh. The table lives in the run config (``mesh.rules``; the default is
`DEFAULT_RULES`) and is passed to every function that places arrays: `param_shardings` for a
parameter State, `batch_sharding` for batches, `with_logical_constraint` for activations inside
a traced function; `shardings_of` reads the shardings of a placed tree. The model's sharded
abstract parameters are `mars_jax.model.abstract_params`; this module knows no model.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import flax.core.spmd
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mars_jax.errors import InputError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (empty: replicated). The form of config's ``mesh.rules``; overrides
# from the command line are tuples, e.g. --config.mesh.rules.embed="('data','fsdp')".
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "length": (),
    "activation_embed": (),
    "layers": (),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "norm": (),
}

# The rules as flax takes them: ((logical name, mesh axis | tuple of axes | None), ...).
Rules = tuple[tuple[str, Any], ...]


def logical_rules(table: Mapping[str, Sequence[str]] = DEFAULT_RULES) -> Rules:
    """Converts a rules table (logical name -> mesh axes, as in config ``mesh.rules``) into the
    ``(name, axes)`` pairs that ``nnx.logical_axis_rules`` takes.

    Raises ValueError for a mesh axis that is not one of `MESH_AXES`, or a mesh axis that two
    dimensions of one array could both take (an axis used twice within one rule).
    """
    pairs = []
    for name, axes in dict(table).items():
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown or len(set(axes)) != len(axes):
            raise InputError(
                f"mesh.rules.{name}: {axes!r} must name distinct mesh axes among {MESH_AXES}"
            )
        pairs.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(pairs)


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all); -1 takes the rest.

    Raises ValueError when the axis sizes do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise InputError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise InputError(
            f"mesh {dict(zip(MESH_AXES, sizes))} does not use the {len(devices)} devices"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def mesh_from_config(mesh_cfg) -> tuple[Mesh, Rules]:
    """(Mesh, rules) of a config's ``mesh`` section (data, fsdp, tensor, rules).

    Raises ValueError as `make_mesh` and `logical_rules`.
    """
    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    return mesh, logical_rules(mesh_cfg.rules)


def logical_spec(names: Sequence[str | None], rules: Rules) -> P:
    """PartitionSpec for a tuple of logical axis names under ``rules``; a name without a rule
    is replicated."""
    table = dict(rules)
    return P(*(table.get(n) if n is not None else None for n in names))


def axis_size(mesh: Mesh, axes) -> int:
    """Number of devices along ``axes`` (None, one mesh axis name or a tuple of them)."""
    if axes is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))


def check_heads(num_heads: int, num_kv_heads: int, mesh: Mesh, rules: Rules) -> None:
    """Raises ValueError when the mesh axes of the "heads" or "kv_heads" rule do not divide the
    number of attention heads and of KV heads: the projections are stored flattened
    ([D, heads * head_dim]), so a width check alone would let a shard split inside a head."""
    table = dict(rules)
    for name, count in (("heads", num_heads), ("kv_heads", num_kv_heads)):
        size = axis_size(mesh, table.get(name))
        if count % size:
            raise InputError(
                f"mesh axes {table.get(name)!r} of size {size} (rule {name!r}) split attention "
                f"heads: num_heads {num_heads} and num_kv_heads {num_kv_heads} must both be "
                f"divisible by it; choose another tensor size or rule"
            )


def param_shardings(state: nnx.State, mesh: Mesh, rules: Rules):
    """NamedShardings for a parameter State (abstract or concrete), same tree structure, read
    from the parameters' flax partitioning metadata (``nnx.get_partition_spec``) under
    ``rules``.

    Raises ValueError for a parameter whose rules use a mesh axis twice, or whose dimension is
    not divisible by its mesh axes.
    """
    with nnx.logical_axis_rules(_with_unnamed_replicated(state, rules)):
        specs = nnx.get_partition_spec(state)

    def one(path, var, spec):
        spec = spec.get_value() if isinstance(spec, nnx.Variable) else spec
        used = [a for axes in spec if axes for a in (axes if isinstance(axes, tuple) else (axes,))]
        if len(used) != len(set(used)):
            names = var.get_metadata().get("out_sharding")
            raise InputError(
                f"parameter {jax.tree_util.keystr(path)}: its axes {names} map to {spec}, which "
                "uses a mesh axis twice; give these logical axes disjoint mesh axes in mesh.rules"
            )
        for dim, axes in zip(var.shape, spec):
            if dim % axis_size(mesh, axes):
                raise InputError(
                    f"parameter {jax.tree_util.keystr(path)}: dimension {dim} is not divisible "
                    f"by mesh axes {axes} of size {axis_size(mesh, axes)}; change the mesh or "
                    "the sharding rules"
                )
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def _with_unnamed_replicated(state: nnx.State, rules: Rules) -> Rules:
    """``rules`` plus (name, None) for logical names the parameters use but the rules omit
    (flax would otherwise pass such a name through as a mesh axis)."""
    names = {
        n
        for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        for n in (v.get_metadata().get("out_sharding") or ())
        if n is not None
    }
    known = dict(rules)
    return tuple(rules) + tuple((n, None) for n in sorted(names - known.keys()))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length] array (``ndim`` 2; 1: a [batch] array, e.g. per-row
    weights): rows split over the "batch" rule's mesh axes."""
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), rules))


def with_logical_constraint(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """``x`` constrained to the sharding its logical axis ``names`` get under the active flax
    logical-axis rules (``nnx.logical_axis_rules``) on the active mesh
    (``jax.sharding.use_abstract_mesh``); unchanged where no mesh is active (a single device) or a
    name has no rule. The name follows MaxText's helper of the same role."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    rules = dict(flax.core.spmd.get_logical_axis_rules())
    return jax.lax.with_sharding_constraint(x, P(*(rules.get(n) for n in names)))


def shardings_of(tree):
    """The sharding of every leaf of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` that carry one),
    same tree structure: e.g. the ``in_shardings`` of a jit over abstract arguments."""
    return jax.tree.map(lambda x: x.sharding, tree)
