"""The documented-command smokes' shared runs (tests/project/smoke.py): each test file that
smoke-runs documented commands gets the background runs its own entries need, once."""

from __future__ import annotations

import pytest

from tests.helpers import write_released
from tests.project.documented import SHARED_DATA, commands_of
from tests.project.smoke import (
    BACKGROUND,
    finished_two_stage,
    needs_shared_data,
    run_command,
    start_claims,
    start_two_stage,
)


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    """{entry: (Job, its run directory)} of the BACKGROUND runs the selected tests of the
    requesting file need (each file smoke-runs the users of its own runs: `smoke.smoke_entries`)."""
    selected = {
        item.callspec.params["entry"]
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "entry" in item.callspec.params
    }
    jobs = {}
    for entry, users in BACKGROUND.items():
        if not selected & users or ("gsm8k" in entry and not SHARED_DATA.is_dir()):
            continue
        base = tmp_path_factory.mktemp(entry)
        jobs[entry] = (
            start_claims(base) if entry == "claims_smoke" else start_two_stage(base, entry)
        )
    yield jobs
    for job, _ in jobs.values():
        job.kill()


@pytest.fixture(scope="module")
def tiny_run(background, tmp_path_factory):
    """The README's quick start at smoke size: runs/tiny with ar/ and mars/ (shared)."""
    return finished_two_stage(background, tmp_path_factory, "quick_start")


@pytest.fixture(scope="module")
def synthetic_run(background, tmp_path_factory):
    return finished_two_stage(background, tmp_path_factory, "two_stage_synthetic")


@pytest.fixture(scope="module")
def gsm8k_run(background, tmp_path_factory):
    needs_shared_data()
    return finished_two_stage(background, tmp_path_factory, "two_stage_gsm8k")


@pytest.fixture(scope="module")
def tiny_export(tiny_run):
    """The documented export command on the tiny run: runs/tiny/hf."""
    [command] = commands_of("export")
    run_command(command, subs={"runs/tiny": tiny_run})
    return tiny_run / "hf"


@pytest.fixture(scope="module")
def smollm2_runs(synthetic_run, tmp_path_factory):
    """Stand-ins for the runs/smollm2 of launch/smollm2_gsm8k.sh in the commands that only read
    it (the launcher's own smoke builds that layout at SmolLM2's size): untuned/ a tiny model
    in Hugging Face layout, mars/ the synthetic smoke run's MARS stage."""
    root = tmp_path_factory.mktemp("smollm2_runs")
    write_released(root / "untuned", block_size=4)
    (root / "mars").symlink_to(synthetic_run / "mars")
    return root


@pytest.fixture(scope="module")
def released_checkpoint(tmp_path_factory):
    """A tiny checkpoint in the paper's released format (block size not recorded)."""
    path = tmp_path_factory.mktemp("released") / "mars-b4"
    write_released(path)
    return path
