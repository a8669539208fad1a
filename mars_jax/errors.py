"""Errors that are the user's: a bad setting, flag or argument, a missing or clashing path, a
malformed input file, row or field. Each message is one line written for the user.

`UserError` is their base; `cli.run` prints one as ``error: MESSAGE`` and exits 1, and any other
exception keeps its traceback (a bug, or a library's error). Every subclass keeps the builtin
base it had before (ValueError, FileNotFoundError, FileExistsError), so ``except ValueError``
still catches it. A leaf module: it imports nothing of mars-jax.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors the user can fix from the message alone (see the module docstring)."""


class InputError(UserError, ValueError):
    """A bad input: a flag or argument, a file's row or field, a token outside a vocabulary,
    a run directory that does not match, ..."""


class NotFound(UserError, FileNotFoundError):
    """A path the user gave (or that a run needs) does not exist or is not what it must be."""


class AlreadyExists(UserError, FileExistsError):
    """A path the user gave already holds what would be written there."""


class SettingError(InputError):
    """A bad config value: ``key=value: reason`` on one line."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key}={value!r}: {reason}")
        self.key, self.value = key, value


class MissingPath(NotFound):
    """A path a run needs does not exist: ``key=path: reason`` on one line."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key}={value!r}: {reason}")
        self.key, self.value = key, value


class StorageUnavailable(UserError, OSError):
    """An object store (a ``gs://`` bucket) did not answer or refused a request: which bucket,
    and that the same command can be rerun (see `mars_jax.storage.unreachable_message`)."""
