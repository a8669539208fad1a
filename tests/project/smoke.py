"""Running a documented command at smoke size: the overrides, the path substitutions, the
environment, and the expensive runs several smoke tests share (`BACKGROUND`, started together in
the background by tests/project/conftest.py's ``background`` fixture)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.project.documented import (
    REGISTRY,
    ROOT,
    SHARED_DATA,
    TIMEOUT_S,
    Command,
    Smoke,
    commands_of,
)

# -- running a documented command -----------------------------------------------------------

# configs/tiny.py shrunk (1 layer of width 32), 2 steps, a 2-example evaluation at 2 thresholds.
MODEL_SMOKE = [
    "--config.model.num_layers=1",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.head_dim=8",
]
EVAL_SMOKE = [
    "--config.eval.num_examples=2",
    "--config.eval.batch_size=2",
    "--config.eval.max_new_tokens=8",
    "--config.eval.thresholds=(1.0,0.9)",
    "--config.eval.nll_examples=2",
    "--config.eval.timing_repeats=1",
]
TRAIN_SMOKE = [
    "--config.train.num_steps=2",
    "--config.train.batch_size=2",
    "--config.train.log_every=1",
    "--config.data.num_synthetic_train=8",
]
RUN_SMOKE = TRAIN_SMOKE + MODEL_SMOKE + EVAL_SMOKE
# The claims smoke experiment with 3 of its 7 runs (stage 1, the AR control, one MARS run).
CLAIMS_SMOKE = [
    "--config.block_sizes=(4,)",
    "--config.ar_weights=(1.0,)",
    "--config.extra_seeds=()",
    "--config.thresholds=(1.0,0.9)",
    "--config.run.eval.timing_repeats=1",
]


def needs_shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not found (../shared/data beside the repository)")


def substitute(argv: list[str], subs: dict[str, str]) -> list[str]:
    """``argv`` with each documented path of ``subs`` (a whole argument, a flag's value or an
    item of a comma list, and what lies under it) replaced."""
    out = []
    for arg in argv:
        for old, new in subs.items():
            arg = re.sub(
                rf"(^|[=,]){re.escape(old)}(?=$|[/,])",
                lambda m, new=new: m.group(1) + str(new),
                arg,
            )
        out.append(arg)
    return out


def prepare(command: Command | str, extra=(), subs=None, env=None, insert=None):
    """(argv, environment) of the documented ``command``: its paths substituted (``subs``),
    ``extra`` arguments appended and ``insert`` (index, args) inserted. Leading ``VAR=value``
    words become the environment, as in a shell; ``python`` is this interpreter, also for the
    bash scripts (first on PATH)."""
    text = command.text if isinstance(command, Command) else command
    argv = shlex.split(text)
    environ = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TPU_SKIP_MDS_QUERY": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        environ[key] = (
            value
            if key != "PYTHONPATH"
            else os.pathsep.join([value, os.environ.get("PYTHONPATH", "")])
        )
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    argv = substitute(argv, subs or {})
    if insert:
        argv[insert[0] : insert[0]] = list(insert[1])
    argv += list(extra)
    environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environ["PATH"]])
    return argv, environ


class Job:
    """A documented command running in the background (from the repository root); `wait`
    asserts exit code 0 and returns its stdout."""

    def __init__(self, command, logs: Path, **kwargs):
        self.command = command
        self.argv, environ = prepare(command, **kwargs)
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = logs / "stdout", logs / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=environ, stdout=out, stderr=err, text=True
            )

    def wait(self, timeout=TIMEOUT_S) -> str:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        stdout = self.out.read_text()
        assert code == 0, (
            f"{self.command} (run as {shlex.join(self.argv)}) exited {code}\n"
            f"{stdout[-3000:]}\n{self.err.read_text()[-5000:]}"
        )
        return stdout

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_command(
    command: Command | str, extra=(), subs=None, env=None, insert=None, timeout=TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`prepare`'s command run to its end; asserts exit code 0."""
    argv, environ = prepare(command, extra, subs, env, insert)
    proc = subprocess.run(
        argv, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{command} (run as {shlex.join(argv)}) exited {proc.returncode}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def check_run_dir(run: Path, stages=("ar", "mars")):
    for stage in stages:
        assert (run / stage / "config.json").exists(), run / stage
        steps = [p.name for p in (run / stage / "checkpoints").iterdir() if p.name.isdigit()]
        assert steps, f"no checkpoint in {run / stage}"


TABLE_HEADER = "| threshold | accuracy | tokens/forward |"


def check_eval_tables(stdout: str, workdirs: list[Path]):
    for w in workdirs:
        assert re.search(rf"^{re.escape(str(w))} step \d+: ", stdout, re.MULTILINE), (
            w,
            stdout[-2000:],
        )
    assert stdout.count(TABLE_HEADER) >= len(workdirs), stdout[-2000:]


# The expensive independent runs: (entries whose commands need them). They start together in
# the background when the first smoke test runs (only those a selected test needs), so that on
# CI's 2 cores they overlap with each other and with the commands run on the tiny run.
BACKGROUND = {
    "quick_start": {
        "quick_start",
        "two_stage_qwen0_5b",
        "evaluate_tiny",
        "configs_train",
        "generate",
        "serve",
        "export",
        "lm_eval_local",
        "decode_speed_both",
    },
    "two_stage_synthetic": {"two_stage_synthetic", "decode_speed_trained", "serve_load"},
    "two_stage_gsm8k": {
        "two_stage_gsm8k",
        "gsm8k_ar_control",
        "decode_speed_trained",
        "serve_one_user",
    },
    "claims_smoke": {"claims_smoke"},
}


def start_two_stage(base: Path, entry: str) -> tuple[Job, Path]:
    [command] = commands_of(entry)
    documented = shlex.split(command.text)[3]
    run = base / Path(documented).name
    return Job(command, base / "logs", extra=RUN_SMOKE, subs={documented: run}), run


def start_claims(base: Path) -> tuple[Job, Path]:
    command = commands_of("claims_smoke")[0]
    documented = re.search(r"--workdir=(\S+)", command.text).group(1)
    return Job(command, base / "logs", extra=CLAIMS_SMOKE, subs={documented: base / "claims"}), (
        base / "claims"
    )


def finished_two_stage(background, tmp_path_factory, entry: str) -> Path:
    """The run directory of ``entry``'s two-stage run, once it has ended and was checked."""
    if entry not in background:  # not started with the others (e.g. -k selected no user)
        background[entry] = start_two_stage(tmp_path_factory.mktemp(entry), entry)
    job, run = background[entry]
    stdout = job.wait()
    check_run_dir(run)
    check_eval_tables(stdout, [run / "ar", run / "mars"])
    return run


def run_subs(request) -> dict:
    """Documented run directories -> the shared smoke runs (fixtures created on first use)."""
    return {
        "runs/tiny": lambda: request.getfixturevalue("tiny_run"),
        "runs/synthetic": lambda: request.getfixturevalue("synthetic_run"),
        "runs/gsm8k": lambda: request.getfixturevalue("gsm8k_run"),
        "models/smollm2": lambda: request.getfixturevalue("smollm2_dir"),
        "runs/smollm2": lambda: request.getfixturevalue("smollm2_runs"),
        # The learning curve's runs (configs/smollm2_curve.py, GSM8K prompts): the GSM8K smoke
        # run (mars/, ar/), whose vocabulary holds GSM8K's ids (the synthetic run's does not).
        "runs/curve": lambda: request.getfixturevalue("gsm8k_run"),
    }


def resolve_subs(command: Command, request, **fixed) -> dict:
    """The substitutions ``command`` needs (only the runs it names are made)."""
    subs = {}
    for old, make in run_subs(request).items():
        if re.search(rf"(^|[\s=,]){re.escape(old)}(?=$|[\s/,])", command.text):
            subs[old] = make()
    return {**subs, **fixed}


def _order(entry: str) -> int:
    """The commands that need no background run first (the background runs progress
    meanwhile), then those on the tiny run, then those waiting on the other background runs."""
    users = [e for e, needed_by in BACKGROUND.items() if entry in needed_by]
    if entry == "two_stage_qwen0_5b":
        return 2  # needs the export of the tiny run
    return 0 if not users else 1 if users == ["quick_start"] else 3


def smoke_entries(runs: str) -> list[str]:
    """The Smoke entries one test file runs, in `_order`: ``"tiny"`` the users of the quick
    start's run, ``"trained"`` those of the synthetic and GSM8K runs, ``"own"`` the rest (each
    starts what it needs itself). One file a group, so that pytest-xdist (``--dist loadfile``)
    gives each its own worker and each background run starts once."""
    tiny = BACKGROUND["quick_start"] | {"two_stage_qwen0_5b"}
    trained = BACKGROUND["two_stage_synthetic"] | BACKGROUND["two_stage_gsm8k"]
    group = {"tiny": lambda e: e in tiny, "trained": lambda e: e in trained}.get(
        runs, lambda e: e not in tiny | trained
    )
    smoke = [n for n, _, h in REGISTRY if isinstance(h, Smoke) and group(n)]
    return sorted(smoke, key=_order)
