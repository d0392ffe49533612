"""The colocated transport's shared-memory segments never outlive their run: a sender killed
with SIGKILL (its whole process group, as a cluster manager does) leaves segments that the next
``prepare`` on the machine unlinks; a live sender's segments are never touched; a normal
close, an unhandled exception and SIGTERM leave nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from drivetrain.ckpt.colocated import ColocatedTransport
from drivetrain.ckpt.config import ColocatedConfig

pytestmark = [
    pytest.mark.fault,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm"),
]
SHM = Path("/dev/shm")
CONFIG = {"bucket_bytes": 1 << 20, "device": "cpu", "timeout_s": 10.0}

# prepare as a sender, print the segments' names, then do what argv[1] says
SENDER = """
import json, sys
from drivetrain.ckpt.colocated import ColocatedTransport
from drivetrain.ckpt.config import ColocatedConfig
transport = ColocatedTransport(ColocatedConfig(**json.loads(sys.argv[2])))
print(json.dumps(transport.prepare()["segments"]), flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the run failed")
sys.stdin.read()  # "wait": until killed
"""


def start_sender(mode: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, mode, json.dumps(CONFIG)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group: killed as a unit, like a Ray worker
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.kill()
        pytest.fail(f"the sender process failed (rc={proc.wait(timeout=30)})")
    return proc, json.loads(line)


def existing(names: list[str]) -> list[str]:
    return [name for name in names if (SHM / name.lstrip("/")).exists()]


@pytest.fixture
def cleanup():
    """Unlink whatever a failing test leaves behind (never another run's segments)."""
    created: list[str] = []
    yield created
    for name in existing(created):
        (SHM / name.lstrip("/")).unlink()


@pytest.mark.timeout(90)
@pytest.mark.serial  # another test's sender would reap these segments before we look
def test_segments_of_a_killed_sender_are_reaped_by_the_next_prepare(cleanup):
    killed, killed_segments = start_sender("wait")
    alive, alive_segments = start_sender("wait")
    cleanup += killed_segments + alive_segments
    try:
        assert existing(killed_segments) == killed_segments
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert existing(killed_segments) == killed_segments  # SIGKILL: nothing ran at death
        transport = ColocatedTransport(ColocatedConfig(**CONFIG))
        mine = transport.prepare()["segments"]
        cleanup += mine
        assert existing(killed_segments) == []  # reaped: its owner is dead
        assert existing(alive_segments) == alive_segments  # a live run's are never touched
        transport.finalize()
        assert existing(mine) == []
    finally:
        for proc in (killed, alive):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.timeout(60)
def test_an_unhandled_exception_leaves_no_segment(cleanup):
    proc, segments = start_sender("raise")
    cleanup += segments
    assert proc.wait(timeout=30) == 1
    assert existing(segments) == []


@pytest.mark.timeout(60)
def test_sigterm_leaves_no_segment_and_still_terminates(cleanup):
    proc, segments = start_sender("wait")
    cleanup += segments
    assert existing(segments) == segments
    proc.terminate()  # the process only, not its group
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default outcome, after cleaning up
    assert existing(segments) == []


def test_finalize_leaves_no_segment(cleanup):
    transport = ColocatedTransport(ColocatedConfig(**CONFIG))
    segments = transport.prepare()["segments"]
    cleanup += segments
    assert existing(segments) == segments
    cleanup += transport.prepare()["segments"]  # reconnecting: the first pair goes
    assert existing(segments) == []
    transport.finalize()
    assert existing(segments) == []
