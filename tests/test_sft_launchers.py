"""The same SFT job in-process, under torchrun and on Ray gives the same loss curve (fp32)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sft_support import make_job, run_sft, sft_env, train_losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("launchers")
    base = make_job(root)
    out = root / "inprocess"
    run_sft(root, out, *base)
    return root, base, train_losses(out)


def assert_same_curve(reference: dict[int, float], other: dict[int, float]) -> None:
    assert list(other) == list(reference) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert other[step] == pytest.approx(loss, abs=1e-5), (step, reference, other)
    assert reference[6] < reference[1]  # it trains


def test_torchrun_two_ranks(job):
    root, base, reference = job
    run_sft(root, root / "torchrun", *base, nproc=2)
    assert_same_curve(reference, train_losses(root / "torchrun"))


@pytest.mark.slow  # a local Ray cluster's start: 30 s
def test_ray_two_actors_local(job):
    root, base, reference = job
    run_sft(root, root / "ray", *base, "workers.num=2")
    assert_same_curve(reference, train_losses(root / "ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(job):
    """A Ray cluster started the way users start one, on loopback, joined by address.

    Stopped by signalling its own head process: `ray stop` would kill every Ray process on the
    machine, other jobs' included."""
    root, _, _ = job
    env = sft_env(root)
    port = free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="rt_", dir="/tmp"))  # unix sockets: <= 107 bytes
    start = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={port}",
        f"--ray-client-server-port={free_port()}", "--dashboard-agent-listen-port=0",
        "--include-dashboard=false", "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]  # fmt: skip
    log = open(temp_dir / "head.log", "w")  # noqa: SIM115 - closed below
    head = subprocess.Popen(
        start, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        ready = temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert head.poll() is None, (temp_dir / "head.log").read_text()
            assert time.monotonic() < deadline, "the Ray head did not come up in 120 s"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # workers share the head's session
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow  # a Ray head's start and two actors: 30-37 s
def test_ray_two_actors_on_an_existing_cluster(job, ray_head):
    root, base, reference = job
    run_sft(root, root / "ray-cluster", *base, "workers.num=2", f"workers.ray_address={ray_head}")
    assert_same_curve(reference, train_losses(root / "ray-cluster"))
