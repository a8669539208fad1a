"""Command-line plumbing shared by the entry points (train, evaluate, generate, export).

Flags are defined only when a module runs as a program (inside its ``main``), never at import,
so every module of the package imports together in one process (a notebook, a test, a sweep
script) and each library function takes plain arguments or a ``ConfigDict``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as _config_flags_impl

from mars_jax import settings


def config_flag(default: str = "configs/tiny.py", help: str = "Run config file.") -> flags.FlagHolder:
    """Defines ``--config`` (an ml_collections config file, ``path[:stage]``, with
    ``--config.<key>=<value>`` overrides). An override of an unknown key exits with one line
    naming the key and the nearest valid one (ml_collections parses overrides here)."""
    global _config_default
    _config_default = default
    with _unknown_override_exits():
        return config_flags.DEFINE_config_file("config", default, help)


_config_default = None  # the default of the --config flag, once defined


@contextlib.contextmanager
def _unknown_override_exits():
    """Turns ml_collections' error for an override of an unknown key (raised when the flag is
    defined without ``--config=``, else when flags are parsed) into a one-line exit."""
    try:
        yield
    except (AttributeError, KeyError) as e:
        key = None if _config_default is None else _unknown_override(sys.argv[1:], _config_default)
        if key is None:
            raise
        raise SystemExit(f"error: {key}") from e


def _unknown_override(argv: list[str], default: str) -> str | None:
    """For the first ``--config.<key>`` override in ``argv`` whose key the config file lacks:
    `settings.unknown_key_message`; None when every override names a key."""
    path, overrides = default, []
    for arg in argv:
        name = arg.lstrip("-").split("=", 1)[0]
        if name == "config" and "=" in arg:
            path = arg.split("=", 1)[1]
        elif name.startswith("config.") and arg.startswith("-"):
            overrides.append(name[len("config."):])
    try:
        cfg = _config_flags_impl.ConfigFileFlagParser("config", lock_config=False).parse(path)
    except Exception:  # noqa: BLE001 - the original error is re-raised instead
        return None
    for key in overrides:
        if (bad := settings.unknown_key(cfg, key)) is not None:
            return f"--config.{key}: " + settings.unknown_key_message(cfg, bad)
    return None


def workdir_flag(help: str = "Run directory.") -> flags.FlagHolder:
    """Defines the required ``--workdir``."""
    return flags.DEFINE_string("workdir", None, help, required=True)


def step_flag() -> flags.FlagHolder:
    """Defines ``--step`` (a checkpoint step; default: the latest)."""
    return flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


def run(main: Callable[[], None]) -> None:
    """Parses the defined flags and runs ``main()`` (absl's ``app.run``), with library INFO
    logs quieted (see `quiet_library_logs`). Extra positional arguments are an error; a bad
    setting (`settings.SettingError`, `settings.MissingPath`) exits with its one-line message."""

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        quiet_library_logs()
        try:
            main()
        except (settings.SettingError, settings.MissingPath) as e:
            # A bad setting (checked before any compile): one line, exit status 1.
            raise SystemExit(f"error: {e}") from None

    # The flags defined here are the program's own: --help lists them with its other flags.
    for flag in flags.FLAGS.get_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    with _unknown_override_exits():
        app.run(absl_main)


def quiet_library_logs() -> None:
    """Keeps INFO records of mars-jax only in absl's log handler (Orbax logs several per save,
    JAX reports absent TPU runtimes); warnings and errors of every library stay."""

    package = os.path.dirname(os.path.abspath(__file__))

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.pathname.startswith(package)

    absl_logging.get_absl_handler().addFilter(keep)
