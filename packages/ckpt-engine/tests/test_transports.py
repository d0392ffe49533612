"""What the transport kit (``test_transport_kit.py``: whole syncs, destinations, a failing
source, a dead receiver) does not cover: an unsupported device refused by name, the disk
receiver's version order, the broadcast store's host. ``Receivers`` and
``transport_worker.py`` also serve the GPU tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.weight_sync import Topology, TransportRole, WeightSyncError
from drivetrain.ckpt.buckets import digest_of
from weights_for_tests import make_weights

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("transport_worker.py")
TRANSPORTS = ["broadcast", "colocated", "disk"]


def make_transport(name: str, **overrides):
    config_class = ckpt_engines.load_config_class(name, WeightSyncConfig)
    config = {"bucket_bytes": 4096, "timeout_s": 20.0, "verify": True, "device": "cpu"}
    config.update(overrides)
    return ckpt_engines.load(name)(config_class(**config)), config


class Receivers:
    """Receiver processes, each with its own result file."""

    def __init__(self, tmp_path, name, config, endpoint, topology, versions, die_after=None):
        self.procs, self.outs = [], []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for rank in topology.receivers:
            out = tmp_path / f"rank{rank}.jsonl"
            spec = tmp_path / f"rank{rank}.json"
            spec.write_text(
                json.dumps(
                    {
                        "transport": name,
                        "config": config,
                        "rank": rank,
                        "senders": list(topology.senders),
                        "receivers": list(topology.receivers),
                        "endpoint": dict(endpoint),
                        "versions": versions,
                        "die_after": die_after if rank == topology.receivers[-1] else None,
                        "out": str(out),
                    }
                )
            )
            self.outs.append(out)
            self.procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env))

    def results(self, timeout=60):
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        return [
            [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            for out in self.outs
        ], [p.returncode for p in self.procs]

    def kill(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("device", ["xpu", "tpu", "banana"])
def test_unsupported_device_is_refused_by_name(name, device):
    transport, _ = make_transport(name, device=device)
    with pytest.raises(
        WeightSyncError, match=r"cpu \(gloo\).*cuda \(nccl\).*npu \(hccl\)|not a device"
    ):
        transport.prepare() if name != "disk" else transport.connect(
            TransportRole.SENDER, 0, Topology.one_sender(1), transport.prepare()
        )
    transport.finalize()


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    transport, _ = make_transport("broadcast", device="cuda")
    with pytest.raises(WeightSyncError, match="CUDA is not available"):
        transport.prepare()


def test_disk_receiver_takes_versions_in_order_even_when_it_looks_late(tmp_path):
    """A receiver that first looks after the sender aborted v1 *and* published v2 still
    reports v1's abort for that sync, then receives v2 (found by CI under load)."""
    import threading

    from drivetrain.ckpt.config import DiskConfig
    from drivetrain.ckpt.disk import DiskTransport

    config = DiskConfig(
        path=str(tmp_path), bucket_bytes=4096, timeout_s=20.0, device="cpu", verify=True
    )
    sender, receiver = DiskTransport(config), DiskTransport(config)
    topology = Topology.one_sender(1)
    endpoint = sender.prepare()
    receiver.connect(TransportRole.RECEIVER, 1, topology, endpoint)
    sender.connect(TransportRole.SENDER, 0, topology, endpoint)

    def broken():
        yield from make_weights(1)[:3]
        raise RuntimeError("export failed")

    with pytest.raises(WeightSyncError):
        sender.send(broken(), version=1)
    sent = []
    thread = threading.Thread(
        target=lambda: sent.append(sender.send(iter(make_weights(2)), version=2))
    )
    thread.start()
    deadline = time.monotonic() + 20
    while not list(tmp_path.glob("session-*/v00000002")):  # v2 is out before the receiver looks
        assert time.monotonic() < deadline, "v2 was never published"
        time.sleep(0.01)
    with pytest.raises(WeightSyncError, match="aborted version 1"):
        list(receiver.receive())
    got = [(name, tensor.clone()) for name, tensor in receiver.receive()]
    thread.join(timeout=20)
    assert digest_of(got) == digest_of(make_weights(2)) == sent[0].digest
    sender.finalize()
    receiver.finalize()


def listening_hosts(port: int) -> list[str]:
    """Local addresses of the listening TCP sockets on ``port`` (from /proc/net/tcp*)."""
    hosts = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                if len(address) == 8:  # IPv4, little-endian
                    hosts.append(".".join(str(b) for b in bytes.fromhex(address)[::-1]))
                else:
                    hosts.append(f"[{address}]")
    return hosts


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs /proc/net/tcp")
@pytest.mark.fault
def test_broadcast_store_listens_on_the_configured_host_only():
    transport, _ = make_transport("broadcast")  # host: the loopback default
    endpoint = transport.prepare()
    try:
        assert listening_hosts(endpoint["port"]) == ["127.0.0.1"]
    finally:
        transport.finalize()
