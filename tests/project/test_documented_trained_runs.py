"""The documented commands that read the synthetic and GSM8K two-stage runs (runs/synthetic,
runs/gsm8k) and runs/smollm2's stand-ins, smoke-run on one such run each
(tests/project/documented.py)."""

from __future__ import annotations

import pytest

from tests.project import smoke_runners
from tests.project.smoke import smoke_entries


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", smoke_entries("trained"))
def test_smoke(entry, request, tmp_path):
    smoke_runners.run_entry(entry, request, tmp_path)
