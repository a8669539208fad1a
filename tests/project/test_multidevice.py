"""Runs tests/multidevice, the tests on 8 simulated CPU devices, in a pytest process of its own:
the device count is fixed when jax's backend starts, and this process's has 1 device
(tests/multidevice/conftest.py sets the count; tests/conftest.py keeps the directory out of this
collection, so each of its tests runs once)."""

import pytest

from tests.helpers import run_python


@pytest.mark.slow
@pytest.mark.subprocess
def test_multidevice_suite():
    proc = run_python("-m", "pytest", "-q", "tests/multidevice", check=False, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
