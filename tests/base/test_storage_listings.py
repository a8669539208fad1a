"""gs:// paths as other processes change them, against the GCS emulator (tests/gcs_emulator.py):
a process that has listed a directory sees objects another process writes or deletes there
afterwards (gcsfs would otherwise answer from its listing cache, which never expires); gcsfs's
warning that it could not tell a bucket's type is logged once a process, not once a call; and the
HTTP requests of a checkpoint save and restore (tests/gcs_requests.py) stay what
docs/reliability.md says.
"""

import subprocess
import sys
import uuid

import pytest

from mars_jax import storage
from tests.gcs_emulator import serving
from tests.helpers import ROOT, python_env

BUCKET = "listings"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator, with this process's clients pointed at it and bucket ``listings``."""
    with serving(tmp_path_factory.mktemp("gcs"), BUCKET) as emulator:
        yield emulator


def in_another_process(gcs, code: str, env=None) -> subprocess.CompletedProcess:
    """``code`` run by a new Python process (``storage`` imported) pointed at the emulator."""
    proc = subprocess.run(
        [sys.executable, "-c", "from mars_jax import storage\n" + code],
        cwd=ROOT,
        env=env or python_env(**gcs.env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_listing_sees_what_another_process_wrote_and_deleted(gcs):
    root = f"gs://{BUCKET}/shared-{uuid.uuid4().hex[:8]}"
    a, b, c = (storage.join(root, n) for n in ("a.txt", "b.txt", "sub/c.txt"))
    storage.write_text(a, "from A")
    # This process looks first (what gcsfs would cache) ...
    assert storage.listdir(root) == ["a.txt"]
    assert storage.files_under(root) == ["a.txt"]
    assert not storage.exists(b) and not storage.isdir(storage.join(root, "sub"))
    assert [p.name for p in storage.Path(root).iterdir()] == ["a.txt"]
    with pytest.raises(FileNotFoundError):
        storage.read_text(b)
    # ... then another process writes there: seen here at once.
    in_another_process(gcs, f"storage.write_text({b!r}, 'from B')\nstorage.write_text({c!r}, 'c')")
    assert storage.listdir(root) == ["a.txt", "b.txt", "sub"]
    assert storage.files_under(root) == ["a.txt", "b.txt", "sub/c.txt"]
    assert storage.exists(b) and storage.isfile(b) and storage.isdir(storage.join(root, "sub"))
    assert storage.read_text(b) == "from B" and storage.read_text(c) == "c"
    assert sorted(p.name for p in storage.Path(root).iterdir()) == ["a.txt", "b.txt", "sub"]
    # Deletions and a replaced object, likewise.
    in_another_process(
        gcs,
        f"storage.remove_tree({storage.join(root, 'sub')!r})\n"
        f"storage.Path({a!r}).unlink()\nstorage.write_text({b!r}, 'B again')",
    )
    assert storage.listdir(root) == ["b.txt"]
    assert storage.files_under(root) == ["b.txt"]
    assert not storage.exists(a) and not storage.isdir(storage.join(root, "sub"))
    assert storage.read_text(b) == "B again"
    with pytest.raises(FileNotFoundError):
        storage.read_text(a)


def test_the_bucket_type_warning_is_logged_once_a_process(gcs, tmp_path):
    """Without Application Default Credentials (an emulator) and with gcsfs's bucket-type probe
    on (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset), gcsfs fails the probe at every call and logs
    'Could not determine bucket type ... default credentials were not found' each time: 60
    calls here log it once."""
    env = python_env(
        **{**gcs.env, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": None},
        GOOGLE_APPLICATION_CREDENTIALS=None,
        CLOUDSDK_CONFIG=str(tmp_path),  # no gcloud credentials either
        NO_GCE_CHECK="True",  # nor a metadata server
    )
    root = f"gs://{BUCKET}/probe-{uuid.uuid4().hex[:8]}"
    code = (
        "import logging\n"
        "for i in range(10):\n"
        f"    path = storage.join({root!r}, f'{{i}}.txt')\n"
        "    storage.write_text(path, str(i))\n"
        "    assert storage.exists(path) and storage.read_text(path) == str(i)\n"
        f"    assert len(storage.listdir({root!r})) == i + 1\n"
        f"    assert len(storage.files_under({root!r})) == i + 1\n"
        "    storage.checksum(path)\n"
        "logging.getLogger('gcsfs').warning('another warning')\n"
    )
    stderr = in_another_process(gcs, code, env).stderr
    warnings = [line for line in stderr.splitlines() if "Could not determine bucket type" in line]
    assert len(warnings) == 1, f"{len(warnings)} warnings:\n{stderr[-3000:]}"
    assert "default credentials were not found" in warnings[0]
    assert stderr.count("another warning") == 1  # gcsfs's other warnings pass


@pytest.mark.slow
@pytest.mark.subprocess
def test_requests_of_a_checkpoint_save_and_restore():
    """`python -m tests.gcs_requests --repeats=1` (docs/reliability.md shows its table): with the
    listing cache off, a save makes about the same requests (Orbax lists little while saving)
    and a restore more, where the cache had answered Orbax's repeated existence checks."""
    from tests import gcs_requests

    results = gcs_requests.measure(1)
    lines = gcs_requests.table(results).splitlines()
    parts = ["first save", "second save", "restore"]
    assert [line.split(" | ")[:2] for line in lines[2:]] == [
        [f"| {p}", c] for p in parts for c in ("off (now)", "on (before)")
    ]
    off, on = results["off"][0], results["on"][0]
    for part in parts:
        for r in (off[part], on[part]):
            assert r["total"] == sum(r[k] for k in gcs_requests.KINDS), r
    for part in ("first save", "second save"):
        assert off[part]["upload"] >= 10 and off[part]["delete"] >= 1, off[part]
        assert 0.7 <= off[part]["total"] / on[part]["total"] <= 1.4, (off[part], on[part])
    assert off["restore"]["upload"] == on["restore"]["upload"] == 0
    assert off["restore"]["download"] == on["restore"]["download"] >= 3
    # 1.3 to 2.0 in docs/reliability.md's measurements
    assert 1.1 <= off["restore"]["total"] / on["restore"]["total"] <= 2.5, (off, on)
