"""The old names of the run-config checks, kept for their callers: `mars_jax.config` holds them.

``settings.check(cfg, training=...)`` is `config.validate`; the other names are
`mars_jax.config`'s and `mars_jax.errors`' own. New code imports those modules.
"""

from __future__ import annotations

from mars_jax.config import (  # re-exported
    SOURCES,
    check_devices,
    check_keys,
    flat_keys,
    mesh_sizes,
    nearest_key,
    unknown_key,
    unknown_key_message,
    validate,
)
from mars_jax.errors import MissingPath, SettingError  # re-exported

__all__ = [
    "SOURCES",
    "MissingPath",
    "SettingError",
    "check",
    "check_devices",
    "check_keys",
    "flat_keys",
    "mesh_sizes",
    "nearest_key",
    "unknown_key",
    "unknown_key_message",
]


def check(cfg, *, training: bool = True, schema=None) -> None:
    """`config.validate` (``training`` defaults to True here, as it did)."""
    validate(cfg, training=training, schema=schema)
