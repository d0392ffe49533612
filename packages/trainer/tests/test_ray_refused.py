"""Joining a Ray cluster that refuses fails in one line within ``workers.start_timeout_s``
(issue 59, item 5), where ``ray.init`` alone retries for minutes. No Ray is started here:
``ray.init`` is replaced, and a call to it where the address refuses fails the test."""

from __future__ import annotations

import socket
import time

import pytest

from drivetrain.trainer.errors import WorkerError
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.workers.ray_runtime import ensure_ray

ray = pytest.importorskip("ray")

START_TIMEOUT_S = 3.0


def _free_port() -> int:
    """A loopback port nothing listens on (bound for a moment by this process, then freed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """``ray.init`` recorded instead of run; Ray taken as not started in this process."""
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.mark.fault
@pytest.mark.serial  # a deadline measured in seconds
@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["workers.ray_address", "RAY_ADDRESS"])
def test_a_refused_cluster_fails_in_one_line_within_the_start_timeout(
    monkeypatch: pytest.MonkeyPatch, no_ray: list[dict], via: str
):
    address = f"127.0.0.1:{_free_port()}"
    if via == "RAY_ADDRESS":  # "auto" joins the cluster the environment names, as Ray does
        monkeypatch.setenv("RAY_ADDRESS", address)
    workers = WorkersConfig(
        ray_address="auto" if via == "RAY_ADDRESS" else address, start_timeout_s=START_TIMEOUT_S
    )
    began = time.monotonic()
    with pytest.raises(WorkerError) as failed:
        ensure_ray(workers)
    took = time.monotonic() - began
    assert START_TIMEOUT_S <= took < START_TIMEOUT_S + 3  # retried until, and not past, it
    message = str(failed.value)
    assert "\n" not in message
    assert address in message and "workers.start_timeout_s=3" in message
    assert "ray status" in message and "RAY_ADDRESS" in message
    assert not no_ray  # ray.init never reached


@pytest.mark.timeout(60)
def test_a_cluster_that_answers_is_joined(monkeypatch: pytest.MonkeyPatch, no_ray: list[dict]):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as head:  # takes connections into its backlog: all the probe needs
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"ray://127.0.0.1:{head.getsockname()[1]}"  # Ray Client's form
        ensure_ray(WorkersConfig(ray_address=address, start_timeout_s=START_TIMEOUT_S))
    assert [call["address"] for call in no_ray] == [address]
