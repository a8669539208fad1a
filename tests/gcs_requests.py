"""The HTTP requests of checkpoints on gs://, counted at the GCS emulator (tests/gcs_emulator.py):
one `Checkpoints` save (the first of a process, with the manager's set-up, then a second one),
and one restore in a new process (`restore_latest`: the steps listed, the checksums checked,
the arrays read), of the small TrainState of tests/training/test_checkpoints.py. Each is
measured with gcsfs's listing cache off (as `mars_jax.storage` sets it: every listing asks the
store) and on (gcsfs's default, what mars-jax did before), side by side:

    python -m tests.gcs_requests --repeats=3

prints a Markdown table of the medians (docs/reliability.md#workdirs-in-a-bucket shows it): the
counts vary from run to run, as Orbax's and tensorstore's threads interleave. Each part runs in
its own process; requests are counted from the emulator's log once it has been quiet for 0.3 s.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.gcs_emulator import GcsEmulator, settled_requests
from tests.helpers import ROOT, python_env

BUCKET = "requests"
KINDS = ("list", "metadata", "download", "upload", "delete", "other")


def kind(method: str, path: str) -> str:
    """Which of KINDS a JSON-API request of the emulator's log is."""
    route = path.split("?", 1)[0]
    if method == "DELETE":
        return "delete"
    if route.startswith("/upload/") or (method == "PUT" and "upload_id=" in path):
        return "upload"
    if method != "GET":
        return "other"
    if route.startswith("/download/") or "alt=media" in path:
        return "download"
    if route.endswith("/o"):
        return "list"
    return "metadata" if "/o/" in route else "other"


def tally(requests: list[tuple[str, str]]) -> dict[str, int]:
    counts = collections.Counter(kind(m, p) for m, p in requests)
    return {"total": len(requests), **{k: counts[k] for k in KINDS}}


def worker(part: str, cache: bool, workdir: str, log: Path) -> dict[str, dict[str, int]]:
    """Runs ``part`` ("save" or "restore") in this process; the requests of each of its steps."""
    import fsspec

    from mars_jax import storage  # noqa: F401 (sets fsspec's gcs configuration)

    if cache:  # gcsfs's default, as before mars_jax.storage turned the cache off
        for protocol in ("gs", "gcs"):
            fsspec.config.conf[protocol]["use_listings_cache"] = True
    from mars_jax.checkpoints import Checkpoints
    from tests.training.test_checkpoints import abstract, tiny_state

    out, before = {}, len(settled_requests(log))
    if part == "save":
        with Checkpoints(workdir, writer=True) as checkpoints:
            for step, name in ((1, "first save"), (2, "second save")):
                checkpoints.save(step, tiny_state(step))
                checkpoints.wait_until_finished()
                now = settled_requests(log)
                out[name], before = tally(now[before:]), len(now)
    else:
        with Checkpoints(workdir) as reader:
            state, step = reader.restore_latest(abstract(tiny_state(0)))
        assert step == 2 and state.data_position == 20, (step, state.data_position)
        out["restore"] = tally(settled_requests(log)[before:])
    return out


def measure_once(cache: str) -> dict[str, dict[str, int]]:
    """{part: its tally} with the listing cache ``cache`` ("off" or "on"): each part in a new
    process, on an emulator of its own."""
    with tempfile.TemporaryDirectory(prefix="gcs_requests_") as tmp:
        emulator = GcsEmulator(Path(tmp) / "gcs")
        emulator.start()
        try:
            emulator.create_bucket(BUCKET)
            out = {}
            for part in ("save", "restore"):
                proc = subprocess.run(
                    [sys.executable, "-m", "tests.gcs_requests", f"--worker={part}"]
                    + [f"--cache={cache}", f"--workdir=gs://{BUCKET}/run", f"--log={emulator.log}"],
                    cwd=ROOT,
                    env=python_env(**emulator.env),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"the {part} worker failed:\n{proc.stderr[-3000:]}")
                out.update(json.loads(proc.stdout.splitlines()[-1]))
            return out
        finally:
            emulator.stop()


def measure(repeats: int) -> dict[str, list[dict[str, dict[str, int]]]]:
    """{"off" / "on": a `measure_once` a repeat}, one at a time (run together they slow each
    other down, and a slowed save or restore makes more requests)."""
    return {cache: [measure_once(cache) for _ in range(repeats)] for cache in ("off", "on")}


def table(results) -> str:
    """``results`` of `measure` as a Markdown table, a row per part and cache setting: the
    median of each count over the repeats, and the range of the total."""
    lines = [
        "| part | listing cache | requests | range | " + " | ".join(KINDS) + " |",
        "|---|---|---:|---:|" + "---:|" * len(KINDS),
    ]
    for part in results["off"][0]:
        for cache, label in (("off", "off (now)"), ("on", "on (before)")):
            rows = [r[part] for r in results[cache]]
            median = {k: round(statistics.median(r[k] for r in rows)) for k in rows[0]}
            totals = [r["total"] for r in rows]
            cells = [part, label, str(median["total"]), f"{min(totals)}-{max(totals)}"]
            lines.append("| " + " | ".join(cells + [str(median[k]) for k in KINDS]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each part")
    parser.add_argument("--worker", choices=("save", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--cache", choices=("off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache == "on", args.workdir, args.log)))
        return
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: at least 1")
    print(table(measure(args.repeats)))


if __name__ == "__main__":
    main()
