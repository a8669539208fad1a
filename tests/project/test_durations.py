"""The test files' order (tests/durations.py): the per-file seconds read from pytest's
``--durations`` report, files ordered heaviest first with each file's tests in their order, and
tests/durations.json naming only files that exist."""

import os
import types

from tests import durations

REPORT = """\
============================= slowest durations ==============================
114.20s call     tests/project/test_documented_commands.py::test_command_runs[smollm2_gsm8k]
3.50s setup    tests/decoding/test_engine.py::test_one[a-1]
0.75s call     tests/decoding/test_engine.py::test_one[a-1]
0.05s teardown tests/decoding/test_engine.py::test_two
12.00s call     tests/base/test_storage.py::TestGcs::test_put
(2376 durations < 0.005s hidden.  Use -vv to show these durations.)
999 passed, 5 warnings in 1703.24s (0:28:23)
"""


def test_seconds_are_summed_per_file_heaviest_first():
    seconds = durations.file_seconds(REPORT.splitlines())
    assert list(seconds) == [
        "tests/project/test_documented_commands.py",
        "tests/base/test_storage.py",
        "tests/decoding/test_engine.py",
    ]
    assert seconds["tests/decoding/test_engine.py"] == 4.3  # setup, call and teardown


def test_files_run_heaviest_first_and_keep_their_tests_order():
    ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t", "tests/b.py::t2"]
    items = [types.SimpleNamespace(nodeid=i) for i in ids]
    weights = {"tests/b.py": 9.0, "tests/a.py": 2.0}  # c.py unlisted: 0, last
    ordered = [i.nodeid for i in durations.heaviest_first(items, weights)]
    assert ordered == [
        "tests/b.py::t1",
        "tests/b.py::t2",
        "tests/a.py::t1",
        "tests/a.py::t2",
        "tests/c.py::t",
    ]


def test_the_committed_weights_name_existing_files():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    weights = durations.load()
    assert weights, "tests/durations.json is missing or empty"
    missing = [f for f in weights if not os.path.exists(os.path.join(root, f))]
    assert not missing, f"tests/durations.json names files that no longer exist: {missing}"
