"""Device mesh and logical-axis sharding rules (in the style of MaxText's logical_axis_rules).

Model parameters carry logical axis names (``logical_axes`` metadata: vocab, embed, heads,
kv_heads, mlp, norm); a rules table maps each name to mesh axes of the ``(data, fsdp, tensor)``
mesh. Batches are split over ``data`` and ``fsdp``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, or None = replicated)
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
)


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all); -1 takes the rest.

    Raises ValueError when the axis sizes do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} does not use the {len(devices)} devices"
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_spec(names: Sequence[str | None], rules=DEFAULT_RULES) -> P:
    """PartitionSpec for a tuple of logical axis names under ``rules``."""
    table = dict(rules)
    return P(*(table.get(n) if n is not None else None for n in names))


def _check_divisible(path: str, shape, spec: P, mesh: Mesh):
    for dim, axes in zip(shape, spec):
        if axes is None:
            continue
        size = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
        if dim % size:
            raise ValueError(
                f"parameter {path}: dimension {dim} is not divisible by mesh axes "
                f"{axes} of size {size}; change the mesh or the sharding rules"
            )


def param_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a parameter State (abstract or concrete), same tree structure.

    Raises ValueError for a parameter whose dimension is not divisible by its mesh axes.
    """

    def one(path, var):
        names = var.get_metadata().get("logical_axes") or (None,) * var.ndim
        spec = logical_spec(names, rules)
        _check_divisible(jax.tree_util.keystr(path), var.shape, spec, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of a [batch, length] array: rows split over the "batch" rule's mesh axes."""
    return NamedSharding(mesh, logical_spec(("batch", None), rules))
