"""Command-line plumbing shared by the entry points (train, evaluate, generate, export).

Flags are defined only when a module runs as a program (inside its ``main``), never at import,
so every module of the package imports together in one process (a notebook, a test, a sweep
script) and each library function takes plain arguments or a ``ConfigDict``.

Every program's ``--help`` (and ``--helpshort``, ``--helpfull``) prints its usage and flags and
exits 0. A program with ``--config`` also has ``--show_config``, which prints the config's keys
and values after the overrides and exits 0 without running.

Errors (`run`): a config file that does not load, an `errors.UserError` (a bad setting, flag
or argument, a malformed file, row or field, a missing run: a message written for the user about
their input) and a FileNotFoundError or FileExistsError (it names a path the user gave) print one
line ``error: MESSAGE`` and exit 1. Anything else, a ValueError from a library (jax, numpy,
Orbax, ...) included, keeps its traceback: it points at a bug.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sys
from typing import Callable

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as _config_flags_impl

from mars_jax import config as config_lib
from mars_jax import platforms, sources, storage
from mars_jax.decode_options import CACHE_MODES, RULES, DecodeOptions
from mars_jax.errors import StorageUnavailable, UserError


def config_flag(
    default: str = "configs/tiny.py", help: str = "Run config file."
) -> flags.FlagHolder:
    """Defines ``--config`` (an ml_collections config file, ``path[:stage]``, with
    ``--config.<key>=<value>`` overrides) and ``--show_config`` (see `run`). An override of an
    unknown key exits with one line naming the key and the nearest valid one (ml_collections
    parses overrides here). The config file's repository root goes first on ``sys.path``
    (`config_imports_resolve`), so configs/gsm8k.py's ``from configs import synthetic`` loads
    from any working directory."""
    global _config_default, _show_config
    _config_default = default
    config_imports_resolve(_config_path(sys.argv[1:], default))
    _show_config = flags.DEFINE_bool(
        "show_config",
        False,
        "Print the config's keys and values (after --config.KEY=VALUE overrides) as "
        "'key = value' lines and exit without running.",
    )
    with _unknown_override_exits():
        return config_flags.DEFINE_config_file("config", default, help)


_config_default = None  # the default of the --config flag, once defined
_show_config = None  # the --show_config flag, defined with --config
_required = []  # flags that must be given unless --show_config is
_HELP_FLAGS = ("help", "helpshort", "helpfull", "?")


def _config_path(argv: list[str], default: str) -> str:
    """The file of the ``--config`` flag in ``argv`` (``--config=F[:stage]`` or ``--config F``),
    else ``default``'s; the ``:stage`` suffix dropped."""
    path = default
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg.startswith(("--config=", "-config=")):
            path = arg.split("=", 1)[1]
        elif arg in ("--config", "-config") and i + 1 < len(argv):
            path = argv[i + 1]
    return path.split(":", 1)[0]


def config_imports_resolve(path: str) -> str | None:
    """Puts the repository root of config file ``path`` on ``sys.path`` (first), so that the
    file's imports of its sibling configs (``from configs import tiny``) resolve from any working
    directory, as they do from the root. The root is the directory above the outermost package
    (a directory with ``__init__.py``) that holds the file: for ``REPO/configs/gsm8k.py``,
    ``REPO``. Returns the directory put on the path; None for a file outside a package or a
    path that is not a file."""
    if not os.path.isfile(path):
        return None
    package = os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(package, "__init__.py")):
        return None
    while os.path.isfile(os.path.join(os.path.dirname(package), "__init__.py")):
        package = os.path.dirname(package)
    root = os.path.dirname(package)
    if root not in sys.path:
        sys.path.insert(0, root)
    return root


def config_lines(cfg, prefix: str = "") -> list[str]:
    """``cfg`` (a ``ConfigDict``) flattened to sorted ``key = repr(value)`` lines, nested keys
    joined with dots as in ``--config.KEY=VALUE`` overrides (e.g. ``train.batch_size = 16``)."""
    lines = []
    for key, value in sorted(cfg.items()):
        if hasattr(value, "items"):
            lines += config_lines(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key} = {value!r}")
    return lines


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
    `config.unknown_key_message`; None when every override names a key."""
    path, overrides = default, []
    for arg in argv:
        name = arg.lstrip("-").split("=", 1)[0]
        if name == "config" and "=" in arg:
            path = arg.split("=", 1)[1]
        elif name.startswith("config.") and arg.startswith("-"):
            overrides.append(name[len("config.") :])
    try:
        cfg = _config_flags_impl.ConfigFileFlagParser("config", lock_config=False).parse(path)
    except Exception:  # noqa: BLE001 - the original error is re-raised instead
        return None
    for key in overrides:
        if (bad := config_lib.unknown_key(cfg, key)) is not None:
            return f"--config.{key}: " + config_lib.unknown_key_message(cfg, bad)
    return None


def workdir_flag(help: str = "Run directory.") -> flags.FlagHolder:
    """Defines ``--workdir``, required unless ``--show_config`` is given (`run` checks it)."""
    holder = flags.DEFINE_string("workdir", None, help + " Required.")
    _required.append(holder)
    return holder


def step_flag() -> flags.FlagHolder:
    """Defines ``--step`` (a checkpoint step; default: the latest)."""
    return flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


class DecodingFlags:
    """The decoding flags of a program that decodes a model it opens (generate, serve):
    ``--threshold``, ``--block_size``, ``--max_new_tokens``, ``--temperature``, ``--top_p``,
    ``--cache_mode`` and ``--rule``, read into one `DecodeOptions` (`open`)."""

    def __init__(
        self,
        *,
        threshold: float,
        max_new_tokens: int,
        budget_help: str,
        threshold_help: str = "Confidence threshold; 1.0 = AR decoding.",
        flag_values: flags.FlagValues = flags.FLAGS,
    ):
        define = dict(flag_values=flag_values)
        self.threshold = flags.DEFINE_float("threshold", threshold, threshold_help, **define)
        self.block_size = flags.DEFINE_integer(
            "block_size",
            None,
            "Block size (default: the run's, or config.json's mars_block_size).",
            **define,
        )
        self.max_new_tokens = flags.DEFINE_integer(
            "max_new_tokens", max_new_tokens, budget_help, **define
        )
        self.temperature = flags.DEFINE_float("temperature", 0.0, "0 = greedy.", **define)
        self.top_p = flags.DEFINE_float(
            "top_p", 1.0, "Nucleus sampling (with temperature > 0); 1 = every token.", **define
        )
        self.cache_mode = flags.DEFINE_enum(
            "cache_mode", "sliding", CACHE_MODES, "KV cache scheme.", **define
        )
        self.rule = flags.DEFINE_enum("rule", "prob", RULES, "Acceptance rule.", **define)

    def open(
        self, path: str, *, step: int | None = None, mesh=None, threshold=None, block_size=None
    ) -> tuple[sources.Opened, DecodeOptions]:
        """The model at ``path`` (`sources.open`, its checkpoint ``step``, on ``mesh``) and the
        flags' options at its block size (``threshold`` and ``block_size``, if given, in place of
        the flags': a threshold may be one per row), checked before any weight is read."""
        block_size = self.block_size.value if block_size is None else block_size
        options = config_lib.check_decoding(
            threshold=self.threshold.value if threshold is None else threshold,
            block_size=block_size,
            max_new_tokens=self.max_new_tokens.value,
            temperature=self.temperature.value,
            top_p=self.top_p.value,
            cache_mode=self.cache_mode.value,
            rule=self.rule.value,
        )
        opened = sources.open(path, block_size=block_size, step=step, mesh=mesh)
        return opened, options.replace(block_size=opened.block_size)


def run(main: Callable[[], None]) -> None:
    """Parses the defined flags and runs ``main()`` (absl's ``app.run``), with library INFO
    logs quieted (see `quiet_library_logs`). ``--help`` exits 0; ``--show_config`` prints the
    config (`config_lines`) instead of running. Extra positional arguments and a missing
    required flag are usage errors. The errors of the module docstring print one line and
    exit 1 (`is_user_error`). On a machine without an accelerator and with ``JAX_PLATFORMS``
    unset, JAX stays on the CPU without trying libtpu (`platforms.cpu_unless_accelerator`)."""

    def absl_main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        if _show_config is not None:
            try:  # ml_collections reports a file that did not load at the config's first use
                lines = config_lines(flags.FLAGS["config"].value)
            except OSError as e:
                raise SystemExit(f"error: --config: {' '.join(str(e).split())}") from None
            if _show_config.value:
                print("\n".join(lines))
                return
        for holder in _required:
            if holder.value is None:
                raise app.UsageError(f"flag --{holder.name} is required")
        quiet_library_logs()
        _quiet_closed_loop_callbacks()
        platforms.limit_malloc_arenas()  # before JAX starts its threads (see there)
        platforms.cpu_unless_accelerator()  # no libtpu errors on a machine without a TPU
        try:
            main()
        except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status, not a traceback
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
            raise SystemExit(130) from None
        except Exception as e:  # re-raised unless it is the user's
            if (full := _disk_full(e)) is not None:
                # As below: Orbax's failed save threads would print hundreds of lines.
                sys.stderr.write(f"error: {disk_full_message(full)}\n")
                sys.stderr.flush()
                os._exit(1)
            if (failed := _storage_unavailable(e)) is not None:
                # A failed checkpoint write leaves Orbax threads that wait minutes for signals
                # that never come; nothing uncommitted is a step, so the process ends here.
                logging.getLogger(__name__).error("traceback", exc_info=e)
                sys.stderr.write(f"error: {failed}\n")
                sys.stderr.flush()
                os._exit(1)
            urls = [a.split("=", 1)[-1] for a in sys.argv[1:] if "://" in a]
            if urls and storage.unreachable(e):  # the user's bucket, not a bug
                raise SystemExit(f"error: {storage.unreachable_message(urls, e)}") from None
            if not is_user_error(e):
                raise
            raise SystemExit(f"error: {e}") from None

    # The flags defined here are the program's own: --help lists them with its other flags.
    for flag in flags.FLAGS.get_flags_for_module(__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    with _unknown_override_exits(), _help_exits_0(sys.argv[1:]):
        app.run(absl_main)


def _storage_unavailable(e: BaseException | None) -> StorageUnavailable | None:
    """The `StorageUnavailable` that ``e`` is or was raised from (or while handling), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, StorageUnavailable):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


_NO_SPACE = "No space left on device"


def _disk_full(e: BaseException | None) -> str | None:
    """The text of the no-space error that ``e`` is or was raised from (an OSError with errno
    ENOSPC, or Orbax's and tensorstore's errors quoting it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or _NO_SPACE in str(e):
            return str(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def disk_full_message(text: str) -> str:
    """One line for a write that found the disk full: the checkpoint (or file) being written,
    the space left on its disk, the size of the run's last committed checkpoint (what the next
    one needs, about) and the committed steps, which are intact."""
    paths = re.findall(r'"(/[^"]+)"', text) or re.findall(r"'(/[^']+)'", text)
    path = paths[0] if paths else ""
    step_dir = re.match(r"(.*/checkpoints)/(\d+)(\.orbax-checkpoint-tmp)?(/|$)", path)
    target = f"{step_dir.group(1)}/{step_dir.group(2)}" if step_dir else path or "a file"
    parts = [f"no space left on device writing {target}"]
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing:
        parts.append(f"{shutil.disk_usage(existing).free / 1e6:.1f} MB free there")
    if step_dir:
        root = step_dir.group(1)
        steps = sorted((int(s) for s in os.listdir(root) if s.isdigit()), reverse=True)
        if steps:
            last = os.path.join(root, str(steps[0]))
            size = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(last) for f in fs
            )
            parts.append(f"a checkpoint of this run takes about {size / 1e6:.1f} MB")
            parts.append(f"the committed steps are intact: {', '.join(map(str, sorted(steps)))}")
    return "; ".join(parts)


def is_user_error(e: BaseException) -> bool:
    """Whether ``e`` is one of the errors that `run` prints as one line: an `errors.UserError`
    (mars-jax's errors about the user's input), or a FileNotFoundError or FileExistsError (a
    path the user gave, e.g. a file that ``open`` did not find). Decided by the exception's
    class alone, never by where it was raised."""
    return isinstance(e, (UserError, FileNotFoundError, FileExistsError))


@contextlib.contextmanager
def _help_exits_0(argv: list[str]):
    """absl's help flags print the usage and exit 1; asked for, that is a success: exit 0."""
    try:
        yield
    except SystemExit as e:
        asked = any(_help_flag(arg) for arg in argv[: argv.index("--") if "--" in argv else None])
        if e.code == 1 and asked:
            raise SystemExit(0) from None
        raise


def _help_flag(arg: str) -> bool:
    """Whether command-line argument ``arg`` is one of absl's help flags (--help, -?, ...)."""
    name, _, value = arg.lstrip("-").partition("=")
    return arg.startswith("-") and name in _HELP_FLAGS and value.lower() not in ("false", "0")


def _record_text(record: logging.LogRecord) -> str:
    """A log record's message and its exception's text (what a handler prints)."""
    try:
        text = record.getMessage()
    except (TypeError, ValueError):
        text = str(record.msg)
    return text + (f" {record.exc_info[1]}" if record.exc_info else "")


def _quiet_closed_loop_callbacks() -> None:
    """Drops the "Event loop is closed" RuntimeErrors of tensorstore's completion callbacks that
    reach an Orbax event loop already closed after a failed save: dozens of tracebacks before
    `run`'s one line (a full disk). tensorstore reports them through ``sys.unraisablehook``;
    ``sys.excepthook`` is covered too. Every other exception is printed as before."""
    previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

    def closed_loop(value) -> bool:
        return type(value) is RuntimeError and str(value) == "Event loop is closed"

    def excepthook(kind, value, tb):
        if not closed_loop(value):
            previous_excepthook(kind, value, tb)

    def unraisablehook(unraisable):
        if not closed_loop(unraisable.exc_value):
            previous_unraisablehook(unraisable)

    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


def quiet_library_logs() -> None:
    """Keeps INFO records of mars-jax only in absl's log handler (Orbax logs several per save,
    JAX reports absent TPU runtimes); warnings and errors of every library stay."""

    package = os.path.dirname(os.path.abspath(__file__))

    def keep(record: logging.LogRecord) -> bool:
        if not record.pathname.startswith(package) and _NO_SPACE in _record_text(record):
            return False  # a library's report of a full disk: `run` prints it as one line
        return record.levelno >= logging.WARNING or record.pathname.startswith(package)

    absl_logging.get_absl_handler().addFilter(keep)
