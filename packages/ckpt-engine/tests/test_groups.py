"""The broadcast transport's group: a participant's abort reaches a peer blocked in a
collective within seconds through the store alone (the aborting side keeps its connections
open here, as an NCCL peer would), and deadlines grow with the bytes a wait covers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from drivetrain.api.config import WeightSyncConfig
from drivetrain.ckpt import groups

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

# rank 1: join, then wait for a broadcast rank 0 never sends, with a deadline far away
PEER = """
import json, sys, time
import torch
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.ckpt import groups
store = groups.client_store("127.0.0.1", int(sys.argv[1]), 30.0)
group = groups.Group("gloo", store, 1, 2, 300.0)
group.all_reduce_max(torch.zeros(1), 30.0)
start = time.monotonic()
try:
    group.wait(group.broadcast(torch.zeros(4), 0), 300.0)
    outcome = "received"
except WeightSyncError as exc:
    outcome = str(exc)
print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start}), flush=True)
group.shut_down(abort=True)  # as the transport does; returns once rank 0 closed its side
"""


@pytest.mark.timeout(90)
def test_an_abort_reaches_a_peer_blocked_in_a_collective_in_seconds():
    store = groups.master_store("127.0.0.1", 0, 30.0)
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(store.port)],
        stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
    )
    try:
        group = groups.Group("gloo", store, 0, 2, 300.0)
        group.all_reduce_max(torch.zeros(1), 30.0)  # the peer has joined
        group.abort("the trainer gave up")  # the key only: our connections stay open
        report = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
        # as the transport does after an abort: closing our side ends the peer's pending
        # operation, so it can exit (gloo would otherwise hold it until the op times out)
        group.shut_down(abort=True)
        assert peer.wait(timeout=30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
    assert "a peer aborted the weight sync: the trainer gave up" in report["outcome"]
    assert report["seconds"] < 5  # the key is looked at every ABORT_POLL_S, not at 300 s


def test_deadlines_grow_with_the_bytes_moved():
    config = WeightSyncConfig(timeout_s=30.0, min_gb_per_s=0.1)
    assert config.deadline_s(0) == 30.0
    assert config.deadline_s(10**9) == pytest.approx(40.0)
    assert WeightSyncConfig().deadline_s(16 * 10**9) == pytest.approx(60.0 + 320.0)
