"""The commands that README.md, docs/*.md and launch/README.md show in ```bash blocks, and the
registry that says how CI runs each at a smoke setting, so that a documented command cannot break
unseen.

`documented_commands` extracts the commands (continuations joined, comments dropped, the shell
setup of SKIP_RULES left out); each matches exactly one REGISTRY entry
(tests/project/test_documented_commands.py), which says how its commands are checked:

- `Smoke`: `test_smoke[<entry>]` runs the documented command itself (same program, same flags, in
  a subprocess from the repository root on CPU) with smoke overrides appended (absl: the last
  value of a flag wins) and the documented paths substituted (`runs/tiny` -> a shared tiny run
  under tmp; output directories -> tmp, so committed results are never overwritten), then checks
  what it printed or wrote (`smoke_runners`). Expensive runs are shared (`smoke.BACKGROUND`):
  the README's quick start at smoke size, reused by evaluate, generate, export, lm-eval,
  decode_speed and a stage-2 train command; the synthetic and GSM8K two-stage runs.
- `Covered`: another test already runs the same script at its smallest setting (named; a test
  asserts that it exists), so it does not run twice.
- `Checked`: an in-process check, no subprocess (the test-suite commands; the full-size claims
  experiments, whose config is built and validated while `claims_smoke` runs the program).
- `NotRun`: needs what CI lacks (network, a GPU cluster); the reason must be visible in the docs
  beside the block (`test_not_run_reasons_are_documented`).

Commands needing ../shared/data skip cleanly without it; the libtpu ones are `Covered` by tests
that skip without libtpu.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

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
        "distill",
        r"python -m mars_jax\.distill --workdir=models/smollm2 .*",
        Smoke(
            "run_distill",
            "needs ../shared/data; on SmolLM2 as printed, 3 questions of 8 tokens in batches of "
            "2: the rows written and the skips add up to 3, the progress file says 3 done",
        ),
    ),
    (
        "smollm2_curve",
        r"python -m experiments\.smollm2_curve --config=configs/smollm2_curve\.py:(mars|ar|self) "
        r"--workdir=runs/curve/(mars|ar|self) .*",
        Covered(
            "tests/project/test_smollm2_curve.py::test_the_curve_evaluates_each_step_once",
            "the script on the same config with a tiny model in SmolLM2's layout, 4 steps "
            "(test_the_self_distilled_run_trains_on_answer_rows: the :self config's rows)",
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
        "decode_width",
        r"PYTHONPATH=\. python benchmarks/decode_width\.py( .*)?",
        Covered(
            "tests/project/test_benchmark_commands.py::test_decode_width",
            "the tiny shape, batches 1 and 3, a fitting and a wider buffer, B = 1 and 2",
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
