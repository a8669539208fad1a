"""tests/multidevice: tests on 8 simulated CPU devices, in a pytest process of their own.

XLA fixes the number of CPU devices when jax's backend starts, so it is set here, before any
test module of this directory imports jax. The main test process has started its backend with 1
device: tests/project/test_multidevice.py runs ``python -m pytest tests/multidevice`` in a subprocess, and
tests/conftest.py keeps this directory out of the main collection. Run it alone the same way:

    python -m pytest -q tests/multidevice

(A package, so that this conftest and the test modules do not take the names of tests/'s.)
"""

import os
import re

DEVICES = 8

# Low backend optimization only to keep compile times short on small CPUs: every comparison
# here is between programs compiled the same way.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = " ".join(
    [
        _flags.strip(),
        f"--xla_force_host_platform_device_count={DEVICES}",
        "--xla_backend_optimization_level=0",
    ]
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after XLA_FLAGS)

if jax.device_count() != DEVICES:
    raise RuntimeError(
        f"tests/multidevice needs {DEVICES} CPU devices, jax has {jax.device_count()}: its "
        "backend started before this conftest set XLA_FLAGS. Run the directory in a pytest "
        "process of its own: python -m pytest tests/multidevice"
    )
