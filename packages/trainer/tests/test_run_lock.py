"""``run_lock.owning``: one writing run per output directory, released when its holder ends,
however it ends; refusals in one line naming the holder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from drivetrain.trainer.errors import RunDirectoryError
from drivetrain.trainer.run_lock import lock_path, owning

pytestmark = pytest.mark.fault


def test_a_second_owner_is_refused_in_one_line_naming_the_first(tmp_path):
    out = tmp_path / "run"
    with owning(out, writer=True):
        with pytest.raises(RunDirectoryError) as refused, owning(out, writer=True):
            pass
        message = str(refused.value)
        assert "\n" not in message and "is in use by another run" in message
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message
        with owning(out, writer=False):  # other ranks take no lock
            pass
    with owning(out, writer=True):  # released at the end of the body
        pass
    assert lock_path(out) == tmp_path / ".run.lock" and not out.exists()


def test_a_killed_holder_releases_the_directory(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from drivetrain.trainer.run_lock import owning
            with owning(Path({str(out)!r}), writer=True):
                print("held", flush=True)
                time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(RunDirectoryError, match=f"pid {holder.pid} on"),
            owning(out, writer=True),
        ):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with owning(out, writer=True):
        pass


def test_a_name_too_long_is_one_line(tmp_path):
    with (
        pytest.raises(RunDirectoryError, match="its name is too long"),
        owning(tmp_path / ("r" * 300), writer=True),
    ):
        pass
