"""Every command that README.md, docs/*.md and launch/README.md show in a ```bash block runs in CI
at a smoke setting (smallest config, a few steps), so that a documented command cannot break
unseen.

`documented_commands` extracts the commands (continuations joined, comments dropped, the shell
setup of SKIP_RULES left out). `test_every_documented_command_has_one_registry_entry` asserts that
each matches exactly one REGISTRY entry, so a new documented command without a smoke entry fails
naming its file, line and text. An entry says how its commands are checked:

- `Smoke`: `test_smoke[<entry>]` runs the documented command itself (same program, same flags, in
  a subprocess from the repository root on CPU) with smoke overrides appended (absl: the last
  value of a flag wins) and the documented paths substituted (`runs/tiny` -> a shared tiny run
  under tmp; output directories -> tmp, so committed results are never overwritten), then checks
  what it printed or wrote. Expensive setup is shared: one tiny two-stage run (the README's quick
  start), reused by evaluate, generate, export, lm-eval, decode_speed and a stage-2 train
  command.
- `Covered`: another test already runs the same script at its smallest setting (named; a test
  here asserts that it exists), so it does not run twice.
- `Checked`: an in-process check, no subprocess (the test-suite commands; the full-size claims
  experiments, whose config is built and validated while `claims_smoke` runs the program).
- `NotRun`: needs what CI lacks (network, a GPU cluster); the reason must be visible in the docs
  beside the block (`test_not_run_reasons_are_documented`).

Commands needing ../shared/data skip cleanly without it; the libtpu ones are `Covered` by tests
that skip without libtpu.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import write_released

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = ROOT.parent / "shared" / "data"
DOC_FILES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
    "launch/README.md",
]
TIMEOUT_S = 420

# Lines of a bash block that are shell setup, not a command to smoke-run: (regex matched at the
# start of the command, why). Comment lines (`#!/bin/bash`, `#SBATCH ...`, `# ...`) and trailing
# comments are dropped before this.
SKIP_RULES = [
    (r"python3? -m venv\b", "creates a virtual environment (environment setup; .ci/run does it)"),
    (r"pip install\b", "installs packages (environment setup; .ci/run does it)"),
    (r"source\b", "activates a virtual environment"),
    (r"export\b", "sets environment variables (the smoke runners set what each command needs)"),
    (r"cd\b", "changes directory (every command runs from the repository root)"),
]


@dataclasses.dataclass(frozen=True)
class Command:
    file: str
    line: int  # 1-based line of the command's first physical line
    text: str  # continuations joined, trailing comment dropped, whitespace collapsed
    block_start: int  # line of the opening fence

    def __str__(self):
        return f"{self.file}:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


@functools.cache
def documented_commands() -> tuple[Command, ...]:
    """Every command of every ```bash block of DOC_FILES, in order (SKIP_RULES left out)."""
    commands = []
    for name in DOC_FILES:
        lines = (ROOT / name).read_text().splitlines()
        block, start, pending, pending_line = None, 0, "", 0  # block: None, "bash" or "other"
        for number, raw in enumerate(lines, 1):
            stripped = raw.strip()
            if stripped.startswith("```"):
                if block is None:
                    block, start = ("bash" if stripped[3:].strip() == "bash" else "other"), number
                else:
                    assert not pending, f"{name}:{pending_line}: a continuation ends the block"
                    block = None
                continue
            if block != "bash":
                continue
            if not pending and stripped.startswith("#"):
                continue  # comment, shebang, #SBATCH
            text = _strip_comment(raw)
            if not pending:
                pending_line = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            text = " ".join((pending + text).split())
            pending = ""
            if not text or any(re.match(rule, text) for rule, _ in SKIP_RULES):
                continue
            commands.append(Command(name, pending_line, text, start))
    return tuple(commands)


# -- the registry ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Smoke:
    runner: str  # name of a function below: runner(commands, ctx)
    note: str


@dataclasses.dataclass(frozen=True)
class Covered:
    test: str  # "tests/test_x.py::test_name"
    note: str


@dataclasses.dataclass(frozen=True)
class Checked:
    checker: str
    note: str


@dataclasses.dataclass(frozen=True)
class NotRun:
    reason: str
    documented_as: str  # a phrase the docs show within the block or the 12 lines above it


# (entry name, regex matched against the whole command, how)
REGISTRY = [
    (
        "quick_start",
        r"bash launch/two_stage\.sh configs/tiny\.py runs/tiny",
        Smoke(
            "run_quick_start",
            "the shared tiny run: 2 steps a stage on a 1-layer tiny model, "
            "2 evaluation examples; checkpoints and both evaluation tables",
        ),
    ),
    (
        "two_stage_synthetic",
        r"bash launch/two_stage\.sh configs/synthetic\.py runs/synthetic",
        Smoke(
            "run_two_stage_synthetic",
            "2 steps a stage; shared with decode_speed's synthetic command",
        ),
    ),
    (
        "two_stage_gsm8k",
        r"bash launch/two_stage\.sh configs/gsm8k\.py runs/gsm8k",
        Smoke(
            "run_two_stage_gsm8k",
            "needs ../shared/data; 2 steps a stage; shared with the "
            "ar_control and decode_speed gsm8k commands",
        ),
    ),
    (
        "two_stage_qwen0_5b",
        r"bash launch/two_stage\.sh configs/qwen0_5b\.py runs/qwen0_5b .*",
        Smoke(
            "run_two_stage_qwen0_5b",
            "init_from: the tiny run's export; train_path: 4 chat rows; "
            "2 steps a stage, batch 2 (needs ../shared/data: its eval set is GSM8K test)",
        ),
    ),
    (
        "smollm2_gsm8k",
        r"bash launch/smollm2_gsm8k\.sh runs/smollm2",
        Smoke(
            "run_smollm2_gsm8k",
            "SMOLLM2: a tiny Llama in SmolLM2's tokenizer layout; 2 steps a run, batch 2, max "
            "length 64; evaluations of 2 questions (needs ../shared/data); the report written",
        ),
    ),
    (
        "evaluate_tiny",
        r"python -m mars_jax\.evaluate --config=configs/tiny\.py:mars "
        r"--workdir=runs/tiny/(mars|hf)( .*)?",
        Smoke(
            "run_evaluate",
            "on the tiny run or its export; the table's title and header are printed",
        ),
    ),
    (
        "evaluate_released",
        r"python -m mars_jax\.evaluate --config=configs/gsm8k\.py:mars "
        r"--workdir=released/mars-b4 .*",
        Smoke(
            "run_evaluate_released",
            "needs ../shared/data; on a tiny checkpoint in the released format "
            "(tests.helpers.write_released), 2 examples; the table is printed",
        ),
    ),
    (
        "gsm8k_ar_control",
        r"python -m mars_jax\.(train|evaluate) --config=configs/gsm8k\.py:ar "
        r"--workdir=runs/gsm8k/ar_control .*",
        Smoke(
            "run_gsm8k_ar_control", "train (2 steps) then evaluate, from the gsm8k run's stage 1"
        ),
    ),
    (
        "configs_train",
        r"python -m mars_jax\.train --config=configs/tiny\.py:mars --workdir=runs/x "
        r"--config\.init_from=runs/tiny/ar .*",
        Smoke("run_configs_train", "from the tiny run's stage 1, 2 steps; a checkpoint"),
    ),
    (
        "show_config",
        r"python -m mars_jax\.train .*--show_config",
        Smoke("run_show_config", "as documented; the overridden key is printed"),
    ),
    (
        "generate",
        r"python -m mars_jax\.generate --workdir=(runs/tiny/mars|runs/tiny/hf|released/mars-b4) .*",
        Smoke(
            "run_generate",
            "each documented form on the tiny run, its export or a tiny checkpoint in the "
            "released format, --max_new_tokens=8",
        ),
    ),
    (
        "serve",
        r"python -m mars_jax\.serve --workdir=(runs/tiny/mars|runs/tiny/hf|released/mars-b4)"
        r"( --block_size=\d+)? --port=8000( .*)?",
        Smoke(
            "run_serve",
            "on the tiny run, its export or a tiny checkpoint in the released format (a free "
            "port): /health, then a chat completion, then SIGTERM with exit status 0",
        ),
    ),
    (
        "chat",
        r"python -m mars_jax\.chat --workdir=runs/tiny/mars --threshold=0\.9",
        Covered(
            "tests/programs/test_chat.py::test_the_command_reads_turns_from_stdin",
            "the command on a tiny checkpoint, turns and /reset, /quit through its stdin",
        ),
    ),
    (
        "smollm2_tool",
        r"python -m tools\.smollm2 --link=models/smollm2",
        Smoke("run_smollm2_tool", "the link made in a temporary folder; its config.json read"),
    ),
    (
        "real_model_parity",
        r"PYTHONPATH=\. python benchmarks/real_model_parity\.py --workdir=models/smollm2 .*",
        Smoke("run_real_model_parity", "on SmolLM2, 4 tokens a prompt; fp32 agrees on all 8"),
    ),
    (
        "smollm2_generate",
        r"python -m mars_jax\.generate --workdir=models/smollm2 --prompt=.*",
        Smoke("run_generate", "on SmolLM2 as printed, 8 new tokens: the answer names Paris"),
    ),
    (
        "smollm2_serve",
        r"python -m mars_jax\.serve --workdir=models/smollm2 --port=8000( .*)?",
        Smoke("run_serve", "on SmolLM2 as printed (its port free): one chat request, SIGTERM"),
    ),
    (
        "smollm2_evaluate",
        r"python -m mars_jax\.evaluate --config=configs/smollm2_gsm8k\.py:ar "
        r"--workdir=models/smollm2 --output_dir=runs/smollm2_untuned",
        Smoke(
            "run_smollm2_evaluate",
            "needs ../shared/data; on SmolLM2 as printed, 2 questions of 8 tokens: the table "
            "printed, the report in the output folder, nothing in the model's",
        ),
    ),
    (
        "export",
        r"python -m mars_jax\.export --workdir=runs/tiny/mars --output=runs/tiny/hf",
        Smoke("run_export", "the export loads with transformers; README.md model card written"),
    ),
    (
        "lm_eval_local",
        r"HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m mars_jax\.lm_eval_adapter "
        r".*--tasks gsm8k_local .*",
        Smoke(
            "run_lm_eval_local",
            "needs ../shared/data and lm_eval; --limit 2, --batch_size 2, "
            "8 new tokens; the results file holds the task's score",
        ),
    ),
    (
        "lm_eval_hub",
        r"python -m mars_jax\.lm_eval_adapter .*--tasks gsm8k .*",
        NotRun(
            "downloads GSM8K from the Hugging Face Hub: needs network",
            "downloads the dataset from the Hub",
        ),
    ),
    (
        "lm_eval_paper_tasks",
        r"python -m mars_jax\.lm_eval_adapter .*--tasks gsm8k_cot,.*",
        NotRun(
            "downloads the paper's benchmark datasets from the Hugging Face Hub: needs network",
            "downloads the datasets from the Hub",
        ),
    ),
    (
        "decode_speed_trained",
        r"PYTHONPATH=\. python benchmarks/decode_speed\.py --model=trained .*",
        Smoke(
            "run_decode_speed",
            "on the run its --workdir names (gsm8k: needs ../shared/data), "
            "1 prompt, 4 tokens, one threshold; the written table",
        ),
    ),
    (
        "serve_one_user",
        r"PYTHONPATH=\. python benchmarks/serve_one_user\.py .*",
        Smoke(
            "run_serve_one_user",
            "needs ../shared/data; on SmolLM2, 1 prompt of 4 tokens: the written rows",
        ),
    ),
    (
        "serve_load",
        r"PYTHONPATH=\. python benchmarks/serve_load\.py .*",
        Smoke(
            "run_serve_load",
            "on the run its --workdir names (or tiny random weights; runs/smollm2's: tiny "
            "stand-ins), 4 requests of 2-4 tokens, the modes it names; the written table",
        ),
    ),
    (
        "decode_speed_both",
        r"PYTHONPATH=\. python benchmarks/decode_speed\.py --model=both .*",
        Smoke("run_decode_speed", "the tiny run and the random 0.5B shape, 1 prompt, 4 tokens"),
    ),
    (
        "decode_speed_accept",
        r"PYTHONPATH=\. python benchmarks/decode_speed\.py --accept=.*",
        Smoke(
            "run_decode_speed_accept",
            "the tiny shape, B = 2, K = 1 and 2, 2 forwards, ar and "
            "sliding, --parts kept (test_benchmark_commands.py::test_decode_step checks the "
            "table's numbers, without --parts)",
        ),
    ),
    (
        "roofline_published",
        r"PYTHONPATH=\. python benchmarks/roofline\.py --markdown "
        r"--cpu_gflops=\S+ --cpu_gbps=\S+",
        Covered("tests/project/test_benchmark_commands.py::test_roofline", "the same flags"),
    ),
    (
        "roofline_other",
        r"(JAX_PLATFORMS=cpu )?PYTHONPATH=\. python benchmarks/roofline\.py "
        r"--markdown --(measure_cpu|context=\d+)",
        Smoke("run_roofline", "as documented; the ridge table"),
    ),
    (
        "decode_tpu_estimate",
        r"PYTHONPATH=\. python benchmarks/decode_tpu_estimate\.py .*",
        Covered(
            "tests/decoding/test_decode_tpu_estimate.py::test_every_program_compiles_with_an_estimate",
            "the script on the tiny shape for v5e:1x1 (skips without libtpu)",
        ),
    ),
    (
        "accelerator_data",
        r"bash benchmarks/accelerator_data\.sh",
        Smoke(
            "run_accelerator_data",
            "into a temporary folder: GSM8K's train rows, SmolLM2's shape where models/ has it",
        ),
    ),
    (
        "train_step_data",
        r"PYTHONPATH=\. python benchmarks/train_step\.py --config=configs/smollm2_gsm8k\.py:mars "
        r"--data .*",
        Covered(
            "tests/project/test_benchmark_commands.py::test_train_step_on_real_rows_packed_and_not",
            "the same flags on 48 GSM8K rows, SmolLM2's tokenizer on a tiny model, lengths 128, 512",
        ),
    ),
    (
        "train_tpu_estimate",
        r"(PYTHONPATH=\. )?python benchmarks/train_tpu_estimate\.py .*",
        Covered(
            "tests/training/test_train_tpu_estimate.py::test_every_program_compiles_with_an_estimate",
            "the script on the tiny config for v5e:1x1 (skips without libtpu)",
        ),
    ),
    (
        "accelerator_wheels",
        r"bash benchmarks/accelerator_wheels\.sh",
        NotRun("downloads wheels from PyPI: needs network", "needs network"),
    ),
    (
        "accelerator",
        r"bash benchmarks/accelerator\.sh",
        Covered(
            "tests/project/test_benchmark_commands.py::test_accelerator_parts",
            "the same script with --smoke on CPU",
        ),
    ),
    (
        "claims_smoke",
        r"python -m experiments\.claims --config=experiments/claims_config\.py:smoke "
        r"--workdir=\S+",
        Smoke(
            "run_claims_smoke",
            "as documented (two steps per run), 3 of its 7 runs "
            "(block size 4, AR weight 1, no extra seed); its results table",
        ),
    ),
    (
        "claims_full",
        r"python -m experiments\.claims --config=experiments/claims_config\.py:"
        r"(synthetic|synthetic_gpu|synthetic_stage2_lr) --workdir=\S+",
        Checked(
            "check_claims_config",
            "hours of training: the experiment's run configs are built "
            "and validated in-process; claims_smoke runs the program",
        ),
    ),
    (
        "tpu_vm",
        r"bash launch/tpu_vm\.sh .*",
        Smoke(
            "run_tpu_vm",
            "--dry_run (added where the docs launch for real); the gcloud commands "
            "printed, with the documented train command",
        ),
    ),
    (
        "xm_launch",
        r"python launch/xm_launch\.py --dry_run .*",
        Smoke("run_xm_launch", "as documented (a dry run); the job spec"),
    ),
    (
        "memory_plan",
        r"(PYTHONPATH=\. )?python launch/memory_plan\.py .*",
        Covered(
            "tests/training/test_memory_plan.py::test_tiny_plan_on_v5e_2x2",
            "the script with the tiny config for v5e:2x2 (skips without libtpu)",
        ),
    ),
    (
        "train_step",
        r"PYTHONPATH=\. python benchmarks/train_step\.py --config=configs/tiny\.py .*",
        Covered(
            "tests/project/test_benchmark_commands.py::test_train_step",
            "accelerator.sh --smoke runs train_step.py on a shrunk tiny config",
        ),
    ),
    (
        "train_call_memory",
        r"PYTHONPATH=\. JAX_PLATFORMS=cpu python benchmarks/train_call_memory\.py .*",
        Covered(
            "tests/project/test_benchmark_commands.py::test_train_call_memory", "2 calls of 1 step"
        ),
    ),
    (
        "soak",
        r"PYTHONPATH=\. JAX_PLATFORMS=cpu python benchmarks/soak\.py .*",
        Covered("tests/project/test_benchmark_commands.py::test_soak", "the script at 2 steps"),
    ),
    (
        "distributed_train",
        r"python -m mars_jax\.train --config=configs/tiny\.py --workdir=\S+ "
        r"--config\.distributed\..*",
        Covered(
            "tests/base/test_distributed.py::test_two_processes_equal_one_process",
            "2 training processes with the distributed.* keys over a localhost coordinator",
        ),
    ),
    (
        "slurm",
        r"srun python -m mars_jax\.train .*",
        NotRun("a Slurm batch script: needs a Slurm cluster with GPU nodes", "A SLURM GPU cluster"),
    ),
    (
        "gcs_emulator",
        r"python tests/gcs_emulator\.py .*"
        r"|python -m mars_jax\.train .*--workdir=gs://my-bucket/\S+( .*)?",
        Smoke(
            "run_gcs_emulator",
            "the emulator on a free port and a temporary root; the printed exports are the "
            "documented ones; train (2 steps, 1 layer) on its bucket commits a checkpoint there",
        ),
    ),
    (
        "gcs_requests",
        r"python -m tests\.gcs_requests( .*)?",
        Covered(
            "tests/base/test_storage_listings.py::test_requests_of_a_checkpoint_save_and_restore",
            "one repeat; the table's rows, and what the listing cache changes",
        ),
    ),
    (
        "test_suite",
        r"bash \.ci/run|JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 python -m pytest .*",
        Checked(
            "check_test_command",
            "the test suite itself (CI runs it): its paths exist and its "
            "-m markers are declared in pyproject.toml",
        ),
    ),
]
ENTRIES = {name: how for name, _, how in REGISTRY}


def matching_entries(command: Command) -> list[str]:
    return [name for name, pattern, _ in REGISTRY if re.fullmatch(pattern, command.text)]


def commands_of(entry: str) -> list[Command]:
    """The documented commands of ``entry``, each distinct text once, in document order."""
    seen, out = set(), []
    for c in documented_commands():
        if matching_entries(c) == [entry] and c.text not in seen:
            seen.add(c.text)
            out.append(c)
    return out


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
    "two_stage_gsm8k": {"two_stage_gsm8k", "gsm8k_ar_control", "decode_speed_trained"},
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


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    """{entry: (Job, its run directory)} of the BACKGROUND runs the selected tests need."""
    selected = {
        item.callspec.params["entry"]
        for item in request.session.items
        if item.module is sys.modules[__name__]
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


def finished_two_stage(background, tmp_path_factory, entry: str) -> Path:
    """The run directory of ``entry``'s two-stage run, once it has ended and was checked."""
    if entry not in background:  # not started with the others (e.g. -k selected no user)
        background[entry] = start_two_stage(tmp_path_factory.mktemp(entry), entry)
    job, run = background[entry]
    stdout = job.wait()
    check_run_dir(run)
    check_eval_tables(stdout, [run / "ar", run / "mars"])
    return run


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


def run_subs(request) -> dict:
    """Documented run directories -> the shared smoke runs (fixtures created on first use)."""
    return {
        "runs/tiny": lambda: request.getfixturevalue("tiny_run"),
        "runs/synthetic": lambda: request.getfixturevalue("synthetic_run"),
        "runs/gsm8k": lambda: request.getfixturevalue("gsm8k_run"),
        "models/smollm2": lambda: request.getfixturevalue("smollm2_dir"),
        "runs/smollm2": lambda: request.getfixturevalue("smollm2_runs"),
    }


@pytest.fixture(scope="module")
def smollm2_runs(tiny_run, tmp_path_factory):
    """Stand-ins for the runs/smollm2 of launch/smollm2_gsm8k.sh in the commands that only read
    it (the launcher's own smoke builds that layout at SmolLM2's size): untuned/ a tiny model
    in Hugging Face layout, mars/ the tiny MARS run."""
    root = tmp_path_factory.mktemp("smollm2_runs")
    write_released(root / "untuned", block_size=4)
    (root / "mars").symlink_to(tiny_run / "mars")
    return root


def resolve_subs(command: Command, request, **fixed) -> dict:
    """The substitutions ``command`` needs (only the runs it names are made)."""
    subs = {}
    for old, make in run_subs(request).items():
        if re.search(rf"(^|[\s=,]){re.escape(old)}(?=$|[\s/,])", command.text):
            subs[old] = make()
    return {**subs, **fixed}


# -- the smoke runners: runner(commands, request, tmp_path) ---------------------------------


def run_quick_start(commands, request, tmp_path):
    run = request.getfixturevalue("tiny_run")
    assert (run / "mars" / "config.json").exists()


def run_two_stage_synthetic(commands, request, tmp_path):
    run = request.getfixturevalue("synthetic_run")
    config = json.loads((run / "mars" / "config.json").read_text())
    assert config["data"]["trim_vocab"] is True  # configs/synthetic.py's trimmed vocabulary


def run_two_stage_gsm8k(commands, request, tmp_path):
    run = request.getfixturevalue("gsm8k_run")
    config = json.loads((run / "mars" / "config.json").read_text())
    assert config["data"]["source"] == "gsm8k"


def run_two_stage_qwen0_5b(commands, request, tmp_path):
    needs_shared_data()
    hf = request.getfixturevalue("tiny_export")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"{i} + {i} = {2 * i}. #### {2 * i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    [command] = commands
    run = tmp_path / "qwen0_5b"
    proc = run_command(
        command,
        # The config packs rows into sequences of 512 (shorter ones make a batch of 2 from 8
        # rows) and trains with TPU's splash kernel (a CPU runs XLA's, as the docs say).
        TRAIN_SMOKE + EVAL_SMOKE + ["--config.data.max_length=128", "--config.model.attention=xla"],
        subs={"runs/qwen0_5b": run, "/models/Qwen2.5-0.5B-Instruct": hf, "/data/sft.jsonl": sft},
    )
    check_run_dir(run)
    check_eval_tables(proc.stdout, [run / "ar", run / "mars"])


def run_smollm2_gsm8k(commands, request, tmp_path):
    needs_shared_data()
    from tests.helpers import write_smol_layout

    model, _ = write_smol_layout(tmp_path / "smol", request.getfixturevalue("smollm2_dir"))
    [command] = commands
    run = tmp_path / "smollm2"
    proc = run_command(
        command,
        TRAIN_SMOKE[:3]
        + ["--config.data.max_length=64", "--config.train.save_every=2"]
        + EVAL_SMOKE,
        subs={"runs/smollm2": run},
        env={"SMOLLM2": str(model)},
        timeout=1200,  # seven programs, each compiling its own
    )
    check_run_dir(run)
    # The untuned model is evaluated where it is, its report in the run folder.
    check_eval_tables(proc.stdout, [model, run / "ar", run / "mars"])
    assert (run / "untuned" / "eval.json").exists() and not (model / "eval.json").exists()
    table = (run / "results" / "smollm2_gsm8k.md").read_text()
    assert all(label in table for label in ("SmolLM2-135M-Instruct", "AR control", "MARS B=4"))
    assert (run / "results" / "smollm2_gsm8k_loss.png").stat().st_size > 1000


def run_evaluate(commands, request, tmp_path):
    for command in commands:
        subs = model_subs(command, request)
        proc = run_command(command, EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
        stage = "hf" if "runs/tiny/hf" in command.text else "mars"
        check_eval_tables(proc.stdout, [subs["runs/tiny"] / stage])
        if "thresholds=" in command.text:  # the documented thresholds are kept
            documented = re.search(r"thresholds=\(([^)]*)\)", command.text).group(1)
            for t in documented.replace(" ", "").split(","):
                assert f"| {float(t):.2f} |" in proc.stdout, (t, proc.stdout[-1500:])


def run_gsm8k_ar_control(commands, request, tmp_path):
    run = request.getfixturevalue("gsm8k_run")
    subs = {"runs/gsm8k": run}
    assert [c.text.split()[2] for c in commands] == ["mars_jax.train", "mars_jax.evaluate"]
    run_command(commands[0], TRAIN_SMOKE + MODEL_SMOKE, subs=subs)
    check_run_dir(run, ["ar_control"])
    proc = run_command(commands[1], EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
    check_eval_tables(proc.stdout, [run / "ar_control"])
    assert "| 1.00 |" in proc.stdout and "| 0.90 |" not in proc.stdout  # its thresholds=(1.0,)


def run_configs_train(commands, request, tmp_path):
    [command] = commands
    run = request.getfixturevalue("tiny_run")
    out = tmp_path / "x"
    run_command(
        command,
        TRAIN_SMOKE + ["--config.train.save_every=2"],
        subs={"runs/tiny": run, "runs/x": out},
    )
    check_run_dir(tmp_path, ["x"])
    config = json.loads((out / "config.json").read_text())
    assert config["objective"]["block_size"] == 8 and config["objective"]["ar_weight"] == 0.0


def run_show_config(commands, request, tmp_path):
    [command] = commands
    out = run_command(command).stdout
    assert "train.batch_size = 8" in out.splitlines() and "objective.name = 'mars'" in out


def run_serve(commands, request, tmp_path):
    for command in commands:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        example = "--workdir=runs/tiny/mars " in command.text  # serving.md's client example
        extra = ["--max_new_tokens=64" if example else "--max_new_tokens=8"]  # the example's
        if "--warmup" in command.text:  # fewer prompt widths to compile
            extra.append("--max_prompt_len=64")
        argv, environ = prepare(command, extra, subs=model_subs(command, request))
        argv = [f"--port={port}" if a.startswith("--port=") else a for a in argv]
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.time() + TIMEOUT_S
            while True:
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.time() < deadline, "the server never answered /health"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if json.loads(r.read())["status"] == "ok":
                            break
                except OSError:
                    time.sleep(0.2)
            body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8}
            chat = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(chat, timeout=TIMEOUT_S) as r:
                answer = json.loads(r.read())
            assert answer["object"] == "chat.completion", answer
            assert 1 <= answer["usage"]["completion_tokens"] <= 8, answer
            if example:  # as printed, but for the port
                example = client_example().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                ran = subprocess.run(
                    [sys.executable, "-c", example],
                    cwd=ROOT,
                    env=environ,
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                )
                assert ran.returncode == 0 and "tokens_per_forward" in ran.stdout, ran.stderr
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()


def client_example() -> str:
    """docs/serving.md's Python example with the official openai client."""
    text = (ROOT / "docs" / "serving.md").read_text()
    return re.search(r"With the official client.*?```python\n(.*?)```", text, re.S).group(1)


def run_smollm2_evaluate(commands, request, tmp_path):
    needs_shared_data()
    model = request.getfixturevalue("smollm2_dir")
    before = sorted(os.listdir(model))
    for command in commands:
        out = tmp_path / "untuned"
        subs = {"models/smollm2": model, "runs/smollm2_untuned": out}
        proc = run_command(command, EVAL_SMOKE[:3] + EVAL_SMOKE[4:], subs=subs)
        check_eval_tables(proc.stdout, [model])
        assert json.loads((out / "eval.json").read_text())["num_examples"] == 2
    assert sorted(os.listdir(model)) == before  # nothing written into the model's directory


def model_subs(command, request) -> dict:
    """The documented model directories of ``command``: the tiny run, its export, the tiny
    checkpoint in the released format, SmolLM2's directory (each made on first use)."""
    if "models/smollm2" in command.text:
        return {"models/smollm2": request.getfixturevalue("smollm2_dir")}
    subs = {"runs/tiny": request.getfixturevalue("tiny_run")}
    if "runs/tiny/hf" in command.text:
        request.getfixturevalue("tiny_export")
    if "released/mars-b4" in command.text:
        subs["released/mars-b4"] = request.getfixturevalue("released_checkpoint")
    return subs


@pytest.fixture(scope="module")
def released_checkpoint(tmp_path_factory):
    """A tiny checkpoint in the paper's released format (block size not recorded)."""
    path = tmp_path_factory.mktemp("released") / "mars-b4"
    write_released(path)
    return path


def run_evaluate_released(commands, request, tmp_path):
    needs_shared_data()
    for command in commands:
        subs = model_subs(command, request)
        model = subs["released/mars-b4"]
        before = sorted(p.name for p in model.iterdir())
        proc = run_command(command, EVAL_SMOKE, subs=subs)  # no thresholds documented
        check_eval_tables(proc.stdout, [model])
        assert re.search(rf"^{re.escape(str(model))} step 0: .*block_size 4", proc.stdout, re.M)
        assert sorted(p.name for p in model.iterdir()) == before  # nothing written into it


def run_generate(commands, request, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "What is 2 + 3?"}\n{"prompt": "What is 4 * 5?", "threshold": 0.9}\n'
    )
    for command in commands:
        subs = {**model_subs(command, request), "prompts.jsonl": prompts}
        out = run_command(command, ["--max_new_tokens=8"], subs=subs).stdout
        # A 2-step model's completion may be blank lines, but it is printed.
        assert out and "Traceback" not in out, command
        if "capital of France" in command.text:  # SmolLM2's own answer
            assert "Paris" in out, out
        if "--json" in command.text:
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            assert len(rows) == (2 if "--prompts_file" in command.text else 1), out
            for r in rows:
                assert {"prompt", "tokens", "text", "tokens_per_forward"} <= set(r)
                assert 1 <= len(r["tokens"]) <= 8


def run_smollm2_tool(commands, request, tmp_path):
    request.getfixturevalue("smollm2_dir")  # skips without the package; builds the cache once
    for command in commands:
        link = tmp_path / "models" / "smollm2"
        out = run_command(command, subs={"models/smollm2": link}).stdout
        assert link.is_symlink() and (link / "config.json").exists()
        assert out.strip() == str(link.resolve())


def run_real_model_parity(commands, request, tmp_path):
    for command in commands:
        out = tmp_path / "parity.json"
        subs = resolve_subs(command, request)
        run_command(command, ["--max_new_tokens=4", f"--output={out}"], subs=subs)
        report = json.loads(out.read_text())
        assert report["prompts"] == 8 and report["max_new_tokens"] == 4
        assert report["float32"]["prompts_equal"] == 1.0, report
        assert 0.0 <= report["bfloat16"]["mean_prefix_fraction"] <= 1.0


def run_export(commands, request, tmp_path):
    hf = request.getfixturevalue("tiny_export")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert AutoTokenizer.from_pretrained(hf).mask_token == "<|mask|>"
    assert (hf / "README.md").exists()


def run_lm_eval_local(commands, request, tmp_path):
    needs_shared_data()
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm_eval is not installed (pip install -e '.[lm-eval]')")
    run = request.getfixturevalue("tiny_run")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "ds")}
    for command in commands:
        text = re.sub(r"--limit \d+", "--limit 2", command.text)
        text = re.sub(r"--batch_size \d+", "--batch_size 2", text)
        out = tmp_path / "lm_eval_out"
        run_command(
            text,
            ["--gen_kwargs", "max_gen_toks=8"],
            subs={"runs/tiny": run, "lm_eval_out": out},
            env=env,
        )
        (results,) = out.glob("*/results_*.json")
        report = json.loads(results.read_text())
        assert report["n-samples"]["gsm8k_local"]["effective"] == 2
        assert 0.0 <= report["results"]["gsm8k_local"]["exact_match,strict-match"] <= 1.0


def run_serve_load(commands, request, tmp_path):
    for i, command in enumerate(commands):
        out = tmp_path / f"out{i}"
        extra = ["--requests=4", "--rate=20", "--max_seconds=30", "--min_tokens=2"]
        extra += ["--max_tokens=4", "--slots=2", f"--output_dir={out}"]
        run_command(command, extra, subs=resolve_subs(command, request))
        rows = [json.loads(line) for line in (out / "serve_load.jsonl").read_text().splitlines()]
        modes = re.search(r"--modes=(\S+)", command.text)
        modes = modes.group(1).split(",") if modes else ["continuous", "static", "ar"]
        assert [r["mode"] for r in rows] == modes, rows
        assert all(r["requests"] == r["sent"] == 4 for r in rows), rows
        assert (out / "serve_load.md").read_text().count("\n| ") == len(modes) + 1


def run_serve_one_user(commands, request, tmp_path):
    needs_shared_data()
    for i, command in enumerate(commands):
        out = tmp_path / f"out{i}"
        extra = ["--num_prompts=1", "--passes=2", "--max_new_tokens=4", f"--output_dir={out}"]
        run_command(command, extra, subs=resolve_subs(command, request))
        rows = json.loads((out / "serve_one_user.json").read_text())["rows"]
        assert [(r["threshold"], r["prompts"], r["same_text"]) for r in rows] == [(1.0, 2, 2)]
        assert rows[0]["generate_tokens"] == rows[0]["serve_tokens"] == 8
        # Each pair's ratio is its tokens/s over the server's; the median lies among them.
        assert len(rows[0]["pair_ratios"]) == 2
        assert (
            min(rows[0]["pair_ratios"])
            <= rows[0]["median_pair_ratio"]
            <= max(rows[0]["pair_ratios"])
        )


def run_decode_speed(commands, request, tmp_path):
    for i, command in enumerate(commands):
        if "gsm8k" in command.text:
            needs_shared_data()
        out = tmp_path / f"out{i}"
        subs = resolve_subs(command, request)
        # --model=both's second model is the random Qwen2.5-0.5B shape: the tiny shape here.
        models = ["--model=trained,tiny_shape"] if "--model=both" in command.text else []
        run_command(
            command,
            models
            + [
                "--num_prompts=1",
                "--max_new_tokens=4",
                "--batch_sizes=1",
                "--thresholds=0.9",
                "--decoders=sliding",
                "--repeats=1",
                "--shape_max_new_tokens=4",
                "--shape_prompt_len=8",
                f"--output_dir={out}",
            ],
            subs=subs,
        )
        rows = [json.loads(line) for line in (out / "decode_speed.jsonl").read_text().splitlines()]
        models = {r["model"] for r in rows}
        assert "trained" in models, rows
        if "--model=both" in command.text:
            assert len(models) == 2, models
        # A model without <|mask|> (SmolLM2) times ar and transformers only.
        mars = set() if "models/smollm2" in command.text else {"sliding"}
        assert {r["decoder"] for r in rows} >= {"ar"} | mars
        assert (out / "decode_speed.md").read_text().startswith("JAX ")


def run_decode_speed_accept(commands, request, tmp_path):
    for command in commands:
        out = tmp_path / "accept"
        stdout = run_command(
            command,
            [
                "--shapes=tiny",
                "--block_sizes=2",
                "--accept=1,2",
                "--steps=2",
                "--repeats=1",
                "--prompt_len=8",
                "--modes=ar,sliding",
                f"--output_dir={out}",
            ],
        ).stdout
        rows = [json.loads(line) for line in (out / "decode_step.jsonl").read_text().splitlines()]
        assert [(r["mode"], r["accept"]) for r in rows] == [
            ("ar", 1),
            ("sliding", 1),
            ("sliding", 2),
        ]
        if "--parts" in command.text:
            assert (out / "decode_step_parts.md").exists()
            assert "| layers ms | projection ms | choice ms |" in stdout


def run_accelerator_data(commands, request, tmp_path):
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip("needs ../shared/data")
    for command in commands:
        out = tmp_path / "accelerator_data"
        run_command(command, [str(out)])
        assert (out / "gsm8k_train.jsonl").read_bytes() == (
            SHARED_DATA / "gsm8k" / "train.jsonl"
        ).read_bytes()
        if (ROOT / "models" / "smollm2" / "config.json").exists():
            assert (out / "smollm2_shape" / "tokenizer.json").exists()


def run_roofline(commands, request, tmp_path):
    for command in commands:
        out = run_command(command).stdout
        assert "### Ridge" in out
        if "--measure_cpu" in command.text:
            assert "CPU (measured)" in out


def run_claims_smoke(commands, request, tmp_path):
    # The documented smoke commands differ only in --workdir: one run (started in the
    # background with the other expensive runs) covers them.
    assert len({re.sub(r"--workdir=\S+", "", c.text) for c in commands}) == 1
    background = request.getfixturevalue("background")
    if "claims_smoke" not in background:
        background["claims_smoke"] = start_claims(tmp_path)
    job, work = background["claims_smoke"]
    out = job.wait()
    assert "### smoke: " in out, out[-2000:]
    assert (work / "results" / "smoke.md").read_text() in out


TPU_ENV = {
    "NAME": "mars-v5e",
    "ZONE": "us-west4-a",
    "ACCELERATOR_TYPE": "v5litepod-16",
    "RUNTIME_VERSION": "v2-alpha-tpuv5-lite",
    "PROJECT": "my-project",
}


def run_tpu_vm(commands, request, tmp_path):
    for command in commands:
        argv = shlex.split(command.text)
        insert = None if "--dry_run" in argv else (2, ["--dry_run"])
        out = run_command(command, env=TPU_ENV, insert=insert).stdout
        gcloud = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ gcloud")]
        ssh = [c for c in gcloud if c[3:5] == ["tpu-vm", "ssh"]]
        assert ssh and ssh[0][5] == TPU_ENV["NAME"], out
        # The last ssh runs the documented command on every worker, its arguments as given.
        remote = shlex.split(ssh[-1][-1].removeprefix("--command="))
        start = remote.index("{") + 1
        assert remote[start : remote.index(";", start)] == argv[argv.index("--") + 1 :], out


def run_xm_launch(commands, request, tmp_path):
    for command in commands:
        spec = json.loads(run_command(command).stdout)
        stage = re.search(r"--stage=(\w+)", command.text)
        stages = ["ar", "mars"] if stage is None or stage.group(1) == "both" else [stage.group(1)]
        assert [j["stage"] for j in spec["jobs"]] == stages
        config = re.search(r"--config=(\S+)", command.text).group(1)
        assert all(f"--config={config}:{j['stage']}" in j["argv"] for j in spec["jobs"])


def run_gcs_emulator(commands, request, tmp_path):
    [serve] = [c for c in commands if c.text.startswith("python tests/gcs_emulator.py")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = re.search(r"--root=(\S+)", serve.text).group(1)
    argv, environ = prepare(serve, subs={root: tmp_path / "gcs"})
    argv = [f"--port={port}" if a.startswith("--port=") else a for a in argv]
    proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stdout=subprocess.PIPE, text=True)
    try:
        exports = []
        for line in proc.stdout:  # the exports, then "# serving ..." once it answers
            if line.startswith("# serving "):
                break
            exports.append(line.strip())
        assert proc.poll() is None, exports
        # What it prints is what the docs tell to export (the documented port there).
        documented = (ROOT / serve.file).read_text()
        for line in exports:
            assert line.replace(f":{port}", ":4443") in documented, line
        env = dict(e.removeprefix("export ").split("=", 1) for e in exports)
        assert env["STORAGE_EMULATOR_HOST"] == f"http://127.0.0.1:{port}", env
        for command in commands:
            if command is serve:
                continue
            workdir = re.search(r"--workdir=gs://(\S+)", command.text).group(1)
            proc_run = run_command(command, TRAIN_SMOKE + MODEL_SMOKE, env=env, timeout=120)
            steps = tmp_path / "gcs" / workdir / "checkpoints"
            committed = [p.name for p in steps.iterdir() if (p / "commit_success.txt").exists()]
            assert committed == ["2"], (committed, proc_run.stderr[-3000:])
            # The last export turns off gcsfs's bucket-type probe (and its warning).
            assert "Could not determine bucket type" not in proc_run.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with socket.socket() as s:  # the server stopped with it: nothing listens on its port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (closed connections may)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _order(entry: str) -> int:
    """The commands that need no background run first (the background runs progress
    meanwhile), then those on the tiny run, then those waiting on the other background runs."""
    users = [e for e, needed_by in BACKGROUND.items() if entry in needed_by]
    if entry == "two_stage_qwen0_5b":
        return 2  # needs the export of the tiny run
    return 0 if not users else 1 if users == ["quick_start"] else 3


SMOKE_ENTRIES = sorted((n for n, _, h in REGISTRY if isinstance(h, Smoke)), key=_order)


@pytest.mark.subprocess
@pytest.mark.parametrize("entry", SMOKE_ENTRIES)
def test_smoke(entry, request, tmp_path):
    commands = commands_of(entry)
    assert commands, entry
    request.getfixturevalue("background")  # starts the expensive runs with the first test
    globals()[ENTRIES[entry].runner](commands, request, tmp_path)


def test_the_decoding_api_example_runs(tiny_run):
    """docs/decoding.md's Python example (`sources.open`, `DecodeOptions`, `decode.generate`),
    on the quick start's MARS run: the text generate.complete gives with the same settings."""
    from mars_jax import generate

    text = (ROOT / "docs" / "decoding.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    path = str(tiny_run / "mars")
    assert '"runs/tiny/mars"' in code
    scope: dict = {}
    exec(code.replace('"runs/tiny/mars"', repr(path)), scope)
    opened, out = scope["opened"], scope["out"]
    tokens = [t for t in out.completions()[0] if t not in opened.stop_ids]
    settings = opened.options(threshold=0.9, max_new_tokens=64)
    want = generate.complete(opened, ["What is 12 * 7?"], settings)[0]
    assert 1 <= len(out.completions()[0]) <= 64
    assert opened.tokenizer.decode(tokens) == want["text"]
