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

Tests point every client at a GCS emulator on 127.0.0.1 (``STORAGE_EMULATOR_HOST``; tensorstore,
which writes Orbax's arrays, by ``TENSORSTORE_GCS_HTTP_URL``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath

from mars_jax.errors import InputError, NotFound


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
    return Path(path).exists()


def isdir(path) -> bool:
    return Path(path).is_dir()


def isfile(path) -> bool:
    return Path(path).is_file()


def makedirs(path) -> None:
    """Creates directory ``path`` and its parents (object stores have no directories: nothing
    is written there)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def read_text(path) -> str:
    return Path(path).read_text()


def read_bytes(path) -> bytes:
    return Path(path).read_bytes()


def write_bytes(path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that no reader sees part of it: a local file through a
    temporary file renamed over it, an object in one upload."""
    if is_remote(path):
        Path(path).write_bytes(data)
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("wb", dir=directory, delete=False) as f:
        f.write(data)
    try:
        os.chmod(f.name, 0o666 & ~_umask())
        os.replace(f.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(f.name)
        raise


def write_text(path, text: str) -> None:
    """`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def checksum(path) -> str:
    """A digest of file ``path`` that changes when its bytes do: ``sha256:<hex>`` of a local
    file (read once), ``crc32c:<base64>`` of an object as its store computed it on upload
    (nothing downloaded); ``md5:`` or, failing both, ``sha256:`` of the bytes for stores
    without crc32c."""
    if is_remote(path):
        info = _info(path)
        for key, name in (("crc32c", "crc32c"), ("md5Hash", "md5")):
            if info.get(key):
                return f"{name}:{info[key]}"
        return "sha256:" + hashlib.sha256(read_bytes(path)).hexdigest()
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def _info(path) -> dict:
    import fsspec

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


def move_tree(source, target) -> None:
    """Moves directory ``source`` to ``target``: a rename on a local disk, a copy of every object
    and then the deletion of the source in an object store (not atomic: an interrupted move
    leaves both, the source whole)."""
    if not is_remote(source) and not is_remote(target):
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        shutil.move(source, target)
        return
    for rel in files_under(source):
        Path(join(target, rel)).write_bytes(Path(join(source, rel)).read_bytes())
    remove_tree(source)


def copy_tree(source, target) -> None:
    """Copies every file under directory ``source`` to ``target`` (either kind)."""
    for rel in files_under(source):
        data = Path(join(source, rel)).read_bytes()
        if not is_remote(target):
            os.makedirs(os.path.dirname(join(target, rel)), exist_ok=True)
        Path(join(target, rel)).write_bytes(data)


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
        for rel in files_under(path) if names is None else names:
            if names is None or exists(join(path, rel)):
                os.makedirs(os.path.dirname(join(tmp, rel)), exist_ok=True)
                with open(join(tmp, rel), "wb") as f:
                    f.write(read_bytes(join(path, rel)))
        try:
            yield tmp
        except Exception as e:
            e.args = tuple(
                a.replace(tmp, os.fspath(path)) if isinstance(a, str) else a for a in e.args
            )
            raise


# Object generations as preconditions (gs:// only; local files use open(..., "x") and unlink).


def _blob(path: str):
    from google.cloud import storage

    bucket, _, name = os.fspath(path).removeprefix("gs://").partition("/")
    return storage.Client().bucket(bucket).blob(name)


def _require_gcs(path: str) -> None:
    if not os.fspath(path).startswith("gs://"):
        raise InputError(f"{path}: exclusive create needs a local path or gs:// (not this store)")


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
        raise FileExistsError(path) from None
    return int(blob.generation)


def delete_if_unchanged(path, generation: int) -> bool:
    """Deletes ``path`` only if it is still at ``generation``; returns whether it did."""
    if not is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_mtime_ns == generation:
                os.unlink(path)
                return True
        return False
    _require_gcs(path)
    from google.api_core import exceptions

    blob = _blob(path)
    try:
        blob.reload()  # checked here too: not every GCS emulator applies the precondition
        if int(blob.generation) != generation:
            return False
        blob.delete(if_generation_match=generation)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
        return False
    return True


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) is an object store that did not
    answer: a refused or dropped connection, a timeout, or a request that failed after its
    client's retries (gcsfs, google-cloud-storage, tensorstore)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        name = type(error).__name__
        if name in ("RetryError", "ServiceUnavailable", "ClientConnectorError", "ClientOSError"):
            return True
        text = str(error)
        if any(m in text for m in ("UNAVAILABLE", "Connection refused", "DEADLINE_EXCEEDED")):
            return True
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
