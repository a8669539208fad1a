"""The command line: --help exits 0, --show_config prints the resolved config,
bad input is one line `error: ...` with exit status 1, and library errors keep their traceback."""

import ast
import json
import subprocess
import sys

import numpy as np
import pytest

from mars_jax import cli, generate
from mars_jax.rows import read_rows
from tests.helpers import ROOT, run_python, tiny_config


def leaves(tree, prefix=""):
    """{dotted key: value} of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.subprocess
def test_help_exits_0_and_lists_show_config():
    proc = run_python("-m", "mars_jax.train", "--help", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--config:", "--workdir:", "--[no]show_config:"):
        assert flag in proc.stdout, proc.stdout


@pytest.mark.subprocess
def test_show_config_prints_every_key_with_overrides():
    proc = run_python(
        "-m",
        "mars_jax.train",
        "--config=configs/tiny.py:mars",
        "--show_config",
        "--config.train.batch_size=8",
        "--config.mesh.rules.embed=('data','fsdp')",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = leaves(tiny_config("mars").to_dict())
    expected["train.batch_size"] = 8
    expected["mesh.rules.embed"] = ("data", "fsdp")
    printed = {}
    for line in proc.stdout.splitlines():
        key, value = line.split(" = ", 1)
        printed[key] = ast.literal_eval(value)
    assert printed == expected
    assert list(printed) == sorted(printed)


@pytest.mark.subprocess
def test_show_config_needs_no_workdir_but_a_run_does():
    proc = run_python(
        "-m", "mars_jax.evaluate", "--show_config", "--config.eval.rule=verify", check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval.rule = 'verify'" in proc.stdout.splitlines()
    proc = run_python("-m", "mars_jax.evaluate", check=False)
    assert proc.returncode == 1
    assert "flag --workdir is required" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.subprocess
def test_bad_input_is_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": 3}) + "\n")
    proc = run_python(
        "-m", "mars_jax.generate", f"--workdir={tmp_path}", f"--prompts_file={prompts}", check=False
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {prompts}: row 2: 'prompt' must be a string, got 3"
    ], proc.stderr[-3000:]
    proc = run_python(
        "-m", "mars_jax.export", f"--workdir={tmp_path}", f"--output={tmp_path}/hf", check=False
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}/model.json not found: {tmp_path} is not a mars-jax run directory"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    missing = tmp_path / "nope"  # a typo in --workdir: said as such, not as a wrong layout
    proc = run_python("-m", "mars_jax.generate", f"--workdir={missing}", "--prompt=hi", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {missing}: does not exist"], proc.stderr
    proc = run_python(
        "-m", "mars_jax.train", "--config=configs/nope.py", f"--workdir={tmp_path}", check=False
    )
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


@pytest.mark.parametrize(
    "threshold, match",
    [
        (2, r"row 2: 'threshold' must lie in \(0, 1\], got 2"),
        (0, r"row 2: 'threshold' must lie in \(0, 1\], got 0"),
        (True, r"row 2: 'threshold' must be a number, got True"),  # was read as 1.0
    ],
)
def test_a_prompts_file_threshold_is_checked_naming_its_row(tmp_path, threshold, match):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "threshold": 0.5})
        + "\n"
        + json.dumps({"prompt": "b", "threshold": threshold})
        + "\n"
    )
    with pytest.raises(ValueError, match=rf"^{path}: " + match):
        generate.read_prompts(str(path))


def test_user_errors_keep_their_builtin_bases():
    from mars_jax import checkpoints, errors, workdir

    for cls, base in [
        (errors.InputError, ValueError),
        (errors.SettingError, ValueError),
        (errors.NotFound, FileNotFoundError),
        (errors.MissingPath, FileNotFoundError),
        (errors.AlreadyExists, FileExistsError),
        (checkpoints.CheckpointError, ValueError),
        (workdir.WorkdirInUse, ValueError),
    ]:
        assert issubclass(cls, errors.UserError) and issubclass(cls, base), cls
    assert errors.SettingError is errors.SettingError
    assert cli.is_user_error(errors.SettingError("train.batch_size", 0, "must be >= 1"))
    assert not cli.is_user_error(ValueError("a library's"))
    assert not cli.is_user_error(RuntimeError("a bug"))


_RUN = """
import os
from mars_jax import cli, errors
def main():
    if os.environ["KIND"] == "user":
        raise errors.InputError("data.jsonl: row 3: 'messages' must be a list")
    if os.environ["KIND"] == "value":
        import numpy as np
        np.zeros(3).reshape(2)  # numpy's ValueError: a bug here, not the user's input
    raise KeyError("nope")
cli.run(main)
"""


@pytest.mark.parametrize("kind", ["user", "value", "key"])
def test_cli_run_prints_a_user_error_as_one_line_and_anything_else_with_its_traceback(kind):
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "KIND": kind}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    if kind == "user":
        assert lines == ["error: data.jsonl: row 3: 'messages' must be a list"], proc.stderr
    else:
        assert "Traceback (most recent call last):" in proc.stderr, proc.stderr[-3000:]
        assert not any(line.startswith("error:") for line in lines), proc.stderr[-3000:]


_CLOSED_LOOP = """
import asyncio, threading
import tensorstore as ts
from mars_jax import cli
def main():
    loop = asyncio.new_event_loop()
    loop.close()  # as Orbax's loop is after a failed save
    promise, future = ts.Promise.new()
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(print))
    thread = threading.Thread(target=promise.set_result, args=(1,))
    thread.start()
    thread.join()
    promise, future = ts.Promise.new()
    future.add_done_callback(lambda _: 1 / 0)  # any other error still prints
    promise.set_result(1)
cli.run(main)
"""


def test_callbacks_into_a_closed_event_loop_print_nothing_and_other_errors_print():
    """The full disk's one line (test_checkpoints) lost to 169 lines of tensorstore callbacks
    into Orbax's closed loop in CI: that race, made certain, prints nothing in `cli.run`."""
    proc = run_python("-c", _CLOSED_LOOP)
    assert "Event loop is closed" not in proc.stderr, proc.stderr
    assert "ZeroDivisionError: division by zero" in proc.stderr, proc.stderr


def test_malloc_arenas_are_capped_unless_the_environment_says(monkeypatch):
    """The cap behind the flat RSS of repeated train calls (docs/training-at-scale.md): set
    through glibc's mallopt where glibc is the allocator, left to MALLOC_ARENA_MAX if set."""
    import ctypes.util

    from mars_jax import platforms

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    glibc = sys.platform.startswith("linux") and "libc.so" in (ctypes.util.find_library("c") or "")
    assert platforms.limit_malloc_arenas() == glibc
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert platforms.limit_malloc_arenas() is False


_FRAGMENTED_HEAP = """
import ctypes, psutil
from mars_jax import platforms
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
process = psutil.Process()
base = process.memory_info().rss
chunks = [libc.malloc(4000) for _ in range(50_000)]  # 200 MB in chunks below mmap's threshold
for chunk in chunks:
    ctypes.memset(chunk, 1, 4000)
for i, chunk in enumerate(chunks):
    if i % 64:  # one chunk in 64 stays live, so the heap cannot shrink from its top
        libc.free(chunk)
held = process.memory_info().rss - base
released = platforms.release_host_memory()
print(held >> 20, (process.memory_info().rss - base) >> 20, released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_host_memory_gives_a_fragmented_heaps_free_pages_back():
    """What `train` and `evaluate` do on their way out (docs/training-at-scale.md, the soak):
    a heap whose freed chunks glibc keeps (RSS ~200 MB above the start) falls back to a few MB.
    """
    held, after, released = run_python("-c", _FRAGMENTED_HEAP).stdout.split()
    assert int(held) > 150 and int(after) < 30 and released == "True", (held, after)


def test_train_and_evaluate_release_host_memory_when_they_return_or_raise(monkeypatch, tmp_path):
    from mars_jax import evaluate, platforms, train

    calls = []
    monkeypatch.setattr(platforms, "release_host_memory", lambda: calls.append(1))
    cfg = tiny_config()
    cfg.train.batch_size = 0  # refused by config.validate, before anything is loaded
    with pytest.raises(ValueError, match="batch_size"):
        train.train(cfg, str(tmp_path / "run"))
    with pytest.raises(FileNotFoundError):
        evaluate.evaluate(tiny_config(), str(tmp_path / "none"))
    assert len(calls) == 2
