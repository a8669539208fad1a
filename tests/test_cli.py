"""The command line (issue 9, item 10): --help exits 0, --show_config prints the resolved config,
bad input is one line `error: ...` with exit status 1, and library errors keep their traceback."""

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mars_jax import cli, generate
from mars_jax.rows import read_rows

ROOT = Path(__file__).resolve().parents[1]


def run_module(module, *args):
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def tiny_config(stage):
    spec = importlib.util.spec_from_file_location("_tiny_cli", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(stage).to_dict()


def leaves(tree, prefix=""):
    """{dotted key: value} of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_help_exits_0_and_lists_show_config():
    proc = run_module("mars_jax.train", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--config:", "--workdir:", "--[no]show_config:"):
        assert flag in proc.stdout, proc.stdout


def test_show_config_prints_every_key_with_overrides():
    proc = run_module("mars_jax.train", "--config=configs/tiny.py:mars", "--show_config",
                      "--config.train.batch_size=8", "--config.mesh.rules.embed=('data','fsdp')")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = leaves(tiny_config("mars"))
    expected["train.batch_size"] = 8
    expected["mesh.rules.embed"] = ("data", "fsdp")
    printed = {}
    for line in proc.stdout.splitlines():
        key, value = line.split(" = ", 1)
        printed[key] = ast.literal_eval(value)
    assert printed == expected
    assert list(printed) == sorted(printed)


def test_show_config_needs_no_workdir_but_a_run_does():
    proc = run_module("mars_jax.evaluate", "--show_config", "--config.eval.rule=verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval.rule = 'verify'" in proc.stdout.splitlines()
    proc = run_module("mars_jax.evaluate")
    assert proc.returncode == 1
    assert "flag --workdir is required" in proc.stderr, proc.stderr[-3000:]


def test_bad_input_is_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": 3}) + "\n")
    proc = run_module("mars_jax.generate", f"--workdir={tmp_path}", f"--prompts_file={prompts}")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {prompts}: row 2: 'prompt' must be a string, got 3"
    ], proc.stderr[-3000:]
    proc = run_module("mars_jax.export", f"--workdir={tmp_path}", f"--output={tmp_path}/hf")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}/model.json not found: {tmp_path} is not a mars-jax run directory"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    proc = run_module("mars_jax.train", "--config=configs/nope.py", f"--workdir={tmp_path}")
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: --config: ") and "No such file or directory" in line, line


def raised(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_user_errors_are_ours_and_library_errors_are_not(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a", "threshold": "high"}\n')
    assert cli.is_user_error(raised(generate.read_prompts, str(bad)))  # our raise
    assert cli.is_user_error(raised(read_rows, str(tmp_path / "missing.jsonl")))  # a path
    assert not cli.is_user_error(raised(np.zeros(3).reshape, 2))  # numpy's ValueError
    assert not cli.is_user_error(raised(generate.format_text, None))  # a TypeError: a bug
    assert not cli.is_user_error(ValueError("never raised"))


@pytest.mark.parametrize("threshold, match", [
    (2, r"row 2: 'threshold' must lie in \(0, 1\], got 2"),
    (0, r"row 2: 'threshold' must lie in \(0, 1\], got 0"),
    (True, r"row 2: 'threshold' must be a number, got True"),  # was read as 1.0
])
def test_a_prompts_file_threshold_is_checked_naming_its_row(tmp_path, threshold, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "threshold": 0.5}) + "\n"
                    + json.dumps({"prompt": "b", "threshold": threshold}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}: " + match):
        generate.read_prompts(str(path))
