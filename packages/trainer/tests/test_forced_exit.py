"""The stop grace's forced exit (issue 59, item 5): with the main thread stuck for good, a
SIGTERM still ends the process within the grace and its last words' deadlines, with the
documented status, the one line of where ``--resume auto`` continues, and every last word
called, one that hangs included."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from drivetrain.trainer.forced_exit import LAST_WORD_S
from drivetrain.trainer.stopping import exit_status

GRACE_S = 1.0

CHILD = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path

    from drivetrain.trainer.forced_exit import on_forced_exit
    from drivetrain.trainer.stopping import StopSignals

    marker = Path(sys.argv[1])
    where = "3 steps done; --resume auto continues from step 3 (/out/step_00000003)"
    with (
        StopSignals(grace_s=float(sys.argv[2]), checkpoint_on_interrupt=True, where=lambda: where),
        on_forced_exit(lambda: marker.write_text("closed")),
        on_forced_exit(lambda: threading.Event().wait()),  # newest: called first, and hangs
    ):
        print("unflushed stdout", end="")  # a pipe: block-buffered, only a flush writes it
        print("ready", file=sys.stderr, flush=True)
        threading.Event().wait()  # the step that never ends
    """
)


def _wait_for_line(stream, deadline: float) -> str:
    """The first line on ``stream``, waiting until ``deadline`` (monotonic) at most."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=deadline - time.monotonic()):
                return stream.readline()
    raise AssertionError("the child never said it was ready")


@pytest.mark.fault
@pytest.mark.serial  # a deadline measured in seconds
@pytest.mark.timeout(120)
def test_the_grace_exit_says_where_runs_the_last_words_and_exits_on_time(tmp_path: Path):
    marker = tmp_path / "closed"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker), str(GRACE_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    )
    try:
        assert _wait_for_line(child.stderr, time.monotonic() + 60) == "ready\n"
        signalled = time.monotonic()
        child.send_signal(signal.SIGTERM)
        budget = GRACE_S + LAST_WORD_S * 3 + 5  # the grace, the hung word, the flushes; slack
        out, err = child.communicate(timeout=budget)
        took = time.monotonic() - signalled
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == exit_status(signal.SIGTERM) == 143, err
    assert GRACE_S <= took < budget
    assert marker.read_text() == "closed"  # called although the one before it hangs
    assert out == "unflushed stdout"
    assert err.strip() == (
        "stopped by SIGTERM (run.stop_grace_s=1 passed), no new checkpoint: 3 steps done; "
        "--resume auto continues from step 3 (/out/step_00000003)"
    )
