"""The documented commands that read the synthetic and GSM8K two-stage runs (runs/synthetic,
runs/gsm8k) and runs/smollm2's stand-ins, smoke-run on one such run each
(tests/project/documented.py)."""

from __future__ import annotations

import pytest

from tests.project import smoke_runners
from tests.project.documented import ENTRIES, commands_of
from tests.project.smoke import smoke_entries


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", smoke_entries("trained"))
def test_smoke(entry, request, tmp_path):
    commands = commands_of(entry)
    assert commands, entry
    request.getfixturevalue("background")  # starts the expensive runs with the first test
    getattr(smoke_runners, ENTRIES[entry].runner)(commands, request, tmp_path)
