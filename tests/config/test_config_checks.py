"""Settings checks: each bad setting is a one-line error naming the config key and its
value, raised before any data is read (where possible) or anything is compiled."""

import importlib
from pathlib import Path

import jax
import pytest

from mars_jax import config, errors, train
from tests.helpers import ROOT, run_python, tiny_config

tiny = tiny_config  # configs/tiny.py with overrides ("a__b" = "a.b")


def check(cfg) -> None:
    """A run config's checks, as training runs them."""
    config.validate(cfg, training=True)


def one_line_error(exc_info, *parts):
    message = str(exc_info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)


def test_defaults_pass():
    cfg = tiny()
    check(cfg)
    for devices in (1, 2, 8):
        config.check_devices(cfg, devices)
    config.check_devices(tiny(mesh__data=2, mesh__tensor=2), 4)


@pytest.mark.parametrize(
    "overrides, key, value",
    [
        ({"objective__block_size": 256}, "objective.block_size", "256"),  # > max_length 128
        ({"objective__block_size": 5}, "objective.block_size", "5"),  # does not divide 128
        ({"objective__block_size": 0}, "objective.block_size", "0"),
        ({"eval__thresholds": (1.0, 1.5)}, "eval.thresholds", "1.5"),
        ({"eval__thresholds": (0.0,)}, "eval.thresholds", "0.0"),
        ({"train__batch_size": 16, "train__grad_accum_steps": 3}, "train.batch_size", "16"),
        ({"data__source": "csv"}, "data.source", "'csv'"),
        ({"train__save_every": 0}, "train.save_every", "0"),  # was a ZeroDivisionError at step 1
        ({"train__log_every": 0}, "train.log_every", "0"),
        ({"train__num_steps": -2}, "train.num_steps", "-2"),
        ({"train__num_steps": 0, "train__num_epochs": 0.0}, "train.num_epochs", "0.0"),
        ({"train__learning_rate": -1.0}, "train.learning_rate", "-1.0"),
        ({"train__learning_rate": float("nan")}, "train.learning_rate", "nan"),
        ({"train__warmup_ratio": 1.5}, "train.warmup_ratio", "1.5"),
        ({"train__grad_clip": 0.0}, "train.grad_clip", "0.0"),
        ({"train__schedule": "cosine"}, "train.schedule", "'cosine'"),
        ({"train__stop_at": -1}, "train.stop_at", "-1"),
        (
            {"data__packing": True, "objective__noisy_weighting": "inverse_t"},
            "objective.noisy_weighting",
            "'inverse_t'",
        ),
        ({"eval__num_examples": 0}, "eval.num_examples", "0"),
        ({"eval__num_examples": -3}, "eval.num_examples", "-3"),
        ({"eval__nll_examples": 0}, "eval.nll_examples", "0"),
        ({"eval__timing_repeats": -1}, "eval.timing_repeats", "-1"),
    ],
)
def test_bad_setting(overrides, key, value):
    with pytest.raises(errors.SettingError) as e:
        check(tiny(**overrides))
    one_line_error(e, f"{key}=", value)
    assert e.value.key == key


def test_unknown_key_names_nearest():
    cfg = tiny()
    cfg.train.batchsize = 8  # a typo in Python (the ConfigDict is not locked)
    with pytest.raises(errors.SettingError) as e:
        check(cfg)
    one_line_error(e, "train.batchsize=8", "'train.batch_size'")
    cfg = tiny()
    cfg.mesh.rules.my_axis = ("data",)  # rules take any logical name
    check(cfg)


@pytest.mark.parametrize(
    "overrides, devices, key, value",
    [
        ({"mesh__data": 3}, 8, "mesh", "data=3"),  # 3 x 1 x 1 != 8
        ({"mesh__data": -1, "mesh__fsdp": -1}, 8, "mesh", "fsdp=-1"),
        ({"mesh__data": 1, "mesh__tensor": 8}, 8, "mesh.rules.heads", "tensor"),  # 4 heads / 8
        ({"mesh__data": 2, "mesh__tensor": 4}, 8, "mesh.rules.kv_heads", "tensor"),  # 2 kv / 4
        ({"train__batch_size": 12}, 8, "train.batch_size", "12"),  # data-parallel 8
        ({"mesh__data": 2, "mesh__fsdp": 4, "train__batch_size": 20}, 8, "train.batch_size", "20"),
    ],
)
def test_bad_device_setting(overrides, devices, key, value):
    with pytest.raises(errors.SettingError) as e:
        config.check_devices(tiny(**overrides), devices)
    one_line_error(e, f"{key}=", value)


def test_heads_of_init_from():
    """With init_from the heads are the loaded model's (Qwen2.5-0.5B: 14 and 2)."""
    cfg = tiny(init_from="/models/q", mesh__data=4, mesh__tensor=2)
    config.check_devices(cfg, 8, heads=(14, 2))
    with pytest.raises(errors.SettingError) as e:
        config.check_devices(tiny(init_from="/models/q", mesh__data=2, mesh__tensor=4), 8, (14, 2))
    one_line_error(e, "mesh.rules.heads=", "splits the 14 heads", "init_from='/models/q'")


def test_missing_paths(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"messages": []}\n')
    cases = [
        # A messages run without an evaluation file: found before the first step.
        ({"data__source": "messages", "data__train_path": str(rows)}, "data.eval_path", "''"),
        (
            {
                "data__source": "messages",
                "data__train_path": str(tmp_path / "no.jsonl"),
                "data__eval_path": str(rows),
            },
            "data.train_path",
            "no.jsonl",
        ),
        (
            {
                "data__source": "gsm8k",
                "data__train_path": str(rows),
                "data__eval_path": str(tmp_path / "test.jsonl"),
            },
            "data.eval_path",
            "test.jsonl",
        ),
        ({"init_from": str(tmp_path / "run")}, "init_from", "run"),
        ({"tokenizer_path": str(tmp_path / "tok")}, "tokenizer_path", "tok"),
    ]
    for overrides, key, value in cases:
        with pytest.raises(errors.MissingPath) as e:
            check(tiny(**overrides))
        one_line_error(e, f"{key}=", value)
        assert isinstance(e.value, FileNotFoundError)
    # Evaluation alone needs neither the training file nor init_from.
    config.validate(
        tiny(data__source="messages", data__eval_path=str(rows), init_from="/nope"), training=False
    )


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled before the settings were checked")


def test_train_checks_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "jit", _no_compile)
    with pytest.raises(errors.SettingError, match=r"^eval\.thresholds="):
        train.train(tiny(eval__thresholds=(2.0,)), str(tmp_path / "a"))
    with pytest.raises(errors.SettingError, match=r"^mesh="):
        train.train(tiny(mesh__data=jax.device_count() + 1), str(tmp_path / "b"))
    # Too few examples is known only once the data is read, still before any compile.
    with pytest.raises(errors.SettingError) as e:
        train.train(tiny(data__num_synthetic_train=1), str(tmp_path / "c"))
    one_line_error(e, "train.batch_size=16", "1 examples cannot fill a batch of 16")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def _cli(*args):
    return run_python("-m", "mars_jax.train", *args, check=False)


@pytest.mark.subprocess
def test_cli_config_typo_is_one_line(tmp_path):
    proc = _cli(f"--workdir={tmp_path}", "--config.train.nonsense=1")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: --config.train.nonsense: unknown config key 'train.nonsense'; "
        "did you mean 'train.num_steps'?"
    ], proc.stderr[-3000:]
    # With --config given the overrides are parsed later, by app.run: the same line.
    proc = _cli(f"--workdir={tmp_path}", "--config=configs/tiny.py:mars", "--config.trian.seed=1")
    assert proc.returncode != 0
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --config.trian.seed: unknown config key 'trian'; did you mean 'train'?")
    ), proc.stderr[-3000:]


@pytest.mark.subprocess
def test_cli_bad_setting_is_one_line(tmp_path):
    proc = _cli(f"--workdir={tmp_path}", "--config.objective.block_size=5")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: objective.block_size=5: must divide data.max_length=128"
    ), proc.stderr[-3000:]
    assert not any("Traceback" in l for l in proc.stderr.splitlines()), proc.stderr[-3000:]


SHIPPED_CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("stage", ["ar", "mars"])
@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_every_shipped_config_passes_the_checks(name, stage):
    """Each config in configs/ passes every check that needs no file; a path it names may be
    absent on this machine (the Qwen weights, ../shared), and is then the only error."""
    cfg = importlib.import_module(f"configs.{name}").get_config(stage)
    assert cfg.objective.name == stage
    try:
        check(cfg)
    except errors.MissingPath as e:  # the user's to supply, or absent here
        assert not e.value or not Path(e.value).exists(), str(e)


@pytest.mark.parametrize(
    "attention, backend, fails",
    [
        ("splash", "cpu", True),
        ("splash", "gpu", True),
        ("splash", "tpu", False),
        ("cudnn", "cpu", True),
        ("cudnn", "tpu", True),
        ("cudnn", "gpu", False),
        ("xla", "cpu", False),
        ("chunked", "tpu", False),
    ],
)
def test_attention_kernel_must_run_on_the_devices(attention, backend, fails):
    """A device-bound kernel on other devices is refused before anything compiles (the paper
    configs train with splash: a GPU user is told which to pass instead)."""
    cfg = tiny(model__attention=attention)
    if not fails:
        config.check_devices(cfg, 1, backend=backend)
        return
    with pytest.raises(errors.SettingError) as e:
        config.check_devices(cfg, 1, backend=backend)
    one_line_error(e, "model.attention=", attention, backend.upper(), "attention=xla")
    config.check_devices(cfg, 1)  # the backend left out: not checked
