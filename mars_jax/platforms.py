"""Keeps JAX off an absent TPU, so a program on a machine without one prints no libtpu errors.

With libtpu installed (``jax[tpu]``, which requirements-test.txt pulls in) and ``JAX_PLATFORMS``
unset, JAX's first use of a device loads libtpu, which on a machine with no TPU prints about
five lines to stderr (``Failed to find host bounds for accelerator type``, ``could not determine
TPU accelerator type``, an ``INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES`` error with a source
trace) before JAX falls back to the CPU. ``TPU_SKIP_MDS_QUERY=1`` does not silence them (it only
skips the cloud metadata server); ``JAX_PLATFORMS=cpu`` does.

`cpu_unless_accelerator` sets ``JAX_PLATFORMS=cpu`` for such a machine: one where
``JAX_PLATFORMS`` is not set and no accelerator is attached (`accelerator_attached`: no Google
PCI device, as JAX's own TPU detection reads /sys/bus/pci, no TPU device file or TPU variable,
no NVIDIA device file, no AMD /dev/kfd). There JAX would end on the CPU anyway. `cli.run` calls it before a program's ``main``; a ``JAX_PLATFORMS`` that is
set, even to "", always wins.
"""

from __future__ import annotations

import functools
import glob
import os
import sys

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (jax._src.hardware_utils)
# Set on TPU VMs and pods (and by users who point libtpu at a TPU by hand).
_TPU_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID")


def accelerator_attached() -> bool:
    """Whether a TPU, an NVIDIA GPU or an AMD GPU may be attached here: any Google PCI device, a
    TPU device file (/dev/accel*, /dev/vfio/N) or a TPU variable of a TPU VM or pod (so a
    container that hides /sys/bus/pci still counts), an NVIDIA device file, AMD's /dev/kfd."""
    if any(os.environ.get(name) for name in _TPU_VARIABLES):
        return True
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return bool(
        glob.glob("/dev/nvidia[0-9]*")
        or os.path.exists("/dev/nvidiactl")
        or os.path.exists("/dev/kfd")
    )


def cpu_unless_accelerator() -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` (the environment, and JAX's config if JAX is imported) when it
    is unset and no accelerator is attached; returns whether it did. Call it before JAX first
    uses a device (later it changes nothing)."""
    if "JAX_PLATFORMS" in os.environ or accelerator_attached():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # read at import: update the live config too
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


# glibc's mallopt parameter for the number of malloc arenas (malloc.h: M_ARENA_MAX).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Caps glibc's malloc arenas at ``arenas`` (``mallopt(M_ARENA_MAX)``, what the environment
    variable ``MALLOC_ARENA_MAX`` sets at start), unless ``MALLOC_ARENA_MAX`` is set. By
    default glibc gives each thread that allocates (XLA's, tensorstore's and Orbax's pools) an
    arena of its own, up to 8 per core, and keeps their freed memory: a process that trains,
    saves and evaluates again and again grows in resident memory with no live object behind it
    (`benchmarks/train_call_memory.py`: 42% from its first call to its eighth, 7.9% with 2
    arenas). Returns whether the cap was set (False off glibc)."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_ARENA_MAX, int(arenas)))
    except (OSError, AttributeError):  # not glibc
        return False


def release_host_memory() -> bool:
    """Gives the system back the free memory that glibc's malloc keeps (``malloc_trim(0)``).

    XLA, tensorstore and Orbax free many large buffers that glibc keeps for reuse: after a
    `train` or `evaluate` call the process holds hundreds of MiB that nothing uses, and a
    process that calls them again and again settles far above its live memory
    (`benchmarks/soak.py`, docs/training-at-scale.md). Returns whether memory was given back
    (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


def releases_host_memory(fn):
    """Decorates an entry function (`train.train`, `evaluate.evaluate`) to call
    `release_host_memory` when it returns or raises, once its own frame (the model, the
    optimizer state, the data pipeline) is gone."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_host_memory()

    return wrapper
