"""The config schema in the package and its one check: mars_jax.config.defaults is the
full schema, every shipped config validates, a bad setting is refused by `config.validate` before
anything is loaded, configs resolve from any working directory, and a machine without a TPU
prints no libtpu errors."""

import dataclasses
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest

from mars_jax import config, errors

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


def leaves(cfg, prefix=""):
    out = {}
    for key, value in cfg.items():
        if hasattr(value, "items") and f"{prefix}{key}" != "mesh.rules":
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def with_overrides(stage="ar", **overrides):
    """config.defaults(stage) with ``overrides`` ("a__b" = "a.b")."""
    cfg = config.defaults(stage)
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


@pytest.mark.parametrize("stage", ["ar", "mars"])
def test_tiny_is_the_package_defaults(stage):
    from configs import tiny

    assert tiny.get_config(stage).to_dict() == config.defaults(stage).to_dict()
    assert config.defaults(stage).objective.name == stage


def test_every_key_of_the_schema_has_a_comment():
    """Each leaf key of `defaults` is written on a line of config.py that carries a comment, or
    under a comment line (the comment may cover the next few keys of one line)."""
    source = Path(config.__file__).read_text()
    start = source.index("def defaults(")
    end = source.index("\n# --- keys", start)
    lines = source[start:end].splitlines()
    commented = set()
    tokens = tokenize.generate_tokens(io.StringIO(source[start:end]).readline)
    comments = {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}
    for i, line in enumerate(lines, start=1):
        if i in comments or (i - 1) in comments:
            commented.update(re.findall(r'"(\w+)":', line))
    # A comment above a line of several keys, or above a section's opening line, covers them.
    missing = [k for k in leaves(config.defaults()) if k.rpartition(".")[2] not in commented]
    assert not missing, missing


@pytest.mark.parametrize("stage", ["ar", "mars"])
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_validates(name, stage):
    """Every value check passes; of the paths, only one the config names and this machine lacks
    (the Qwen weights, ../shared) may fail, and then as MissingPath."""
    cfg = importlib.import_module(f"configs.{name}").get_config(stage)
    for training in (True, False):
        config.validate(cfg, training=training, paths=False)
        try:
            config.validate(cfg, training=training)
        except errors.MissingPath as e:
            assert not e.value or not Path(e.value).exists(), str(e)


def test_unknown_key_names_the_nearest_one():
    cfg = config.defaults()
    cfg.eval.rulee = "prob"
    with pytest.raises(
        errors.SettingError,
        match=r"^eval\.rulee='prob': unknown config key; "
        r"did you mean 'eval\.rule'\?$",
    ):
        config.validate(cfg, training=False)
    cfg = config.defaults()
    cfg.objective.nonsense = 1
    with pytest.raises(errors.SettingError, match=r"^objective\.nonsense=1: unknown config key"):
        config.validate(cfg, training=True, paths=False)


def test_keys_are_checked_with_the_package_alone(tmp_path):
    """With only the package importable (no configs/ beside it, as when mars-jax is installed),
    unknown keys are still refused: the schema is in the package."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mars_jax").symlink_to(ROOT / "mars_jax")
    code = (
        "from mars_jax import config\ncfg = config.defaults()\ncfg.train.batchsize = 3\n"
        "config.validate(cfg, training=True)\n"
    )
    env = {"PYTHONPATH": str(tmp_path / "site"), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert (
        "SettingError: train.batchsize=3: unknown config key; did you mean 'train.batch_size'?"
    ) in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"eval__rule": "probs"}, r"^eval\.rule='probs': must be one of \('prob', "),
        (
            {"eval__cache_mode": "slidng"},
            r"^eval\.cache_mode='slidng': must be one of \('sliding', ",
        ),
        (
            {"eval__rule": "verify", "eval__temperature": 0.7},
            r"^eval\.rule='verify': .*temperature",
        ),
        ({"eval__rule": "verify", "eval__cache_mode": "block"}, r"^eval\.rule='verify': .*'block'"),
        ({"eval__temperature": -1.0}, r"^eval\.temperature=-1\.0: must be >= 0"),
        ({"model__remat": "all"}, r"^model\.remat='all': must be one of"),
        ({"model__attention": "flash"}, r"^model\.attention='flash': must be one of"),
        ({"objective__name": "diffusion"}, r"^objective\.name='diffusion': must be one of"),
        (
            {"objective__normalization": "batch"},
            r"^objective\.normalization='batch': must be one of",
        ),
        ({"objective__noisy_weighting": "inverse_t"}, r"needs objective\.name='mars'"),
        ({"objective__ce_chunk_size": -1}, r"^objective\.ce_chunk_size=-1: must be >= 0"),
    ],
)
def test_evaluation_settings_are_refused_before_the_checkpoint_is_touched(
    overrides, match, tmp_path
):
    """The workdir does not exist: loading it would raise FileNotFoundError, so a SettingError
    shows the setting was refused first (these were refused only after the model loaded)."""
    from mars_jax import evaluate

    cfg = with_overrides(**overrides)
    with pytest.raises(errors.SettingError, match=match):
        evaluate.evaluate(cfg, str(tmp_path / "no_run"))
    assert not (tmp_path / "no_run").exists()


def test_train_refuses_a_bad_objective_before_reading_anything(tmp_path, monkeypatch):
    from mars_jax import train, train_inputs

    monkeypatch.setattr(
        train_inputs, "load_train_examples", lambda *a: pytest.fail("read the data")
    )
    with pytest.raises(errors.SettingError, match=r"^objective\.normalization='batch'"):
        train.train(with_overrides(objective__normalization="batch"), str(tmp_path / "run"))
    with pytest.raises(errors.SettingError, match=r"^train\.batch_size=16: must be divisible"):
        train.train(with_overrides(train__grad_accum_steps=3), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_the_choices_are_those_of_the_modules_that_use_them():
    from mars_jax import attention, model, objectives

    assert config.REMAT == model.REMAT
    assert config.ATTENTION == tuple(model.ATTENTION) == tuple(attention.IMPLEMENTATIONS)
    # The decoding choices have one definition, mars_jax.decode_options (test_decode_options).
    assert config.OBJECTIVE_NAMES == tuple(objectives.OBJECTIVES)
    # NORMALIZATIONS and NOISY_WEIGHTINGS are defined only in config (objectives reads them there).


def test_objective_config_is_typed_and_frozen():
    from mars_jax import train_step
    from mars_jax.batches import Example
    from mars_jax.common_types import IGNORE_INDEX

    cfg = config.defaults("mars")
    labels = [[IGNORE_INDEX] * 3 + [5] * 9, [IGNORE_INDEX] + [5] * 3]
    examples = [Example(np.asarray(l), np.asarray(l), i) for i, l in enumerate(labels)]
    obj = train_step.objective_settings(cfg, 7, examples)
    assert obj == config.ObjectiveConfig(
        name="mars",
        block_size=4,
        ar_weight=1.0,
        noisy_weighting="none",
        normalization="sequence",
        max_label_tokens=16,
        ce_chunk_size=0,
        mask_id=7,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.block_size = 8
    cfg.objective.max_label_tokens = 24
    assert train_step.objective_settings(cfg, 7, []).max_label_tokens == 24
    assert config.objective_config(cfg, 7, longest_labels=100).max_label_tokens == 24
    with pytest.raises(ValueError, match="objective.normalization must be one of"):
        config.ObjectiveConfig(normalization="batch")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 2.0}, r"^threshold must lie in \(0, 1\], got 2.0"),
        ({"threshold": [0.5, 0.0]}, r"^threshold must lie in \(0, 1\], got 0.0"),
        ({"rule": "verify", "temperature": 1.0}, r"^rule='verify' reproduces greedy AR decoding"),
        ({"cache_mode": "slidng"}, r"^cache_mode must be one of"),
        ({"block_size": 0}, r"^block_size must be >= 1, got 0"),
    ],
)
def test_decoding_arguments_are_refused_with_the_users_message(kwargs, match):
    with pytest.raises(errors.InputError, match=match):
        config.check_decoding(**kwargs)


def test_decoding_flags_are_refused_before_the_model_is_opened(monkeypatch):
    from absl import flags

    from mars_jax import cli, sources

    def opened(*args, **kwargs):
        raise AssertionError("the model was opened")

    monkeypatch.setattr(sources, "open", opened)
    values = flags.FlagValues()
    decoding = cli.DecodingFlags(
        threshold=0.9, max_new_tokens=8, threshold_help="", budget_help="", flag_values=values
    )
    values(["generate", "--threshold=2.0"])
    with pytest.raises(errors.InputError, match=r"^threshold must lie in \(0, 1\], got 2.0"):
        decoding.open("no_run")
    values.threshold = 0.9
    with pytest.raises(errors.InputError, match=r"^threshold must lie in \(0, 1\], got 0.0"):
        decoding.open("no_run", threshold=(0.5, 0.0))
    with pytest.raises(AssertionError, match="opened"):
        decoding.open("no_run")


def _env(**extra):
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **extra}
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("name", ["gsm8k", "synthetic", "qwen0_5b", "qwen7b"])
def test_a_config_importing_configs_loads_from_another_directory(name, tmp_path):
    """configs/gsm8k.py imports `configs.synthetic`; run from elsewhere, with only the package
    importable, its repository root is put on sys.path (cli.config_imports_resolve)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mars_jax").symlink_to(ROOT / "mars_jax")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mars_jax.train",
            f"--config={ROOT}/configs/{name}.py:mars",
            "--show_config",
        ],
        cwd=tmp_path,
        env=_env(PYTHONPATH=str(tmp_path / "site"), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "objective.name = 'mars'" in proc.stdout.splitlines()
    expected = importlib.import_module(f"configs.{name}").get_config("mars")
    assert f"train.batch_size = {expected.train.batch_size!r}" in proc.stdout.splitlines()


def test_config_imports_resolve_only_for_a_package(tmp_path):
    from mars_jax import cli

    loose = tmp_path / "mine.py"
    loose.write_text("def get_config():\n    return None\n")
    assert cli.config_imports_resolve(str(loose)) is None
    assert cli.config_imports_resolve(str(tmp_path / "missing.py")) is None
    assert cli.config_imports_resolve(str(ROOT / "configs" / "tiny.py")) == str(ROOT)
    assert cli._config_path(["--config", "a/b.py:mars", "--x"], "d.py") == "a/b.py"
    assert cli._config_path(["--config=c.py"], "d.py") == "c.py"
    assert cli._config_path([], "d.py:ar") == "d.py"


_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(not _LIBTPU, reason="libtpu is not installed")
def test_no_libtpu_errors_without_jax_platforms(tmp_path):
    """With libtpu installed and JAX_PLATFORMS unset, a command that uses a device prints no
    libtpu lines on a machine without an accelerator (platforms.cpu_unless_accelerator)."""
    from mars_jax import platforms

    if platforms.accelerator_attached():
        pytest.skip("an accelerator is attached: JAX may use it")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mars_jax.train",
            f"--config={ROOT}/configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.data.num_synthetic_train=1",
        ],
        cwd=tmp_path,
        env=_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: train.batch_size=16: 1 examples cannot fill a batch of 16: give "
        "train.batch_size <= 1, or more training rows"
    ), lines
    for bad in ("TPU", "libtpu", "InitGoogle", "E0000", "Source Location Trace"):
        assert not any(bad in line for line in lines), proc.stderr[-3000:]


def test_cpu_is_chosen_only_where_no_accelerator_can_be(monkeypatch):
    from mars_jax import platforms

    monkeypatch.setattr(platforms, "accelerator_attached", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "")  # set, even empty: the user's choice wins
    assert not platforms.cpu_unless_accelerator()
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(platforms, "accelerator_attached", lambda: True)
    assert not platforms.cpu_unless_accelerator() and "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(platforms, "accelerator_attached", lambda: False)
    assert platforms.cpu_unless_accelerator() and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.undo()
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # a TPU VM's variable
    assert platforms.accelerator_attached()
