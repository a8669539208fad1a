"""Paths on a local disk or in an object store (``gs://bucket/...``, or any fsspec URL), read and
written through etils.epath, the file layer Orbax uses (gcsfs for ``gs://``).

Local paths behave as with ``os`` and ``open``. What object stores do differently is handled
here, in one place:

- No rename and no append: `write_text` / `write_bytes` replace a whole object in one request
  (an object is never seen half-written); a growing log is rewritten whole (`mars_jax.metrics`).
- No exclusive ``open``: `create_new` and `delete_if_unchanged` use the object's generation as a
  precondition (google-cloud-storage's ``if_generation_match``), so two processes racing for
  the same object cannot both win (the run lock, `mars_jax.workdir.RunLock`).
- Reading a file back to hash it would download a checkpoint again: `checksum` of an object is
  the crc32c the store computed on upload (a local file: its SHA-256).
- Libraries that read only local files (safetensors' memory map, the tokenizers package) get a
  local copy of a remote directory (`local_dir`).
- Other processes write to the same bucket (the hosts of a pod, a trainer and an evaluator):
  gcsfs's listing cache, which never expires and which only this process's own writes update, is
  off for every gcsfs filesystem made after this module is imported (fsspec's configuration:
  the epath objects of `Path` and Orbax's included), so each read, existence check and listing
  asks the store. The cost in requests is in docs/reliability.md#workdirs-in-a-bucket.
- gcsfs asks which kind a bucket is before each call and, where it cannot tell (no Application
  Default Credentials, as with an emulator), logs the same warning every time: once a process
  here.

Tests point every client at a GCS emulator on 127.0.0.1 (``STORAGE_EMULATOR_HOST``; tensorstore,
which writes Orbax's arrays, by ``TENSORSTORE_GCS_HTTP_URL``).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import fsspec
from etils import epath

from mars_jax.errors import InputError, NotFound

for _protocol in ("gs", "gcs"):  # gcsfs registers both; fsspec applies each one's entry
    fsspec.config.conf.setdefault(_protocol, {})["use_listings_cache"] = False


class _FirstOnly(logging.Filter):
    """Passes the first record whose message starts with one of ``prefixes``, drops the later
    ones (every other record passes)."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes, self.seen, self.lock = prefixes, False, threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefixes):
            return True
        with self.lock:
            first, self.seen = not self.seen, True
        return first


# gcsfs's bucket-type probe (gcsfs.extended_gcsfs: not cached when it fails, so asked again at
# every call).
logging.getLogger("gcsfs").addFilter(
    _FirstOnly("Could not determine bucket type for bucket ", "Error: Bucket ")
)


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL of an object store (``gs://...``), not a local path."""
    return "://" in os.fspath(path)


def Path(path: str | os.PathLike) -> epath.Path:  # noqa: N802 (a constructor, as epath.Path)
    """``path`` as an `epath.Path` (local or remote)."""
    return epath.Path(path)


def join(path: str | os.PathLike, *parts: str) -> str:
    """``path/part/...`` as a string (``os.path.join`` for both kinds: a URL's separator is /)."""
    return os.path.join(os.fspath(path), *parts)


def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute; a URL as it is."""
    path = os.fspath(path)
    return path if is_remote(path) else os.path.abspath(path)


def exists(path) -> bool:
    """Whether file or directory ``path`` exists (in a bucket: an object, or objects under it)."""
    return Path(path).exists()


def isdir(path) -> bool:
    """Whether ``path`` is a directory (in a bucket: a prefix with objects under it)."""
    return Path(path).is_dir()


def isfile(path) -> bool:
    """Whether ``path`` is a file (in a bucket: an object)."""
    return Path(path).is_file()


def makedirs(path) -> None:
    """Creates directory ``path`` and its parents (object stores have no directories: nothing
    is written there)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def read_text(path) -> str:
    """The text of file ``path`` (UTF-8); FileNotFoundError if it does not exist."""
    return Path(path).read_text()


def read_bytes(path) -> bytes:
    """The bytes of file ``path``; FileNotFoundError if it does not exist."""
    return Path(path).read_bytes()


def write_bytes(path, data: bytes, *, atomic: bool = False) -> None:
    """Writes ``data`` to ``path``: an object in one upload (never seen half-written); a local
    file as ``open(path, "wb")`` does, or with ``atomic`` through a temporary file renamed over
    it (a reader sees the old file or the new one)."""
    if is_remote(path):
        Path(path).write_bytes(data)
        return
    path = os.fspath(path)
    if not atomic:
        with open(path, "wb") as f:
            f.write(data)
        return
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("wb", dir=directory, delete=False) as f:
        f.write(data)
    try:
        os.chmod(f.name, 0o666 & ~_UMASK)
        os.replace(f.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(f.name)
        raise


def write_text(path, text: str, *, atomic: bool = False) -> None:
    """`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode(), atomic=atomic)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import: setting it to read it races with other threads


def listdir(path) -> list[str]:
    """The names in directory ``path``, sorted."""
    return sorted(p.name for p in Path(path).iterdir())


def files_under(path) -> list[str]:
    """The files under directory ``path`` (recursively), as sorted paths relative to it with /
    separators; [] where ``path`` does not exist."""
    root = Path(path)
    if not root.exists():
        return []
    out = []
    base = os.fspath(root).split("://", 1)[-1]  # fsspec walks without the scheme
    for directory, _, files in root.walk():
        rel = os.path.relpath(os.fspath(directory).split("://", 1)[-1], base)
        out += [name if rel == "." else f"{rel}/{name}" for name in files]
    return sorted(out)


def size(path) -> int:
    """The size of file ``path`` in bytes."""
    if is_remote(path):
        return int(_info(path)["size"])
    return os.path.getsize(path)


def checksum(path, kind: str | None = None) -> str:
    """A digest of file ``path`` that changes when its bytes do, as ``<kind>:<value>``.

    By default the cheapest for its place: ``sha256:<hex>`` of a local file (read once),
    ``crc32c:<base64>`` of an object as its store computed it on upload (nothing downloaded).
    ``kind`` ("sha256" or "crc32c") asks for that one wherever the file is: a run copied
    between a disk and a bucket is checked by the digests it was saved with (an object's SHA-256
    is computed from its bytes, a local file's crc32c as GCS computes it)."""
    kind = kind or ("crc32c" if is_remote(path) else "sha256")
    if kind == "crc32c" and is_remote(path):
        value = _info(path).get("crc32c")
        if value:
            return f"crc32c:{value}"
    if kind not in ("sha256", "crc32c"):
        raise InputError(f"{path}: unknown checksum kind {kind!r}")
    import google_crc32c

    digest = hashlib.sha256() if kind == "sha256" else google_crc32c.Checksum()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if kind == "sha256":
        return "sha256:" + digest.hexdigest()
    return "crc32c:" + base64.b64encode(digest.digest()).decode()


def _info(path) -> dict:
    fs, inner = fsspec.core.url_to_fs(os.fspath(path))
    fs.invalidate_cache(inner)
    return fs.info(inner)


def remove_tree(path) -> None:
    """Deletes directory ``path`` and everything under it (nothing if it does not exist)."""
    if is_remote(path):
        root = Path(path)
        if root.exists():
            root.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def copy_file(source, target) -> None:
    """Copies file ``source`` to ``target`` (either kind), streamed: never whole in memory."""
    if not is_remote(target):
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    with Path(source).open("rb") as f, Path(target).open("wb") as g:
        shutil.copyfileobj(f, g, 1 << 24)


def move_tree(source, target) -> None:
    """Moves directory ``source`` to ``target``: a rename on a local disk, a copy of every object
    and then the deletion of the source in an object store (not atomic: an interrupted move
    leaves both, the source whole)."""
    if not is_remote(source) and not is_remote(target):
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        shutil.move(source, target)
        return
    copy_tree(source, target)
    remove_tree(source)


def copy_tree(source, target, names: list[str] | None = None) -> None:
    """Copies every file under directory ``source`` (or only ``names``, relative paths, those
    that exist) to ``target`` (either kind)."""
    for rel in files_under(source) if names is None else names:
        if names is None or exists(join(source, rel)):
            copy_file(join(source, rel), join(target, rel))


@contextlib.contextmanager
def local_dir(path, names: list[str] | None = None) -> Iterator[str]:
    """A local directory with the files of directory ``path``: ``path`` itself where it is local,
    otherwise a temporary copy (deleted on exit) of its files, or of only ``names`` (relative
    paths, those that exist), for readers of local files only (safetensors, tokenizers).
    Errors raised inside name ``path``, not the copy."""
    if not is_remote(path):
        yield os.fspath(path)
        return
    if not isdir(path):
        raise NotFound(f"{path}: no such directory in the object store")
    with tempfile.TemporaryDirectory(prefix="mars_jax_") as tmp:
        copy_tree(path, tmp, names)
        try:
            yield tmp
        except Exception as e:

            def named(a):
                return a.replace(tmp, os.fspath(path)) if isinstance(a, str) else a

            e.args = tuple(named(a) for a in e.args)
            if isinstance(e, OSError) and isinstance(e.filename, str):
                e.filename = named(e.filename)
            raise


# Object generations as preconditions (gs:// only; local files use open(..., "x") and unlink).


@functools.cache
def _client():
    from google.cloud import storage

    # project=None: bucket and object requests need none (ADC may not name one).
    return storage.Client(project=None)


def _blob(path: str):
    bucket, _, name = os.fspath(path).removeprefix("gs://").partition("/")
    return _client().bucket(bucket).blob(name)


def _require_gcs(path: str) -> None:
    if not os.fspath(path).startswith("gs://"):
        raise InputError(f"{path}: exclusive create needs a local path or gs:// (not this store)")


def _ours(path, text: str) -> int | None:
    """The generation of ``path`` if it holds ``text`` (a write of ours whose answer was lost,
    then retried by the client into a failed precondition), else None."""
    found = read_with_generation(path)
    return found[1] if found is not None and found[0] == text else None


def create_new(path, text: str) -> int:
    """Creates file ``path`` holding ``text`` only if it does not exist; raises FileExistsError
    if it does (another process created it first). Returns the object's generation (0 for a
    local file)."""
    if not is_remote(path):
        with open(path, "x") as f:
            f.write(text)
        return 0
    _require_gcs(path)
    from google.api_core import exceptions

    blob = _blob(path)
    try:
        blob.upload_from_string(text, if_generation_match=0)
    except exceptions.PreconditionFailed:
        if (generation := _ours(path, text)) is not None:
            return generation
        raise FileExistsError(path) from None
    return int(blob.generation)


def read_with_generation(path) -> tuple[str, int] | None:
    """(text, generation) of ``path``, or None if it does not exist (a local file's generation
    is its modification time in ns)."""
    if not is_remote(path):
        try:
            with open(path) as f:
                return f.read(), os.stat(f.fileno()).st_mtime_ns
        except FileNotFoundError:
            return None
    _require_gcs(path)
    from google.api_core import exceptions

    blob = _blob(path)
    try:
        blob.reload()
        return blob.download_as_text(if_generation_match=blob.generation), int(blob.generation)
    except exceptions.NotFound:
        return None
    except exceptions.PreconditionFailed:  # replaced between the two requests
        return read_with_generation(path)


def replace_if_unchanged(path, text: str, generation: int) -> int:
    """Replaces ``path`` with ``text`` only if it is still at ``generation``; raises
    FileExistsError if another process changed or deleted it. Returns the new generation."""
    _require_gcs(path)
    from google.api_core import exceptions

    blob = _blob(path)
    try:
        blob.upload_from_string(text, if_generation_match=generation)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
        if (mine := _ours(path, text)) is not None:
            return mine
        raise FileExistsError(path) from None
    return int(blob.generation)


def delete_if_unchanged(path, generation: int, *, patient: bool = True) -> bool:
    """Deletes ``path`` only if it is still at ``generation``; returns whether it did. Not
    ``patient``: one attempt of at most 10 s (no retries), for a best-effort cleanup."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_mtime_ns == generation:
                os.unlink(path)
                return True
        return False
    _require_gcs(path)
    from google.api_core import exceptions
    from google.cloud.storage.retry import DEFAULT_RETRY

    retry, timeout = (DEFAULT_RETRY, 60) if patient else (None, 10)
    blob = _blob(path)
    try:
        blob.reload(retry=retry, timeout=timeout)  # not every emulator applies the precondition
        if int(blob.generation) != generation:
            return False
        blob.delete(if_generation_match=generation, retry=retry, timeout=timeout)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
        return False
    return True


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` or an exception it was raised from is an object store's failure: an
    error of its clients (google-cloud-storage's API errors and exhausted retries, gcsfs's HTTP
    errors, aiohttp's and requests' connection errors, a resumable upload that the store lost)
    or tensorstore's report of a failed gs:// request."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        module = type(error).__module__ or ""
        text = str(error)
        if module.startswith(("google.api_core", "google.auth", "gcsfs", "aiohttp")):
            return True
        if module.startswith(("requests", "urllib3")) and isinstance(error, OSError):
            return True
        if isinstance(error, FileNotFoundError) and "/upload/storage/v1/" in text:
            return True  # gcsfs: the store forgot a resumable upload (it restarted)
        if "gs://" in text and any(m in text for m in ("UNAVAILABLE", "DEADLINE_EXCEEDED")):
            return True  # tensorstore
        error = error.__cause__ or error.__context__
    return False


def unreachable_message(urls: list[str], error: BaseException) -> str:
    """The one-line error of a command whose object store (the buckets of ``urls``) did not
    answer or refused a request: which buckets, and that rerunning the same command is safe (a
    save that did not commit is not a step; a training run resumes from its last committed
    one)."""
    buckets = sorted({u.split("://", 1)[1].split("/", 1)[0] for u in urls if is_remote(u)})
    first = " ".join(str(error).split())[:300]
    return (
        f"the object store failed a request ({type(error).__name__}: {first}); check that "
        f"bucket{'s' if len(buckets) > 1 else ''} {', '.join(map(repr, buckets))} "
        "can be reached and written from this machine, then rerun the same command: nothing "
        "committed was lost, and a training run resumes from its last committed checkpoint"
    )
