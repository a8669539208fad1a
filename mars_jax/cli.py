"""Command-line plumbing shared by the entry points (train, evaluate, generate, export).

Flags are defined only when a module runs as a program (inside its ``main``), never at import,
so every module of the package imports together in one process (a notebook, a test, a sweep
script) and each library function takes plain arguments or a ``ConfigDict``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags


def config_flag(default: str = "configs/tiny.py", help: str = "Run config file.") -> flags.FlagHolder:
    """Defines ``--config`` (an ml_collections config file, ``path[:stage]``, with
    ``--config.<key>=<value>`` overrides; an unknown key is an error)."""
    return config_flags.DEFINE_config_file("config", default, help)


def workdir_flag(help: str = "Run directory.") -> flags.FlagHolder:
    """Defines the required ``--workdir``."""
    return flags.DEFINE_string("workdir", None, help, required=True)


def step_flag() -> flags.FlagHolder:
    """Defines ``--step`` (a checkpoint step; default: the latest)."""
    return flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


def run(main: Callable[[], None]) -> None:
    """Parses the defined flags and runs ``main()`` (absl's ``app.run``), with library INFO
    logs quieted (see `quiet_library_logs`). Extra positional arguments are an error."""

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        quiet_library_logs()
        main()

    # The flags defined here are the program's own: --help lists them with its other flags.
    for flag in flags.FLAGS.get_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    app.run(absl_main)


def quiet_library_logs() -> None:
    """Keeps INFO records of mars-jax only in absl's log handler (Orbax logs several per save,
    JAX reports absent TPU runtimes); warnings and errors of every library stay."""

    package = os.path.dirname(os.path.abspath(__file__))

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.pathname.startswith(package)

    absl_logging.get_absl_handler().addFilter(keep)
