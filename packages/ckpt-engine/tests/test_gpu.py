"""GPU paths (skipped without CUDA): colocated through CUDA IPC handles between processes on
one GPU, and broadcast over NCCL (one GPU per process, so it needs three)."""

from __future__ import annotations

import pytest
import torch

from drivetrain.api.weight_sync import Topology, TransportRole
from drivetrain.ckpt.buckets import digest_of
from test_transports import Receivers, make_transport
from weights_for_tests import make_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def sync_twice(tmp_path, name, *, on_gpu_weights, verify=True):
    sender, config = make_transport(
        name, device="cuda", bucket_bytes=1 << 16, timeout_s=60.0, verify=verify
    )
    topology = Topology.one_sender(2)
    endpoint = sender.prepare()
    receivers = Receivers(tmp_path, name, config, endpoint, topology, versions=[1, 2])
    sent = {}
    try:
        sender.connect(TransportRole.SENDER, 0, topology, endpoint)
        for version in (1, 2):
            weights = make_weights(version, big=300_000)  # 8.4 MB: many 64 KiB buckets
            if on_gpu_weights:
                weights = [(n, t.cuda()) for n, t in weights]
            stats = sender.send(iter(weights), version=version)
            sent[version] = digest_of(weights)
            assert stats.digest == (sent[version] if verify else None)
        results, codes = receivers.results(timeout=120)
    finally:
        receivers.kill()
        sender.finalize()
    assert codes == [0, 0]
    for per_rank in results:
        assert [r["digest"] for r in per_rank] == [sent[1], sent[2]]


@pytest.mark.parametrize("on_gpu_weights", [True, False])
def test_colocated_cuda_ipc_between_processes(tmp_path, on_gpu_weights):
    sync_twice(tmp_path, "colocated", on_gpu_weights=on_gpu_weights)


def test_colocated_cuda_ipc_orders_its_copies_on_the_device_alone(tmp_path):
    """Without ``verify`` no side reads a bucket back to the host, which would wait for the
    device: only the interprocess events order the sender's packing before the receivers'
    copies and their copies before the next packing. The receivers' own digests (of their
    clones) catch a copy that read a half-written or already refilled buffer."""
    sync_twice(tmp_path, "colocated", on_gpu_weights=True, verify=False)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs one GPU per rank (3)")
def test_broadcast_over_nccl(tmp_path):
    sync_twice(tmp_path, "broadcast", on_gpu_weights=True)
