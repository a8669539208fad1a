"""Every command that README.md, docs/*.md and launch/README.md show in a ```bash block has one
registry entry (tests/project/documented.py says how entries are checked), and the commands that
need no shared run are smoke-run here: the users of the quick start's run are in
test_documented_tiny_run.py, those of the synthetic and GSM8K runs in
test_documented_trained_runs.py, so that the three spread over pytest-xdist's workers."""

from __future__ import annotations

import ast
import re
import shlex
import tomllib

import pytest

from tests.project import smoke_runners
from tests.project.documented import (
    DOC_FILES,
    ENTRIES,
    REGISTRY,
    ROOT,
    Checked,
    Command,
    Covered,
    NotRun,
    _strip_comment,
    commands_of,
    documented_commands,
    matching_entries,
)
from tests.project.smoke import smoke_entries


def test_extraction_finds_the_known_forms():
    commands = documented_commands()
    texts = [c.text for c in commands]
    assert "bash launch/two_stage.sh configs/tiny.py runs/tiny" in texts
    # A continuation is joined, and a trailing comment dropped.
    assert any(
        t.startswith(
            "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m mars_jax."
            "lm_eval_adapter --model mars_jax --model_args"
        )
        for t in texts
    )
    assert "bash benchmarks/accelerator_wheels.sh" in texts
    assert not any(t.startswith(("#", "source ", "export ", "pip ")) for t in texts)
    assert all(set(DOC_FILES) >= {c.file for c in commands} for c in commands)
    assert _strip_comment('a --p="x # y" # z') == 'a --p="x # y"'


def test_every_documented_command_has_one_registry_entry():
    problems = []
    for c in documented_commands():
        found = matching_entries(c)
        if len(found) != 1:
            problems.append(f"{c} -> {found or 'no registry entry'}")
    assert not problems, (
        "each documented command needs exactly one REGISTRY entry in "
        "tests/project/test_documented_commands.py (a smoke run, a covering test or a documented "
        "reason not to run it):\n" + "\n".join(problems)
    )


def test_every_registry_entry_matches_a_documented_command():
    used = {e for c in documented_commands() for e in matching_entries(c)}
    assert [name for name, _, _ in REGISTRY if name not in used] == []
    assert len(ENTRIES) == len(REGISTRY)


def test_covering_tests_exist():
    for name, _, how in REGISTRY:
        if isinstance(how, Covered):
            path, test = how.test.split("::")
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert test in names, f"{name}: {how.test} does not exist"


def test_not_run_reasons_are_documented():
    """A command left out of CI says why in the docs, within its block or the lines above it."""
    for c in documented_commands():
        [entry] = matching_entries(c) or [None]
        how = ENTRIES.get(entry)
        if isinstance(how, NotRun):
            lines = (ROOT / c.file).read_text().splitlines()
            context = " ".join(lines[max(0, c.block_start - 13) : c.line + 3])
            assert how.documented_as in " ".join(context.split()), (
                f"{c}: NotRun ({how.reason}) but the docs do not say {how.documented_as!r} "
                "beside it"
            )
    assert sum(isinstance(h, NotRun) for h in ENTRIES.values()) <= 4  # keep the list short


# -- in-process checks ----------------------------------------------------------------------


def check_test_command(command: Command) -> None:
    argv = shlex.split(command.text)
    if argv[:2] == ["bash", ".ci/run"]:
        ci = (ROOT / ".ci" / "run").read_text()
        assert "python -m pytest" in ci and "tests" in ci
        return
    argv = [a for a in argv if "=" not in a or a.startswith("-")]
    assert argv[:4] == ["python", "-m", "pytest", "-q"], argv
    markers = {
        m.split(":")[0]
        for m in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
            "ini_options"
        ]["markers"]
    }
    rest = argv[4:]
    while rest:
        arg = rest.pop(0)
        if arg == "-m":
            expression = rest.pop(0)
            words = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
            assert words <= markers, f"{command}: undeclared markers {words - markers}"
        elif arg in ("-n", "--dist"):  # pytest-xdist: workers, and how tests are shared out
            value = rest.pop(0)
            assert value.isdigit() or value in ("loadfile", "load", "auto"), (command, value)
        else:
            assert (ROOT / arg).exists(), f"{command}: {arg} does not exist"


def check_claims_config(command: Command) -> None:
    from experiments import claims, claims_config
    from mars_jax import config

    name = re.search(r"claims_config\.py:(\w+)", command.text).group(1)
    runs = claims.run_configs(claims_config.get_config(name))
    assert "stage1" in runs and len(runs) > 2
    for cfg in runs.values():
        config.validate(cfg, training=True)


@pytest.mark.parametrize("entry", [n for n, _, h in REGISTRY if isinstance(h, Checked)])
def test_checked(entry):
    commands = commands_of(entry)
    assert commands
    for c in commands:
        globals()[ENTRIES[entry].checker](c)


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", smoke_entries("own"))
def test_smoke(entry, request, tmp_path):
    smoke_runners.run_entry(entry, request, tmp_path)
