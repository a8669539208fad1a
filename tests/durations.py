"""The order test files run in: heaviest first, from the seconds each took in the last full run
(``tests/durations.json``), so that pytest-xdist's ``--dist loadfile`` workers end together
instead of one waiting on the last long file (longest-processing-time-first scheduling).

Refresh the weights after a full run that printed every duration:

  python -m pytest -q -n 2 --dist loadfile --durations=0 tests > run.log
  python -m tests.durations run.log

A file that is not listed weighs 0 (it runs after the listed ones); tests within a file keep
their order.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from typing import Iterable

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/[^:\s]+\.py)::")


def file_seconds(lines: Iterable[str]) -> dict[str, float]:
    """{test file: seconds} summed over the setup, call and teardown lines of pytest's
    ``--durations`` report, heaviest first."""
    seconds: collections.Counter = collections.Counter()
    for line in lines:
        m = _LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in seconds.most_common()}


def heaviest_first(items: list, weights: dict[str, float]) -> list:
    """``items`` (pytest items) ordered by their file's weight, heaviest first; stable."""
    weight = lambda item: weights.get(item.nodeid.split("::")[0], 0.0)
    return sorted(items, key=lambda item: -weight(item))


def load(path: str = PATH) -> dict[str, float]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m tests.durations PYTEST_LOG (run with --durations=0)")
    with open(argv[1]) as f:
        seconds = file_seconds(f)
    if not seconds:
        raise SystemExit(f"{argv[1]}: no duration lines (run pytest with --durations=0)")
    with open(PATH, "w") as f:
        json.dump(seconds, f, indent=1)
        f.write("\n")
    print(f"{PATH}: {len(seconds)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv)
