"""Files that could run code are refused before anything in them runs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from drivetrain.runtime.untrusted import DCP_METADATA_GLOBALS, UnsafeFileError, check_pickle

pytestmark = pytest.mark.fault


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_a_command_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps({"storage": RunsACommand(marker)}))
    with pytest.raises(UnsafeFileError, match=r"refers to (posix|os)\.system"):
        check_pickle(bad, DCP_METADATA_GLOBALS)
    assert not marker.exists()
    # the same bytes *do* run the command when unpickled: the test's pickle is a real attack
    subprocess.run(
        [sys.executable, "-c", f"import pickle; pickle.load(open({str(bad)!r}, 'rb'))"], check=True
    )
    assert marker.exists()


def test_plain_data_and_garbage(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(pickle.dumps({"a": [1, 2.5, "x", None, (True,)]}))
    check_pickle(plain, frozenset())
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(UnsafeFileError, match="not a readable pickle"):
        check_pickle(garbage, DCP_METADATA_GLOBALS)
